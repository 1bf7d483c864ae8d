"""Validation: a :class:`~router.requests.GenerateRequest` becomes a prompt and
``SamplingParams``, or an ``InvalidRequest`` whose message names the field by its path in
the request (``sampling.top_p``; the router answers INVALID_ARGUMENT). Every front end's
requests are judged here, alike.

Checks that need the tokenizer (prompt length against the context) happen in
:func:`check_length`, after tokenization, so that text and token-id prompts are judged alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.requests import (
    DISAGGREGATION_MODES,
    Disaggregation,
    GenerateRequest,
    StructuredOptions,
)
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.structured_output import StructuredOutput, check_structured_output
from workers.text.tokenizer import Tokenizer

# SamplingParams field -> its path in the GenerateRequest (and the protobuf message).
_FIELD_PATHS = {
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "speculative": "sampling.speculative",
    "logit_bias": "sampling.logit_bias",
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "logprobs": "output.logprobs",
    "prompt_logprobs": "output.prompt_logprobs",
}
_MAX_STOP_STRINGS = 16
_MAX_STOP_LEN = 256
# Checked per generated token on the engine thread (a set there, but built from this):
# more than a vocabulary's worth of special tokens is no use and costs every step.
_MAX_STOP_TOKEN_IDS = 64
_MAX_SALT_LEN = 256
_MAX_TOP_K = 2**31 - 1  # the protobuf field's int32; past the vocabulary it means off
_MAX_REQUEST_ID_LEN = 256  # echoed in every response message of the request
_MAX_ERROR_LEN = 400  # of a refusal's text that quotes a client's schema or pattern
_MAX_ECHO_LEN = 80  # of a client's value quoted in a refusal (gRPC trailers are <= 16 KiB)


class InvalidRequest(ValueError):
    """The request is malformed; the message starts with the offending field."""


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    return_text: bool
    return_timing: bool
    disaggregation: Disaggregation | None  # None: the router's configured policy


def validate(req: GenerateRequest, served_model: str, request_id: str) -> ValidRequest:
    """Everything that can be judged without the tokenizer."""
    if req.model and req.model != served_model:
        raise InvalidRequest(f"model: unknown model {clip(req.model)} (serving {served_model!r})")
    if len(request_id) > _MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id: at most {_MAX_REQUEST_ID_LEN} characters")
    if req.prompt is None:
        raise InvalidRequest("prompt: set either text or token_ids")
    kind = "text" if isinstance(req.prompt, str) else "token_ids"
    prompt: str | list[int] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    if not prompt:
        raise InvalidRequest(f"{kind}: the prompt is empty")
    if isinstance(prompt, str):
        check_unicode("text", prompt)
    stop = list(req.stopping.stop)
    if len(stop) > _MAX_STOP_STRINGS:
        raise InvalidRequest(f"stopping.stop: at most {_MAX_STOP_STRINGS} stop strings")
    if any(len(s) > _MAX_STOP_LEN for s in stop):
        raise InvalidRequest(f"stopping.stop: stop strings are at most {_MAX_STOP_LEN} chars")
    for s in stop:
        check_unicode("stopping.stop", s)
    if len(req.cache_salt) > _MAX_SALT_LEN:
        raise InvalidRequest(f"cache_salt: at most {_MAX_SALT_LEN} characters")
    check_unicode("cache_salt", req.cache_salt)
    if len(req.stopping.stop_token_ids) > _MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stopping.stop_token_ids: at most {_MAX_STOP_TOKEN_IDS} stop token ids, got "
            f"{len(req.stopping.stop_token_ids)}"
        )
    return ValidRequest(
        request_id=request_id,
        prompt=prompt,
        params=_sampling_params(req),
        return_text=req.output.return_text,
        return_timing=req.output.return_timing,
        disaggregation=_disaggregation(req.disaggregation),
    )


def check_unicode(path: str, value: str) -> None:
    """Refuse a string UTF-8 cannot encode: a lone surrogate (JSON's ``"\\ud800"``), which
    the tokenizer and the wire to the workers would fail on."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{path}: not valid Unicode ({exc.reason} at character {exc.start})"
        ) from None


def clip(value: str) -> str:
    """``value``'s repr, cut short: a refusal must not echo a hostile input at length."""
    if len(value) <= _MAX_ECHO_LEN:
        return repr(value)
    return f"{value[:_MAX_ECHO_LEN]!r}... ({len(value)} characters)"


