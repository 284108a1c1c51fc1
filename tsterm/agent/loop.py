"""The agent loop: model -> tool calls -> tool results as tool messages -> model, until a final answer or max_steps.

Each step's prompt is the previous step's exact ids (its prompt + every id it generated) followed by the tokens of
the text the new messages add - the tool results, or a next task's user message - planned by tsterm.chat under the
session's thinking-history policy (`history_policy`, tsterm.chat.history). Under `preserve` (the default) the kept
ids are never re-rendered: a reasoning template that drops the `<think>` of replies before the last user message
changes nothing the engine computed, so a task after a tool loop computes only its own message. Under `template`
the history is rendered as the chat template says; where that differs from the ids the model saw, the step says so
(`StepStarted.miss`, the first divergent position and the tokens that are recomputed) instead of hiding it. A
`preserve` step that cannot apply (a reply cut at max_tokens, a history edited since) is planned as `template`, and
the step says why (`fallback_reason`). A reply ends on the engine's stop set: its eos ids (`stop_ids`, read from the
backend's engine when not given) and the request's `stop_token_ids`.

Tool calls are constrained by default (`constrain_tool_calls`, the profile's `agent.constrain_tool_calls`): each step
generates under a grammar (tsterm.agent.tool_grammar.agent_grammar, applied by the engine's llguidance through
`SamplingParams.structured_outputs`) that lets the reply be free text, its reasoning included, and calls of the
offered tools only, in the form the chat template writes them, each call's arguments valid against its tool's JSON
schema; the reply may still answer without a call, and ends on the stop set as before. So a small model's calls are
well-formed (a reply cut by max_tokens inside a call is still an incomplete call). Where the grammar cannot be built
(the template writes calls in no form the grammar follows, or llguidance cannot compile a tool's schema), the session
runs unconstrained and says so once (`constraint_note`); it never fails for it. Params that carry their own
`structured_outputs` are left as they are.

The assistant message is the model's reply as it wrote it: its raw text, the `<think>` block and the tool-call tags
included. That is what its ids stand for, malformed calls too, and what the reasoning templates read back: they
parse the reasoning out of a content's `</think>` and render the tags verbatim (so `template` keeps the ids inside
a loop too; re-serialised structured `tool_calls` would not be the model's text).

While the session waits on its tools, and after its answer while it waits on the user, the session's blocks are
pinned in the engine (a TTL, under the engine's cap), so other sessions' traffic cannot evict its prefix; `close()`
releases the pin.

A harmony model (gpt-oss: tsterm.agent.harmony's `is_harmony`, the one choice the server makes too) is read by
`HarmonyParser` from the text of the reply's ids with their markers (the engine's text leaves them out): its analysis
channel comes as `ReasoningChunk`s (the step's `reasoning`), its final channel and commentary preambles as
`TextChunk`s, its `to=functions.NAME` message as the call. Its prompts are rendered by tsterm (`harmony.render`), and
its reply is kept as a structured message (reasoning, content, the calls with their arguments as written), which the
renderer writes back as harmony where a turn is re-rendered; the kept ids are the model's own under `preserve`. Its
calls are constrained by `harmony.turn_grammar` (reasoning and preambles, then a final answer or a call of an offered
tool, its arguments held to the tool's schema).

The loop is an async generator of events (`Agent.run`), shared by `tsterm agent`, the TUI and the server. No
Textual here, no engine import: the backend is anything with AsyncEngine's `generate` / `abort` / `pin` / `unpin`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tsterm.agent.harmony import (ReasoningDelta, TurnText, call_arguments, chat_tokenizer, is_harmony,
                                  reads_special_tokens, turn_grammar, turn_parser)
from tsterm.agent.tool_calls import TextDelta, ToolCall
from tsterm.agent.tool_grammar import (CallFormError, ChatTokens, agent_grammar, call_form, prompt_opens_reasoning,
                                       tool_parameters)
from tsterm.agent.tools import Tool, ToolResult
from tsterm.chat.history import PRESERVE, THINK_END, check_policy, request_stop_ids, stop_ids_of
from tsterm.chat.plan import PromptPlan, TextCodec
from tsterm.chat.session import Session, TurnStats, new_session_id
from tsterm.config import SamplingParams, StructuredOutputs
from tsterm.errors import ConfigError, RequestError
from tsterm.profiles import AgentOptions

REFUSED = "the user refused this call"
NO_APPROVER = "this tool needs the user's approval and nobody can give it here (run with --auto, or set " \
              "agent.auto_approve in the profile)"
ABORTED = "the session was aborted before this call ran"


class Backend(Protocol):
    """What the loop needs from an engine (tsterm.engine.AsyncEngine has it)."""

    def generate(self, prompt: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def pin(self, token_ids: list[int], ttl_s: float = 300.0, key: str | None = None) -> Any: ...

    def unpin(self, pin_id: str) -> bool: ...


class ChatTokenizer(TextCodec, Protocol):
    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, **kwargs: Any): ...


Approver = Callable[["ToolCallRecord", Tool], Awaitable[bool]]


@dataclass
class ToolCallRecord:
    """One call the model made, and what became of it."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str  # the exact text of the call, tags included
    error: str | None = None  # a malformed call, a refusal, or the tool's own error
    result: str | None = None  # what the model read back (None until the call is done)
    status: str = "parsed"  # parsed -> waiting (approval) -> running -> done | error | refused
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "error": self.error}


