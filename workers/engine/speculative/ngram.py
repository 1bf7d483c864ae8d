"""Prompt lookup (n-gram) proposals: continue the request the way it went before.

The longest suffix of the request's tokens (``ngram_max`` down to ``ngram_min`` tokens)
that also occurs earlier in its prompt + output is looked up, latest occurrence first;
the tokens that followed it there are the proposal. Useful where the output repeats the
input (editing code or text the prompt contains, quoting, extraction). No model, no KV:
a miss costs a few microseconds and the request simply decodes one token that step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of ``ngram_min``+ tokens recurs."""
        num = len(token_ids)
        if k < 1 or num <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, num - 1), self.ngram_min - 1, -1):
            suffix = tokens[num - n :]
            # Windows starting at 0 .. num - n - 1: every occurrence but the suffix itself.
            windows = sliding_window_view(tokens[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                follow = int(hits[-1]) + n
                return tokens[follow : follow + k].tolist()
        return []
