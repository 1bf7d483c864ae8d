"""The router's events as OpenAI answers: one JSON body, or server-sent events.

Streams are OpenAI's: one ``data: {json}`` event per chunk, ``data: [DONE]`` last; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk with
no choices carries the usage. An error after the status was sent (a worker failed) is
an ``data: {"error": ...}`` event, then ``[DONE]``, as vLLM sends it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from router.errors import RouterError
from router.events import Delta, Finish
from router.http.convert import Plan, completion_logprobs, token_text
from router.http.errors import from_router_error
from router.http.schemas import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from router.http.streams import Choices
from workers.protocol.logprobs import TokenLogprobs
from workers.text.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"


def sse(message: BaseModel, exclude: set[str] | None = None) -> bytes:
    return b"data: " + message.model_dump_json(exclude=exclude).encode() + b"\n\n"


@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: Finish | None = None
    prompt: Delta | None = None  # the delta that carried the prompt's logprobs


@dataclass(frozen=True)
class Answer:
    """What every answer of one HTTP request shares."""

    id: str
    model: str
    plan: Plan
    tokenizer: Tokenizer
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def usage(finishes: list[Finish | None], n: int, echo_only: bool = False) -> UsageInfo:
    """Usage of all choices; a prompt counts once however many choices it has. With
    ``echo_only`` (echo, max_tokens 0) the token asked for is not part of the answer."""
    done = [f for f in finishes if f is not None]
    prompts = [f for i, f in enumerate(finishes) if f is not None and i % n == 0]
    prompt_tokens = sum(f.usage.prompt_tokens for f in prompts)
    completion_tokens = 0 if echo_only else sum(f.usage.completion_tokens for f in done)
    cached = sum(f.usage.cached_prompt_tokens for f in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def stop_reason(finish: Finish | None) -> int | str | None:
    if finish is None:
        return None
    return finish.stop_string if finish.stop_string is not None else finish.stop_token_id


async def collect(choices: Choices, num: int) -> list[Collected]:
    out = [Collected() for _ in range(num)]
    async for index, event in choices.events():
        choice = out[index]
        choice.text.append(event.delta.text)
        choice.logprobs.extend(event.delta.logprobs)
        if event.delta.prompt_logprobs is not None:
            choice.prompt = event.delta
        if event.finish is not None:
            choice.finish = event.finish
    return out


# ---- completions ----------------------------------------------------------------------


async def completion_response(answer: Answer, choices: Choices) -> CompletionResponse:
    """Raises RouterError (a failure after the first event)."""
    plan = answer.plan
    collected = await collect(choices, len(plan.requests))
    out = []
    for index, choice in enumerate(collected):
        echo = plan.echo_texts[index] if plan.echo_texts else ""
        text = "" if plan.echo_only else "".join(choice.text)
        logprobs = None
        if plan.requests[index].output.logprobs is not None:
            logprobs, offset = _prompt_part(answer.tokenizer, choice.prompt, len(echo))
            if not plan.echo_only:
                more = completion_logprobs(answer.tokenizer, choice.logprobs, offset)
                logprobs = _joined(logprobs, more)
        finish = _echo_only_finish(choice.finish) if plan.echo_only else choice.finish
        out.append(
            CompletionChoice(
                index=index,
                text=echo + text,
                logprobs=logprobs,
                finish_reason=finish.reason if finish else None,
                stop_reason=stop_reason(finish),
            )
        )
    finishes = [c.finish for c in collected]
    return CompletionResponse(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=out,
        usage=usage(finishes, plan.n, plan.echo_only),
    )


def _prompt_part(
    tokenizer: Tokenizer, prompt: Delta | None, offset: int
) -> tuple[CompletionLogprobs, int]:
    """An echo's logprobs of the prompt (OpenAI's and vLLM's shape: every prompt token, the
    first with null logprob and null top_logprobs, text offsets from 0) and where the
    output's offsets go on; without prompt logprobs, nothing and ``offset``."""
    out = CompletionLogprobs()
    if prompt is None or prompt.prompt_logprobs is None:
        return out, offset
    first = token_text(tokenizer, prompt.prompt_token_ids[0])
    out.tokens.append(first)
    out.token_logprobs.append(None)
    out.top_logprobs.append(None)
    out.text_offset.append(0)
    out = _joined(out, completion_logprobs(tokenizer, prompt.prompt_logprobs, len(first)))
    return out, out.text_offset[-1] + len(out.tokens[-1])


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def _echo_only_finish(finish: Finish | None) -> Finish | None:
    """max_tokens 0 with echo: the answer generated nothing, so it ended by its length."""
    if finish is None or finish.reason == "abort":
        return finish
    return dataclasses.replace(finish, reason="length", stop_string=None, stop_token_id=None)


async def completion_events(answer: Answer, choices: Choices) -> AsyncIterator[bytes]:
    plan = answer.plan
    num = len(plan.requests)
    finishes: list[Finish | None] = [None] * num
    offsets = [len(plan.echo_texts[i]) if plan.echo_texts else 0 for i in range(num)]
    is_first = [True] * num
    exclude = None if answer.include_usage else {"usage"}
    try:
        async for index, event in choices.events():
            delta, finish = event.delta, event.finish
            text = "" if plan.echo_only else delta.text
            first = is_first[index]
            if first and plan.echo_texts:
                text = plan.echo_texts[index] + text
            is_first[index] = False
            if plan.echo_only:
                finish = _echo_only_finish(finish)
                if not (first or finish):
                    continue  # the token asked for is not part of the answer
            if not (text or delta.logprobs or finish):
                continue  # nothing to say yet (text withheld: a partial stop string)
            logprobs = None
            if plan.requests[index].output.logprobs is not None:
                # The echo's first chunk: the prompt's logprobs (they came with it), then
                # the output's.
                logprobs = CompletionLogprobs()
                if first:
                    logprobs, offsets[index] = _prompt_part(answer.tokenizer, delta, offsets[index])
                if not plan.echo_only:
                    more = completion_logprobs(answer.tokenizer, delta.logprobs, offsets[index])
                    offsets[index] += sum(len(t) for t in more.tokens)
                    logprobs = _joined(logprobs, more)
            finishes[index] = finish
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish.reason if finish else None,
                stop_reason=stop_reason(finish),
            )
            chunk = CompletionChunk(
                id=answer.id, created=answer.created, model=answer.model, choices=[choice]
            )
            yield sse(chunk, exclude)
        if answer.include_usage:
            yield sse(
                CompletionChunk(
                    id=answer.id,
                    created=answer.created,
                    model=answer.model,
                    choices=[],
                    usage=usage(finishes, plan.n, plan.echo_only),
                )
            )
    except RouterError as exc:
        yield error_event(exc, plan)
    finally:
        await choices.aclose()
    yield DONE


def error_event(exc: RouterError, plan: Plan) -> bytes:
    error = from_router_error(exc, plan.names)
    return sse(ErrorResponse(error=error.info))
