"""Agent sessions on the chat screen: a task typed in an agent session runs the agent loop (tsterm.agent.loop) on
the engine; its steps stream into the log as replies, its tool calls as collapsible blocks, and tools that need
approval ask through a dialog.

`AgentRuns` owns each agent session's loop, tools and running task (session id -> AgentRun) and turns the loop's
events into state; it shows them through an `AgentView` (the screen). A task runs as an async worker on the app's
event loop, so the view's calls update the widgets directly, in the order the loop's events come.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tsterm.agent.loop import (Agent, AgentFinished, ReasoningChunk, StepFinished, StepStarted, TextChunk,
                               ToolCallParsed, ToolCallRecord, ToolFinished, ToolStarted)
from tsterm.agent.tools import Tool
from tsterm.agent.toolset import ToolSet, build_toolset
from tsterm.chat.chat_format import shown_reply
from tsterm.chat.session import Session
from tsterm.errors import TstermError
from tsterm.tui import engine_host
from tsterm.tui.controllers.sessions import SessionBook
from tsterm.tui.tool_support import tool_profiles

if TYPE_CHECKING:
    from textual.worker import Worker

AGENT_WELCOME = ("Agent session: type a task and press enter. The model may call tools ({tools}) in {workspace}; "
                 "{approval}. esc stops a task; later messages are further tasks.")
NO_TOOLS_WELCOME = ("Agent session: type a task and press enter; esc stops it. This model's chat template does not "
                    "show it the tools ({tools}), so it cannot call them: it answers on its own. {offer}")
TOOL_PROFILES = "Profiles whose templates show tools: {names}; /profile NAME switches to one."
NO_TOOL_PROFILES = ("No installed profile's template shows tools: use a model whose chat template has a tools section "
                    "(e.g. Qwen3's).")
FINISH_NOTES = {"max_steps": "stopped: the task used its {steps} steps (agent.max_steps) without a final answer",
                "length": "stopped: the last reply hit max_tokens",
                "aborted": "aborted"}

RunWorker = Callable[[Coroutine[Any, Any, None], str, str], "Worker"]


@dataclass
class AgentRun:
    """One agent session's loop and tools (built on its first task), and the task it is running."""

    agent: Agent | None = None
    toolset: ToolSet | None = None
    worker: Worker | None = None  # the running task; None while the session waits on the user
    phase: str | None = None  # "tools" while the last step's calls run, "generating" while a step streams
    text: str = ""  # the step being generated: its text so far as shown (reasoning as a <think> block)
    answer: str = ""  # its text chunks so far
    reasoning: str = ""  # its reasoning chunks so far (a harmony reply's analysis channel)
    shown_at: float = 0.0
    calls: list[ToolCallRecord] = field(default_factory=list)  # the current step's calls
    lost_tokens: int = 0


class AgentView(Protocol):
    """What the agent runs show on the screen. Each call is about `session`: the view shows it only if that session is
    the one on screen (and notifies otherwise, where that is said)."""

    async def step_started(self, session: Session, event: StepStarted) -> None:
        """A step streams: a note on a template miss, and its live reply."""

    def showing_step(self, session: Session) -> bool:
        """Whether the session's live step is on screen (text shown to it would be seen)."""

    async def step_text(self, session: Session, text: str) -> None:
        """The step's visible text so far."""

    async def call_parsed(self, session: Session, call: ToolCallRecord) -> None:
        """A tool call came out of the step: its block."""

    async def step_finished(self, session: Session, run: AgentRun, event: StepFinished) -> None:
        """The step ended (its turn is the session's last): its footer and the dashboard's turn."""

    def call_changed(self, session: Session, call: ToolCallRecord, status: str | None = None) -> None:
        """A call's block shows `status` (default: the call's own)."""

    async def approve(self, session: Session, call: ToolCallRecord, tool: Tool, workspace: str) -> bool:
        """Ask whether the call may run (a cancellation takes the question down)."""

    async def report(self, session: Session, text: str, error: bool) -> None:
        """A task's error or a note on how it ended: in the log, or as a notification for a session not shown."""

    async def task_ended(self, session: Session) -> None:
        """The task is over (answered, failed or stopped): nothing of it streams any more."""


