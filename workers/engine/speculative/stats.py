"""Speculative decoding's counters: cumulative since the engine started."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counts over every verify step of one engine, since it started.

    A verify step is one request's 1 + k tokens checked in a target forward; each adds
    the tokens proposed for it (``num_draft_tokens``) and those the target accepted
    (``num_accepted_tokens``; the bonus/correction token the target samples itself is
    not counted there).
    """

    num_steps: int = 0
    """Verify steps (one per speculating request per engine step)."""
    num_draft_tokens: int = 0
    """Tokens proposed."""
    num_accepted_tokens: int = 0
    """Proposed tokens the target accepted."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed; 0.0 before any proposal."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted / steps + 1, the + 1 counting the token
        the target samples itself at the first rejection (or the bonus token after the
        last proposal). 0.0 before any verify step; 1.0 when nothing is ever accepted."""
        return self.num_accepted_tokens / self.num_steps + 1.0 if self.num_steps else 0.0

    def plus(self, num_draft_tokens: int, num_accepted_tokens: int) -> SpecDecodeStats:
        """These counts after one more verify step."""
        return SpecDecodeStats(
            self.num_steps + 1,
            self.num_draft_tokens + num_draft_tokens,
            self.num_accepted_tokens + num_accepted_tokens,
        )
