"""What a client asks the router for: :class:`GenerateRequest`, as front ends hand it over.

A front end (the gRPC servicer, ``router/server.py``) only converts its wire message into
these types; judging the values is the router's (``router/validation.py``), so that every
front end refuses the same requests with the same messages. Hence the fields are raw:
``None`` where the client left an option unset (the engine's default applies), and
nothing here is checked. Error messages name fields by their path in this type
(``sampling.top_p``, ``stopping.max_tokens``), which is also the path in the protobuf
``GenerateRequest``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Disaggregation = Literal["always", "never", "auto"]
DISAGGREGATION_MODES: tuple[Disaggregation, ...] = ("always", "never", "auto")


@dataclass(frozen=True)
class SamplingOptions:
    """How to sample (vLLM's meanings); None = the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # False: the decode worker does not speculate on this request (None: it may, when its
    # pool has decode.speculative on); the output is the same either way.
    speculative: bool | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StoppingOptions:
    """When to stop; stop strings are not included in the output text."""

    max_tokens: int | None = None  # None: up to the model's context length
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class OutputOptions:
    """What the output carries besides token ids."""

    logprobs: int | None = None  # top-k logprobs per generated token; None = none
    # Logprobs of the prompt's tokens after the first, with top-k each; None = none.
    prompt_logprobs: int | None = None
    return_text: bool = True  # deltas carry detokenized text
    return_timing: bool = False  # the finish carries a Timing


@dataclass(frozen=True)
class StructuredOptions:
    """The output's constraint as the client gave it (docs/structured-outputs.md); judged
    by the router (``workers/protocol/structured_output.py`` says what each kind means)."""

    kind: str  # json_schema | json_object | regex | grammar | choice
    spec: str = ""  # the schema (JSON text), the pattern or the grammar
    choices: tuple[str, ...] = ()
    strict: bool = True  # json_schema: refuse keywords the engine cannot enforce


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, unvalidated."""

    prompt: str | tuple[int, ...] | None  # text or token ids; None: the client gave neither
    request_id: str = ""  # the router fills one in when empty
    model: str = ""  # the served model's name; empty = the only one
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stopping: StoppingOptions = field(default_factory=StoppingOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    disaggregation: Disaggregation | None = None  # None: the router's configured policy
    # W3C trace context of the caller (HTTP headers, gRPC metadata); empty: none. With
    # tracing on, the request's trace continues the caller's (router/tracing.py).
    traceparent: str = ""
    tracestate: str = ""
    # Who sent it (router/auth.py: the API key's name), set by the front end after it
    # authenticated the call; "" when no keys are configured. Only its sender may abort it.
    principal: str = ""
    tenant: str = ""  # the key's tenant (router/auth.py): mixed into the cache salt
    # Prefix-cache isolation (vLLM's field): requests share cached KV only with requests
    # of the same salt and tenant (workers/protocol/block_hashes.py); "" = the tenant's.
    cache_salt: str = ""
    structured: StructuredOptions | None = None  # None: free text