@dataclass
class AgentStep:
    """One model call: what it was given, what it reused, what it said and called."""

    index: int  # 1-based
    prompt_tokens: int
    cached_tokens: int  # served from the prefix cache
    kept_tokens: int  # leading prompt ids taken verbatim from the previous step
    generated_tokens: int
    text: str  # the visible text (tool-call tags left out)
    raw: str  # everything the model generated
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    finish_reason: str | None = None
    miss: bool = False
    diverged_at: int | None = None
    lost_tokens: int = 0  # previous ids the template's rendering did not keep (recomputed on a miss)
    ttft_s: float | None = None
    duration_s: float = 0.0
    policy_applied: str | None = None  # the thinking-history policy that planned the prompt
    fallback_reason: str | None = None  # why `preserve` could not apply to this step (planned as `template`)
    reasoning: str = ""  # a harmony reply's analysis channel (other families keep theirs in `text`'s <think>)

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "new_tokens": self.new_tokens, "kept_tokens": self.kept_tokens,
                "generated_tokens": self.generated_tokens, "text": self.text,
                "tool_calls": [c.to_json() for c in self.tool_calls], "finish_reason": self.finish_reason,
                "miss": self.miss, "diverged_at": self.diverged_at, "lost_tokens": self.lost_tokens,
                "policy_applied": self.policy_applied, "fallback_reason": self.fallback_reason,
                "ttft_s": self.ttft_s, "duration_s": self.duration_s,
                "tool_latency_s": [c.duration_s for c in self.tool_calls]}


# ---- events (what a UI shows as it happens)

@dataclass(frozen=True)
class StepStarted:
    step: int
    prompt_tokens: int
    kept_tokens: int
    miss: bool
    diverged_at: int | None
    lost_tokens: int
    policy_applied: str | None = None  # the thinking-history policy that planned this prompt
    fallback_reason: str | None = None  # why `preserve` could not apply (the step is planned as `template`)


@dataclass(frozen=True)
class TextChunk:
    step: int
    text: str


@dataclass(frozen=True)
class ReasoningChunk:
    step: int
    text: str  # a harmony reply's reasoning (its analysis channel), as it streams


@dataclass(frozen=True)
class ToolCallParsed:
    step: int
    call: ToolCallRecord


@dataclass(frozen=True)
class StepFinished:
    step: AgentStep


@dataclass(frozen=True)
class ToolStarted:
    call: ToolCallRecord


@dataclass(frozen=True)
class ToolFinished:
    call: ToolCallRecord


@dataclass(frozen=True)
class AgentFinished:
    answer: str  # the last reply's text after its reasoning (the step's `text` keeps the `<think>` block)
    reason: str  # "answer" | "max_steps" | "length" (the last reply hit max_tokens) | "aborted"
    steps: int  # steps this task took


AgentEvent = StepStarted | TextChunk | ReasoningChunk | ToolCallParsed | StepFinished | ToolStarted | ToolFinished \
    | AgentFinished


