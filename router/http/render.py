"""The router's events as OpenAI answers: one JSON body, or server-sent events.

Streams are OpenAI's: one ``data: {json}`` event per chunk, ``data: [DONE]`` last; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk with
no choices carries the usage. An error after the status was sent (a worker failed) is
an ``data: {"error": ...}`` event, then ``[DONE]``, as vLLM sends it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from router.errors import RouterError
from router.events import Finish
from router.http.convert import Plan, chat_logprobs, completion_logprobs
from router.http.errors import from_router_error
from router.http.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    UsageInfo,
)
from router.http.streams import Choices
from router.http.tools import ParsedCall, ToolCalling
from workers.protocol.logprobs import TokenLogprobs
from workers.text.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"


def sse(message: BaseModel, exclude: set[str] | None = None) -> bytes:
    return b"data: " + message.model_dump_json(exclude=exclude).encode() + b"\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: Finish | None = None


@dataclass(frozen=True)
class Answer:
    """What every answer of one HTTP request shares."""

    id: str
    model: str
    plan: Plan
    tokenizer: Tokenizer
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def usage(finishes: list[Finish | None], n: int) -> UsageInfo:
    """Usage of all choices; a prompt counts once however many choices it has."""
    done = [f for f in finishes if f is not None]
    prompts = [f for i, f in enumerate(finishes) if f is not None and i % n == 0]
    prompt_tokens = sum(f.usage.prompt_tokens for f in prompts)
    completion_tokens = sum(f.usage.completion_tokens for f in done)
    cached = sum(f.usage.cached_prompt_tokens for f in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _stop_reason(finish: Finish | None) -> int | str | None:
    if finish is None:
        return None
    return finish.stop_string if finish.stop_string is not None else finish.stop_token_id


async def _collect(choices: Choices, num: int) -> list[_Choice]:
    out = [_Choice() for _ in range(num)]
    async for index, event in choices.events():
        choice = out[index]
        choice.text.append(event.delta.text)
        choice.logprobs.extend(event.delta.logprobs)
        if event.finish is not None:
            choice.finish = event.finish
    return out


# ---- completions ----------------------------------------------------------------------


async def completion_response(answer: Answer, choices: Choices) -> CompletionResponse:
    """Raises RouterError (a failure after the first event)."""
    plan = answer.plan
    collected = await _collect(choices, len(plan.requests))
    out = []
    for index, choice in enumerate(collected):
        echo = plan.echo_texts[index] if plan.echo_texts else ""
        logprobs = None
        if plan.requests[index].output.logprobs is not None:
            logprobs = completion_logprobs(answer.tokenizer, choice.logprobs, len(echo))
        out.append(
            CompletionChoice(
                index=index,
                text=echo + "".join(choice.text),
                logprobs=logprobs,
                finish_reason=choice.finish.reason if choice.finish else None,
                stop_reason=_stop_reason(choice.finish),
            )
        )
    finishes = [c.finish for c in collected]
    return CompletionResponse(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=out,
        usage=usage(finishes, plan.n),
    )


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
            text = delta.text
            if is_first[index] and plan.echo_texts:
                text = plan.echo_texts[index] + text
            is_first[index] = False
            if not (text or delta.logprobs or finish):
                continue  # nothing to say yet (text withheld: a partial stop string)
            logprobs = None
            if plan.requests[index].output.logprobs is not None:
                logprobs = completion_logprobs(answer.tokenizer, delta.logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            finishes[index] = finish
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish.reason if finish else None,
                stop_reason=_stop_reason(finish),
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
                    usage=usage(finishes, plan.n),
                )
            )
    except RouterError as exc:
        yield _error_event(exc, plan)
    finally:
        await choices.aclose()
    yield DONE


def _error_event(exc: RouterError, plan: Plan) -> bytes:
    error = from_router_error(exc, plan.names)
    return sse(ErrorResponse(error=error.info))


# ---- chat -----------------------------------------------------------------------------


async def chat_response(answer: Answer, choices: Choices) -> ChatCompletionResponse:
    """Raises RouterError (a failure after the first event)."""
    plan = answer.plan
    collected = await _collect(choices, len(plan.requests))
    out = []
    for index, choice in enumerate(collected):
        logprobs = None
        if plan.requests[index].output.logprobs is not None:
            logprobs = chat_logprobs(answer.tokenizer, choice.logprobs)
        content: str | None = "".join(choice.text)
        calls: list[ParsedCall] = []
        if plan.tools is not None and content is not None:
            content, calls = plan.tools.parse(content)
        out.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(
                    content=content,
                    tool_calls=[_tool_call(c) for c in calls] or None,
                ),
                logprobs=logprobs,
                finish_reason=_chat_finish_reason(choice.finish, bool(calls)),
                stop_reason=_stop_reason(choice.finish),
            )
        )
    finishes = [c.finish for c in collected]
    return ChatCompletionResponse(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=out,
        usage=usage(finishes, plan.n),
    )


async def chat_events(answer: Answer, choices: Choices) -> AsyncIterator[bytes]:
    plan = answer.plan
    num = len(plan.requests)
    finishes: list[Finish | None] = [None] * num
    exclude = None if answer.include_usage else {"usage"}

    def chunk(choice: ChatChunkChoice) -> bytes:
        message = ChatCompletionChunk(
            id=answer.id, created=answer.created, model=answer.model, choices=[choice]
        )
        return sse(message, exclude)

    try:
        # OpenAI's first chunk of each choice: the role, with empty content.
        for index in range(num):
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
        tools = plan.tools
        # Tool calls other than a named one are read from the whole output: held until
        # its end (a named call's arguments are the output, and stream as they come).
        held = [_Choice() for _ in range(num)] if tools and tools.mode != "named" else None
        named_ids = [""] * num
        async for index, event in choices.events():
            delta, finish = event.delta, event.finish
            if held is not None:
                held[index].text.append(delta.text)
                held[index].logprobs.extend(delta.logprobs)
                if finish is None:
                    continue
                finishes[index] = finish
                yield chunk(_held_choice(answer, index, held[index], finish))
                continue
            if not (delta.text or delta.logprobs or finish):
                continue
            logprobs = None
            if plan.requests[index].output.logprobs is not None:
                logprobs = chat_logprobs(answer.tokenizer, delta.logprobs)
            finishes[index] = finish
            message = ChatDelta(content=delta.text or None)
            if tools is not None:  # named: the text is the call's arguments
                message = ChatDelta(tool_calls=_named_delta(tools, named_ids, index, delta.text))
            yield chunk(
                ChatChunkChoice(
                    index=index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=_chat_finish_reason(finish, tools is not None),
                    stop_reason=_stop_reason(finish),
                )
            )
        if answer.include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=answer.id,
                    created=answer.created,
                    model=answer.model,
                    choices=[],
                    usage=usage(finishes, plan.n),
                )
            )
    except RouterError as exc:
        yield _error_event(exc, plan)
    finally:
        await choices.aclose()
    yield DONE


def _chat_finish_reason(finish: Finish | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the output ended as calls (not when cut by length)."""
    if finish is None:
        return None
    return "tool_calls" if called and finish.reason == "stop" else finish.reason


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _named_delta(
    tools: ToolCalling, ids: list[str], index: int, text: str
) -> list[ToolCallDelta] | None:
    """The next piece of a named call: its id and name first, then its arguments."""
    if not ids[index]:
        ids[index] = f"call_{uuid.uuid4().hex[:24]}"
        name = FunctionCallDelta(name=tools.names[0], arguments=text)
        return [ToolCallDelta(index=0, id=ids[index], type="function", function=name)]
    if not text:
        return None
    return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]


def _held_choice(answer: Answer, index: int, held: _Choice, finish: Finish) -> ChatChunkChoice:
    """A held output's one chunk: its content (if any) and its calls, whole."""
    assert answer.plan.tools is not None
    content, calls = answer.plan.tools.parse("".join(held.text))
    logprobs = None
    if answer.plan.requests[index].output.logprobs is not None:
        logprobs = chat_logprobs(answer.tokenizer, held.logprobs)
    deltas = [
        ToolCallDelta(
            index=i,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=call.name, arguments=call.arguments),
        )
        for i, call in enumerate(calls)
    ]
    return ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=content, tool_calls=deltas or None),
        logprobs=logprobs,
        finish_reason=_chat_finish_reason(finish, bool(calls)),
        stop_reason=_stop_reason(finish),
    )
