"""The Anthropic Messages API: `POST /v1/messages` (streaming as Anthropic's SSE events), on the same engine.

The request becomes the same chat-template messages the OpenAI route renders (system -> a system message, assistant
text + tool_use blocks -> one assistant message with `tool_calls`, tool_result blocks -> `tool` messages), so a
follow-up request re-renders the history the model produced and reuses the prefix cache. Prompt rendering, the
tool-call parser, admission, generation with disconnect watching and usage counting are `generation`'s.
tool_choice "any" and a named tool constrain generation as on the OpenAI route (tool_choice.call_grammar: the reply is
calls of the offered tools, their `input` held to each tool's `input_schema`; a named tool, or
`disable_parallel_tool_use`, allows one). A constrained reply cut short by max_tokens before its first call was
whole is a 422 (in a stream, an error event).
Reasoning: `thinking: {"type": "enabled" | "disabled"}` reaches the chat template as `enable_thinking` (true |
false); an assistant message's `thinking` blocks reach it as the message's `reasoning_content`. A request that
continues a conversation the server stored is planned under the server's history policy (`preserve` by default;
Anthropic's API has no field to choose it per request), as on the OpenAI route (generation.plan_chat).
A streamed tool_use block starts (`content_block_start`, empty input) once its name is read and is an offered tool;
`input_json_delta` events carry `partial_json` fragments of the input as the model writes it; `content_block_stop`
ends it. A streamed block that turns out malformed stays (its input is what the model wrote); stop_reason is still
"tool_use" unless max_tokens cut it short.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tsterm.config import SamplingParams
from tsterm.outputs import CompletionOutput, RequestOutput
from tsterm.server.errors import APIError
from tsterm.server.metrics import ServerMetrics
from tsterm.server.generation import (
    LAST, ChatPrompt, Lease, ReplyRecord, SSEResponse, check_max_tokens, check_model, check_prompt, check_stop,
    count_history, count_usage, generate, gone, plan_chat, remember, render_messages, request_owner, run_to_end,
    sse_events,
)
from tsterm.server.tool_choice import ToolUse, reply_parser, stop_at_call_end, unsatisfied
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart, ReplyParser
from tsterm.server.state import RequestInfo, ServerState

router = APIRouter()
PATH = "/v1/messages"


def is_anthropic(request: Request) -> bool:
    """Whether `request` is on an Anthropic route (its errors take Anthropic's shape)."""
    return request.url.path.startswith(PATH)


# ---- bodies ------------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Body):
    """An assistant's reasoning as Anthropic returns it; a client sends it back with the message. It reaches the chat
    template as the message's `reasoning_content` (the signature is not checked: tsterm signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ThinkingConfig(_Body):
    """`thinking`: Anthropic's switch for extended thinking, given to the chat template as `enable_thinking`
    (`budget_tokens` is accepted and not enforced: max_tokens bounds the whole reply)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Body):
    """`POST /v1/messages/count_tokens`: what a request's prompt would cost, without generating."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop_sequences: list[str] | None = None
    stream: bool = False


# ---- request -> prompt -------------------------------------------------------------------------------------


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _template_messages(body: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text, calls, thinking = [], [], []
        for block in message.content:
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock):
                if message.role != "assistant":
                    raise APIError(400, "thinking blocks belong in assistant messages", param="messages")
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise APIError(400, "tool_use blocks belong in assistant messages", param="messages")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            else:
                if message.role != "user":
                    raise APIError(400, "tool_result blocks belong in user messages", param="messages")
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if thinking:
                entry["reasoning_content"] = "".join(thinking)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: CountTokensRequest) -> ToolUse:
    specs = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []]
    kind = body.tool_choice.type if body.tool_choice else "auto"
    if not specs:
        if kind in ("any", "tool"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return ToolUse(None, False, False)
    if kind == "none":
        return ToolUse(None, False, False)
    if kind == "tool":
        name = body.tool_choice.name if body.tool_choice else None
        named = [s for s in specs if s["function"]["name"] == name]
        if not named:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolUse(named, True, True, name=name, single=True)
    single = bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return ToolUse(specs, True, kind == "any", single=single)


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any]:
    """Anthropic's `thinking` as the chat template's `enable_thinking` (absent: the template's own default)."""
    return {} if body.thinking is None else {"enable_thinking": body.thinking.type == "enabled"}


def _sampling(state: ServerState, body: MessagesRequest) -> SamplingParams:
    fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")}
    fields = {k: v for k, v in fields.items() if v is not None}
    if body.stop_sequences:
        fields["stop"] = check_stop(state, list(body.stop_sequences), "stop_sequences")
    try:
        return dataclasses.replace(state.defaults, **fields, max_tokens=body.max_tokens, n=1)
    except ValueError as e:  # SamplingParams names the field, its value and its range
        raise APIError(400, str(e), param=getattr(e, "param", None)) from e


# ---- responses ---------------------------------------------------------------------------------------------


def _stop(o: CompletionOutput, parser: ReplyParser) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if parser.finish_reason(o.finish_reason) == "tool_calls":
        return "tool_use", None
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput | None, output_tokens: int | None = None) -> dict:
    if out is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}
    generated = sum(len(o.token_ids) for o in out.outputs)
    return {"input_tokens": len(out.prompt_token_ids), "output_tokens": generated if output_tokens is None
            else output_tokens, "cache_read_input_tokens": out.num_cached_tokens, "cache_creation_input_tokens": 0}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n"


