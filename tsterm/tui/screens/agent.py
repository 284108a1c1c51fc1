"""Agent sessions on the chat screen: a task typed in an agent session runs the agent loop (tsterm.agent.loop) on
the engine; its steps stream into the log as replies, its tool calls as collapsible blocks, and tools that need
approval ask through a dialog.

A mixin, like SessionActions: it relies on the ChatScreen attributes (`sessions`, `current_id`, `host`, `chat_log`,
`dashboard`, `_log_lock`, `save`, `notice`, `refresh_sidebar`, ...). The loop runs in an async worker on the app's
event loop, so its events update the widgets directly (under the log lock, like a chat reply's messages).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from textual.css.query import NoMatches
from textual.widgets import Static
from textual.worker import Worker

from tsterm.agent.loop import (Agent, AgentFinished, StepFinished, StepStarted, TextChunk, ToolCallParsed,
                               ToolCallRecord, ToolFinished, ToolStarted)
from tsterm.agent.tools import Tool
from tsterm.agent.toolset import ToolSet, build_toolset
from tsterm.chat.session import Session, new_session_id
from tsterm.errors import TstermError
from tsterm.tui import engine_host
from tsterm.tui.screens.dialogs import ApproveTool
from tsterm.tui.tool_support import tool_profiles
from tsterm.tui.widgets.agent_log import CallState, ToolCallView, agent_history_views, step_summary
from tsterm.tui.widgets.chat_log import MessageView, ReplyView, miss_notice

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


@dataclass
class AgentRun:
    """One agent session's loop and tools (built on its first task), and the task it is running."""

    agent: Agent | None = None
    toolset: ToolSet | None = None
    worker: Worker | None = None  # the running task; None while the session waits on the user
    phase: str | None = None  # "tools" while the last step's calls run, "generating" while a step streams
    text: str = ""  # the step being generated: its visible text so far
    shown_at: float = 0.0
    calls: list[ToolCallRecord] = field(default_factory=list)  # the current step's calls
    lost_tokens: int = 0


