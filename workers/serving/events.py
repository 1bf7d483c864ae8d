"""What a worker tells the router about one request: engine output as wire events."""

from __future__ import annotations

from workers.engine.outputs import StreamDelta
from workers.protocol.wire import TokenEvent


def token_event(
    delta: StreamDelta,
    *,
    kv_handles: tuple[bytes, ...] = (),
    transfer: tuple[float, int] = (0.0, 0),
    error: str = "",
    is_retryable: bool = False,
) -> TokenEvent:
    """One step's delta; ``transfer`` is the (seconds, bytes) of its KV hand-off."""
    reason = delta.finish_reason.value if delta.finish_reason is not None else None
    return TokenEvent(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        finished=delta.finished,
        finish_reason=reason,
        stop_token_id=delta.stop_reason if isinstance(delta.stop_reason, int) else None,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        logprobs=delta.logprobs,
        prompt_logprobs=delta.prompt_logprobs,
        kv_handles=kv_handles,
        kv_transfer_seconds=transfer[0],
        kv_transfer_bytes=transfer[1],
        error=error,
        is_retryable=is_retryable,
    )


def failed_event(
    request_id: str, num_prompt_tokens: int, error: str, *, is_retryable: bool = False
) -> TokenEvent:
    """The request ended on the worker with ``error``: the router migrates a retryable
    one to another worker, else answers INTERNAL."""
    return TokenEvent(
        request_id=request_id,
        token_ids=(),
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=num_prompt_tokens,
        error=error or "failed",
        is_retryable=is_retryable,
    )
