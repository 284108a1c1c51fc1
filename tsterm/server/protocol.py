"""Pydantic models of the OpenAI request and response bodies the server speaks (the fields tsterm serves).

Requests ignore unknown fields (clients send newer ones); a field of the wrong type or out of range is a 400. An
explicit JSON `null` is the field not given (its default), as OpenAI takes it, in every request object.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """`"n": null` is `n` left out: its default (clients such as LangChain send every optional field)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


# ---- requests ----------------------------------------------------------------------------------------------


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # "function": the legacy result of a `function_call` (its `name` says which), read as a "tool" message
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: FunctionCall | None = None  # the legacy form of one tool call (an assistant message's)
    tool_call_id: str | None = None
    # an assistant message's reasoning, as clients of reasoning parsers send it back (vLLM, SGLang: reasoning_content;
    # others: reasoning); the chat template decides whether it renders it
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; a call tool_choice requires is held to `parameters` whether or not


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class LegacyFunctionChoice(_Body):
    """The legacy `function_call: {"name": ...}` (a named tool_choice)."""

    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way (as vLLM does)


class ResponseFormat(_Body):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # token id (as a string: JSON keys are strings) -> a bias in [-100, 100] added to its logit; checked against the
    # vocabulary and the bounds by the routes and the engine (SamplingParams.logit_bias)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's field, as the engine takes it: exactly one of json, json_object, regex, choice, grammar (Lark / GBNF),
    # plus disable_any_whitespace (tsterm/config.py StructuredOutputs)
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: shares cached blocks only with its salt


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the legacy form of tools / tool_choice (one call per reply; the reply's call comes back as `function_call`)
    functions: list[FunctionSpec] | None = None
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None
    response_format: ResponseFormat | None = None
    # variables for the chat template, as vLLM and SGLang take them (enable_thinking, preserve_thinking, ...), and
    # tsterm's `thinking_history` ("preserve" | "template"): checked by generation.template_kwargs
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


# ---- responses ---------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a harmony model's analysis channel (as vLLM's reasoning parsers return it)
    tool_calls: list[ToolCallOut] | None = None
    function_call: ToolCallFunction | None = None  # the call, where the request used the legacy `functions`

    @model_serializer(mode="wrap")
    def _content_always(self, handler: Any) -> dict[str, Any]:
        """`content` is part of OpenAI's message even when it is null (a reply of tool calls only), while the
        responses are otherwise dumped without their None fields."""
        data = handler(self)
        data.setdefault("content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction | None = None


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: ToolCallFunction | None = None  # the legacy `functions` form of a call delta


def _with_nulls(data: dict[str, Any], *names: str) -> dict[str, Any]:
    for name in names:
        data.setdefault(name, None)
    return data


class ChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None

    @model_serializer(mode="wrap")
    def _nulls(self, handler: Any) -> dict[str, Any]:
        """OpenAI's chunks carry `finish_reason: null` (and `logprobs: null`) until the choice's last one."""
        return _with_nulls(handler(self), "finish_reason", "logprobs")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None

    @model_serializer(mode="wrap")
    def _nulls(self, handler: Any) -> dict[str, Any]:
        return _with_nulls(handler(self), "finish_reason", "logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """A served model, with OpenAI's fields (`object`, `created` in Unix seconds, `owned_by`) and Anthropic's (`type`,
    `display_name`, `created_at` in RFC 3339), so either client reads it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tsterm"
    type: Literal["model"] = "model"
    display_name: str
    created_at: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AnthropicModelList(BaseModel):
    """Anthropic's page of models (`GET /v1/models` from an Anthropic client): `has_more`, `first_id`, `last_id`."""

    data: list[ModelCard]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