def _disaggregation(mode: str | None) -> Disaggregation | None:
    if mode is not None and mode not in DISAGGREGATION_MODES:
        raise InvalidRequest(
            f"disaggregation: one of {DISAGGREGATION_MODES}, got {clip(str(mode))}"
        )
    return mode  # type: ignore[return-value]


def _sampling_params(req: GenerateRequest) -> SamplingParams:
    kwargs: dict[str, object] = {}
    sampling, stopping = req.sampling, req.stopping
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "speculative",
    ):
        if getattr(sampling, name) is not None:
            kwargs[name] = getattr(sampling, name)
    # Unset max_tokens: up to the context length (the engine resolves None).
    kwargs["max_tokens"] = stopping.max_tokens
    if stopping.min_tokens is not None:
        kwargs["min_tokens"] = stopping.min_tokens
    if req.output.logprobs is not None:
        kwargs["logprobs"] = req.output.logprobs
    if req.output.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = req.output.prompt_logprobs
    if sampling.logit_bias:
        kwargs["logit_bias"] = sampling.logit_bias
    # What the wire to the workers (msgpack) and the protobuf message (int32) carry; JSON's
    # integers have no bound, and top_k has none above in SamplingParams.
    if sampling.top_k is not None and sampling.top_k > _MAX_TOP_K:
        raise InvalidRequest(f"sampling.top_k: at most {_MAX_TOP_K}, got {sampling.top_k}")
    structured = None if req.structured is None else structured_output(req.structured)
    try:
        return SamplingParams(
            stop=tuple(stopping.stop),
            stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos,
            cache_salt=cache_salt(req.tenant, req.cache_salt),
            structured=structured,
            **kwargs,  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise InvalidRequest(_with_field_path(str(exc))) from None


def structured_output(options: StructuredOptions) -> StructuredOutput:
    """The constraint, checked to compile (no tokenizer needed: the grammar alone; cached
    by constraint, so a schema sent again costs a lookup). InvalidRequest names the field
    (``structured.spec``) or, for a schema the engine cannot compile, the part of it."""
    try:
        structured = StructuredOutput(
            options.kind, options.spec, tuple(options.choices), options.strict
        )
    except ValueError as exc:  # "structured.<field> must ...": the field first, as ours
        field, _, rest = str(exc).partition(" ")
        raise InvalidRequest(f"{field}: {rest[:_MAX_ERROR_LEN]}") from None
    try:
        check_structured_output(structured)
    except ValueError as exc:
        raise InvalidRequest(f"structured: {str(exc)[:_MAX_ERROR_LEN]}") from None
    return structured


def cache_salt(tenant: str, salt: str) -> str:
    """The salt a request's block hashes are chained from: its tenant's (each tenant a cache
    of its own, by default, when keys are configured) and the client's own, apart."""
    return f"{tenant}\0{salt}" if tenant else salt


def _with_field_path(message: str) -> str:
    """Prefix SamplingParams' message with the request path of the field it names."""
    match = re.match(r"\W*(\w+)", message)
    name = match.group(1) if match else ""
    path = _FIELD_PATHS.get(name)
    return f"{path}: {message}" if path else message


def check_length(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """After tokenization: the prompt, and prompt + max_tokens, must fit the context."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            f"prompt: {num_prompt_tokens} tokens leave no room to generate within "
            f"max_model_len={max_model_len}"
        )
    if params.min_tokens > max_model_len:  # unbounded when max_tokens is unset
        raise InvalidRequest(
            f"stopping.min_tokens: {params.min_tokens} exceeds max_model_len={max_model_len}"
        )
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"stopping.max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
            f"({params.max_tokens}) exceeds max_model_len={max_model_len}"
        )


def prompt_token_ids(
    valid: ValidRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int
) -> list[int]:
    """Tokenize (text prompts) and judge what needs the model: vocabulary, context length,
    stop token ids. Raises InvalidRequest naming the field."""
    kind = "text" if isinstance(valid.prompt, str) else "token_ids"
    if isinstance(valid.prompt, str):
        token_ids = tokenizer.encode(valid.prompt)
        if not token_ids:
            raise InvalidRequest("text: the prompt encodes to no tokens")
    else:
        token_ids = valid.prompt
    # Also for text: a tokenizer can have ids past the model's embedding.
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{kind}: ids out of vocabulary [0, {vocab_size}): {bad[:5]}")
    check_length(len(token_ids), valid.params, max_model_len)
    try:
        valid.params.validate_for_model(vocab_size)
    except ValueError as exc:
        raise InvalidRequest(_with_field_path(str(exc))) from None
    return token_ids
