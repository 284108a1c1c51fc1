"""The OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions` (streaming as SSE).

Tool calls: with `tools` (and `tool_choice` "auto", the default) the tools are rendered by the chat template and the
reply is split by `tool_stream.ReplyParser` into `content` and `tool_calls` (finish_reason "tool_calls"). A call the
parser finds malformed (bad JSON, unknown tool, arguments failing the schema) is not a call: its raw text stays in
`content`. `tool_choice` "none" renders no tools and parses nothing. "required" and a named function constrain
generation with a grammar (`tool_choice.call_grammar`): the reply is calls of the allowed tools as the template
writes them, their arguments held to each tool's `parameters`; a named function (or `parallel_tool_calls: false`)
allows one call. A constrained reply cut short by max_tokens before its first call was whole is a 422
(`tool_choice_unsatisfied`; in a stream, an error event after what was streamed). A `strict: true` function under
"auto" holds its calls' arguments to its schema, the text before them free (tool_choice.py says where it applies).
A harmony model's (gpt-oss) reasoning, its analysis channel, comes back as the message's `reasoning_content` (streamed,
as `delta.reasoning_content`), its final channel as `content` (tool_stream.py).

Structured outputs (`structured.py`): `response_format` json_object / json_schema, or vLLM's `structured_outputs`
field (chat and completions), become the engine's `SamplingParams.structured_outputs`; a schema llguidance cannot
compile is a 400 naming the client's field. A request cannot both send one and constrain its tool calls (400).

Streaming: a call's first delta (index, id, type, name, `arguments: ""`) comes once its name is read and is an
offered tool, then `function.arguments` fragments whose concatenation is the arguments JSON the model wrote (the same
string a non-streamed reply carries). A streamed call that turns out malformed cannot be taken back: the client keeps
the arguments as the model wrote them, and finish_reason is still "tool_calls", unless max_tokens cut the call short
("length"). Non-streamed, a reply max_tokens cut is parsed as its stream is: a call cut after its name is a call with
the arguments written so far (finish_reason "length"), as OpenAI returns one; cut before its name is read, it stays
text. Arguments a client sends back are taken as any string (OpenAI does not check them): JSON ones reach the
template as the object, others as the string. The legacy `functions` / `function_call` are tools / tool_choice with
one call a reply, which comes back as the message's `function_call` (finish_reason "function_call"; streamed, as
`delta.function_call`); history messages in that form are read too.

max_tokens: left out, a chat reply may run to the end of the context (OpenAI's default; the profile's other sampling
defaults still apply) and a completion to 16 tokens (OpenAI's default there); set past the room the prompt leaves,
it is a 400 naming that room. `logit_bias` (token id strings -> [-100, 100], at most 300) is the engine's.
`/v1/models` answers an Anthropic client (its `anthropic-version` header) in Anthropic's page shape; every card carries
both APIs' fields. Admission (the `Lease`) comes before the costly part of a request (a grammar check, rendering,
tokenising); prompt rendering and disconnect-aware generation live in `generation`.

`chat_template_kwargs` (as vLLM and SGLang take it): an object whose keys reach the chat template as variables
(`enable_thinking`, `preserve_thinking`, `clear_thinking` must be booleans; the variables the server sets itself,
such as `messages` and `tools`, are refused), plus tsterm's `thinking_history: "preserve" | "template"`, the history
policy of this request when it continues a conversation the server stored (conversations.py; default `preserve`).
An assistant message's `reasoning_content` (or `reasoning`) reaches the template too.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tsterm.config import SamplingParams
from tsterm.outputs import CompletionOutput, RequestOutput
from tsterm.server.errors import APIError
from tsterm.server.generation import (
    LAST, ChatPrompt, Lease, ReplyRecord, SSEResponse, check_max_tokens, check_model, check_prompt, check_stop,
    count_history, count_usage, generate, gone, plan_chat, remember, request_owner, run_to_end, sse_events,
    template_kwargs,
)
from tsterm.server import structured
from tsterm.server.tool_choice import ToolUse, reply_parser, stop_at_call_end, unsatisfied
from tsterm.server.metrics import ServerMetrics
from tsterm.server.protocol import (
    AnthropicModelList, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatMessage, ChoiceDelta, ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs,
    CompletionRequest, LegacyFunctionChoice, ModelCard, ModelList, NamedFunction, NamedToolChoice,
    PromptTokensDetails, TokenLogprob, ToolCallDelta, ToolCallFunction, ToolCallIn, ToolCallOut, ToolSpec, TopLogprob,
    Usage,
)
from tsterm.server.security import request_salt
from tsterm.server.state import RequestInfo, ServerState
from tsterm.server.tool_stream import CallArguments, CallStart, Piece, Reasoning, ReplyParser

router = APIRouter()
_STARTED = int(time.time())


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


# ---- models -------------------------------------------------------------------------------------------------


def anthropic_client(request: Request) -> bool:
    """Whether the request comes from an Anthropic client (its SDK always sends `anthropic-version`): the routes
    both APIs share (`/v1/models`) answer it in Anthropic's shapes."""
    return "anthropic-version" in request.headers