@router.post(f"{PATH}/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    """The prompt's tokens as `/v1/messages` would render it (the system prompt and the tools included; a required
    call is held to its grammar, which adds no prompt tokens); nothing is generated."""
    state = request.app.state.server
    check_model(state, body.model)
    prompt = await asyncio.to_thread(render_messages, state, _template_messages(body), _tools(body),
                                     _template_kwargs(body))
    return JSONResponse({"input_tokens": len(prompt.ids)})


@router.post(PATH, response_model=None)
async def messages(body: MessagesRequest, request: Request) -> Any:
    state, metrics = request.app.state.server, request.app.state.metrics
    check_model(state, body.model)
    tools = _tools(body)
    params = stop_at_call_end(_sampling(state, body), tools)
    messages = _template_messages(body)
    owner = request_owner(request, state)
    stored = state.conversations.find(owner, messages) if state.conversations is not None else None
    prompt = await asyncio.to_thread(plan_chat, state, messages, tools, _template_kwargs(body), None, stored)
    check_prompt(state, prompt.ids)
    check_max_tokens(state, prompt.ids, body.max_tokens, "max_tokens")
    if prompt.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=prompt.grammar)
    lease = Lease(state, metrics)
    info = RequestInfo(f"msg_{uuid.uuid4().hex}", "messages", prompt.ids, messages=messages,
                       history_policy=prompt.policy, history_fallback=prompt.fallback_reason,
                       history_context=prompt.context)
    count_history(metrics, prompt, info.request_id)
    parser = reply_parser(tools, prefix="toolu")
    if body.stream:
        events = _stream(state, metrics, tools, parser, info, params, owner, prompt)
        return SSEResponse(sse_events(events, lease, metrics, _error_event), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    (o,) = out.outputs
    pieces = parser.feed(o.text, final=True, stop_reason=o.stop_reason)
    if tools.required and not parser.calls:
        raise unsatisfied()
    record = ReplyRecord()
    record.add(pieces)
    remember(state, owner, prompt, out, {o.index: record.message()})
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = [p.call for p in pieces if isinstance(p, CallEnd)]
    content: list[dict] = [{"type": "text", "text": text}] if text.strip() or not calls else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]
    stop_reason, stop_sequence = _stop(o, parser)
    return JSONResponse({"id": info.request_id, "type": "message", "role": "assistant", "model": state.model_name,
                         "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": _usage(out)})


async def _stream(state: ServerState, metrics: ServerMetrics, tools: ToolUse, parser: ReplyParser,
                  info: RequestInfo, params: SamplingParams, owner: str, prompt: ChatPrompt) -> AsyncIterator[str]:
    last, index, text_open = None, 0, False
    start = {"id": info.request_id, "type": "message", "role": "assistant", "model": state.model_name,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**_usage(None), "input_tokens": len(info.prompt_ids)}}
    yield _event("message_start", {"message": start})
    o = None
    record = ReplyRecord()
    async for out in generate(state, info, params):
        last = out
        (o,) = out.outputs
        pieces = parser.feed(o.delta_text, o.finish_reason is not None, o.stop_reason)
        record.add(pieces)
        for piece in pieces:
            if isinstance(piece, str):
                if not text_open and not piece.strip():
                    continue
                if not text_open:
                    yield _event("content_block_start", {"index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield _event("content_block_delta", {"index": index,
                                                     "delta": {"type": "text_delta", "text": piece}})
                continue
            if text_open:
                yield _event("content_block_stop", {"index": index})
                index, text_open = index + 1, False
            if isinstance(piece, CallStart):
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}})
            elif isinstance(piece, CallArguments):
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": piece.text}})
            else:
                yield _event("content_block_stop", {"index": index})
                index += 1
    if o is None or last is None:
        raise APIError(500, "the request ended without output", type_="api_error")
    if tools.required and not parser.calls:
        raise unsatisfied()
    if text_open:
        yield _event("content_block_stop", {"index": index})
    count_usage(metrics, last)
    remember(state, owner, prompt, last, {o.index: record.message()})
    stop_reason, stop_sequence = _stop(o, parser)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": _usage(last)})
    yield LAST
    yield _event("message_stop", {})
