"""The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

A request is `input` (a string: one user message; or a list of items: `message` items of role user / system /
developer / assistant with text content parts (`input_text`, `output_text`, `refusal`), and the items a client echoes
back from earlier responses: `function_call`, `function_call_output`, `reasoning`), `instructions` (a leading system
message, not carried over from a previous response, as OpenAI does), function `tools` in the Responses flat shape
(`{"type": "function", "name", "description", "parameters", "strict"}`, strict by default as OpenAI's),
`tool_choice` ("auto", "none", "required", `{"type": "function", "name"}`, `{"type": "allowed_tools", "mode",
"tools"}`), `parallel_tool_calls`, `max_output_tokens` (left out: to the end of the context, as OpenAI's),
`temperature`, `top_p`, `text.format` (`json_object` / `json_schema`: the chat route's structured outputs,
structured.py; strict functions are then not held to their schemas, one grammar at a time), `reasoning.effort` (the
template's `enable_thinking`: off for "none" / "minimal"), `stream`, `store` (default true), `previous_response_id`,
`metadata`, `user`; plus tsterm's `chat_template_kwargs` as on the chat route. Unknown fields are ignored; fields for
what this server cannot do (`background`, `conversation`, `prompt`, `top_logprobs`, item references, images, files,
hosted tools) are a 400 naming them.

The reply is split as the chat route splits it (tool_choice.reply_parser / tool_stream.ReplyParser: text and calls,
a malformed call left as text), and its text further into reasoning and answer (`ReasoningSplit`: a `<think>` block
the reply opens, or that the generation prompt left open, up to its `</think>`). Output items, in the order the
model wrote them: `reasoning` (its `content` one `reasoning_text`), `message` (one `output_text`), `function_call`
(`call_id`, `name`, `arguments` as the model wrote them). A reply cut by max_output_tokens is `status: "incomplete"`
(`incomplete_details.reason: "max_output_tokens"`; a stream then ends with `response.incomplete`). Streaming sends
the typed events the official client parses: response.created, response.in_progress, then per item
output_item.added, content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta,
their .done, content_part.done, output_item.done, and response.completed; an error after the stream began is an
`error` event.

Conversation state: a stored response (response_store.py) is a Session with the exact ids of its prompt and reply;
`previous_response_id` continues it under the `preserve` history policy (the kept ids + the template's text for the
new input only: no re-rendering, no re-tokenising, the whole earlier conversation from the prefix cache) unless the
request names `chat_template_kwargs.thinking_history` or its `instructions` differ from the previous response's (the
conversation then starts differently and is rendered as the template says). A client that sends its whole history
instead (store false, or the Agents SDK's default) is matched against the server's API conversations like a chat
request (conversations.py; `store: false` keeps nothing retrievable, while that cache of recent conversations holds
its ids as it does for chat). Every request is admitted (the queue bound) before its input is converted and rendered,
and told to the observer as `api="responses"` with the whole conversation as chat-template messages, so the
workstation shows it as an API session.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tsterm.agent.tool_grammar import THINK_CLOSE, THINK_OPEN, prompt_opens_reasoning
from tsterm.chat.history import PRESERVE
from tsterm.chat.session import Session
from tsterm.config import SamplingParams, StructuredOutputs
from tsterm.outputs import RequestOutput
from tsterm.server import structured
from tsterm.server.errors import APIError
from tsterm.server.generation import (
    LAST, ChatPrompt, Lease, ReplyRecord, SSEResponse, check_max_tokens, check_model, check_prompt, count_history,
    count_usage, generate, gone, plan_chat, remember, request_owner, run_to_end, sse_events, template_kwargs,
)
from tsterm.server.metrics import ServerMetrics
from tsterm.server.protocol import JSONSchemaFormat, ResponseFormat
from tsterm.server.response_store import StoredResponse
from tsterm.server.security import request_salt
from tsterm.server.state import RequestInfo, ServerState
from tsterm.server.tool_choice import ToolUse, reply_parser, stop_at_call_end, unsatisfied
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart, Piece, Reasoning, ReplyParser

router = APIRouter()
PATH = "/v1/responses"


# ---- request ---------------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    """OpenAI's reasoning options: `effort` "none" / "minimal" turns a hybrid model's thinking off (the template's
    `enable_thinking: false`), another effort on; `summary` is accepted (the reasoning is returned whole)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # what a local server does not do: a 400 naming the field when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # tsterm's, as on the chat route: variables for the chat template, and `thinking_history`
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: shares cached blocks only with its salt


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise APIError(400, "background: this server answers while the client waits (background responses are not "
                       "supported)", param="background")
    if body.conversation is not None:
        raise APIError(400, "conversation: the Conversations API is not supported; continue a response with "
                       "previous_response_id, or send the history as input", param="conversation")
    if body.prompt is not None:
        raise APIError(400, "prompt: stored prompt templates are not supported; send input and instructions",
                       param="prompt")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs: this server returns no log probabilities on /v1/responses; use "
                       "/v1/chat/completions with logprobs", param="top_logprobs")