def _cards(state: ServerState) -> list[ModelCard]:
    created_at = datetime.fromtimestamp(_STARTED, timezone.utc).isoformat().replace("+00:00", "Z")
    return [ModelCard(id=state.model_name, created=_STARTED, display_name=state.model_name, created_at=created_at,
                      max_model_len=state.max_model_len)]


@router.get("/v1/models", response_model=None)
async def list_models(request: Request, limit: int = 20, before_id: str | None = None,
                      after_id: str | None = None) -> Any:
    """OpenAI's list (every model); for an Anthropic client, Anthropic's page: `limit` (1 to 1000) models after
    `after_id` or before `before_id`, with `has_more`, `first_id` and `last_id`."""
    cards = _cards(_state(request))
    if not anthropic_client(request):
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))
    if not 1 <= limit <= 1000:
        raise APIError(400, f"limit must be in [1, 1000], got {limit}", param="limit")
    if before_id is not None and after_id is not None:
        raise APIError(400, "send before_id or after_id, not both", param="before_id")
    ids = [card.id for card in cards]
    for name, value in (("before_id", before_id), ("after_id", after_id)):
        if value is not None and value not in ids:
            raise APIError(400, f"{name} {value!r} is not a model this server serves", param=name)
    if after_id is not None:
        cards = cards[ids.index(after_id) + 1:]
        page, has_more = cards[:limit], len(cards) > limit
    elif before_id is not None:
        cards = cards[:ids.index(before_id)]
        page, has_more = cards[-limit:], len(cards) > limit
    else:
        page, has_more = cards[:limit], len(cards) > limit
    return JSONResponse(AnthropicModelList(data=page, has_more=has_more, first_id=page[0].id if page else None,
                                           last_id=page[-1].id if page else None).model_dump())


@router.get("/v1/models/{model_id:path}", response_model=None)
async def retrieve_model(model_id: str, request: Request) -> Any:
    """One model (both APIs' `models.retrieve`); an unknown id is a 404 in the client's error shape."""
    card = next((card for card in _cards(_state(request)) if card.id == model_id), None)
    if card is None:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {_state(request).model_name!r}",
                       type_="not_found_error", param="model", code="model_not_found")
    return JSONResponse(card.model_dump(exclude_none=True))


# ---- request pieces --------------------------------------------------------------------------------------------


def _sampling(state: ServerState, body: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if body.n > state.limits.max_n:
        raise APIError(400, f"n is {body.n}; this server returns at most {state.limits.max_n} choices per request",
                       param="n")
    fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                     "frequency_penalty", "repetition_penalty", "seed")}
    fields = {k: v for k, v in fields.items() if v is not None}
    if body.stop is not None:
        fields["stop"] = check_stop(state, [body.stop] if isinstance(body.stop, str) else list(body.stop), "stop")
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    try:
        return dataclasses.replace(state.defaults, **fields, n=body.n, logprobs=logprobs,
                                   ignore_eos=body.ignore_eos, logit_bias=_logit_bias(state, body.logit_bias))
    except ValueError as e:  # ConfigError too: SamplingParams names the field, its value and its range
        raise APIError(400, str(e), param=getattr(e, "param", None)) from e