class AgentSessions:
    # ---- sessions
    def new_agent(self, title: str | None = None) -> Session:
        session = Session(id=new_session_id(), title=title or "new agent", model=self.host.model_key, kind="agent")
        session.set_system_prompt(self.host.system_prompt)
        return session

    async def action_new_agent_session(self, title: str | None = None) -> None:
        session = self.new_agent(title)
        self.add_session(session)
        await self.show_session(session.id)

    @property
    def running_agents(self) -> set[str]:
        return {sid for sid, run in self.agent_runs.items() if run.worker is not None}

    async def agent_welcome(self) -> str:
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
        approval = ("tools run without asking (auto-approve)" if self.app.agent_auto_approve or settings.auto_approve
                    else "tools that write or run commands ask first")
        return AGENT_WELCOME.format(tools=names, workspace=self.app.agent_workspace or settings.workspace,
                                    approval=approval)

    def agent_views(self, session: Session) -> tuple[list, dict[str, ToolCallView]]:
        """The log of an agent session: its history, and the step it is generating right now."""
        run = self.agent_runs.get(session.id)
        pending = run.calls if run is not None and run.phase == "tools" else ()
        views, by_id = agent_history_views(session, self.collapse_thinking, pending)
        self.agent_reply = None
        if run is not None and run.phase == "generating":
            self.agent_reply = ReplyView(self.collapse_thinking)
            views.append(self.agent_reply)
            for call in run.calls:
                by_id[call.id] = ToolCallView(CallState.of(call))
                views.append(by_id[call.id])
        return views, by_id

    # ---- a task
    async def send_task(self, text: str) -> None:
        session = self.session
        if session.id in self.running_agents:
            self.notify("this agent is still working: wait, or press esc to stop it", severity="warning")
            return
        run = self.agent_runs.setdefault(session.id, AgentRun())
        index = len(session.messages)  # where the loop puts the task
        async with self._log_lock:
            await self.chat_log.add(MessageView("user", text, index=index, number=session.number_of(index)))
        run.worker = self.run_worker(self._agent_task(session, run, text), name=f"agent {session.id}",
                                     group="agents", exit_on_error=False)
        self.refresh_sidebar()
        self.refresh_status()

    async def _agent_task(self, session: Session, run: AgentRun, task: str) -> None:
        before = len(session.messages)
        try:
            if run.agent is None and not await self._build_agent(session, run):
                return
            async for event in run.agent.run(task):
                await self._agent_event(session, run, event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed task is reported; the session stays usable
            if len(session.messages) == before + 1:
                session.drop_last_user()  # nothing came of the task: the history is as before it
            await self._agent_error(session, f"the task failed: {type(e).__name__}: {e}" if not isinstance(
                e, TstermError) else f"the task failed: {e}")
        finally:
            run.worker, run.phase, run.calls = None, None, []
            self.save(session, quiet=True)
            with contextlib.suppress(NoMatches):  # the screen is being taken down
                if session.id == self.current_id and self.agent_reply is not None:
                    reply, self.agent_reply = self.agent_reply, None
                    await reply.finish("", note="aborted")
                self.refresh_sidebar()
                self.refresh_status()

    async def _build_agent(self, session: Session, run: AgentRun) -> bool:
        """The session's tools (MCP servers start here: on a thread) and its loop. False, reported, if the
        profile's agent section cannot be built."""
        settings = self.host.agent
        building = asyncio.ensure_future(asyncio.to_thread(build_toolset, settings, self.app.agent_workspace))
        try:
            toolset = await asyncio.shield(building)
        except asyncio.CancelledError:  # esc or quit while MCP servers start: stop them once they have
            building.add_done_callback(_close_when_built)
            raise
        except Exception as e:  # noqa: BLE001 - a bad agent section (ConfigError) or a server that did not start
            user_error = isinstance(e, (TstermError, OSError))
            await self._agent_error(session, "the agent's tools could not be set up: "
                                    + (str(e) if user_error else f"{type(e).__name__}: {e}"))
            return False
        auto = True if self.app.agent_auto_approve else None
        try:
            options = settings.loop_options(auto_approve=auto)
            run.agent = Agent(self.host.agent_backend, self.host.tokenizer, toolset.tools, self.host.sampling,
                              options=options, approve=self._approver(session, toolset), session=session)
        except TstermError as e:
            await asyncio.to_thread(toolset.close)
            await self._agent_error(session, f"the agent could not start: {e}")
            return False
        run.toolset = toolset
        return True

    async def _agent_error(self, session: Session, text: str) -> None:
        if session.id == self.current_id:
            await self.notice(text, "error")
        else:
            self.notify(f"{session.title}: {text}", severity="error")

    # ---- its events
    async def _agent_event(self, session: Session, run: AgentRun, event: Any) -> None:
        shown = session.id == self.current_id
        if isinstance(event, StepStarted):
            run.phase, run.text, run.calls, run.shown_at = "generating", "", [], 0.0
            run.lost_tokens = event.lost_tokens
            if event.miss and not session.num_misses:
                self.notify(miss_notice(event.diverged_at, event.lost_tokens), title="less reuse this step",
                            severity="warning")
            if shown:
                async with self._log_lock:
                    self.agent_reply = ReplyView(self.collapse_thinking)
                    await self.chat_log.add(self.agent_reply)
                self.refresh_sidebar()  # the first task names the session
                self.refresh_status()
        elif isinstance(event, TextChunk):
            run.text += event.text
            now = time.monotonic()
            if shown and self.agent_reply is not None and now - run.shown_at >= engine_host.PROGRESS_INTERVAL:
                run.shown_at = now
                async with self._log_lock:
                    await self.agent_reply.show(run.text)
        elif isinstance(event, ToolCallParsed):
            run.calls.append(event.call)
            if shown:
                async with self._log_lock:
                    view = self.call_views[event.call.id] = ToolCallView(CallState.of(event.call))
                    await self.chat_log.add(view)
        elif isinstance(event, StepFinished):
            await self._step_finished(session, run, event, shown)
        elif isinstance(event, ToolStarted):
            self.show_call(session, event.call, "running" if event.call.status == "parsed" else None)
        elif isinstance(event, ToolFinished):
            self.show_call(session, event.call)
        elif isinstance(event, AgentFinished):
            run.phase = None
            if event.reason != "answer":
                note = FINISH_NOTES.get(event.reason, event.reason).format(steps=event.steps)
                if shown:
                    await self.notice(note)
                else:
                    self.notify(f"{session.title}: {note}")
            self.save(session)

    async def _step_finished(self, session: Session, run: AgentRun, event: StepFinished, shown: bool) -> None:
        step = event.step
        run.phase = "tools" if step.tool_calls else None
        self.dashboard.record_turn(session.turns[-1])
        if not shown:
            return
        index = len(session.messages) - 1
        async with self._log_lock:
            reply, self.agent_reply = self.agent_reply, None
            if reply is not None:
                await reply.show(step.text)
                number = sum(m["role"] == "assistant" for m in session.messages)  # steps so far, every task's
                await reply.finish(step_summary(number, step, run.lost_tokens), step.miss, index=index,
                                   number=session.number_of(index))
                if not step.text.strip() and step.tool_calls:
                    reply.query_one(".answer").display = False  # only calls: the blocks say it all
        self.dashboard.show_turns(session)

    def show_call(self, session: Session, call: ToolCallRecord, status: str | None = None) -> None:
        if session.id != self.current_id:
            return
        view = self.call_views.get(call.id)
        if view is not None and view.is_attached:
            view.show(CallState.of(call, status))

    # ---- approval
    def _approver(self, session: Session, toolset: ToolSet):
        async def approve(call: ToolCallRecord, tool: Tool) -> bool:
            """Ask through the dialog; the task waits on the answer (esc or n = deny)."""
            self.show_call(session, call)  # "waiting"
            answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

            def answered(allowed: bool | None) -> None:
                if not answer.done():
                    answer.set_result(bool(allowed))

            dialog = ApproveTool(call.name, call.arguments, str(toolset.workspace.root),
                                 getattr(tool, "description", ""), session.title)
            await self.app.push_screen(dialog, answered)
            try:
                allowed = await answer
            except asyncio.CancelledError:  # the task was cancelled (session deleted, quit): take the dialog down
                with contextlib.suppress(Exception):
                    if dialog.is_current:
                        dialog.dismiss(False)
                raise
            self.show_call(session, call, "running" if allowed else None)
            return allowed

        return approve

    # ---- stop, close
    def abort_agent(self, session_id: str) -> bool:
        run = self.agent_runs.get(session_id)
        if run is None or run.worker is None:
            return False
        if run.agent is None:  # still setting up its tools: nothing has reached the model yet
            run.worker.cancel()
        else:
            run.agent.abort()
        return True

    async def close_agent(self, session_id: str) -> None:
        """The session is deleted (or the screen goes): stop its task, release its pin, stop its MCP servers."""
        run = self.agent_runs.pop(session_id, None)
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

    async def close_agents(self) -> None:
        for session_id in list(self.agent_runs):
            await self.close_agent(session_id)


def _close_when_built(building: asyncio.Future) -> None:
    """A tool set built for a task that was cancelled meanwhile: close it (on a thread: MCP servers take a while)."""
    if not building.cancelled() and building.exception() is None:
        threading.Thread(target=building.result().close, name="tsterm-toolset-close", daemon=True).start()