class Agent:
    """One agent session: its chat history and exact ids (a tsterm.chat Session), its tools, its steps.

    `run(task)` is an async generator of events; a session can run several tasks one after the other (the history
    grows). `abort()` stops the current task at the next point it can (the model's request is aborted at once; a
    tool already running finishes first). Several agents can run at once on one backend: the engine batches them.

    `history_policy`: `preserve` (default) or `template` (tsterm.chat.history; a profile's `thinking_history`).
    `stop_ids`: the ids the engine ends a reply on (default: the backend engine's `eos_token_ids`, else the
    tokenizer's); the request's own `stop_token_ids` are added per step.
    `constrain_tool_calls`: generate under the tool-call grammar (the module's docstring; default on).
    """

    def __init__(self, backend: Backend, tokenizer: ChatTokenizer, tools: Sequence[Tool],
                 params: SamplingParams | None = None, *, options: AgentOptions | None = None,
                 approve: Approver | None = None, session: Session | None = None,
                 system_prompt: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 history_policy: str = PRESERVE, stop_ids: Collection[int] | None = None,
                 constrain_tool_calls: bool = True):
        self.harmony = is_harmony(tokenizer)
        self.backend, self.tokenizer = backend, chat_tokenizer(tokenizer)  # harmony: rendered by tsterm
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ConfigError(f"two tools are named {tool.name!r}: tool names must be unique in a session")
            self.tools[tool.name] = tool
        self.specs = [tool.spec() for tool in tools]
        self.params = params or SamplingParams()
        self.options = options or AgentOptions()
        self.approve = approve
        self.session = session or Session(id=new_session_id(), title="new agent")
        if system_prompt and self.session.system_prompt is None and not self.session.messages:
            self.session.set_system_prompt(system_prompt)
        self.template_kwargs = dict(template_kwargs or {})
        self.history_policy = check_policy(history_policy)
        self.eos_ids = frozenset(stop_ids) if stop_ids is not None else engine_eos_ids(backend, tokenizer)
        if not isinstance(constrain_tool_calls, bool):
            raise ConfigError(f"constrain_tool_calls must be true or false, got {constrain_tool_calls!r}")
        self.constrain_tool_calls = constrain_tool_calls
        self._grammars: dict[bool, StructuredOutputs] | None = None  # by "the prompt opened a reasoning block"
        self._tokens: ChatTokens | None = None
        self._note: str | None = None
        self.steps: list[AgentStep] = []
        self.pin_key = f"agent:{self.session.id}"
        self._pinned = False
        self._aborted = False
        self._request_id: str | None = None
        self._requests = 0

    # ---- rendering
    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.specs or None, add_generation_prompt=True,
                                                  tokenize=False, **self.template_kwargs)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end this session's replies: the engine's eos ids (unless the params ignore eos) and the
        params' stop_token_ids. A reply whose last id is not one of them was cut (max_tokens, a stop string)."""
        return request_stop_ids(self.eos_ids, self.params)

    # ---- the tool-call grammar
    @property
    def constrains_tool_calls(self) -> bool:
        """Whether this session's steps generate under the tool-call grammar (built on first use)."""
        return bool(self._tool_grammars())

    @property
    def constraint_note(self) -> str | None:
        """One line saying why tool calls are not constrained although they were asked to be (None: they are, or
        were not asked to be). Builds the grammar on first use."""
        self._tool_grammars()
        return self._note

    def _tool_grammars(self) -> dict[bool, StructuredOutputs]:
        """The grammar of this session's replies, by whether the prompt opened a reasoning block; {} where the steps
        run unconstrained (not asked, no tools, the params' own structured_outputs, or it cannot be built: `_note`)."""
        if self._grammars is not None:
            return self._grammars
        self._grammars = {}
        if not self.constrain_tool_calls or not self.specs or self.params.structured_outputs is not None:
            return self._grammars
        try:
            self._grammars = self._build_grammars()
        except _Unconstrained as why:
            self._note = f"tool calls are not constrained in this session: {why}"
        return self._grammars

    def _build_grammars(self) -> dict[bool, StructuredOutputs]:
        import llguidance

        grammars = getattr(getattr(self.backend, "engine", None), "grammars", None)  # the engine's llguidance view
        try:
            self._tokens = ChatTokens(self.tokenizer, getattr(grammars, "lltokenizer", None))
            form = None if self.harmony else call_form(self._tokens)
        except CallFormError as e:
            raise _Unconstrained(str(e)) from e
        except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: unconstrained, said once
            raise _Unconstrained(f"{type(e).__name__}: {e}") from e
        parameters = tool_parameters(self.specs)
        stops = sorted(set(self.params.stop_token_ids) - self.eos_ids)

        def problem(grammar: str) -> str | None:
            error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokens.lltokenizer)
            return _readable(messages[0]) if error else None

        if self.harmony:  # one grammar: a harmony prompt opens no reasoning block
            for name, schema in parameters.items():
                error = problem(turn_grammar(self._tokens, {name: schema}, required=False))
                if error is not None:
                    raise _Unconstrained(f"llguidance cannot compile the parameters schema of tool {name!r} ({error})")
            grammar = StructuredOutputs(grammar=turn_grammar(self._tokens, parameters, required=False))
            return {False: grammar, True: grammar}
        for name, schema in parameters.items():  # name the tool whose schema llguidance cannot take
            error = problem(agent_grammar(self._tokens, form, {name: schema}))
            if error is not None:
                raise _Unconstrained(f"llguidance cannot compile the parameters schema of tool {name!r} ({error})")
        built = {}
        for opened in (False, True):
            grammar = agent_grammar(self._tokens, form, parameters, opened=opened, stop_token_ids=stops)
            error = problem(grammar)
            if error is not None:
                raise _Unconstrained(f"llguidance cannot compile the tool-call grammar ({error})")
            built[opened] = StructuredOutputs(grammar=grammar)
        return built

    def _step_params(self, prompt_ids: list[int]) -> SamplingParams:
        """The step's sampling: the session's params, under the tool-call grammar where the session has one."""
        grammars = self._tool_grammars()
        if not grammars:
            return self.params
        grammar = grammars[prompt_opens_reasoning(self._tokens, prompt_ids)]
        return dataclasses.replace(self.params, structured_outputs=grammar)

    def plan(self) -> PromptPlan:
        """The next model call's prompt under the session's history policy (raises what the template raises)."""
        return self.session.plan(self.render, self.tokenizer, self.history_policy, self.stop_ids)

    # ---- control
    def abort(self) -> None:
        """Stop the running task (from the loop's event loop): the model's request ends at once."""
        self._aborted = True
        if self._request_id is not None:
            self.backend.abort(self._request_id)

    async def close(self) -> None:
        """Release the session's pin (the session is over or deleted)."""
        if self._pinned:
            self._pinned = False
            await asyncio.to_thread(self.backend.unpin, self.pin_key)

    # ---- the loop
    async def run(self, task: str) -> AsyncIterator[AgentEvent]:
        if not task.strip():
            raise ValueError("the task is empty")
        self._aborted = False
        self.session.add_user(task)
        first = len(self.steps)
        answer, reason = "", "max_steps"
        for _ in range(self.options.max_steps):
            step: AgentStep | None = None
            async for event in self._step():
                if isinstance(event, StepFinished):
                    step = event.step
                yield event
            if step is None:  # aborted while generating
                reason = "aborted"
                if len(self.steps) == first:  # nothing of this task happened: the session is as it was
                    self.session.drop_last_user()
                break
            answer = _after_reasoning(step.text)
            if not step.tool_calls:
                reason = "length" if step.finish_reason == "length" else "answer"
                break
            await self._pin()
            async for event in self._run_tools(step):
                yield event
            if self._aborted:
                reason = "aborted"
                break
        await self._pin()  # waiting on the user now
        yield AgentFinished(answer.strip(), reason, len(self.steps) - first)

    async def _step(self) -> AsyncIterator[AgentEvent]:
        before = len(self.session.token_ids)
        index = len(self.steps) + 1
        plan = self._plan(index)
        lost = before - plan.kept_tokens if plan.miss else 0
        yield StepStarted(index, len(plan.token_ids), plan.kept_tokens, plan.miss, plan.diverged_at, lost,
                          plan.policy_applied, plan.fallback_reason)
        if self._grammars is None:  # the first step builds the grammar (llguidance's tokenizer: off the event loop)
            await asyncio.to_thread(self._tool_grammars)
        params = self._step_params(plan.token_ids)
        parser = turn_parser(self.tokenizer, self.specs, id_prefix=f"call_{index}_")
        # harmony's markers are special tokens, and Kimi-K2's call markers: read from the ids, which hold them
        turn = TurnText(self.tokenizer, keep_stop=self.harmony) if reads_special_tokens(self.tokenizer) else None
        calls: list[ToolCallRecord] = []
        text: list[str] = []
        reasoning: list[str] = []
        self._requests += 1
        self._request_id = f"{self.session.id}-{self._requests}"
        start = time.monotonic()
        final = None
        try:
            async for out in self.backend.generate(plan.token_ids, params, request_id=self._request_id):
                output = out.outputs[0]
                events = parser.feed(output.delta_text if turn is None
                                     else turn.feed(output.token_ids, out.finished, self.stop_ids))
                if out.finished:
                    final = out
                    events += parser.finish()
                for event in events:
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                        yield TextChunk(index, event.text)
                    elif isinstance(event, ReasoningDelta):
                        reasoning.append(event.text)
                        yield ReasoningChunk(index, event.text)
                    else:
                        call = _record(event)
                        calls.append(call)
                        yield ToolCallParsed(index, call)
        finally:
            self._request_id = None
        if final is None or final.finish_reason == "abort":
            self._aborted = True
            return
        ids = list(final.outputs[0].token_ids)
        raw = final.outputs[0].text if turn is None else turn.text
        stats = TurnStats.from_plan(plan, final.num_cached_tokens, len(ids), ttft=final.metrics.ttft,
                                    finish_reason=final.finish_reason)
        # the reply as the model wrote it (see the module docstring): the kept ids become the plan's + these ids,
        # standing for every message through this one; the tool messages that answer its calls come after them
        message = {"role": "assistant", "content": raw}
        if self.harmony:  # its messages, which the renderer writes back as the model wrote them
            message = {"role": "assistant", "content": "".join(text), "reasoning_content": "".join(reasoning)}
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name or "unknown", "arguments": call_arguments(_call(c))}} for c in calls]
        self.session.record_reply(plan, raw, ids, stats, message=message)
        step = AgentStep(index, len(plan.token_ids), final.num_cached_tokens, plan.kept_tokens, len(ids),
                         "".join(text), raw, calls, final.finish_reason, plan.miss, plan.diverged_at, lost,
                         final.metrics.ttft, time.monotonic() - start, plan.policy_applied, plan.fallback_reason,
                         "".join(reasoning))
        self.steps.append(step)
        yield StepFinished(step)

    def _plan(self, index: int) -> PromptPlan:
        """Step `index`'s prompt. When the chat template or the tokenizer cannot take the conversation, the turn fails
        with a RequestError before anything reaches the engine. If the last step's tool results are what they cannot
        take (a result holding a lone surrogate, say), those results are replaced in the session by an error note
        first, so that the session's next turn renders."""
        try:
            return self.plan()
        except Exception as err:  # noqa: BLE001 - whatever the template or the tokenizer raised, said below
            cause = f"{type(err).__name__}: {err}"
            error = err
        calls = {c.id: c for c in self.steps[-1].tool_calls} if self.steps else {}
        results = [m for m in self.session.messages if m["role"] == "tool" and m.get("tool_call_id") in calls]
        note = f"error: the result could not be rendered into the prompt ({cause})"
        saved = [m["content"] for m in results]
        for m in results:
            m["content"] = note
        if results and self._renders():
            culprits = []
            for m, content in zip(results, saved):  # put back every result the prompt can take
                m["content"] = content
                if not self._renders():
                    m["content"] = note
                    culprits.append(calls[m["tool_call_id"]])
            for call in culprits:
                call.status, call.error = "error", note.removeprefix("error: ")
            named = ", ".join(f"{c.name} ({c.id})" for c in culprits)
            raise RequestError(f"agent step {index}: the result of {named} could not be rendered into the prompt "
                               f"({cause}); the turn failed, and the session keeps an error note in its place") \
                from error
        for m, content in zip(results, saved):
            m["content"] = content
        raise RequestError(f"agent step {index}: the conversation could not be rendered into a prompt ({cause})") \
            from error

    def _renders(self) -> bool:
        try:
            self.plan()
        except Exception:  # noqa: BLE001
            return False
        return True

    async def _run_tools(self, step: AgentStep) -> AsyncIterator[AgentEvent]:
        try:
            for call in step.tool_calls:
                if self._aborted:
                    break
                yield ToolStarted(call)
                await self._call(call)
                yield ToolFinished(call)
        finally:  # every call gets a tool message, even when the task is aborted or cancelled in between
            for call in step.tool_calls:
                if call.result is None:
                    call.status, call.error, call.result = "error", call.error or ABORTED, ""
                self.session.messages.append(_tool_message(call))
            self.session.touch()

    async def _call(self, call: ToolCallRecord) -> None:
        if call.error is not None:  # malformed: the parser's message goes back to the model
            call.status, call.result = "error", ""
            return
        tool = self.tools[call.name]  # the parser only accepts declared names
        if tool.needs_approval and not self.options.auto_approve:
            call.status = "waiting"
            allowed = False if self.approve is None else await self.approve(call, tool)
            if not allowed:
                call.status, call.result = "refused", ""
                call.error = REFUSED if self.approve is not None else NO_APPROVER
                return
        call.status = "running"
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(asyncio.to_thread(tool.call, dict(call.arguments)),
                                            self.options.tool_timeout_s)
        except asyncio.TimeoutError:
            result = ToolResult("", f"{call.name}: no result within {self.options.tool_timeout_s:g} s "
                                    "(the agent stopped waiting for it)")
        except Exception as err:  # noqa: BLE001 - a tool's bug is the model's error result, never the session's end
            result = ToolResult("", f"{call.name} failed: {type(err).__name__}: {err}")
        call.duration_s = time.monotonic() - start
        call.result, call.error = result.content, result.error
        call.status = "done" if result.ok else "error"

    async def _pin(self) -> None:
        if not self.session.token_ids:
            return
        result = await asyncio.to_thread(self.backend.pin, list(self.session.token_ids), self.options.pin_ttl_s,
                                         self.pin_key)
        self._pinned = self._pinned or getattr(result, "pin_id", None) is not None

    # ---- results
    def to_json(self, answer: str | None = None) -> dict[str, Any]:
        """The `tsterm agent --json` object: the answer and every step of this session."""
        if answer is None:
            answer = _after_reasoning(self.steps[-1].text).strip() if self.steps else ""
        return {"answer": answer, "steps": [s.to_json() for s in self.steps]}

    def trace(self, model: str | None = None) -> dict[str, Any]:
        """A replayable trace of this session (Session.trace) with its tools' latencies."""
        latencies = [[c.duration_s for c in step.tool_calls] for step in self.steps]
        offset = max(0, len(self.session.turns) - len(latencies))  # turns from before this Agent (a reopened session)
        return self.session.trace(model, [[]] * offset + latencies)


