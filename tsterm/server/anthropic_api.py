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
false); an assistant message's `thinking` blocks reach it as the message's `reasoning_content`, rendered where and as
the template renders reasoning; `redacted_thinking` blocks (Anthropic's encrypted reasoning; tsterm writes none) are
accepted and add nothing. A request that continues a conversation the server stored is planned under the server's
history policy (`preserve` by default; Anthropic's API has no field to choose it per request), as on the OpenAI route
(generation.plan_chat).
Prefill: a final assistant message is continued, as Anthropic does: the conversation is rendered without a
generation prompt and cut right after that message's text (where transformers' `continue_final_message` cuts), so
the prompt ends inside the assistant turn, and the reply's content is the continuation only. Its text may not end in
whitespace (Anthropic's rule); an empty one is no prefill (the reply starts the turn).
Usage, as Anthropic counts it: `input_tokens` are the prompt tokens computed for this request, `cache_read_input_tokens`
those served from the prefix cache, `cache_creation_input_tokens` is 0 (the prefix cache keeps every prompt's blocks
on its own, with no write a client asks or pays for), so input + cache_read + cache_creation is the prompt's length,
in message_start (sent once the request is admitted into the engine, when its cache hit is known) and message_delta.
Admission: a request takes its place in the server's bound (generation.Lease, a 429 past it) before its prompt is
rendered and tokenised; `count_tokens` holds one while it renders.
Validation: each error is one 400 naming where it is (`messages[1].content[0].text: Field required`); image and
document blocks are refused ("this model reads text only"), tools with a `type` (Anthropic's server tools such as
web_search_20250305) by name.
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
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tsterm.chat.history import render_context
from tsterm.config import SamplingParams
from tsterm.errors import TstermError
from tsterm.outputs import CompletionOutput, RequestOutput
from tsterm.server.errors import ANTHROPIC_PATH, APIError, is_anthropic  # noqa: F401 - app.py reads them here
from tsterm.server.metrics import ServerMetrics
from tsterm.server.generation import (
    LAST, ChatPrompt, Lease, ReplyRecord, SSEResponse, check_max_tokens, check_model, check_prompt, check_stop,
    count_history, count_usage, generate, gone, plan_chat, remember, render_messages, request_owner, run_to_end,
    sse_events,
)
from tsterm.server.tool_choice import ToolUse, call_grammar, reply_parser, stop_at_call_end, unsatisfied
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart, Reasoning, ReplyParser
from tsterm.server.security import request_salt
from tsterm.server.state import RequestInfo, ServerState

router = APIRouter()
PATH = ANTHROPIC_PATH


# ---- bodies ------------------------------------------------------------------------------------------------
# No field is a union of models: a union's validation error lists every member's failure. Fields that take a string
# or a list of blocks are `Any` here and read by `_content` / `_system_text` / `_result_text`, which name the
# block they refuse; `_validate` turns any other validation error into one message naming its field.


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


class RedactedThinkingBlock(_Body):
    """Reasoning Anthropic's API returned encrypted, sent back with its message: its `data` is opaque (tsterm writes
    no such block), so it adds nothing to the prompt."""

    type: Literal["redacted_thinking"]
    data: str


class ThinkingConfig(_Body):
    """`thinking`: Anthropic's switch for extended thinking, given to the chat template as `enable_thinking`
    (`budget_tokens` is accepted and not enforced: max_tokens bounds the whole reply)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = None  # a string or a list of text blocks (`_result_text`)
    is_error: bool = False


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Any  # a string or a list of content blocks (`_content`)


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
    system: Any = None  # a string or a list of text blocks (`_system_text`)
    tools: list[dict[str, Any]] | None = None  # each read by `_tool`
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: shares cached blocks only with its salt


# Blocks by type, and the roles whose messages may hold them
BLOCKS: dict[str, tuple[type[_Body], tuple[str, ...]]] = {
    "text": (TextBlock, ("user", "assistant")),
    "tool_use": (ToolUseBlock, ("assistant",)),
    "tool_result": (ToolResultBlock, ("user",)),
    "thinking": (ThinkingBlock, ("assistant",)),
    "redacted_thinking": (RedactedThinkingBlock, ("assistant",)),
}
NOT_TEXT = ("image", "document")  # Anthropic's blocks a text-only model cannot read
# Blocks of Anthropic's own server-side tools (their calls and results) and sources: valid there, served by no tool here
SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                 "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                 "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload", "search_result")
_M = TypeVar("_M", bound=BaseModel)


def _where(loc: tuple | list) -> str:
    """A pydantic location as a client writes the field: messages[1].content[0].text."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _validate(model: type[_M], raw: Any, where: str = "") -> _M:
    """`raw` as `model`, or one 400 naming the first field in error (and how many more there are)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        field = _where(first["loc"])
        field = f"{where}.{field}" if where and field else where or field or "body"
        more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise APIError(400, f"{field}: {first['msg']}{more}", param=field) from None


def _parse_body(model: type[_M], raw: dict[str, Any]) -> _M:
    """The request body as `model`. An explicit null in an optional field is that field left out (as clients that
    serialise every field send it)."""
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    return _validate(model, {k: v for k, v in raw.items() if v is not None or k in required})


def _block(raw: Any, where: str, role: str) -> BaseModel:
    """One content block of a `role` message, or a 400 naming it: image / document blocks (this model reads text),
    Anthropic's server-tool blocks, unknown types, a block in a message of the wrong role."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str):
        raise APIError(400, f"{where}: a content block is an object with a string `type`", param=where)
    if kind in NOT_TEXT:
        raise APIError(400, f"this model reads text only: {kind} block at {where}", param=where)
    if kind in SERVER_BLOCKS:
        raise APIError(400, f"{where}: {kind} blocks (Anthropic's server tools and their results) are not supported "
                       "by this server", param=where)
    if kind not in BLOCKS:
        raise APIError(400, f"{where}: unknown content block type {kind!r}; this server takes "
                       f"{', '.join(BLOCKS)} blocks", param=where)
    model, roles = BLOCKS[kind]
    if role not in roles:
        raise APIError(400, f"{where}: {kind} blocks belong in {' or '.join(roles)} messages, not {role} ones",
                       param=where)
    return _validate(model, raw, where)


def _text_blocks(content: Any, where: str, what: str) -> str:
    """A field that is a string or a list of text blocks (system, a tool_result's content), as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: {what} is a string or a list of text blocks", param=where)
    text = []
    for j, raw in enumerate(content):
        block = _block(raw, f"{where}[{j}]", "user")
        if not isinstance(block, TextBlock):
            raise APIError(400, f"{where}[{j}]: {what} holds text blocks only, not {block.type}",
                           param=f"{where}[{j}]")
        text.append(block.text)
    return "".join(text)


def _content(message: Message, i: int) -> list[BaseModel]:
    where = f"messages[{i}].content"
    if isinstance(message.content, str):
        return [TextBlock(type="text", text=message.content)]
    if not isinstance(message.content, list):
        raise APIError(400, f"{where}: a message's content is a string or a list of content blocks", param=where)
    return [_block(raw, f"{where}[{j}]", message.role) for j, raw in enumerate(message.content)]


def _tool(raw: dict[str, Any], i: int) -> Tool:
    kind = raw.get("type")
    if kind is not None and kind != "custom":
        raise APIError(400, f"server tool {kind} is not supported by this server (tools[{i}]); it runs the tools "
                       "the client defines (name, description, input_schema)", param=f"tools[{i}].type")
    return _validate(Tool, raw, f"tools[{i}]")


# ---- request -> prompt -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Chat:
    """A request as chat-template messages; `prefill` is set when its final message is an assistant turn to continue
    (that message is the last of `messages`)."""

    messages: list[dict]
    tools: ToolUse
    kwargs: dict[str, Any]
    prefill: bool = False


def _template_messages(body: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if body.system is not None:
        system = _text_blocks(body.system, "system", "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        text, calls, thinking = [], [], []
        for j, block in enumerate(_content(message, i)):
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text_blocks(block.content, f"messages[{i}].content[{j}].content", "a tool_result's content")
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


def _chat(body: CountTokensRequest) -> Chat:
    """The request's messages, tools and template variables; a final assistant message is a prefill (an empty one
    is dropped: the reply starts the turn, as without it)."""
    messages = _template_messages(body)
    tools = _tools(body)
    kwargs = _template_kwargs(body)
    if body.messages[-1].role != "assistant":
        return Chat(messages, tools, kwargs)
    final, where = messages[-1], f"messages[{len(body.messages) - 1}]"
    if final.get("tool_calls"):
        raise APIError(400, f"{where}: a final assistant message is continued as text (a prefill); it cannot end "
                       "with tool_use blocks: send their tool_result in a user message", param=where)
    if final["content"] != final["content"].rstrip():
        raise APIError(400, f"{where}: final assistant content cannot end with trailing whitespace", param=where)
    if not final["content"] and "reasoning_content" not in final:
        return Chat(messages[:-1], tools, kwargs)
    return Chat(messages, tools, kwargs, prefill=True)


def _prefill_prompt(state: ServerState, chat: Chat, grammar: bool) -> ChatPrompt:
    """The prompt that continues the final assistant message (blocking): the conversation rendered without a
    generation prompt, cut where that message's text ends (found by a marker appended to it, so text the template
    writes elsewhere cannot be taken for it). `messages` of the result are those before it: `remember` stores the
    message with its continuation. `grammar`: a required call's grammar, after the prefill."""
    tokenizer, tools = state.tokenizer, chat.tools
    marker = f"[[tsterm-prefill-{uuid.uuid4().hex}]]"
    *before, final = chat.messages

    def render(conversation: list[dict], generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(conversation, tools=tools.offered, add_generation_prompt=generation_prompt,
                                             tokenize=False, **chat.kwargs)

    try:
        text = render([*before, {**final, "content": final["content"] + marker}], generation_prompt=False)
        context = render_context(render)
    except TstermError as e:
        raise APIError(400, str(e), param="messages") from e
    cut = text.rfind(marker)
    if cut < 0:
        where = f"messages[{len(chat.messages) - 1}]"
        raise APIError(400, f"{where}: the chat template does not render this final assistant message's text, so "
                       "the model cannot continue it (prefill)", param=where)
    prompt = ChatPrompt(list(tokenizer.encode(text[:cut])), messages=[dict(m) for m in before], context=context)
    if grammar and (tools.required or tools.strict):
        prompt.grammar = call_grammar(state, tools, prompt.ids, chat.kwargs.get("enable_thinking") is True)
    return prompt


def _tools(body: CountTokensRequest) -> ToolUse:
    offered = [_tool(raw, i) for i, raw in enumerate(body.tools or [])]
    specs = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in offered]
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


