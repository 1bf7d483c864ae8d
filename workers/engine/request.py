"""A request as the engine tracks it: tokens so far and how many are computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.protocol.block_hashes import salt_root
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Decode role: blocks allocated for the prompt, its KV on the way from a prefill worker.
    RECEIVING = "receiving"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, a stop string or a completed grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller (or failed)


@dataclass(eq=False)
class Request:
    """Mutable engine-side state of one request; owned by the scheduler.

    ``token_ids`` is prompt + output. Prefix-cache hits, prefill chunks and KV
    received from another worker all just advance ``num_computed_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens capped by max_model_len
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # In batches still in the pipeline (scheduled, not yet computed): a prompt's next
    # chunk may be scheduled while the previous one is in flight (workers/engine/scheduler.py).
    num_in_flight_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # steps that computed part of the prompt (its trace says)
    # What its trace reports (workers/serving/tracing.py): the prompt tokens onboarded from
    # the KV tiers and when (epoch ns), and speculative proposals made and accepted.
    num_onboarded_tokens: int = 0
    onboard_ns: tuple[int, int] | None = None
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    arrival_time: float = field(default_factory=time.monotonic)  # added to the engine
    first_scheduled_time: float | None = None
    # Prefill role: once the prompt is computed and the first token sampled, the request
    # leaves the scheduler with its blocks kept (held) for a decode worker to pull.
    is_prefill_only: bool = False
    # Decode role: added with its prompt's KV to come from a prefill worker. From then on
    # the hand-off (workers/engine/handoff.py) tracks that KV; once it arrived (or failed
    # and gets recomputed) a later preemption recomputes everything locally like any request.
    is_remote_prefill: bool = False
    # Peer pull (G4, LLMEngine.add_request's ``peer_prefix_tokens``): the KV of the
    # prompt's first tokens comes from another worker's lease; the rest is computed here.
    num_peer_tokens: int = 0
    # The scheduler slot whose batches carry it (pipeline stages; 0 without); a prompt's
    # chunks may also ride in other slots' batches.
    slot: int = 0
    # Speculative decoding (workers/engine/speculative/): the tokens proposed for the next
    # step, not part of token_ids until the target accepts them; and how many leading
    # positions hold the draft model's KV (its own cache, the target's block table).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_num_computed: int = 0
    # Structured outputs (workers/engine/grammar.py): the matcher of params.structured,
    # advanced with every output token by append_token, so that its state follows from
    # the output alone (a hand-off, a migration, a preemption carry nothing else).
    grammar: GrammarMatcher | None = None
    # Prompt logprobs (params.prompt_logprobs): those of the prompt positions computed so
    # far, one per prompt token after the first, until the first sampled delta takes them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    has_sent_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        # Where its block-hash chain starts: the shared cache's root, or its salt's.
        self.cache_root = salt_root(self.params.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_remote_tokens(self) -> int:
        """Leading prompt tokens whose KV comes from another worker through the hand-off:
        the whole prompt for a remote prefill, the peer prefix for a peer pull, else 0."""
        return self.num_prompt_tokens if self.is_remote_prefill else self.num_peer_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Computed or on their way through the pipeline."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        return len(self.token_ids) - self.num_scheduled_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not sent yet, and its prompt is computed
        here (a decode worker's request received it: the prefill worker sent them). While
        true, every prompt position is computed (no prefix-cache or KV-tier hit)."""
        return (
            self.params.prompt_logprobs is not None
            and not self.has_sent_prompt_logprobs
            and not self.is_remote_prefill
        )

    def add_prompt_logprobs(self, start_pos: int, logprobs: list[TokenLogprobs]) -> None:
        """A computed chunk's prompt logprobs, its first scoring prompt token
        ``start_pos + 1``; a chunk computed again (after a preemption) replaces them."""
        del self.prompt_logprobs[start_pos:]
        assert len(self.prompt_logprobs) == start_pos, "prompt chunks computed out of order"
        self.prompt_logprobs.extend(logprobs)

    def take_prompt_logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        """For its first delta with tokens: the prompt's logprobs (then never again)."""
        if not self.needs_prompt_logprobs:
            return None
        self.has_sent_prompt_logprobs = True
        out, self.prompt_logprobs = tuple(self.prompt_logprobs), []
        assert len(out) == self.num_prompt_tokens - 1, "prompt logprobs incomplete"
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append an output token (and advance the grammar past it)."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


def check_stop(
    req: Request, token_id: int, stop_matched: str | None, max_model_len: int
) -> tuple[FinishReason | None, str | int | None]:
    """(finish reason, stop reason) after ``token_id`` was appended; (None, None) = go on."""
    # A complete grammar allows nothing more (not even past min_tokens): stop here, as
    # vLLM does, rather than spend a step sampling the EOS it would force.
    if req.grammar is not None and req.grammar.is_terminated:
        return FinishReason.STOP, None
    # EOS, stop ids and stop strings apply once min_tokens are out (stop_matched is
    # None before that, and always when the router matches stop strings itself).
    if req.num_output_tokens >= req.params.min_tokens:
        if token_id in req.eos_token_ids:
            return FinishReason.STOP, None
        if token_id in req.params.stop_token_ids:
            return FinishReason.STOP, token_id
        if stop_matched is not None:
            return FinishReason.STOP, stop_matched
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None
