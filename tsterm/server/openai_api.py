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

Structured outputs (`structured.py`): `response_format` json_object / json_schema, or vLLM's `structured_outputs`
field (chat and completions), become the engine's `SamplingParams.structured_outputs`; a schema llguidance cannot
compile is a 400 naming the client's field. A request cannot both send one and constrain its tool calls (400).

Streaming: a call's first delta (index, id, type, name, `arguments: ""`) comes once its name is read and is an
offered tool, then `function.arguments` fragments whose concatenation is the arguments JSON the model wrote (the same
string a non-streamed reply carries). A streamed call that turns out malformed cannot be taken back: the client keeps
the arguments as the model wrote them, and finish_reason is still "tool_calls", unless max_tokens cut the call short
("length"). Admission, prompt rendering and disconnect-aware generation live in `generation`.

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
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, ChoiceDelta,
    ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, ModelCard,
    ModelList, NamedToolChoice, PromptTokensDetails, TokenLogprob, ToolCallDelta, ToolCallFunction, ToolCallOut,
    TopLogprob, Usage,
)
from tsterm.server.state import RequestInfo, ServerState
from tsterm.server.tool_stream import CallArguments, CallStart, Piece, ReplyParser

router = APIRouter()
_STARTED = int(time.time())


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    return ModelList(data=[ModelCard(id=state.model_name, created=_STARTED, max_model_len=state.max_model_len)])


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
                                   ignore_eos=body.ignore_eos)
    except ValueError as e:  # ConfigError too: SamplingParams names the field, its value and its range
        raise APIError(400, str(e), param=getattr(e, "param", None)) from e


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
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as e:
                raise APIError(400, f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                               param=f"messages.{index}.tool_calls.{j}.function.arguments") from e
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


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


def _call_deltas(pieces: list[Piece]) -> tuple[str, list[ToolCallDelta]]:
    """One step's pieces of a reply as content and tool-call deltas: a call's first delta has its index, id, type,
    name and empty arguments; then arguments fragments."""
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
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tools = _tools(body)
    spec, param = structured.from_request(body.response_format, body.structured_outputs)
    if spec is not None and (tools.required or tools.strict):
        raise APIError(400, f"{param.split('.')[0]} and tool_choice {_choice_name(body)} (or a strict function) each "
                       "constrain the reply; send one of them", param="tool_choice")
    structured.check(spec, param)
    params = stop_at_call_end(_sampling(state, body, body.max_completion_tokens or body.max_tokens,
                                        (body.top_logprobs or 0) if body.logprobs else None), tools)
    kwargs, policy = template_kwargs(body.chat_template_kwargs)
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    owner = request_owner(request, state, body.user)
    stored = state.conversations.find(owner, messages) if state.conversations is not None else None
    # a long history: planned off the event loop
    prompt = await asyncio.to_thread(plan_chat, state, messages, tools, kwargs, policy, stored)
    check_prompt(state, prompt.ids)
    check_max_tokens(state, prompt.ids, body.max_completion_tokens or body.max_tokens,
                     "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    if spec is not None or prompt.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=spec or prompt.grammar)
    lease = Lease(state, metrics)
    info = RequestInfo(f"chatcmpl-{uuid.uuid4().hex}", "chat.completions", prompt.ids, params.n, messages=messages,
                       history_policy=prompt.policy, history_fallback=prompt.fallback_reason,
                       history_context=prompt.context)
    count_history(metrics, prompt, info.request_id)
    parsers = [reply_parser(tools) for _ in range(params.n)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_stream(state, metrics, body, tools, parsers, info, params, include_usage, owner, prompt)
        return SSEResponse(sse_events(events, lease, metrics, _sse_error), lease.release,
                           media_type="text/event-stream")
    out = await run_to_end(request, state, metrics, lease, info, params)
    if out is None:
        return gone()
    choices, replies = [], {}
    for o in out.outputs:
        parser = parsers[o.index]
        pieces = parser.feed(o.text, final=True, stop_reason=o.stop_reason)
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
        message = AssistantMessage(content=None if calls and not content.strip() else content, tool_calls=calls or None)
        logprobs = _chat_logprobs(state, o.logprobs or []) if body.logprobs else None
        choices.append(ChatChoice(index=o.index, message=message, logprobs=logprobs,
                                  finish_reason=parser.finish_reason(o.finish_reason)))
    remember(state, owner, prompt, out, replies)
    result = ChatCompletion(id=info.request_id, created=int(time.time()), model=state.model_name, choices=choices,
                            usage=_usage(out))
    return JSONResponse(result.model_dump(exclude_none=True))


async def _chat_stream(state: ServerState, metrics: ServerMetrics, body: ChatCompletionRequest,
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
            pieces = parser.feed(o.delta_text, final, o.stop_reason)
            records[i].add(pieces)
            text, deltas = _call_deltas(pieces)
            logprobs = None
            if body.logprobs:
                entries = _new_logprobs(o, sent_logprobs)
                logprobs = _chat_logprobs(state, entries) if entries else None
            if text or logprobs:
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=text or None), logprobs=logprobs)])
            for delta in deltas:  # one call delta a chunk, in the order the model wrote them
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(tool_calls=[delta]))])
            if final:
                done.add(i)
                if tools.required and not parser.calls:
                    raise unsatisfied()
                yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(),
                                         finish_reason=parser.finish_reason(o.finish_reason))])
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
    structured.check(spec, param)
    if spec is not None:
        params = dataclasses.replace(params, structured_outputs=spec)
    prompt = await asyncio.to_thread(_completion_prompt, state, body.prompt)
    check_prompt(state, prompt)
    check_max_tokens(state, prompt, body.max_tokens, "max_tokens")
    lease = Lease(state, metrics)
    text = body.prompt if isinstance(body.prompt, str) else body.prompt[0] if body.prompt and isinstance(
        body.prompt[0], str) else None
    info = RequestInfo(f"cmpl-{uuid.uuid4().hex}", "completions", prompt, params.n, prompt=text)
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
