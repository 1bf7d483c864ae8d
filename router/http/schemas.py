"""Pydantic models of every HTTP body, field for field as OpenAI's API names them.

Requests check only shapes and types (a wrong type is a 400 naming the field); values are
judged by the router's validation (``router/validation.py``), as for gRPC. Unknown fields
are ignored, as vLLM does, so that clients that send newer OpenAI fields keep working.
Baton's own sampling and routing options are accepted as extra body fields (vLLM's names):
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``disaggregation``, and ``speculative`` (``false`` opts the request
out of speculative decoding on a decode pool that has it on; Baton's own). Structured
outputs: OpenAI's ``response_format`` and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs`` (router/http/structured.py).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_serializer,
)

from router.requests import Disaggregation


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Request):
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # OpenAI's default: false


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's ``structured_outputs`` extra: one of these."""

    json_: dict | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


class _Sampling(_Request):
    """The fields completions and chat share."""

    model: StrictStr | None = None  # None: the served model
    n: StrictInt = Field(1, ge=1, le=16)  # each choice is one request to the router
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: StrictStr | None = None  # accepted, unused
    # Extras (vLLM's names).
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    disaggregation: Disaggregation | None = None
    speculative: StrictBool | None = None  # Baton's: false = no speculative decoding
    cache_salt: StrictStr | None = None  # prefix-cache isolation (vLLM's; docs/security.md)
    # Structured outputs (router/http/structured.py): at most one of these.
    response_format: ResponseFormat | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputsParams | None = None


TokenIds = list[StrictInt]
Prompt = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    # top-k per token (OpenAI allows at most 5; we allow 20); with echo, the prompt's too
    logprobs: StrictInt | None = None
    echo: StrictBool = False  # the prompt first (max_tokens 0: only the prompt)
    suffix: StrictStr | None = None  # refused: no fill-in-the-middle
    best_of: StrictInt | None = None  # refused unless equal to n
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Request):
    name: StrictStr
    arguments: StrictStr  # JSON text


class MessageToolCall(_Request):
    """A call in an earlier assistant message (sent back with the tools' results)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: StrictStr | None = None  # tool: the call this is the result of


class FunctionDefinition(_Request):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON Schema; None: any object
    strict: StrictBool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ToolDefinition] | None = None  # router/http/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call (required)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    prompt_logprobs: StrictInt | None = None  # vLLM's extra: the prompt's, top-k each
    add_generation_prompt: StrictBool = True  # vLLM's extra: end with the assistant's header


# ---- responses ------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Completions' legacy logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


OpenAIFinishReason = Literal["stop", "length", "tool_calls", "abort"] | None
"""``abort`` (drained past the grace period, or aborted) is not OpenAI's; vLLM sends it too."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinishReason = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # only when the model called tools

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """vLLM's: one candidate token at a prompt position."""

    logprob: float
    rank: int
    decoded_token: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # vLLM's, with the prompt_logprobs extra: per prompt token (null first), token id ->
    # its logprob; the prompt's own token, then the top-k. Absent when not asked for.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        body = handler(self)
        if body.get("prompt_logprobs") is None:
            body.pop("prompt_logprobs", None)
        return body


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed call: its first chunk has the id and name, the next ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    """A chunk's delta carries only what it has (OpenAI's: the role once, then content)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A streamed completion chunk has the response's shape (``object`` too, as OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "baton"
    max_model_len: int  # vLLM's extra
    vocab_size: int  # Baton's extra: what `baton bench --backend openai` draws token ids from


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str


class HealthInfo(BaseModel):
    status: Literal["ok", "draining", "starting"]
    fault_injection: bool = False  # KV transfer faults injected on purpose (testing only)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
