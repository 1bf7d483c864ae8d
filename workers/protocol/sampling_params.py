"""Per-request sampling and stopping options, with vLLM's field names.

`SamplingParams` is validated once, when it is built (at the router's edge or by `LLM`
users); every `ValueError` names the offending field and value so the edge can turn it
into `INVALID_ARGUMENT` as is. Checks that need the model (`stop_token_ids` inside the
vocabulary) live in `validate_for_model`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workers.protocol.structured_output import StructuredOutput

_GREEDY_EPS = 1e-5
_MAX_LOGPROBS = 20
# OpenAI's range for one bias; the entries' bound keeps the per-step scatter small (a
# client-sized map is applied to every sampled row of the request).
_MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# What `torch.Generator.manual_seed` accepts; anything else would fail later, in the engine.
_SEED_MIN, _SEED_END = -(2**63), 2**64
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_OPTIONAL_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    `stop` accepts a string or any sequence of strings and `stop_token_ids` any iterable
    of ints; both are stored as tuples (so instances stay hashable). Int values given
    for float fields are stored as floats.
    """

    max_tokens: int | None = 16
    """Most tokens to generate; None = until the model's max_model_len."""
    min_tokens: int = 0
    """EOS and `stop_token_ids` cannot be sampled before this many tokens were generated."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-5 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose mass reaches top_p; 1 = off."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's; 0 = off."""
    seed: int | None = None
    """Seed of the request's own random stream; reproducible whatever else is batched."""
    repetition_penalty: float = 1.0
    """HF semantics over prompt + output tokens: positive logits divided, negative multiplied."""
    presence_penalty: float = 0.0
    """OpenAI semantics: subtracted once from every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI semantics: subtracted once per occurrence of a token already generated."""
    stop: tuple[str, ...] = ()
    """Strings that end generation (not included in the output text)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation, besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs per token; None = off."""
    prompt_logprobs: int | None = None
    """Return the logprob of every prompt token after the first (given the tokens before
    it) plus this many top logprobs per position (0 = the token's own only); None = off.
    Such a request computes its whole prompt: it takes no prefix-cache or KV-tier hit."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, OpenAI's ``logit_bias``: each bias in [-100, 100] is added to
    the token's logit before sampling (before penalties, as vLLM); logprobs stay the raw
    model's. A mapping or any iterable of pairs is accepted and stored sorted by id."""
    cache_salt: str = ""
    """Prefix-cache isolation: the request's block hashes are chained from this salt's root
    (block_hashes.salt_root), so it shares cached KV only with requests of the same salt.
    The router sets it (the caller's tenant and its ``cache_salt``); "" = the shared cache."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    speculative: bool = True
    """Allow speculative decoding for this request (when the engine has it on); False =
    decode one token per step. Output is the same either way (greedy token for token,
    sampled in distribution)."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a grammar or one of
    a few choices (workers/protocol/structured_output.py); None = unconstrained. The router
    checks it compiles (``check_structured_output``) before admission."""

    def __post_init__(self) -> None:
        # Normalise types first (frozen, hence object.__setattr__), then check ranges.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL_FIELDS:
                object.__setattr__(self, name, _as_int(name, value))
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_MIN <= self.seed < _SEED_END:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}"
            )

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks what needs the model: every stop token id and logit_bias id is inside
        the vocabulary."""
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(
                    f"stop_token_ids must be below the vocabulary size {vocab_size}, got {token_id}"
                )
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token_id} is not below the vocabulary size {vocab_size}"
                )

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature ~ 0); such rows draw no randomness."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition / presence / frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass, but True as a token count or seed is almost surely a mistake;
    # numpy integers are welcome (token ids often come from arrays).
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _normalise_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, Iterable):
        raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
    strings = tuple(stop)
    for s in strings:
        if not isinstance(s, str):
            raise ValueError(f"stop must hold strings, got {s!r}")
        if not s:
            raise ValueError("stop must not hold an empty string, got ''")
    return strings


def _normalise_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
    out = tuple(_as_int("stop_token_ids", token_id) for token_id in ids)
    for token_id in out:
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be non-negative, got {token_id}")
    return out


def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """A mapping or iterable of (token id, bias) pairs, checked, as pairs sorted by id."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not isinstance(bias, Iterable):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    else:
        pairs = list(bias)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(pairs)}"
        )
    out: dict[int, float] = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable) or len(pair) != 2:
            raise ValueError(f"logit_bias must hold (token id, bias) pairs, got {pair!r}")
        token_id, value = pair
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise ValueError(f"logit_bias token ids must be ints, got {token_id!r}")
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"logit_bias biases must be numbers, got {value!r}")
        if not -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS:  # NaN fails too
            raise ValueError(
                f"logit_bias biases must be in [-100, 100], got {value!r} for token {int(token_id)}"
            )
        if int(token_id) in out:
            raise ValueError(f"logit_bias gives token id {int(token_id)} twice")
        out[int(token_id)] = float(value)
    return tuple(sorted(out.items()))