def thinking_kwargs(body: ResponsesRequest, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template's variables with `reasoning.effort` as `enable_thinking` (unless chat_template_kwargs sets it)."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None or "enable_thinking" in kwargs:
        return kwargs
    return {**kwargs, "enable_thinking": effort not in ("none", "minimal")}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _where(param: str) -> str:
    """`input.2.content.0` -> `input[2].content[0]` (how a message names the field)."""
    return ".".join(f"[{p}]" if p.isdigit() else p for p in param.split(".")).replace(".[", "[")


def _content_text(content: Any, param: str) -> str:
    """A message's content (a string, or a list of text parts) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{_where(param)} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        at = f"{param}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _bad(f"{_where(at)}: a {kind} part needs a string "
                           f"{'refusal' if kind == 'refusal' else 'text'}", at)
            texts.append(text)
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{_where(at)}.type: {kind} parts cannot be read: this model reads text only", f"{at}.type")
        else:
            raise _bad(f"{_where(at)}.type: {kind!r} is not a content part this server takes (input_text, "
                       "output_text, refusal)", f"{at}.type")
    return "".join(texts)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{_where(param)}.{key} must be a string", f"{param}.{key}")
    return value


def _arguments(text: str) -> Any:
    """A call's arguments for the chat template: the parsed object, or the text as it came when it is not JSON (a
    call cut short: OpenAI takes any string back)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def input_messages(items: str | list[Any]) -> list[dict]:
    """`input` as chat-template messages (tool calls with object arguments): consecutive assistant items of one
    model turn (its reasoning, its message, its function calls) become one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message the next assistant items of the same turn join
    reasoning: str | None = None  # a reasoning item, for the assistant message that follows it

    def assistant() -> dict:
        nonlocal turn, reasoning
        turn = {"role": "assistant", "content": ""}
        if reasoning is not None:
            turn["reasoning_content"], reasoning = reasoning, None
        messages.append(turn)
        return turn

    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"{_where(param)} must be an object (an input item)", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{_where(param)}.role must be user, system, developer or assistant, got {role!r}",
                           f"{param}.role")
            text = _content_text(item.get("content"), f"{param}.content")
            if role == "assistant":
                message = turn if turn is not None and not turn.get("tool_calls") else assistant()
                message["content"] += text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
                turn = None
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param),
                                 "arguments": _arguments(_string(item, "arguments", param))}}
            (turn if turn is not None else assistant()).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
            turn = None
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning, turn = _content_text(parts, f"{param}.content"), None
        elif kind == "item_reference":
            raise _bad(f"{_where(param)}: item references are not supported; send the item itself, or continue a "
                       "stored response with previous_response_id", f"{param}.type")
        else:
            raise _bad(f"{_where(param)}.type: {kind!r} items are not supported; this server takes message, "
                       "function_call, function_call_output and reasoning items", f"{param}.type")
    return messages


def _tools(body: ResponsesRequest, constrained_text: bool) -> tuple[ToolUse, list[dict]]:
    """(what the tools and tool_choice ask of generation, the tools as the response echoes them). Under
    `text.format` (a grammar of its own) strict functions are not held to their schemas."""
    specs, echoed = [], []
    for i, tool in enumerate(body.tools or []):
        param = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}].type: {kind!r} tools are not supported; this server offers function tools (the "
                       "client runs them)", f"{param}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name must be a non-empty string", f"{param}.name")
        parameters, strict = tool.get("parameters"), tool.get("strict")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"tools[{i}].parameters must be a JSON schema object", f"{param}.parameters")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"tools[{i}].strict must be true or false", f"{param}.strict")
        strict = True if strict is None else strict  # OpenAI's default for a Responses function tool
        function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}, "strict": strict}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        specs.append({"type": "function", "function": function})
        echoed.append({"type": "function", **function, "description": function.get("description")})
    choice, single = body.tool_choice, body.parallel_tool_calls is False
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            named = [t for t in specs if t["function"]["name"] == name]
            if not named:
                raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice.name")
            return ToolUse(named, True, True, name=name, single=True), echoed
        if kind == "allowed_tools":
            mode = choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise _bad(f"tool_choice.mode must be auto or required, got {mode!r}", "tool_choice.mode")
            allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
            specs = [t for t in specs if t["function"]["name"] in allowed]
            if not specs:
                raise _bad("tool_choice.tools allows none of the tools", "tool_choice.tools")
            choice = mode
        else:
            raise _bad(f"tool_choice.type {kind!r} is not supported; use \"function\" or \"allowed_tools\" (hosted "
                       "tools are not offered)", "tool_choice.type")
    if choice not in (None, "auto", "none", "required"):
        raise _bad(f"tool_choice must be auto, none, required or an object naming a function, got {choice!r}",
                   "tool_choice")
    if not specs:
        if choice == "required":
            raise _bad("tool_choice requires tools", "tool_choice")
        return ToolUse(None, False, False), echoed
    if choice == "none":
        return ToolUse(None, False, False), echoed
    strict = not constrained_text and any(t["function"]["strict"] for t in specs)
    return ToolUse(specs, True, choice == "required", single=single, strict=strict), echoed


def _text_format(text: TextConfig | None) -> tuple[StructuredOutputs | None, str]:
    """`text.format` as the engine's structured output (structured.py), and the field its errors name."""
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None, ""
    if form.type == "json_schema" and form.schema_ is None:
        raise _bad("text.format type \"json_schema\" needs schema, the JSON schema the reply must follow",
                   "text.format.schema")
    spec, _ = structured.from_request(ResponseFormat(type=form.type, json_schema=JSONSchemaFormat(
        name=form.name, schema=form.schema_, strict=form.strict) if form.type == "json_schema" else None), None)
    param = "text.format.schema" if form.type == "json_schema" else "text.format"
    structured.check(spec, param)
    return spec, param