def _usage(out: RequestOutput) -> dict:
    """Anthropic's usage: the prompt split into tokens computed (input) and read from the prefix cache; nothing is
    a cache write (see the module's docstring), so the three add up to the prompt's length."""
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": sum(len(o.token_ids) for o in out.outputs)}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n"


@router.post(f"{PATH}/count_tokens", response_model=None)
async def count_tokens(request: Request, raw: dict[str, Any] = Body()) -> Any:
    """The prompt's tokens as `/v1/messages` would render it (the system prompt and the tools included; a required
    call is held to its grammar, which adds no prompt tokens); nothing is generated. Rendering holds a place in the
    server's admission bound (a 429 past it), as a generation request does."""
    state, metrics = request.app.state.server, request.app.state.metrics
    body = _parse_body(CountTokensRequest, raw)
    check_model(state, body.model)
    chat = _chat(body)
    lease = Lease(state, metrics)
    try:
        if chat.prefill:
            prompt = await asyncio.to_thread(_prefill_prompt, state, chat, False)
        else:
            prompt = await asyncio.to_thread(render_messages, state, chat.messages, chat.tools, chat.kwargs)
    finally:
        lease.release()
    return JSONResponse({"input_tokens": len(prompt.ids)})


@router.post(PATH, response_model=None)
async def messages(request: Request, raw: dict[str, Any] = Body()) -> Any:
    state, metrics = request.app.state.server, request.app.state.metrics
    body = _parse_body(MessagesRequest, raw)
    check_model(state, body.model)
    chat = _chat(body)
    params = stop_at_call_end(_sampling(state, body), chat.tools, state)
    owner = request_owner(request, state)
    lease = Lease(state, metrics)  # before rendering: a full server renders and tokenises nothing more
    try:
        if chat.prefill:  # a prefilled turn is rendered as sent (it continues no stored conversation's reply)
            prompt = await asyncio.to_thread(_prefill_prompt, state, chat, True)
        else:
            stored = state.conversations.find(owner, chat.messages) if state.conversations is not None else None
            prompt = await asyncio.to_thread(plan_chat, state, chat.messages, chat.tools, chat.kwargs, None, stored)
        check_prompt(state, prompt.ids)
        check_max_tokens(state, prompt.ids, body.max_tokens, "max_tokens")
    except BaseException:
        lease.release()
        raise
    if prompt.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=prompt.grammar)
    info = RequestInfo(f"msg_{uuid.uuid4().hex}", "messages", prompt.ids, messages=chat.messages,
                       history_policy=prompt.policy, history_fallback=prompt.fallback_reason,
                       history_context=prompt.context, cache_salt=request_salt(state, request, body.cache_salt))
    count_history(metrics, prompt, info.request_id)
    parser = reply_parser(chat.tools, prefix="toolu", state=state)
    prefill = chat.messages[-1] if chat.prefill else None
    if body.stream:
        events = _stream(state, metrics, chat.tools, parser, info, params, owner, prompt, prefill)
        return SSEResponse(sse_events(events, lease, metrics, _error_event), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    (o,) = out.outputs
    pieces = parser.feed(parser.text(o, whole=True), final=True, stop_reason=o.stop_reason)
    if chat.tools.required and not parser.calls:
        raise unsatisfied()
    record = ReplyRecord()
    record.add(pieces)
    remember(state, owner, prompt, out, {o.index: _reply_message(record, prefill)})
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = [p.call for p in pieces if isinstance(p, CallEnd)]
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content: list[dict] = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    content += [{"type": "text", "text": text}] if text.strip() or not calls else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]
    stop_reason, stop_sequence = _stop(o, parser)
    return JSONResponse({"id": info.request_id, "type": "message", "role": "assistant", "model": state.model_name,
                         "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": _usage(out)})


