"""What the OpenAI and Anthropic routes share: admission (`Lease`), checks of the model and the prompt, rendering
chat-template messages (tool calls with object arguments) into prompt ids, running a request to its end while
watching for the client leaving, and an SSE response that aborts the engine request when the client disconnects.
Errors are `APIError`s; each route shapes its own bodies. Splitting a reply into text and (streamed) tool calls is
`tool_stream.ReplyParser`'s; what tools and tool_choice ask of generation (the call grammar of tool_choice
"required" and a named tool) is `tool_choice`'s.

Chat requests go through `ChatPlanner`: a request that continues a conversation the server stored (conversations.py)
is planned under the history policy (`preserve` by default: the stored exact ids + the template's text for the new
messages; `template`, or a `preserve` that cannot apply: the client's messages rendered as the template says, as a
request that continues nothing is; the prefix cache serves what that rendering shares with earlier prompts). `remember` stores each choice's conversation with
its exact ids for the next request. What was applied is counted in /metrics, logged, and told to the observer.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tsterm.chat.history import POLICIES, PRESERVE, TEMPLATE, kimi_call_ids, writes_call_ids
from tsterm.chat.session import Session
from tsterm.config import SamplingParams, StructuredOutputs
from tsterm.engine.admission import check_reply_room
from tsterm.errors import DistributedError, EngineStepError, EngineStoppedError, EngineTimeoutError, TstermError
from tsterm.outputs import RequestOutput
from tsterm.server.conversations import owner_of
from tsterm.server.errors import APIError
from tsterm.server.metrics import ServerMetrics
from tsterm.server.state import RequestInfo, ServerState
from tsterm.server.tool_choice import ToolUse, call_grammar
from tsterm.server.tool_stream import CallArguments, CallStart, Piece, Reasoning

log = logging.getLogger("tsterm.server")
CUT_SHORT = "cut short before its end (the client left, or the server refused the reply)"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving while it streams (whatever the ASGI spec
    version) and always closes its iterator, so a disconnect aborts the engine request at once. `on_close` runs
    once the response is over, even if the iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.on_close()


class Lease:
    """One admitted generation request: counted against `limits.max_queued_requests` until released (once). A route
    takes it before the request's costly preparation (rendering, tokenising, compiling a grammar), so the bound holds
    for those too, and releases it on every path (its stream's end, `run_to_end`, or an error before either)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics):
        limit = state.limits.max_queued_requests
        if state.in_flight >= limit:
            raise APIError(429, f"the server is at its limit of {limit} requests in flight; retry shortly",
                           type_="rate_limit_error", code="too_many_requests")
        self.state, self.metrics, self.released = state, metrics, False
        state.in_flight += 1
        metrics.in_flight.inc()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.in_flight -= 1
            self.metrics.in_flight.dec()


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       type_="not_found_error", param="model", code="model_not_found")


def check_prompt(state: ServerState, prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(prompt_ids) >= state.max_model_len:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but this model's context holds "
                       f"{state.max_model_len} (prompt + at least one generated token); shorten it",
                       param="messages", code="context_length_exceeded")


def check_max_tokens(state: ServerState, prompt_ids: list[int], max_tokens: int | None, param: str) -> None:
    """A max_tokens the client set must fit in the context after the prompt (as OpenAI answers it: a 400,
    context_length_exceeded, naming the room left); left unset, each route says how long a reply may run."""
    if max_tokens is not None:
        try:
            check_reply_room(len(prompt_ids), max_tokens, state.max_model_len, param)
        except TstermError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from e


def check_stop(state: ServerState, stops: list[str], param: str) -> list[str]:
    """Stop strings within the server's limits (every one is matched after every generated token)."""
    limits = state.limits
    if len(stops) > limits.max_stop:
        raise APIError(400, f"{len(stops)} stop strings; this server takes at most {limits.max_stop}", param=param)
    long = next((s for s in stops if len(s) > limits.max_stop_chars), None)
    if long is not None:
        raise APIError(400, f"a stop string has {len(long)} characters; this server takes at most "
                       f"{limits.max_stop_chars}", param=param)
    return stops


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), type_="server_error", code="engine_stopped")
    if isinstance(e, EngineTimeoutError):
        return APIError(504, str(e), type_="server_error", code="engine_timeout")
    if isinstance(e, (EngineStepError, DistributedError)):  # the engine's fault, not the request's
        return APIError(500, str(e), type_="server_error", code="engine_error")
    return APIError(400, str(e), param=getattr(e, "param", None))  # RequestError and other user-caused errors