def _sampling(state: ServerState, body: ResponsesRequest) -> SamplingParams:
    fields: dict[str, Any] = {k: v for k in ("temperature", "top_p") if (v := getattr(body, k)) is not None}
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    try:
        return dataclasses.replace(state.defaults, **fields, n=1, logprobs=None)
    except ValueError as e:  # SamplingParams names the field, its value and its range
        raise APIError(400, str(e), param=getattr(e, "param", None)) from e


# ---- output ----------------------------------------------------------------------------------------------------


def _hold(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (held back until the next delta decides)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class ReasoningSplit:
    """A reply's text, fed as it streams, as ("reasoning" | "text", fragment) pieces: a `<think>` block the reply
    opens with (after whitespace), or that the generation prompt left open (`opened`), is reasoning up to its
    `</think>`; the rest is text. A tag's possible beginning is held back until the next delta decides."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        rest, self.held, out = self.held + text, "", []
        while rest:
            if self.state == "start":
                stripped = rest.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.state, rest = "reasoning", stripped[len(THINK_OPEN):]
                elif not final and THINK_OPEN.startswith(stripped):  # "", "<thi": wait for more
                    self.held = rest
                    break
                else:
                    self.state = "text"
            elif self.state == "reasoning":
                end = rest.find(THINK_CLOSE)
                if end >= 0:
                    out.append(("reasoning", rest[:end]))
                    self.state, rest = "text", rest[end + len(THINK_CLOSE):]
                    continue
                keep = 0 if final else _hold(rest, THINK_CLOSE)
                out.append(("reasoning", rest[:len(rest) - keep]))
                self.held = rest[len(rest) - keep:]
                break
            else:
                out.append(("text", rest))
                break
        return [(kind, fragment) for kind, fragment in out if fragment]


class OutputBuilder:
    """The response's output items from one reply's pieces (ReplyParser's), as streaming events: `feed` and
    `finish` return the events (dicts without their sequence numbers); `items` are the items so far. Reasoning
    opens a `reasoning` item, text a `message` item (leading whitespace between items is dropped), a call a
    `function_call` item; each closes the item before it."""

    def __init__(self, opened: bool):
        self.split = ReasoningSplit(opened)
        self.items: list[dict] = []
        self.current: dict | None = None
        self.calls: dict[int, dict] = {}  # ReplyParser's call index -> its item

    def feed(self, pieces: list[Piece]) -> list[dict]:
        events: list[dict] = []
        for piece in pieces:
            if isinstance(piece, str):
                for kind, fragment in self.split.feed(piece):
                    self._text(kind, fragment, events)
            elif isinstance(piece, Reasoning):  # a harmony reply's analysis channel
                self._text("reasoning", piece.text, events)
            elif isinstance(piece, CallStart):
                self._close(events)
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece.id,
                        "name": piece.name, "arguments": "", "status": "in_progress"}
                self.calls[piece.index] = item
                self._open(item, events)
            elif isinstance(piece, CallArguments):
                item = self.calls[piece.index]
                item["arguments"] += piece.text
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": piece.text})
            elif isinstance(piece, CallEnd):
                item = self.calls[piece.index]
                if item is self.current:
                    self._close(events, "completed" if piece.call.ok else "incomplete")
        return events

    def finish(self, cut: bool) -> list[dict]:
        """The reply ended (`cut`: by max_output_tokens): what was held back, and the last item closed."""
        events: list[dict] = []
        for kind, fragment in self.split.feed("", final=True):
            self._text(kind, fragment, events)
        self._close(events, "incomplete" if cut else "completed")
        return events

    def _text(self, kind: str, fragment: str, events: list[dict]) -> None:
        item = self.current
        if kind == "reasoning":
            if item is None or item["type"] != "reasoning":
                self._close(events)
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                        "content": [], "status": "in_progress"}
                self._open(item, events)
                self._part(item, {"type": "reasoning_text", "text": ""}, events)
            item["content"][0]["text"] += fragment
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                           "output_index": self.items.index(item), "content_index": 0, "delta": fragment})
            return
        if item is None or item["type"] != "message":
            fragment = fragment.lstrip()  # the whitespace between a reasoning block or a call and the answer
            if not fragment:
                return
            self._close(events)
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "in_progress",
                    "content": []}
            self._open(item, events)
            self._part(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}, events)
        item["content"][0]["text"] += fragment
        events.append({"type": "response.output_text.delta", "item_id": item["id"],
                       "output_index": self.items.index(item), "content_index": 0, "delta": fragment,
                       "logprobs": []})

    def _open(self, item: dict, events: list[dict]) -> None:
        self.items.append(item)
        self.current = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": json.loads(json.dumps(item))})

    def _part(self, item: dict, part: dict, events: list[dict]) -> None:
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": self.items.index(item), "content_index": 0, "part": dict(part)})

    def _close(self, events: list[dict], status: str = "completed") -> None:
        item, self.current = self.current, None
        if item is None:
            return
        item["status"] = status
        index = self.items.index(item)
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            event = {"type": done, "item_id": item["id"], "output_index": index, "content_index": 0,
                     "text": part["text"]}
            if item["type"] == "message":
                event["logprobs"] = []
            events += [event, {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": json.loads(json.dumps(item))})


def _usage(state: ServerState, out: RequestOutput) -> dict[str, Any]:
    o = out.outputs[0]
    generated, prompt = len(o.token_ids), len(out.prompt_token_ids)
    close = state.tokenizer.token_to_id(THINK_CLOSE)
    reasoning = list(o.token_ids).index(close) + 1 if close is not None and close in o.token_ids else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + generated}


@dataclasses.dataclass
class _Call:
    """One request, as routes below carry it."""

    body: ResponsesRequest
    response_id: str
    created: float
    owner: str  # of the stored response (the API key)
    chat_owner: str  # of the API conversation (the key and `user`, as the chat route's)
    tools: ToolUse
    echoed_tools: list[dict]
    prompt: ChatPrompt | None  # once planned
    instructions: str | None

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 cut: bool = False) -> dict[str, Any]:
        body = self.body
        form = body.text.format if body.text is not None and body.text.format is not None else None
        text_format = form.model_dump(by_alias=True, exclude_none=True) if form is not None else {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": int(self.created), "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store is not False, "temperature": body.temperature, "text": {"format": text_format},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": self.echoed_tools, "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


def _not_found(response_id: str, previous: bool = False) -> APIError:
    if previous:
        return APIError(404, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                        code="previous_response_not_found")
    return APIError(404, f"No response found with id '{response_id}'.", type_="not_found_error",
                    code="response_not_found")


@router.post(PATH, response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state, metrics = _state(request), _metrics(request)
    check_model(state, body.model)
    _refuse_unsupported(body)
    owner = request_owner(request, state)
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(owner, body.previous_response_id) if state.responses is not None else None
        if previous is None:
            raise _not_found(body.previous_response_id, previous=True)
    form = body.text.format if body.text is not None else None
    tools, echoed = _tools(body, form is not None and form.type != "text")
    if form is not None and form.type != "text" and tools.required:
        raise _bad("text.format and tool_choice each constrain the reply; send one of them", "tool_choice")
    params = stop_at_call_end(_sampling(state, body), tools, state)
    kwargs, policy = template_kwargs(body.chat_template_kwargs)
    kwargs = thinking_kwargs(body, kwargs)
    # admitted before the costly part (compiling a schema, converting, rendering and tokenising the input), so that
    # the queue bound bounds those too; given back on every path (the stream's end or run_to_end, else here)
    lease = Lease(state, metrics)
    try:
        call = _Call(body, f"resp_{uuid.uuid4().hex}", time.time(), owner, request_owner(request, state, body.user),
                     tools, echoed, None, body.instructions)
        return await _respond(request, state, metrics, lease, call, previous, params, kwargs, policy)
    except BaseException:
        lease.release()
        raise


async def _respond(request: Request, state: ServerState, metrics: ServerMetrics, lease: Lease, call: _Call,
                   previous: StoredResponse | None, params: SamplingParams, kwargs: dict[str, Any],
                   policy: str | None) -> Any:
    body, tools = call.body, call.tools
    spec, _ = _text_format(body.text)
    new = input_messages(body.input)
    if not new:
        raise _bad("input is empty: send a string or at least one input item", "input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    stored: Session | None = None
    if previous is not None:
        history = previous.session.messages[0 if previous.instructions is None else 1:]
        messages = system + history + new
        if previous.instructions == body.instructions:  # the stored conversation, as its ids stand for it
            stored, policy = previous.session, policy or PRESERVE
    else:
        messages = system + new
        stored = state.conversations.find(call.chat_owner, messages) if state.conversations is not None else None
    call.prompt = prompt = await asyncio.to_thread(plan_chat, state, messages, tools, kwargs, policy, stored)
    try:
        check_prompt(state, prompt.ids)
    except APIError as e:
        e.param = "input"
        raise
    check_max_tokens(state, prompt.ids, body.max_output_tokens, "max_output_tokens")
    if body.max_output_tokens is None:  # OpenAI's default: the reply may run to the end of the context
        params = dataclasses.replace(params, max_tokens=state.max_model_len - len(prompt.ids))
    if spec is not None or prompt.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=spec or prompt.grammar)
    info = RequestInfo(call.response_id, "responses", prompt.ids, 1, messages=messages,
                       history_policy=prompt.policy, history_fallback=prompt.fallback_reason,
                       history_context=prompt.context, cache_salt=request_salt(state, request, body.cache_salt))
    count_history(metrics, prompt, info.request_id)
    parser = reply_parser(tools, state=state)
    builder = OutputBuilder(prompt_opens_reasoning(state, prompt.ids))
    if body.stream:
        sequence = _Sequence()
        events = _stream(state, metrics, call, parser, builder, info, params, sequence)
        return SSEResponse(sse_events(events, lease, metrics, sequence.error), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    o = out.outputs[0]
    pieces = parser.feed(parser.text(o, whole=True), final=True, stop_reason=o.stop_reason)
    if tools.required and not parser.calls:
        raise unsatisfied()
    record = ReplyRecord()
    record.add(pieces)
    cut = o.finish_reason == "length"
    builder.feed(pieces)
    builder.finish(cut)
    result = call.response("incomplete" if cut else "completed", builder.items, _usage(state, out), cut)
    _keep(state, call, out, record, result)
    return JSONResponse(result)


class _Sequence:
    """A stream's event numbering (`sequence_number` from 0), and its `error` event."""

    def __init__(self) -> None:
        self.next = 0

    def sse(self, event: dict) -> str:
        event = {"type": event["type"], "sequence_number": self.next,
                 **{k: v for k, v in event.items() if k != "type"}}
        self.next += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def error(self, error: APIError) -> str:
        return self.sse({"type": "error", "code": error.code or error.type, "message": error.message,
                         "param": error.param})


async def _stream(state: ServerState, metrics: ServerMetrics, call: _Call, parser: ReplyParser,
                  builder: OutputBuilder, info: RequestInfo, params: SamplingParams,
                  sequence: _Sequence) -> AsyncIterator[Any]:
    yield sequence.sse({"type": "response.created", "response": call.response("in_progress", [])})
    yield sequence.sse({"type": "response.in_progress", "response": call.response("in_progress", [])})
    record, last = ReplyRecord(), None
    async for out in generate(state, info, params):
        last = out
        o = out.outputs[0]
        final = o.finish_reason is not None
        pieces = parser.feed(parser.text(o), final, o.stop_reason)
        record.add(pieces)
        for event in builder.feed(pieces):
            yield sequence.sse(event)
        if final:
            if call.tools.required and not parser.calls:
                raise unsatisfied()
            for event in builder.finish(o.finish_reason == "length"):
                yield sequence.sse(event)
    count_usage(metrics, last)
    if last is None or not last.finished:
        return
    cut = last.outputs[0].finish_reason == "length"
    result = call.response("incomplete" if cut else "completed", builder.items, _usage(state, last), cut)
    _keep(state, call, last, record, result)
    yield LAST
    yield sequence.sse({"type": "response.incomplete" if cut else "response.completed", "response": result})


def _keep(state: ServerState, call: _Call, out: RequestOutput, record: ReplyRecord, result: dict) -> None:
    """Keep the conversation through this reply with its exact ids: as an API conversation (for a client that
    sends its whole history next) and, with `store`, as the stored response (for `previous_response_id`)."""
    o = out.outputs[0]
    if o.finish_reason not in ("stop", "length"):
        return
    reply = record.message()
    remember(state, call.chat_owner, call.prompt, out, {o.index: reply})
    if call.body.store is False or state.responses is None:
        return
    session = Session(id=call.response_id, title="api responses", messages=[*call.prompt.messages, reply],
                      model=state.model_name, kind="api")
    session.keep(list(call.prompt.ids) + list(o.token_ids), len(session.messages), call.prompt.context)
    state.responses.put(call.response_id, call.owner, result, session, call.instructions)


@router.get(PATH + "/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request) -> Any:
    state = _state(request)
    entry = state.responses.get(request_owner(request, state), response_id) if state.responses is not None else None
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.body)


@router.delete(PATH + "/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Any:
    state = _state(request)
    if state.responses is None or not state.responses.delete(request_owner(request, state), response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