class AgentRuns:
    """`host`: the engine host (its agent settings, the backend agents generate with, tokenizer, sampling; read when
    a task starts). `workspace` and `auto_approve`: the command line's, over the profile's."""

    def __init__(self, host: Any, book: SessionBook, view: AgentView, run_worker: RunWorker, *,
                 workspace: str | None = None, auto_approve: bool = False):
        self.host, self.book, self.view, self.run_worker = host, book, view, run_worker
        self.workspace, self.auto_approve = workspace, auto_approve
        self.runs: dict[str, AgentRun] = {}  # agent session id -> its loop and tools (after its first task)
        self.tool_profiles: list[str] | None = None  # installed profiles whose templates show tools, once looked up

    @property
    def running(self) -> set[str]:
        return {sid for sid, run in self.runs.items() if run.worker is not None}

    async def welcome(self) -> str:
        """What an agent session says when it opens; on a model whose template drops the tools, that it cannot call
        them, and which installed profiles' templates show them (looked up once, off the UI thread)."""
        settings = self.host.agent
        if settings.tools is not None:
            tools = list(settings.tools)
        else:
            tools = ["calculator", "read_file", "list_dir", "grep"]
            tools += ["write_file"] * settings.allow_write + ["run_command"] * settings.allow_commands
        extra = len(settings.command_tools) + len(settings.mcp_servers)
        names = ", ".join(tools) + (f", + {extra} configured tool source(s)" if extra else "")
        if not self.host.renders_tools:
            if self.tool_profiles is None:
                self.tool_profiles = await asyncio.to_thread(tool_profiles)
            offer = (TOOL_PROFILES.format(names=", ".join(self.tool_profiles)) if self.tool_profiles
                     else NO_TOOL_PROFILES)
            return NO_TOOLS_WELCOME.format(tools=names, offer=offer)
        approval = ("tools run without asking (auto-approve)" if self.auto_approve or settings.auto_approve
                    else "tools that write or run commands ask first")
        return AGENT_WELCOME.format(tools=names, workspace=self.workspace or settings.workspace, approval=approval)

    # ---- a task
    def start(self, session: Session, task: str) -> AgentRun:
        """Run `task` in the session (its loop and tools are built on its first task). The caller checks that the
        session is not running one already."""
        run = self.runs.setdefault(session.id, AgentRun())
        run.worker = self.run_worker(self._task(session, run, task), f"agent {session.id}", "agents")
        return run

    async def _task(self, session: Session, run: AgentRun, task: str) -> None:
        before = len(session.messages)
        try:
            if run.agent is None and not await self._build(session, run):
                return
            async for event in run.agent.run(task):
                await self._event(session, run, event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed task is reported; the session stays usable
            if len(session.messages) == before + 1:
                session.drop_last_user()  # nothing came of the task: the history is as before it
            await self.view.report(session, f"the task failed: {type(e).__name__}: {e}" if not isinstance(
                e, TstermError) else f"the task failed: {e}", error=True)
        finally:
            run.worker, run.phase, run.calls = None, None, []
            self.book.save(session, quiet=True)
            await self.view.task_ended(session)

    async def _build(self, session: Session, run: AgentRun) -> bool:
        """The session's tools (MCP servers start here: on a thread) and its loop. False, reported, if the
        profile's agent section cannot be built."""
        settings = self.host.agent
        building = asyncio.ensure_future(asyncio.to_thread(build_toolset, settings, self.workspace))
        try:
            toolset = await asyncio.shield(building)
        except asyncio.CancelledError:  # esc or quit while MCP servers start: stop them once they have
            building.add_done_callback(_close_when_built)
            raise
        except Exception as e:  # noqa: BLE001 - a bad agent section (ConfigError) or a server that did not start
            user_error = isinstance(e, (TstermError, OSError))
            await self.view.report(session, "the agent's tools could not be set up: "
                                   + (str(e) if user_error else f"{type(e).__name__}: {e}"), error=True)
            return False
        auto = True if self.auto_approve else None
        try:
            options = settings.loop_options(auto_approve=auto)
            run.agent = Agent(self.host.agent_backend, self.host.tokenizer, toolset.tools, self.host.sampling,
                              options=options, approve=self._approver(session, toolset), session=session,
                              history_policy=self.host.thinking_history,
                              constrain_tool_calls=settings.constrain_tool_calls)
        except TstermError as e:
            await asyncio.to_thread(toolset.close)
            await self.view.report(session, f"the agent could not start: {e}", error=True)
            return False
        run.toolset = toolset
        if any(tool.needs_approval for tool in toolset.tools):  # write or command tools: how they are confined
            await self.view.report(session, toolset.sandbox, error=False)
        if note := await asyncio.to_thread(lambda: run.agent.constraint_note):  # said once; the task runs unconstrained
            await self.view.report(session, note, error=False)
        return True

    async def _event(self, session: Session, run: AgentRun, event: Any) -> None:
        if isinstance(event, StepStarted):
            run.phase, run.text, run.answer, run.reasoning, run.calls, run.shown_at = "generating", "", "", "", [], 0.0
            run.lost_tokens = event.lost_tokens
            await self.view.step_started(session, event)
        elif isinstance(event, (TextChunk, ReasoningChunk)):
            if isinstance(event, TextChunk):
                run.answer += event.text
            else:
                run.reasoning += event.text
            run.text = shown_reply(run.reasoning, run.answer, thinking_done=bool(run.answer))
            now = time.monotonic()
            if now - run.shown_at >= engine_host.PROGRESS_INTERVAL and self.view.showing_step(session):
                run.shown_at = now
                await self.view.step_text(session, run.text)
        elif isinstance(event, ToolCallParsed):
            run.calls.append(event.call)
            await self.view.call_parsed(session, event.call)
        elif isinstance(event, StepFinished):
            run.phase = "tools" if event.step.tool_calls else None
            await self.view.step_finished(session, run, event)
        elif isinstance(event, ToolStarted):
            self.view.call_changed(session, event.call, "running" if event.call.status == "parsed" else None)
        elif isinstance(event, ToolFinished):
            self.view.call_changed(session, event.call)
        elif isinstance(event, AgentFinished):
            run.phase = None
            if event.reason != "answer":
                await self.view.report(session, FINISH_NOTES.get(event.reason, event.reason).format(steps=event.steps),
                                       error=False)
            self.book.save(session)

    def _approver(self, session: Session, toolset: ToolSet):
        async def approve(call: ToolCallRecord, tool: Tool) -> bool:
            """Ask through the view; the task waits on the answer."""
            self.view.call_changed(session, call)  # "waiting"
            allowed = await self.view.approve(session, call, tool, str(toolset.workspace.root))
            self.view.call_changed(session, call, "running" if allowed else None)
            return allowed

        return approve

    # ---- stop, close
    def abort(self, session_id: str) -> bool:
        """Stop the session's task: the model's request ends at once; a running tool finishes first. False if it
        runs none."""
        run = self.runs.get(session_id)
        if run is None or run.worker is None:
            return False
        if run.agent is None:  # still setting up its tools: nothing has reached the model yet
            run.worker.cancel()
        else:
            run.agent.abort()
        return True

    async def close(self, session_id: str) -> None:
        """The session is deleted (or the screen goes): stop its task, release its pin, stop its MCP servers."""
        run = self.runs.pop(session_id, None)
        if run is None:
            return
        if run.worker is not None:
            run.worker.cancel()  # the loop gives each call of the cut step a tool message; the task saves the session
            with contextlib.suppress(Exception):  # WorkerCancelled: that is what was asked
                await asyncio.wait_for(run.worker.wait(), timeout=10)
        if run.agent is not None:
            with contextlib.suppress(Exception):  # an engine already gone has no pin left to release
                await asyncio.wait_for(run.agent.close(), timeout=10)
        if run.toolset is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(run.toolset.close)

    async def close_all(self) -> None:
        for session_id in list(self.runs):
            await self.close(session_id)


def _close_when_built(building: asyncio.Future) -> None:
    """A tool set built for a task that was cancelled meanwhile: close it (on a thread: MCP servers take a while)."""
    if not building.cancelled() and building.exception() is None:
        threading.Thread(target=building.result().close, name="tsterm-toolset-close", daemon=True).start()