def _readable(error: str) -> str:
    """llguidance's compile error on one line, without the grammar listing it appends or the position in it."""
    lines = []
    for line in error.splitlines():
        if re.match(r"\s*\d+ \|", line):
            break
        lines.append(line)
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(" ".join(lines).split()))
    return text if len(text) <= 300 else text[:300] + "..."


class _Unconstrained(Exception):
    """The tool-call grammar cannot be built for this session: why."""


def engine_eos_ids(backend: Any, tokenizer: Any) -> frozenset[int]:
    """The ids an engine ends a reply on: an AsyncEngine's `engine.eos_token_ids` (the tokenizer's and the model
    config's), a backend's own `eos_token_ids`, else the tokenizer's eos ids."""
    for owner in (getattr(backend, "engine", None), backend):
        ids = getattr(owner, "eos_token_ids", None)
        if ids is not None:
            return frozenset(ids)
    return stop_ids_of(tokenizer)


def _after_reasoning(text: str) -> str:
    """A reply's text without its reasoning: what follows its last `</think>` (all of it when there is none)."""
    return text.rsplit(THINK_END, 1)[1] if THINK_END in text else text


def _call(record: ToolCallRecord) -> ToolCall:
    return ToolCall(record.id, record.name, record.arguments, record.raw, record.error)


def _record(call: ToolCall) -> ToolCallRecord:
    return ToolCallRecord(call.id, call.name, dict(call.arguments), call.raw, call.error,
                          status="parsed" if call.error is None else "error")


def _tool_message(call: ToolCallRecord) -> dict[str, Any]:
    content = call.result or ""
    if call.error is not None:
        content = f"error: {call.error}" + (f"\n{content}" if content else "")
    return {"role": "tool", "content": content, "name": call.name or "unknown", "tool_call_id": call.id}


__all__ = ["ABORTED", "Agent", "AgentEvent", "AgentFinished", "AgentOptions", "AgentStep", "Backend",
           "engine_eos_ids", "NO_APPROVER", "REFUSED", "ReasoningChunk", "StepFinished", "StepStarted",
           "TextChunk", "ToolCallParsed", "ToolCallRecord",
           "ToolFinished", "ToolStarted"]