def _logit_bias(state: ServerState, raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token id strings -> bias) as the engine takes it, its ids checked against the vocabulary
    (the bounds of the biases and their count are SamplingParams')."""
    if not raw:
        return None
    bias, vocab = {}, state.tokenizer.vocab_size
    for key, value in raw.items():
        token = int(key) if key.strip().isdecimal() else None
        if token is None or token >= vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary [0, {vocab})",
                           param="logit_bias")
        bias[token] = value
    return bias


def _usage(out: RequestOutput) -> Usage:
    generated = sum(len(o.token_ids) for o in out.outputs)
    prompt = len(out.prompt_token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


def _sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


# ---- chat ---------------------------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _arguments(text: str) -> Any:
    """A call's arguments as the template gets them: the object they parse to, or, where they are no JSON (a call
    max_tokens cut, echoed back), the string as it came (OpenAI takes any string; the template writes it as is)."""
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return text


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as chat-template messages. The legacy forms are read as today's: an assistant's
    `function_call` as its one tool call, a "function" message as that call's "tool" result."""
    out, legacy_id = [], None
    for index, message in enumerate(messages):
        if message.role == "function":
            message = message.model_copy(update={"role": "tool", "tool_call_id": message.tool_call_id or legacy_id})
        elif message.function_call is not None:
            if message.role != "assistant" or message.tool_calls:
                raise APIError(400, f"messages[{index}]: function_call belongs to an assistant message without "
                               "tool_calls", param=f"messages.{index}.function_call")
            legacy_id = f"call_{index}"
            message = message.model_copy(update={"tool_calls": [
                ToolCallIn(id=legacy_id, function=message.function_call)], "function_call": None})
        out.append(_template_message(message, index))
    return out


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _text(message.content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    for field in ("reasoning_content", "reasoning"):  # the tokenizer hands it to the template under every name
        if getattr(message, field) is not None and role == "assistant":
            out[field] = getattr(message, field)
    if message.tool_calls:
        if role != "assistant":
            raise APIError(400, f"messages[{index}]: only assistant messages carry tool_calls",
                           param=f"messages.{index}.tool_calls")
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                             for call in message.tool_calls]
    return out


def _legacy_functions(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """A request in the legacy form (`functions`, `function_call`) as its tools / tool_choice: one call a reply, as
    the legacy API gives (the reply's call then comes back as `function_call`)."""
    if body.functions is None:
        if body.function_call is not None:
            raise APIError(400, "function_call requires functions", param="function_call")
        return body
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(400, "send tools / tool_choice or the legacy functions / function_call, not both",
                       param="functions")
    choice: Any = body.function_call
    if isinstance(choice, LegacyFunctionChoice):
        if choice.name not in {f.name for f in body.functions}:
            raise APIError(400, f"function_call names {choice.name!r}, which is not among the functions",
                           param="function_call")
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return body.model_copy(update={"tools": [ToolSpec(type="function", function=f) for f in body.functions],
                                   "tool_choice": choice, "parallel_tool_calls": False})


def _tools(body: ChatCompletionRequest) -> ToolUse:
    specs = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if specs is None:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return ToolUse(None, False, False)
    if choice == "none":
        return ToolUse(None, False, False)
    if isinstance(choice, NamedToolChoice):
        named = [t for t in specs if t["function"]["name"] == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return ToolUse(named, True, True, name=choice.function.name, single=True)
    return ToolUse(specs, True, choice == "required", single=body.parallel_tool_calls is False,
                   strict=any(t["function"].get("strict") for t in specs))


def _choice_name(body: ChatCompletionRequest) -> str:
    choice = body.tool_choice
    return f"names {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else f"{choice!r}"


def _chat_logprobs(state: ServerState, entries: list[dict]) -> ChoiceLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = state.tokenizer.decode([token_id], skip_special_tokens=False)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for entry in entries:
        head = top(entry["token_id"], entry["logprob"])
        content.append(TokenLogprob(**head.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry["top"]]))
    return ChoiceLogprobs(content=content)


def _legacy_delta(delta: ToolCallDelta) -> ChoiceDelta:
    """A tool-call delta in the legacy form (`delta.function_call`: the name first, then arguments fragments)."""
    return ChoiceDelta(function_call=delta.function)


def _call_deltas(pieces: list[Piece]) -> tuple[str, list[ToolCallDelta]]:
    """One step's pieces of a reply as content and tool-call deltas: a call's first delta has its index, id, type,
    name and empty arguments; then arguments fragments (reasoning pieces: `_reasoning`)."""
    text, deltas = [], []
    for piece in pieces:
        if isinstance(piece, str):
            text.append(piece)
        elif isinstance(piece, CallStart):
            deltas.append(ToolCallDelta(index=piece.index, id=piece.id, type="function",
                                        function=ToolCallFunction(name=piece.name, arguments="")))
        elif isinstance(piece, CallArguments):
            deltas.append(ToolCallDelta(index=piece.index, function=ToolCallFunction(arguments=piece.text)))
    return "".join(text), deltas


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state, metrics = _state(request), _metrics(request)
    check_model(state, body.model)
    legacy = body.functions is not None
    body = _legacy_functions(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tools = _tools(body)
    spec, param = structured.from_request(body.response_format, body.structured_outputs)
    if spec is not None and (tools.required or tools.strict):
        raise APIError(400, f"{param.split('.')[0]} and tool_choice {_choice_name(body)} (or a strict function) each "
                       "constrain the reply; send one of them", param="tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = stop_at_call_end(_sampling(state, body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None),
                              tools, state)
    kwargs, policy = template_kwargs(body.chat_template_kwargs)
    # admitted before the costly part (checking a schema, rendering and tokenising a body of up to max_body_bytes),
    # so that the queue bound bounds those too; given back on every path (the stream's end or run_to_end, else here)
    lease = Lease(state, metrics)
    try:
        return await _chat(request, state, metrics, lease, body, legacy, tools, spec, param, params, max_tokens,
                           kwargs, policy)
    except BaseException:
        lease.release()
        raise


async def _chat(request: Request, state: ServerState, metrics: ServerMetrics, lease: Lease,
                body: ChatCompletionRequest, legacy: bool, tools: ToolUse, spec: Any, param: str,
                params: SamplingParams, max_tokens: int | None, kwargs: dict[str, Any], policy: str | None) -> Any:
    structured.check(spec, param)
    messages = _template_messages(body.messages)
    owner = request_owner(request, state, body.user)
    stored = state.conversations.find(owner, messages) if state.conversations is not None else None
    # a long history: planned off the event loop
    prompt = await asyncio.to_thread(plan_chat, state, messages, tools, kwargs, policy, stored)
    check_prompt(state, prompt.ids)
    params = _reply_room(state, params, prompt.ids, max_tokens,
                         "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    if spec is not None or prompt.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=spec or prompt.grammar)
    info = RequestInfo(f"chatcmpl-{uuid.uuid4().hex}", "chat.completions", prompt.ids, params.n, messages=messages,
                       history_policy=prompt.policy, history_fallback=prompt.fallback_reason,
                       history_context=prompt.context, cache_salt=request_salt(state, request, body.cache_salt))
    count_history(metrics, prompt, info.request_id)
    parsers = [reply_parser(tools, state=state) for _ in range(params.n)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_stream(state, metrics, body, legacy, tools, parsers, info, params, include_usage, owner,
                              prompt)
        return SSEResponse(sse_events(events, lease, metrics, _sse_error), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    choices, replies = [], {}
    for o in out.outputs:
        parser = parsers[o.index]
        if o.finish_reason == "length":
            # fed as a stream is: a call max_tokens cut after its name is a call with the arguments written so far
            # (not the model's raw markup as text), as the same reply streamed gives it
            pieces = parser.feed(parser.text(o, whole=True), final=False) + parser.feed("", final=True)
        else:
            pieces = parser.feed(parser.text(o, whole=True), final=True, stop_reason=o.stop_reason)
        if tools.required and not parser.calls:
            raise unsatisfied()
        record = ReplyRecord()
        record.add(pieces)
        replies[o.index] = record.message()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [ToolCallOut(id=p.id, function=ToolCallFunction(name=p.name, arguments="")) for p in pieces
                 if isinstance(p, CallStart)]
        for piece in pieces:
            if isinstance(piece, CallArguments):
                calls[piece.index].function.arguments += piece.text
        message = AssistantMessage(content=None if calls and not content.strip() else content,
                                   reasoning_content=_reasoning(pieces))
        finish_reason = parser.finish_reason(o.finish_reason)
        if legacy and calls:  # one call (the request allowed one), in the legacy form
            message.function_call, finish_reason = calls[0].function, _legacy_finish(finish_reason)
        else:
            message.tool_calls = calls or None
        logprobs = _chat_logprobs(state, o.logprobs or []) if body.logprobs else None
        choices.append(ChatChoice(index=o.index, message=message, logprobs=logprobs, finish_reason=finish_reason))
    remember(state, owner, prompt, out, replies)
    result = ChatCompletion(id=info.request_id, created=int(time.time()), model=state.model_name, choices=choices,
                            usage=_usage(out))
    return JSONResponse(result.model_dump(exclude_none=True))


def _reasoning(pieces: list[Piece]) -> str | None:
    """The reasoning among a reply's pieces (a harmony model's analysis channel), or None."""
    text = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return text or None


def _legacy_finish(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason


def _reply_room(state: ServerState, params: SamplingParams, prompt_ids: list[int], max_tokens: int | None,
                param: str) -> SamplingParams:
    """`params` with the reply's length: the client's max_tokens, which must fit in the context after the prompt
    (else a 400 naming the limit), or, left out, the rest of the context (OpenAI's default for chat)."""
    check_max_tokens(state, prompt_ids, max_tokens, param)
    if max_tokens is not None:
        return params
    return dataclasses.replace(params, max_tokens=state.max_model_len - len(prompt_ids))


async def _chat_stream(state: ServerState, metrics: ServerMetrics, body: ChatCompletionRequest, legacy: bool,
                       tools: ToolUse, parsers: list[ReplyParser], info: RequestInfo, params: SamplingParams,
                       include_usage: bool, owner: str, prompt: ChatPrompt) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        return _sse(ChatCompletionChunk(id=info.request_id, created=created, model=state.model_name, choices=choices,
                                        usage=usage))

    sent_logprobs, done = [0] * params.n, set()
    records = [ReplyRecord() for _ in range(params.n)]
    last = None
    for index in range(params.n):
        yield chunk([ChunkChoice(index=index, delta=ChoiceDelta(role="assistant", content=""))])
    async for out in generate(state, info, params):
        last = out
        for o in out.outputs:
            if o.index in done:
                continue
            i, final, parser = o.index, o.finish_reason is not None, parsers[o.index]
            pieces = parser.feed(parser.text(o), final, o.stop_reason)
            records[i].add(pieces)
            text, deltas = _call_deltas(pieces)
            if reasoning := _reasoning(pieces):
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(reasoning_content=reasoning))])
            logprobs = None
            if body.logprobs:
                entries = _new_logprobs(o, sent_logprobs)
                logprobs = _chat_logprobs(state, entries) if entries else None
            if text or logprobs:
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=text or None), logprobs=logprobs)])
            for delta in deltas:  # one call delta a chunk, in the order the model wrote them
                yield chunk([ChunkChoice(index=i, delta=_legacy_delta(delta) if legacy
                                         else ChoiceDelta(tool_calls=[delta]))])
            if final:
                done.add(i)
                if tools.required and not parser.calls:
                    raise unsatisfied()
                reason = parser.finish_reason(o.finish_reason)
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(),
                                         finish_reason=_legacy_finish(reason) if legacy else reason)])
    count_usage(metrics, last)
    remember(state, owner, prompt, last, {i: records[i].message() for i in done})
    if include_usage and last is not None:
        yield chunk([], usage=_usage(last))
    yield LAST
    yield "data: [DONE]\n\n"