def count_usage(metrics: ServerMetrics, out: RequestOutput | None) -> None:
    if out is not None:
        metrics.on_usage(len(out.prompt_token_ids), out.num_cached_tokens,
                         sum(len(o.token_ids) for o in out.outputs))


async def generate(state: ServerState, info: RequestInfo, params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request (every route generates through here), told to `state.observer`.
    Leaving early aborts the request and frees its blocks, as leaving `AsyncEngine.generate` does."""
    observer = state.observer
    salted = {} if info.cache_salt is None else {"cache_salt": info.cache_salt}  # stand-ins may take no salt
    stream = state.engine.generate(info.prompt_ids, params, request_id=info.request_id, **salted)
    if observer is None:
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out
        return
    _tell(observer.started, info)
    last, error = None, CUT_SHORT
    try:
        async with contextlib.aclosing(stream):
            async for out in stream:
                last = out
                _tell(observer.progress, info, out)
                yield out
        error = None if last is not None and last.finished else "aborted: the request ended without a final output"
    except TstermError as e:
        error = str(e)
        raise
    finally:
        _tell(observer.finished, info, last, error)


def _tell(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except Exception:  # an observer's bug must not fail the request it watches
        log.exception("the request observer failed")


async def run_to_end(request: Request, state: ServerState, metrics: ServerMetrics, lease: Lease, info: RequestInfo,
                     params: SamplingParams) -> RequestOutput | None:
    """The final output, its usage counted; None if the client left first (the request is aborted then). The
    lease is released either way."""
    try:
        out = await _run_to_end(request, state, metrics, info, params)
    finally:
        lease.release()
    count_usage(metrics, out)
    return out


async def _run_to_end(request: Request, state: ServerState, metrics: ServerMetrics, info: RequestInfo,
                      params: SamplingParams) -> RequestOutput | None:
    async def consume() -> RequestOutput:
        last = None
        async for out in generate(state, info, params):
            last = out
        if last is None or not last.finished:
            raise EngineStoppedError(f"request {info.request_id} ended without a final output (aborted)")
        return last

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                try:
                    return task.result()
                except TstermError as e:
                    raise engine_error(e) from e
            if await request.is_disconnected():
                metrics.disconnects.inc()
                return None
    finally:
        if not task.done():
            task.cancel()  # leaving `generate` aborts the request and frees its blocks
            with contextlib.suppress(BaseException):
                await task


LAST = object()  # a stream yields it just before its closing event: a client leaving after that did not leave early


async def sse_events(events: AsyncIterator[Any], lease: Lease, metrics: ServerMetrics,
                     error_event: Any) -> AsyncIterator[str]:
    """A route's SSE events, ended the same way for every route: an APIError or an engine error becomes the route's
    error event (`error_event(APIError)`); the lease is released once; a stream that stops before its `LAST` marker
    (the client left) counts as a disconnect. Closing this closes `events` at once (its request is aborted)."""
    ended = False
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if event is LAST:
                    ended = True
                else:
                    yield event
    except APIError as e:
        ended = True
        yield error_event(e)
    except TstermError as e:
        ended = True
        yield error_event(engine_error(e))
    finally:
        lease.release()
        if not ended:
            metrics.disconnects.inc()


def gone() -> Response:
    return Response(status_code=499)  # nobody reads it: the client has left


@dataclasses.dataclass
class Prompt:
    """The prompt ids sent to the engine (the rendered messages) and the grammar a required call holds the reply to."""

    ids: list[int]
    grammar: StructuredOutputs | None = None  # tool_choice required / any / named: `call_grammar`


def render_messages(state: ServerState, messages: list[dict], tools: ToolUse,
                    template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """Chat-template messages (tool calls with object arguments) -> the prompt ids (the Anthropic route's
    count_tokens; a required call's grammar adds none). `template_kwargs` are variables for the template."""
    if writes_call_ids(state.tokenizer):  # Kimi-K2: its calls' ids in the form its template writes
        messages = kimi_call_ids(messages)
    try:
        ids = list(state.tokenizer.apply_chat_template(messages, tools=tools.offered, add_generation_prompt=True,
                                                       tokenize=True, **(template_kwargs or {})))
    except TstermError as e:
        raise APIError(400, str(e), param="messages") from e
    return Prompt(ids)


# ---- chat template variables and the history policy -------------------------------------------------------------

# Variables the server itself hands to the template: a request may not set them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "tokenize")
# Switches templates read, checked for their type (a template sees any other key as it came)
BOOLEAN_TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking", "clear_thinking")
HISTORY_KEY = "thinking_history"  # tsterm's: the history policy of this request; not passed to the template


def template_kwargs(raw: dict[str, Any] | None, param: str = "chat_template_kwargs") -> tuple[dict[str, Any],
                                                                                            str | None]:
    """A request's `chat_template_kwargs` -> (the template's variables, the history policy it names or None); a 400
    naming the bad field otherwise. The body is JSON, so every value is a JSON value already."""
    if raw is None:
        return {}, None
    kwargs = dict(raw)
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"{param}.{key}: the server sets {key!r} itself; it cannot be a template variable",
                           param=f"{param}.{key}")
        if not key.isidentifier():
            raise APIError(400, f"{param}: {key!r} is not a template variable name", param=f"{param}.{key}")
    for key in BOOLEAN_TEMPLATE_KWARGS:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise APIError(400, f"{param}.{key} must be true or false, got {kwargs[key]!r}", param=f"{param}.{key}")
    policy = kwargs.pop(HISTORY_KEY, None)
    if policy is not None and policy not in POLICIES:
        raise APIError(400, f"{param}.{HISTORY_KEY} must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}",
                       param=f"{param}.{HISTORY_KEY}")
    return kwargs, policy


# Prefixes of history.py's / Session.plan's fallback reasons -> the short label /metrics counts them under
FALLBACK_LABELS = (
    ("the last reply did not end with a stop token", "reply_cut"),
    ("the kept ids or the messages they stand for changed", "history_changed"),
    ("the session does not know which messages", "coverage_unknown"),
    ("the template renders another context", "context_changed"),
    ("the template rejected the probe", "template_rejected"),
    ("the kept ids do not end with an assistant reply", "no_reply"),
    ("no new messages", "no_new_messages"),
)


def fallback_label(reason: str) -> str:
    return next((label for prefix, label in FALLBACK_LABELS if reason.startswith(prefix)), "end_marker")


@dataclasses.dataclass
class ChatPrompt(Prompt):
    """A chat request's prompt with how it was planned: `messages` is the conversation its ids stand for (what
    `remember` stores with each reply), `policy` the history policy applied (None: it continued no stored
    conversation and was rendered as sent)."""

    messages: list[dict] = dataclasses.field(default_factory=list)
    context: str = ""
    policy: str | None = None
    fallback_reason: str | None = None
    kept_tokens: int = 0


def plan_chat(state: ServerState, messages: list[dict], tools: ToolUse, kwargs: dict[str, Any],
              policy: str | None, stored: Session | None) -> ChatPrompt:
    """The prompt of a chat request (blocking: run it off the event loop). `stored` is the conversation it continues
    (ConversationStore.find), or None."""
    tokenizer = state.tokenizer
    call_ids = writes_call_ids(tokenizer)  # Kimi-K2: its calls' ids in the form its template writes

    def render(conversation: list[dict]) -> str:
        if call_ids:
            conversation = kimi_call_ids(conversation)
        return tokenizer.apply_chat_template(conversation, tools=tools.offered, add_generation_prompt=True,
                                             tokenize=False, **kwargs)

    try:
        applied, why, plan = None, None, None
        if stored is not None:
            applied = policy or state.history_policy
            if applied == PRESERVE:
                # planned on a copy: the stored conversation stays as stored while other requests may match it
                stored = dataclasses.replace(stored, messages=stored.messages[:stored.kept_messages]
                                             + list(messages[stored.kept_messages:]))
                plan = stored.plan(render, tokenizer, PRESERVE)
                if plan.fallback_reason is not None:
                    applied, why, plan = TEMPLATE, plan.fallback_reason, None
        if plan is None:  # the client's messages as the template renders them (today's path; the cache serves what
            # the rendering shares with earlier prompts)
            plan = Session(id="api", kind="api", messages=list(messages)).plan(render, tokenizer, TEMPLATE)
            planned = messages
        else:
            planned = stored.messages
    except TstermError as e:
        raise APIError(400, str(e), param="messages") from e
    prompt = ChatPrompt(list(plan.token_ids), messages=[dict(m) for m in planned], context=plan.context,
                        policy=applied, fallback_reason=why, kept_tokens=plan.kept_tokens)
    if tools.required or tools.strict:
        prompt.grammar = call_grammar(state, tools, prompt.ids, kwargs.get("enable_thinking") is True)
    return prompt


def count_history(metrics: ServerMetrics, prompt: ChatPrompt, request_id: str) -> None:
    """/metrics and the log: which history policy planned a chat request, and why a `preserve` one fell back."""
    if prompt.policy is None:
        metrics.history_unmatched.inc()
        log.debug("%s continues no stored conversation: rendered as sent (%d prompt tokens)", request_id,
                  len(prompt.ids))
        return
    metrics.history_policy.labels(prompt.policy).inc()
    if prompt.fallback_reason is not None:
        metrics.history_fallbacks.labels(fallback_label(prompt.fallback_reason)).inc()
        log.info("%s: history policy 'preserve' fell back to 'template': %s", request_id, prompt.fallback_reason)
    else:
        log.debug("%s: history policy %r kept %d of %d prompt tokens", request_id, prompt.policy, prompt.kept_tokens,
                  len(prompt.ids))


class ReplyRecord:
    """One choice's reply as the client receives it (its text and its calls), from the pieces sent to it: the
    assistant message a client sends back, stored with the conversation."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a harmony reply's analysis channel
        self.calls: list[list] = []  # [id, name, arguments text]

    def add(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, str):
                self.text.append(piece)
            elif isinstance(piece, Reasoning):
                self.reasoning.append(piece.text)
            elif isinstance(piece, CallStart):
                self.calls.append([piece.id, piece.name, ""])
            elif isinstance(piece, CallArguments):
                self.calls[piece.index][2] += piece.text

    def message(self) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        calls = []
        for call_id, name, arguments in self.calls:
            try:
                parsed: Any = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = arguments
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
        if calls:
            message["tool_calls"] = calls
        return message


def request_owner(request: Request, state: ServerState, user: str | None = None) -> str:
    """The owner of a request's conversations (conversations.owner_of): the API key it presented when the server
    has one (app.create_app checked it), and the client's `user`."""
    key = None
    if state.api_key is not None:
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "").partition(" ")[2].strip()
    return owner_of(key, user)


def remember(state: ServerState, owner: str, prompt: ChatPrompt, out: RequestOutput | None,
             replies: dict[int, dict]) -> None:
    """Store each finished choice's conversation (the request's messages + its reply) with its exact ids (the prompt
    + the choice's generated ids) for the owner's next request. Choices not in `replies` (not finished) and replies
    that ended otherwise than by a stop or max_tokens (aborted, failed) are not."""
    if out is None or state.conversations is None:
        return
    for o in out.outputs:
        reply = replies.get(o.index)
        if reply is None or o.finish_reason not in ("stop", "length"):  # (a cut reply is kept: its next turn
            continue  # is planned as `template`, and says why)
        session = Session(id=f"{out.request_id}-{o.index}", kind="api", messages=[*prompt.messages, reply],
                          model=state.model_name)
        session.keep(list(prompt.ids) + list(o.token_ids), len(session.messages), prompt.context)
        state.conversations.put(owner, session)
