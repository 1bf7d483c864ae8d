"""Chat answers (``/v1/chat/completions``): one JSON body, or server-sent events, with
tool calls (``router/http/tools.py``) and vLLM's ``prompt_logprobs``. What both routes
share (usage, collecting, the stream's framing) is in ``render.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from router.errors import RouterError
from router.events import Delta, Finish
from router.http.convert import chat_logprobs, token_text
from router.http.render import (
    DONE,
    Answer,
    Collected,
    collect,
    error_event,
    sse,
    stop_reason,
    usage,
)
from router.http.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    PromptLogprob,
    ToolCall,
    ToolCallDelta,
)
from router.http.streams import Choices
from router.http.tools import AutoStream, ParsedCall, ToolCalling, new_call_id
from workers.text.tokenizer import Tokenizer


async def chat_response(answer: Answer, choices: Choices) -> ChatCompletionResponse:
    """Raises RouterError (a failure after the first event)."""
    plan = answer.plan
    collected = await collect(choices, len(plan.requests))
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
                stop_reason=stop_reason(choice.finish),
            )
        )
    finishes = [c.finish for c in collected]
    prompt = None
    if plan.requests[0].output.prompt_logprobs is not None:
        prompt = _vllm_prompt_logprobs(answer.tokenizer, collected[0].prompt)
    return ChatCompletionResponse(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=out,
        usage=usage(finishes, plan.n),
        prompt_logprobs=prompt,
    )


def _vllm_prompt_logprobs(
    tokenizer: Tokenizer, prompt: Delta | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: null for the first token, then per position the prompt
    token's own entry and the top-k's, keyed by token id."""
    if prompt is None or prompt.prompt_logprobs is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = [None]
    for lp in prompt.prompt_logprobs:
        top = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        candidates = [(lp.token_id, lp.logprob, lp.rank)]
        candidates += [(token_id, value, rank) for rank, (token_id, value) in enumerate(top, 1)]
        entry: dict[str, PromptLogprob] = {}
        for token_id, value, rank in candidates:
            text = token_text(tokenizer, token_id)
            entry.setdefault(
                str(token_id), PromptLogprob(logprob=value, rank=rank, decoded_token=text)
            )
        out.append(entry)
    return out


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
        # A named call's arguments are the output, and stream as they come; an auto
        # choice streams its text up to where a call may begin (AutoStream); required
        # calls are read from the whole output, held until its end.
        held = [Collected() for _ in range(num)] if tools and tools.mode == "required" else None
        auto = [AutoStream(tools) for _ in range(num)] if tools and tools.mode == "auto" else None
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
            if auto is not None:
                finishes[index] = finish
                piece = _auto_choice(answer, index, auto[index], delta, finish)
                if piece is not None:
                    yield chunk(piece)
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
                    stop_reason=stop_reason(finish),
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
        yield error_event(exc, plan)
    finally:
        await choices.aclose()
    yield DONE


def _auto_choice(
    answer: Answer, index: int, stream: AutoStream, delta: Delta, finish: Finish | None
) -> ChatChunkChoice | None:
    """An auto tool choice's next chunk: the content that may go out, and at the end the
    calls, whole; None when there is nothing to say yet."""
    content = stream.feed(delta.text)
    calls: list[ParsedCall] = []
    if finish is not None:
        rest, calls = stream.finish()
        content += rest
    logprobs = None
    if answer.plan.requests[index].output.logprobs is not None and delta.logprobs:
        logprobs = chat_logprobs(answer.tokenizer, delta.logprobs)
    if not (content or logprobs or finish):
        return None
    return ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=content or None, tool_calls=_whole_calls(calls)),
        logprobs=logprobs,
        finish_reason=_chat_finish_reason(finish, bool(calls)),
        stop_reason=stop_reason(finish),
    )


def _chat_finish_reason(finish: Finish | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the output ended as calls (not when cut by length)."""
    if finish is None:
        return None
    return "tool_calls" if called and finish.reason == "stop" else finish.reason


def _whole_calls(calls: list[ParsedCall]) -> list[ToolCallDelta] | None:
    """Calls read from a whole output, each in one streamed piece (None: no call)."""
    return [
        ToolCallDelta(
            index=i,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=call.name, arguments=call.arguments),
        )
        for i, call in enumerate(calls)
    ] or None


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _named_delta(
    tools: ToolCalling, ids: list[str], index: int, text: str
) -> list[ToolCallDelta] | None:
    """The next piece of a named call: its id and name first, then its arguments."""
    if not ids[index]:
        ids[index] = new_call_id()
        name = FunctionCallDelta(name=tools.names[0], arguments=text)
        return [ToolCallDelta(index=0, id=ids[index], type="function", function=name)]
    if not text:
        return None
    return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]


def _held_choice(answer: Answer, index: int, held: Collected, finish: Finish) -> ChatChunkChoice:
    """A held output's one chunk: its content (if any) and its calls, whole."""
    assert answer.plan.tools is not None
    content, calls = answer.plan.tools.parse("".join(held.text))
    logprobs = None
    if answer.plan.requests[index].output.logprobs is not None:
        logprobs = chat_logprobs(answer.tokenizer, held.logprobs)
    return ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=content, tool_calls=_whole_calls(calls)),
        logprobs=logprobs,
        finish_reason=_chat_finish_reason(finish, bool(calls)),
        stop_reason=stop_reason(finish),
    )
