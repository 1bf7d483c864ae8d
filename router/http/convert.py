"""OpenAI bodies -> the router's typed requests, and the router's output -> OpenAI's pieces.

One HTTP request becomes one ``GenerateRequest`` per choice: ``n`` per prompt (a completion
may carry a batch of prompts; choice ``index = prompt_index * n + i``, as OpenAI numbers
them). With a ``seed``, choice ``i`` samples with ``seed + i``: the same seed for every
choice would make them identical, since each choice is its own request with its own
random stream (vLLM draws the n samples of one request from one stream instead).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.errors import bad_field, field_names
from router.http.schemas import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
)
from router.http.structured import STRUCTURED_PATHS, structured_options
from router.http.tools import ToolCalling, template_message, tool_calling
from router.requests import (
    GenerateRequest,
    OutputOptions,
    SamplingOptions,
    StoppingOptions,
    StructuredOptions,
)
from router.validation import InvalidRequest, check_unicode, clip
from workers.protocol.logprobs import TokenLogprobs
from workers.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks of the router."""

    requests: tuple[GenerateRequest, ...]  # choice i is requests[i]
    n: int  # choices per prompt
    names: dict[str, str]  # typed-request path -> OpenAI field, for error messages
    echo_texts: tuple[str, ...] = ()  # completions with echo: each choice's prompt text
    # Completions with echo and max_tokens 0 (OpenAI's and vLLM's "the prompt only"): each
    # choice asks the router for one token, which the answer leaves out.
    echo_only: bool = False
    tools: ToolCalling | None = None  # chat with tools: how the output becomes calls


# Work one call may ask of the router's event loop, before admission counts it: each
# choice is a request (validated, tokenized, streamed), each message is rendered.
MAX_CHOICES = 128
MAX_MESSAGES = 2048