def _new_logprobs(o: CompletionOutput, sent: list[int]) -> list[dict]:
    entries = o.logprobs or []
    new, sent[o.index] = entries[sent[o.index]:], len(entries)
    return new


# ---- completions --------------------------------------------------------------------------------------------


def _completion_prompt(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request: this server does not batch a list of prompts",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(state.tokenizer.encode(prompt))
    vocab = state.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(prompt)


def _completion_logprobs(state: ServerState, entries: list[dict], offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in entries:
        token = state.tokenizer.decode([entry["token_id"]], skip_special_tokens=False)
        result.tokens.append(token)
        result.token_logprobs.append(entry["logprob"])
        result.top_logprobs.append({state.tokenizer.decode([t], skip_special_tokens=False): lp
                                    for t, lp in entry["top"]})
        result.text_offset.append(offset)
        offset += len(token)
    return result


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state, metrics = _state(request), _metrics(request)
    check_model(state, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    params = _sampling(state, body, body.max_tokens, body.logprobs)
    spec, param = structured.from_request(None, body.structured_outputs)
    lease = Lease(state, metrics)  # before tokenising (see chat_completions); given back on every path
    try:
        return await _complete(request, state, metrics, lease, body, params, spec, param)
    except BaseException:
        lease.release()
        raise


COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


async def _complete(request: Request, state: ServerState, metrics: ServerMetrics, lease: Lease,
                    body: CompletionRequest, params: SamplingParams, spec: Any, param: str) -> Any:
    structured.check(spec, param)
    if spec is not None:
        params = dataclasses.replace(params, structured_outputs=spec)
    prompt = await asyncio.to_thread(_completion_prompt, state, body.prompt)
    check_prompt(state, prompt)
    check_max_tokens(state, prompt, body.max_tokens, "max_tokens")
    if body.max_tokens is None:  # OpenAI's default, where the context leaves room for it
        params = dataclasses.replace(params, max_tokens=min(COMPLETION_MAX_TOKENS, state.max_model_len - len(prompt)))
    text = body.prompt if isinstance(body.prompt, str) else body.prompt[0] if body.prompt and isinstance(
        body.prompt[0], str) else None
    info = RequestInfo(f"cmpl-{uuid.uuid4().hex}", "completions", prompt, params.n, prompt=text,
                       cache_salt=request_salt(state, request, body.cache_salt))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _completion_stream(state, metrics, body, info, params, include_usage)
        return SSEResponse(sse_events(events, lease, metrics, _sse_error), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    choices = [CompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                logprobs=_completion_logprobs(state, o.logprobs or [], 0)
                                if body.logprobs is not None else None) for o in out.outputs]
    result = Completion(id=info.request_id, created=int(time.time()), model=state.model_name, choices=choices,
                        usage=_usage(out))
    return JSONResponse(result.model_dump(exclude_none=True))


async def _completion_stream(state: ServerState, metrics: ServerMetrics, body: CompletionRequest,
                             info: RequestInfo, params: SamplingParams, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return _sse(Completion(id=info.request_id, created=created, model=state.model_name, choices=choices, usage=usage))

    sent_logprobs, offsets, done = [0] * params.n, [0] * params.n, set()
    last = None
    async for out in generate(state, info, params):
        last = out
        for o in out.outputs:
            if o.index in done:
                continue
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(state, _new_logprobs(o, sent_logprobs), offsets[o.index])
            offsets[o.index] += len(o.delta_text)
            if o.delta_text or o.finish_reason:
                yield chunk([CompletionChoice(index=o.index, text=o.delta_text, finish_reason=o.finish_reason,
                                              logprobs=logprobs)])
            if o.finish_reason is not None:
                done.add(o.index)
    count_usage(metrics, last)
    if include_usage and last is not None:
        yield chunk([], usage=_usage(last))
    yield LAST
    yield "data: [DONE]\n\n"