def _reply_message(record: ReplyRecord, prefill: dict | None) -> dict:
    """The assistant message the stored conversation holds for a reply: with a prefill, that message continued."""
    message = record.message()
    if prefill is not None:
        message = {**prefill, **message, "content": prefill["content"] + message["content"]}
    return message


async def _stream(state: ServerState, metrics: ServerMetrics, tools: ToolUse, parser: ReplyParser,
                  info: RequestInfo, params: SamplingParams, owner: str, prompt: ChatPrompt,
                  prefill: dict | None) -> AsyncIterator[str]:
    last, index, text_open = None, 0, False
    thinking_open: int | None = None  # the index of an open thinking block
    o = None
    record = ReplyRecord()
    async for out in generate(state, info, params):
        if last is None:  # the first output: the request is in the engine and its cache hit known
            start = {"id": info.request_id, "type": "message", "role": "assistant", "model": state.model_name,
                     "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(out)}
            yield _event("message_start", {"message": start})
        last = out
        (o,) = out.outputs
        pieces = parser.feed(parser.text(o), o.finish_reason is not None, o.stop_reason)
        record.add(pieces)
        for piece in pieces:
            if isinstance(piece, Reasoning):  # a harmony reply's analysis: a thinking block (tsterm signs nothing)
                if thinking_open is None:
                    if text_open:
                        yield _event("content_block_stop", {"index": index})
                        index, text_open = index + 1, False
                    yield _event("content_block_start", {"index": index, "content_block": {
                        "type": "thinking", "thinking": "", "signature": ""}})
                    thinking_open = index
                yield _event("content_block_delta", {"index": index,
                                                     "delta": {"type": "thinking_delta", "thinking": piece.text}})
                continue
            if thinking_open is not None:
                yield _event("content_block_delta", {"index": index,
                                                     "delta": {"type": "signature_delta", "signature": ""}})
                yield _event("content_block_stop", {"index": index})
                index, thinking_open = index + 1, None
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
    if thinking_open is not None:
        yield _event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})
        yield _event("content_block_stop", {"index": index})
    if text_open:
        yield _event("content_block_stop", {"index": index})
    count_usage(metrics, last)
    remember(state, owner, prompt, last, {o.index: _reply_message(record, prefill)})
    stop_reason, stop_sequence = _stop(o, parser)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": _usage(last)})
    yield LAST
    yield _event("message_stop", {})