def completion_plan(body: CompletionRequest, request_id: str, tokenizer: Tokenizer) -> Plan:
    """Raises OpenAIError (400 naming the field) for what Baton does not do."""
    if body.suffix:
        raise bad_field("suffix", "not supported (no fill-in-the-middle)")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_field("best_of", "only best_of == n is supported")
    logit_bias = _logit_bias(body.logit_bias)
    prompts = _prompts(body.prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_field(
            "prompt",
            f"at most {MAX_CHOICES} choices per call (prompts x n), got {len(prompts)} x {body.n}",
        )
    # echo + logprobs: the prompt's logprobs too (vLLM: prompt_logprobs = logprobs).
    prompt_logprobs = body.logprobs if body.echo else None
    output = OutputOptions(logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
    echo_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens
    structured, source = structured_options(body)
    requests = tuple(
        _request(
            body,
            prompt,
            f"{request_id}-{p * body.n + i}",
            i,
            max_tokens,
            output,
            structured,
            logit_bias,
        )
        for p, prompt in enumerate(prompts)
        for i in range(body.n)
    )
    echo: tuple[str, ...] = ()
    if body.echo:
        texts = [p if isinstance(p, str) else _echo_text(tokenizer, p) for p in prompts]
        echo = tuple(t for t in texts for _ in range(body.n))
    names = field_names("prompt", "max_tokens", "logprobs")
    names["output.prompt_logprobs"] = "logprobs"
    names |= dict.fromkeys(STRUCTURED_PATHS, source) if source else {}
    return Plan(requests, body.n, names, echo, echo_only)


def chat_plan(
    body: ChatCompletionRequest,
    request_id: str,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    admissible: Callable[[], None] = lambda: None,
) -> Plan:
    """Renders the chat template and tokenizes (the template writes the special tokens, so
    the tokenizer adds none). Raises OpenAIError (400 naming the field). ``admissible``
    runs once the body is judged valid, before the rendering: it raises when the caller
    would be refused now (quotas), so that a refusal costs no template and no tokenizer."""
    if template is None:
        raise bad_field(
            "messages",
            "this model has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use /v1/completions",
        )
    logit_bias = _logit_bias(body.logit_bias)
    if body.prompt_logprobs is not None and body.stream:
        raise bad_field("prompt_logprobs", "not supported with stream (as in vLLM)")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_field("top_logprobs", "needs logprobs: true")
    structured, source = structured_options(body)
    calling, forced, tools = tool_calling(body, template)
    if forced is not None:
        if structured is not None:
            raise bad_field("tool_choice", f"a forced tool call cannot be combined with {source}")
        structured, source = forced, "tool_choice"
    if len(body.messages) > MAX_MESSAGES:
        raise bad_field("messages", f"at most {MAX_MESSAGES} messages, got {len(body.messages)}")
    messages = [
        template_message(
            {"role": m.role, "content": _content(m.content)}
            | m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
        )
        for m in body.messages
    ]
    for i, message in enumerate(messages):
        for key in ("content", "name"):
            try:
                check_unicode(f"messages[{i}].{key}", message.get(key, ""))
            except InvalidRequest as exc:
                raise bad_field(f"messages[{i}].{key}", str(exc).partition(": ")[2]) from None
    admissible()
    try:
        text = template.render(
            messages, add_generation_prompt=body.add_generation_prompt, tools=tools
        )
    except ChatTemplateError as exc:
        raise bad_field("messages", str(exc)) from None
    try:  # what else went in (tool calls, tool results, tool definitions) is text too
        check_unicode("messages", text)
    except InvalidRequest as exc:
        field = "tools" if tools and not _is_unicode(tools) else "messages"
        raise bad_field(field, str(exc).partition(": ")[2]) from None
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.max_completion_tokens
    max_tokens_name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_name = body.max_tokens, "max_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    output = OutputOptions(logprobs=logprobs, prompt_logprobs=body.prompt_logprobs)
    requests = tuple(
        _request(body, prompt, f"{request_id}-{i}", i, max_tokens, output, structured, logit_bias)
        for i in range(body.n)
    )
    names = field_names("messages", max_tokens_name, "top_logprobs")
    names["output.prompt_logprobs"] = "prompt_logprobs"
    names |= dict.fromkeys(STRUCTURED_PATHS, source) if source else {}
    return Plan(requests, body.n, names, tools=calling)


def _request(
    body: CompletionRequest | ChatCompletionRequest,
    prompt: str | tuple[int, ...],
    request_id: str,
    choice: int,
    max_tokens: int | None,
    output: OutputOptions,
    structured: StructuredOptions | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> GenerateRequest:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return GenerateRequest(
        prompt=prompt,
        request_id=request_id,
        model=body.model or "",
        sampling=SamplingOptions(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=None if body.seed is None else body.seed + choice,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            speculative=body.speculative,
            logit_bias=logit_bias,
        ),
        stopping=StoppingOptions(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        ),
        output=output,
        disaggregation=body.disaggregation,
        cache_salt=body.cache_salt or "",
        structured=structured,
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map (token ids as JSON object keys, so strings) as (id, bias) pairs; the
    router judges the values and the ids against the vocabulary."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdecimal()) or len(key) > 10:
            raise bad_field("logit_bias", f"keys must be token ids, got {clip(key)}")
        pairs.append((int(key), value))
    return tuple(pairs)


def _prompts(prompt: str | list) -> list[str | tuple[int, ...]]:
    """A completion's prompt: text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_field("prompt", "the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [tuple(prompt)]
    return [p if isinstance(p, str) else tuple(p) for p in prompt]


def _echo_text(tokenizer: Tokenizer, token_ids: tuple[int, ...]) -> str:
    """A token-id prompt's text, for echo: decoded before the router judges the ids, so
    they are judged here first (an id past the vocabulary would fail the decoder)."""
    bad = [t for t in token_ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_field("prompt", f"ids out of vocabulary [0, {tokenizer.vocab_size}): {bad[:5]}")
    return tokenizer.decode(list(token_ids))


def _is_unicode(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _content(content) -> str:
    """A message's content as text: a string, or its text parts joined (vLLM's "string"
    content format, what most templates expect)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# ---- output ---------------------------------------------------------------------------


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text, special tokens included (a partial UTF-8 character shows as U+FFFD).
    Decoded once per id and process (``Tokenizer.token_text`` caches it): logprobs name
    every token and its top-k at every step, mostly the same few ids."""
    return tokenizer.token_text(token_id, skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Sequence[TokenLogprobs], offset: int
) -> CompletionLogprobs:
    """Completions' parallel lists; ``offset`` is where the first token's text starts."""
    out = CompletionLogprobs()
    for lp in logprobs:
        token = token_text(tokenizer, lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        out.top_logprobs.append({token_text(tokenizer, t): v for t, v in top})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprobs]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        token = token_text(tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    content = []
    for lp in logprobs:
        sampled = top(lp.token_id, lp.logprob)
        tops = [top(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)
