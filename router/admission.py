"""Admission: a request judged, let in or refused, and tokenized, before it has a life.

``Router.generate``'s first step, the same for every front end: validate every field
(``router/validation.py``; a bad request is refused as such even when the router is
full), admit it against the quotas (``router/quotas.py``: RESOURCE_EXHAUSTED, with when
a retry can pass), then tokenize (after admission: a refused request costs no tokenizer
work). Errors are :class:`~router.errors.RouterError`; a request let in holds a quota
share until its life settles (``RequestLife.settle``).
"""

from __future__ import annotations

from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.quotas import QuotaConfig, QuotaExceeded, Quotas
from router.request_trace import RequestTrace
from router.requests import GenerateRequest
from router.validation import InvalidRequest, ValidRequest, prompt_token_ids, validate
from workers.text.tokenizer import Tokenizer


def admit(
    req: GenerateRequest,
    request_id: str,
    config: RouterConfig,
    tokenizer: Tokenizer,
    quotas: Quotas,
    trace: RequestTrace,
) -> tuple[ValidRequest, list[int]]:
    """The request validated and its prompt's token ids; takes a share of ``quotas`` (the
    caller gives it back when the request settles). Raises RouterError."""
    with trace.span("validate"):
        # Judged first (no tokenizer yet): a bad request is refused as such, even when
        # the router is full; then admission, before the tokenizer's work.
        valid = _checked(validate, req, config.model_name, request_id)
        try:
            quotas.admit(req.principal)
        except QuotaExceeded as exc:
            error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, exc.message)
            error.retry_after_s = exc.retry_after_s
            raise error from None
        try:
            args = (valid, tokenizer, config.vocab_size, config.max_model_len)
            token_ids = _checked(prompt_token_ids, *args)
        except BaseException:
            quotas.release(req.principal)
            raise
    trace.set(**{"gen_ai.usage.input_tokens": len(token_ids)})
    return valid, token_ids


def quotas_of(config: RouterConfig) -> Quotas:
    """The router's quotas, as ``router.*`` configures them."""
    share, rate = config.max_queued_share_per_key, config.requests_per_second_per_key
    limits = QuotaConfig(config.max_queued_requests, share, rate, config.request_burst_per_key)
    return Quotas(limits)


def scoped_id(principal: str, request_id: str) -> str:
    """The router's and the workers' id of a caller's request: the caller's own id, under
    its key's name when keys are configured (router/auth.py), so that two callers' ids
    never meet."""
    return f"{principal}/{request_id}" if principal else request_id


def _checked(check, *args):
    """``check(*args)``, its InvalidRequest as INVALID_ARGUMENT."""
    try:
        return check(*args)
    except InvalidRequest as exc:
        raise RouterError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
