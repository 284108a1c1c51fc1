"""The chat screen: sessions sidebar, streaming conversation, prompt, and the dashboard panel.

The screen composes the widgets, routes key bindings, slash commands, palette entries and the engine's messages to
the controllers (tsterm.tui.controllers), and renders what they hold: the sessions (SessionBook), the context budget
(ContextBudget), chat replies in flight (ChatTurns), API clients' requests (ApiConversations) and agent tasks
(AgentRuns, which render through this screen's AgentView methods). The views of what streams now (`live_reply`,
`agent_reply`, `api_reply`, `call_views`) are the screen's own state.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.command import Provider
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, OptionList, Static

from tsterm.agent.loop import StepFinished, StepStarted, ToolCallRecord
from tsterm.agent.tools import Tool
from tsterm.chat.chat_format import shown_message, shown_reply
from tsterm.chat.session import Session, new_session_id
from tsterm.chat.store import SessionStore
from tsterm.errors import TstermError
from tsterm.tui.commands import Command, CommandError, help_text, parse_command, unescape_message
from tsterm.tui.controllers.agent import AgentRun, AgentRuns
from tsterm.tui.controllers.api import API_WELCOME, READ_ONLY, ApiConversations
from tsterm.tui.controllers.context import ContextBudget, TooLong
from tsterm.tui.controllers.sessions import ExportFailed, NothingToExport, SessionBook, fork_notice
from tsterm.tui.controllers.turns import ChatTurns, DoesNotFit, InFlight
from tsterm.tui.engine_host import EngineHost
from tsterm.tui.messages import (ApiTurnFinished, ApiTurnProgress, ApiTurnStarted, StatsUpdate, TurnFinished,
                                 TurnProgress)
from tsterm.tui.palette import ChatCommands
from tsterm.tui.screens.dialogs import ApproveTool, Confirm, ContextFull, TextPrompt
from tsterm.tui.widgets.agent_log import CallState, ToolCallView, agent_history_views, step_summary
from tsterm.tui.widgets.chat_log import (
    ChatLog,
    MessageView,
    ReplyView,
    Selectable,
    miss_notice,
    reply_note,
    turn_summary,
)
from tsterm.tui.widgets.dashboard import Dashboard
from tsterm.tui.widgets.prompt_input import PromptHistory, PromptInput
from tsterm.tui.widgets.session_list import SessionList

NARROW = 110  # below this many columns the dashboard replaces the sidebar
WIDE = 150  # from this many columns the dashboard starts open
WELCOME = ("Type a message and press enter. /help lists the commands; ctrl+p opens the palette; "
           "ctrl+t shows the dashboard.")


class ChatScreen(Screen):
    CSS_PATH = "chat.tcss"
    COMMANDS: ClassVar[set[type[Provider]]] = {ChatCommands}
    AUTO_FOCUS = "#prompt"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+n", "new_session", "New"),
        Binding("ctrl+g", "new_agent_session", "New agent session", show=False),
        Binding("ctrl+b", "fork_session", "Fork"),
        Binding("ctrl+r", "rename_session", "Rename"),
        Binding("f8", "delete_session", "Delete"),
        Binding("ctrl+y", "copy_message", "Copy"),
        Binding("ctrl+t", "toggle_dashboard", "Stats"),
        Binding("escape", "abort", "Stop"),
        Binding("ctrl+up", "select_message", "Select message", show=False),
        Binding("ctrl+pagedown,alt+down", "next_session(1)", "Next session", show=False),
        Binding("ctrl+pageup,alt+up", "next_session(-1)", "Previous session", show=False),
    ]

    def __init__(self, host: EngineHost, store: SessionStore, current_id: str | None = None, *,
                 agent_workspace: str | None = None, auto_approve: bool = False):
        """`current_id`: the session to show first (default: the most recently touched one). `agent_workspace`
        and `auto_approve`: the command line's, over the profile's `agent:` section."""
        super().__init__()
        self.host, self.store = host, store
        self.book = SessionBook(host, store, lambda text: self.notify(text, severity="error"), current_id)
        self.budget = ContextBudget(host)
        self.chats = ChatTurns(host, self.book, self.budget, self._run_worker, self.post_message)
        self.api = ApiConversations(host, self.book)
        self.agents = AgentRuns(host, self.book, self, self._run_worker, workspace=agent_workspace,
                                auto_approve=auto_approve)
        # What streams on screen now (None: nothing of that kind); a session switch rebuilds them.
        self.live_reply: ReplyView | None = None  # the shown chat's reply being generated
        self.agent_reply: ReplyView | None = None  # the shown agent session's step being generated
        self.call_views: dict[str, ToolCallView] = {}  # the shown agent session's tool blocks, by call id
        self.api_reply: ReplyView | None = None  # the shown API session's reply being generated
        # Key bindings and palette commands run in the app's task, message handlers in this screen's: whatever
        # rebuilds or appends to the chat log holds this lock, so a streaming reply never writes to a removed view.
        self._log_lock = asyncio.Lock()

    def _run_worker(self, work, name: str, group: str):
        return self.run_worker(work, name=name, group=group, exit_on_error=False)

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("sessions", classes="pane-title")
                yield SessionList(id="sessions")
            with Vertical(id="chat"):
                yield ChatLog(id="log")
                yield Static("", id="status", markup=False)
                yield PromptInput(PromptHistory(self.store.directory.parent / "prompt_history.json"), id="prompt",
                                  placeholder="message, or /help")
            yield Dashboard(self.host.device, id="dashboard")
        yield Footer(compact=True, show_command_palette=False)

    # ---- lifecycle
    async def on_mount(self) -> None:
        errors, rebound = self.book.load()
        for error in errors:
            self.notify(error, title="session file", severity="error", timeout=15)
        for title in rebound:
            self.notify(f"{title}: made with another model; its history will be re-tokenised", severity="warning")
        shown = {"auto": self.app.size.width >= WIDE, "shown": True, "hidden": False}[self.host.ui.dashboard]
        self.set_class(shown, "-dashboard")
        self.set_class(self.app.size.width < NARROW, "-narrow")
        await self.show_session(self.current_id)
        self.host.start_stats(self.post_message)

    async def on_unmount(self) -> None:
        self.host.stop_stats()
        await self.agents.close_all()  # their pins and MCP servers; the engine is shut down after the screens
        self.chats.keep_cut_replies()  # a reply cut by quitting is kept, as aborted
        self.book.save_all(quiet=True)

    def on_resize(self) -> None:
        self.set_class(self.size.width < NARROW, "-narrow")

    # ---- what the controllers hold, as the screen's callers read it
    @property
    def sessions(self) -> dict[str, Session]:
        return self.book.sessions

    @property
    def current_id(self) -> str:
        return self.book.current_id

    @current_id.setter
    def current_id(self, session_id: str) -> None:
        self.book.current_id = session_id

    @property
    def session(self) -> Session:
        return self.book.current

    @property
    def turns(self) -> dict[str, InFlight]:
        return self.chats.turns

    @property
    def agent_runs(self) -> dict[str, AgentRun]:
        return self.agents.runs

    @property
    def running_agents(self) -> set[str]:
        return self.agents.running

    @property
    def api_busy(self) -> set[str]:
        return self.api.busy

    @property
    def busy(self) -> set[str]:
        """Sessions generating a chat reply, running an agent task or answering an API client."""
        return set(self.chats.turns) | self.agents.running | self.api.busy

    @property
    def collapse_thinking(self) -> bool:
        return self.host.ui.thinking == "collapsed"

    @property
    def chat_log(self) -> ChatLog:
        return self.query_one("#log", ChatLog)

    @property
    def dashboard(self) -> Dashboard:
        return self.query_one(Dashboard)

    # ---- showing
    async def show_session(self, session_id: str) -> None:
        async with self._log_lock:
            await self._show_session(session_id)

    async def _show_session(self, session_id: str) -> None:
        self.current_id = session_id
        session = self.session
        self.api_reply = None
        if session.kind == "api":
            await self._show_api_session(session)
            return
        if session.kind == "agent":
            await self._show_agent_session(session)
            return
        self.agent_reply, self.call_views = None, {}  # an agent running elsewhere only updates its own log
        views, replies = [], iter(session.reply_stats())
        for index, m in enumerate(session.messages):
            number = session.number_of(index)
            if m["role"] == "assistant":
                stats = next(replies, None)
                views.append(MessageView("assistant", shown_message(m), turn_summary(stats) if stats else "",
                                         miss=bool(stats and stats.miss), index=index, number=number,
                                         collapse_thinking=self.collapse_thinking, note=reply_note(stats)))
            else:
                views.append(MessageView(m["role"], m["content"], index=index, number=number))
        if not any(m["role"] != "system" for m in session.messages) and session.id not in self.chats.turns:
            views.append(Static(WELCOME, classes="welcome"))
        self.live_reply = None
        in_flight = self.chats.turns.get(session_id)
        if in_flight is not None:
            self.live_reply = live = ReplyView(self.collapse_thinking)
            views.append(live)
        await self.chat_log.show_messages(views)
        if in_flight is not None and live.is_attached:
            await live.show(in_flight.text)
        self._after_show(session)

    async def _show_agent_session(self, session: Session) -> None:
        views, self.call_views = self._agent_views(session)
        if not any(m["role"] != "system" for m in session.messages) and session.id not in self.agents.running:
            views.append(Static(await self.agents.welcome(), classes="welcome"))
        self.live_reply = None
        await self.chat_log.show_messages(views)
        run = self.agents.runs.get(session.id)
        if self.agent_reply is not None and run is not None and self.agent_reply.is_attached:
            await self.agent_reply.show(run.text)
        self._after_show(session)

    def _agent_views(self, session: Session) -> tuple[list, dict[str, ToolCallView]]:
        """The log of an agent session: its history, and the step it is generating right now."""
        run = self.agents.runs.get(session.id)
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

    async def _show_api_session(self, session: Session) -> None:
        views, _ = agent_history_views(session, self.collapse_thinking)
        self.call_views, self.agent_reply, self.live_reply = {}, None, None
        turn = self.api.turn_of(session.id)
        if not session.messages:
            views.append(Static(API_WELCOME, classes="welcome"))
        self.api_reply = ReplyView(self.collapse_thinking) if turn is not None else None
        if self.api_reply is not None:
            views.append(self.api_reply)
        await self.chat_log.show_messages(views)
        if self.api_reply is not None and self.api_reply.is_attached:
            await self.api_reply.show(turn.text)
        self._after_show(session)

    def _after_show(self, session: Session) -> None:
        """A session's log is shown: its turns on the dashboard, the sidebar and the status line."""
        self.dashboard.show_turns(session)
        self.refresh_sidebar()
        self.refresh_status()

    def refresh_sidebar(self) -> None:
        """Every change to the sessions or to what generates ends here: the sidebar, and the dashboard's counts."""
        self.query_one(SessionList).show(self.sessions.values(), self.current_id, self.busy)
        self.refresh_sessions_count()
        self.refresh_bindings()  # "esc Stop" is live only while this session generates

    def refresh_sessions_count(self) -> None:
        api = [s for s in self.sessions.values() if s.kind == "api"]
        local = len(self.sessions) - len(api)
        server = self.app.api_server
        lines = [f"{local} local · {len(api)} api · {len(self.busy)} generating"]
        if server is not None:
            lines.append(f"serving {server.model_name} at {server.url}")
            lines.append(f"{len(self.api.turns)} api request(s) generating")
        else:
            lines.append("API server off (/serve starts it)")
        self.dashboard.show_sessions("\n".join(lines))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "abort":  # an API client's request stops when the client disconnects
            return True if self.current_id in set(self.chats.turns) | self.agents.running else None
        return True

    def refresh_status(self) -> None:
        s = self.dashboard.latest
        kv = f" · KV {s.get('used', 0)}/{s.get('num_blocks', 0)} used, {s.get('shared', 0)} shared" if s else ""
        busy = f" · {len(self.busy)} generating" if self.busy else ""
        used = len(self.session.token_ids)
        busy = f" · context {used}/{self.budget.limit}{busy}" if used else busy
        server = f" · API {self.app.api_server.url}" if self.app.api_server is not None else ""
        self.query_one("#status", Static).update(
            f"{self.session.title} · {self.host.model_name} · {self.host.device}{busy}{kv}{server}")

    def selected_index(self) -> int | None:
        """The index (in the current session) of the focused message, if a message has the focus."""
        focused = self.focused
        if isinstance(focused, Selectable) and focused.index is not None and focused in self.chat_log.children:
            return focused.index
        return None

    async def notice(self, text: str, role: str = "notice") -> None:
        async with self._log_lock:
            await self.chat_log.add(MessageView(role, text))

    # ---- input
    @on(Input.Submitted, "#prompt")
    async def submitted(self, event: Input.Submitted) -> None:
        text = event.value
        if not text.strip():
            return
        prompt = self.query_one(PromptInput)
        prompt.remember(text)
        prompt.value = ""
        try:
            command = parse_command(text)
        except CommandError as e:
            await self.notice(str(e), "error")
            return
        if command is not None:
            await self.run_command(command)
        else:
            await self.send(unescape_message(text))

    async def send(self, text: str) -> None:
        session = self.session
        if session.kind == "api":
            await self.notice(READ_ONLY, "error")
            return
        if session.kind == "agent":
            await self.send_task(text)
            return
        if session.id in self.chats.turns:
            self.notify("this session is still replying: wait, or press esc to abort it", severity="warning")
            return
        try:
            plan = self.chats.prepare(session, text)
        except TstermError as e:
            await self.notice(str(e), "error")
            return
        except DoesNotFit as e:
            await self.context_full(session, text, e.prompt_tokens)
            return
        if plan.miss and not session.num_misses:  # the first one per session; the turn line shows every one
            self.notify(miss_notice(plan.diverged_at, len(session.token_ids) - plan.diverged_at),
                        title="less reuse this turn", severity="warning")
        index = len(session.messages) - 1
        async with self._log_lock:
            await self.chat_log.add(MessageView("user", text, index=index, number=session.number_of(index)))
            self.live_reply = ReplyView(self.collapse_thinking)
            await self.chat_log.add(self.live_reply)
        self.chats.start(session, plan)
        self.refresh_sidebar()
        self.refresh_status()

    async def send_task(self, text: str) -> None:
        session = self.session
        if session.id in self.agents.running:
            self.notify("this agent is still working: wait, or press esc to stop it", severity="warning")
            return
        index = len(session.messages)  # where the loop puts the task
        async with self._log_lock:
            await self.chat_log.add(MessageView("user", text, index=index, number=session.number_of(index)))
        self.agents.start(session, text)
        self.refresh_sidebar()
        self.refresh_status()

    async def context_full(self, session: Session, text: str, prompt_tokens: int) -> None:
        """`text` did not fit (`prompt_tokens` with it): keep it in the prompt and offer the ways out."""
        prompt = self.query_one(PromptInput)
        prompt.value = text
        try:
            way = self.budget.way_out(session, text, prompt_tokens)
        except TooLong as e:
            await self.notice(str(e), "error")
            return

        async def chosen(choice: str | None) -> None:
            if choice is None:
                return
            prompt.value = ""
            if choice == "drop":
                session.drop_oldest(way.drop)
                self.book.save(session)
                await self.show_session(session.id)
            else:
                child = session.carry_over(new_session_id(), way.keep)
                self.book.add(child)
                await self.show_session(child.id)
            await self.send(text)

        await self.app.push_screen(ContextFull(way.summary, way.drop_text, way.new_text), chosen)

    # ---- chat replies (TurnProgress / TurnFinished, from the turn's worker)
    async def on_turn_progress(self, message: TurnProgress) -> None:
        if self.chats.progress(message) is None:
            return
        async with self._log_lock:
            if message.session_id == self.current_id and self.live_reply is not None:
                with contextlib.suppress(NoMatches):  # the screen is being taken down
                    await self.live_reply.show(message.text)

    async def on_turn_finished(self, message: TurnFinished) -> None:
        ended = self.chats.finish(message)
        if ended is None:
            return
        session, failed = ended.session, ended.failed
        if session is not None and not failed:
            warning = self.budget.filling(session)
            if warning is not None:
                self.notify(warning, title="context filling up", severity="warning", timeout=10)
        with contextlib.suppress(NoMatches):  # the screen is being taken down: the session is saved already
            await self._show_finished(message, session, failed)
            self.refresh_sidebar()
            self.refresh_status()

    async def _show_finished(self, message: TurnFinished, session: Session | None, failed: bool) -> None:
        if session is not None and not failed:
            self.dashboard.record_turn(message.stats)
        async with self._log_lock:
            live = self.live_reply if message.session_id == self.current_id else None
            self.live_reply = None if live is not None else self.live_reply
            if session is not None and failed and live is not None:
                await self._show_session(session.id)
                await self.chat_log.add(MessageView("error", f"the turn failed: {message.error}"))
            elif session is not None and failed:
                self.notify(f"{session.title}: the turn failed: {message.error}", severity="error")
            elif session is not None and live is not None:
                stats = message.stats
                await live.show(message.text)
                index = len(session.messages) - 1
                await live.finish(turn_summary(stats), stats.miss, note=reply_note(stats), index=index,
                                  number=session.number_of(index))
                self.dashboard.show_turns(session)

    # ---- API clients' requests (from the workstation's server)
    async def on_api_turn_started(self, message: ApiTurnStarted) -> None:
        session = self.api.started(message)
        with contextlib.suppress(NoMatches):  # the screen is being taken down
            if session.id == self.current_id:
                await self.show_session(session.id)
            self.refresh_sidebar()
            self.refresh_status()

    async def on_api_turn_progress(self, message: ApiTurnProgress) -> None:
        turn = self.api.progress(message)
        if turn is None:
            return
        async with self._log_lock:
            if turn.session_id == self.current_id and self.api_reply is not None:
                with contextlib.suppress(NoMatches):
                    await self.api_reply.show(message.text)

    async def on_api_turn_finished(self, message: ApiTurnFinished) -> None:
        session, stats = self.api.finished(message)
        with contextlib.suppress(NoMatches):
            if stats is not None:
                self.dashboard.record_turn(stats)
            if message.error is not None:
                note = f"{session.title}: the API request was {message.error}"
                self.notify(note, severity="warning" if message.output is not None else "error")
            if session.id == self.current_id:
                await self.show_session(session.id)
            self.refresh_sidebar()
            self.refresh_status()

    # ---- AgentView: what an agent task shows (AgentRuns calls these from the task's worker)
    def _showing(self, session: Session) -> bool:
        return session.id == self.current_id

    async def step_started(self, session: Session, event: StepStarted) -> None:
        if event.miss and not session.num_misses:
            self.notify(miss_notice(event.diverged_at, event.lost_tokens), title="less reuse this step",
                        severity="warning")
        if self._showing(session):
            async with self._log_lock:
                self.agent_reply = ReplyView(self.collapse_thinking)
                await self.chat_log.add(self.agent_reply)
            self.refresh_sidebar()  # the first task names the session
            self.refresh_status()

    def showing_step(self, session: Session) -> bool:
        return self._showing(session) and self.agent_reply is not None

    async def step_text(self, session: Session, text: str) -> None:
        async with self._log_lock:
            if self.agent_reply is not None:
                await self.agent_reply.show(text)

    async def call_parsed(self, session: Session, call: ToolCallRecord) -> None:
        if self._showing(session):
            async with self._log_lock:
                view = self.call_views[call.id] = ToolCallView(CallState.of(call))
                await self.chat_log.add(view)

    async def step_finished(self, session: Session, run: AgentRun, event: StepFinished) -> None:
        step = event.step
        self.dashboard.record_turn(session.turns[-1])
        if not self._showing(session):
            return
        index = len(session.messages) - 1
        async with self._log_lock:
            reply, self.agent_reply = self.agent_reply, None
            if reply is not None:
                await reply.show(shown_reply(step.reasoning, step.text))  # a harmony step's analysis as thinking
                number = sum(m["role"] == "assistant" for m in session.messages)  # steps so far, every task's
                await reply.finish(step_summary(number, step, run.lost_tokens), step.miss, index=index,
                                   number=session.number_of(index))
                if not step.text.strip() and step.tool_calls:
                    reply.query_one(".answer").display = False  # only calls: the blocks say it all
        self.dashboard.show_turns(session)

    def call_changed(self, session: Session, call: ToolCallRecord, status: str | None = None) -> None:
        if not self._showing(session):
            return
        view = self.call_views.get(call.id)
        if view is not None and view.is_attached:
            view.show(CallState.of(call, status))

    async def approve(self, session: Session, call: ToolCallRecord, tool: Tool, workspace: str) -> bool:
        """Ask through the dialog; the task waits on the answer (esc or n = deny)."""
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def answered(allowed: bool | None) -> None:
            if not answer.done():
                answer.set_result(bool(allowed))

        dialog = ApproveTool(call.name, call.arguments, workspace, getattr(tool, "description", ""), session.title)
        await self.app.push_screen(dialog, answered)
        try:
            return await answer
        except asyncio.CancelledError:  # the task was cancelled (session deleted, quit): take the dialog down
            with contextlib.suppress(Exception):
                if dialog.is_current:
                    dialog.dismiss(False)
            raise

    async def report(self, session: Session, text: str, error: bool) -> None:
        if self._showing(session):
            await self.notice(text, "error" if error else "notice")
        elif error:
            self.notify(f"{session.title}: {text}", severity="error")
        else:
            self.notify(f"{session.title}: {text}")

    async def task_ended(self, session: Session) -> None:
        with contextlib.suppress(NoMatches):  # the screen is being taken down
            if self._showing(session) and self.agent_reply is not None:
                reply, self.agent_reply = self.agent_reply, None
                await reply.finish("", note="aborted")
            self.refresh_sidebar()
            self.refresh_status()

    # ---- slash commands
    async def run_command(self, command: Command) -> None:
        arg = command.arg
        if command.name == "new":
            await self.action_new_session(arg or None)
        elif command.name == "agent":
            await self.action_new_agent_session(arg or None)
        elif command.name in ("fork", "copy") and arg:
            try:
                index = self.session.index_of(int(arg))
            except ValueError as e:
                await self.notice(str(e), "error")
                return
            await (self.action_fork_session(index) if command.name == "fork" else self.action_copy_message(index))
        elif command.name == "profile":
            self.switch_profile(arg)
        elif command.name == "rename":
            self.rename(arg)
        elif command.name == "system" and arg:
            await self.set_system(arg)
        elif command.name == "system":
            await self.notice(f"system prompt: {self.session.system_prompt or '(none)'}")
        elif command.name == "serve":
            self.serve_command(arg)
        elif command.name == "export":
            fmt, _, path = arg.partition(" ")
            self.action_export(fmt, path.strip())
        elif command.name == "help":
            await self.action_help()
        else:
            action = {"fork": "fork_session", "copy": "copy_message", "delete": "delete_session",
                      "clear": "clear_session", "save": "save", "stats": "toggle_dashboard"}[command.name]
            await self.run_action(action)

    def serve_command(self, arg: str) -> None:
        """`/serve` (the profile's port), `/serve PORT`, `/serve stop`."""
        if arg == "stop":
            self.app.stop_api_server()
        elif not arg:
            self.app.start_api_server()
        elif arg.isdigit() and 0 < int(arg) < 65536:
            self.app.start_api_server(int(arg))
        else:
            self.notify(f"usage: /serve [PORT|stop] (got {arg!r})", severity="error")

    # ---- actions (key bindings, the palette, slash commands)
    async def action_help(self) -> None:
        keys = [(b.key, b.description) for b in self.BINDINGS] + [("sidebar click, ctrl+p", "switch sessions"),
            ("up/down", "prompt history"), ("shift+tab", "select a message, like ctrl+up"),
            ("up/down, f, c, enter", "on a selected message: move, fork there, copy it, back to the prompt"),
            ("ctrl+p", "command palette"), ("ctrl+q", "quit")]
        await self.notice(help_text(keys))

    def _idle(self, what: str) -> bool:
        if self.current_id in self.busy:
            self.notify(f"wait for the reply (or press esc) before you {what}", severity="warning")
            return False
        return True

    async def action_new_session(self, title: str | None = None) -> None:
        session = self.book.new_chat(title)
        self.book.add(session)
        await self.show_session(session.id)

    async def action_new_agent_session(self, title: str | None = None) -> None:
        session = self.book.new_agent(title)
        self.book.add(session)
        await self.show_session(session.id)

    async def action_next_session(self, step: int) -> None:
        """Show the next (or previous) session of the sidebar, wrapping around."""
        session_id = self.book.neighbour(step)
        if session_id is not None:
            await self.show_session(session_id)

    async def action_fork_session(self, index: int | None = None) -> None:
        """Branch after message `index` (default: the selected message, else the last one). The branch keeps the
        exact ids of that prefix, so its next turn takes the parent's KV blocks by reference (zero copy)."""
        if index is None:
            index = self.selected_index()
        if index is None and not self._idle("fork"):
            return
        parent = self.session
        child = self.book.fork(index)
        await self.show_session(child.id)
        self.query_one("#prompt").focus()
        self.notify(fork_notice(parent, child, index))

    async def action_copy_message(self, index: int | None = None) -> None:
        """Copy message `index` (default: the selected message, else the last reply): a reply without its
        thinking block, through the terminal's clipboard (OSC 52)."""
        if index is None:
            index = self.selected_index()
        found = self.book.copy_text(index)
        if found is None:
            self.notify("no reply to copy yet: select a message (shift+tab) or use /copy N", severity="warning")
            return
        index, text = found
        self.app.copy_to_clipboard(text)
        number = self.session.number_of(index)
        self.notify(f"copied {'the system prompt' if number is None else f'message #{number}'} ({len(text)} chars)")

    def action_select_message(self) -> None:
        """From the prompt: focus the last message (then up/down walk the log, f forks, c copies, enter returns)."""
        views = [v for v in self.chat_log.query_children(Selectable) if v.can_focus]
        if not views:
            self.notify("no messages to select yet")
            return
        at = views.index(self.focused) - 1 if self.focused in views else len(views) - 1
        views[max(0, at)].focus()

    def action_focus_prompt(self) -> None:
        self.query_one(PromptInput).focus()
        self.chat_log.anchor()  # follow the stream again

    def action_pick_profile(self) -> None:
        self.app.push_screen(TextPrompt("profile name or YAML path", self.host.profile_name),
                             lambda profile: self.switch_profile(profile) if profile else None)

    def switch_profile(self, profile: str) -> None:
        if self.busy:
            self.notify("wait for the replies and agent tasks to finish (or press esc in each) before switching "
                        "profiles", severity="warning")
            return
        self.book.save_all()
        self.app.switch_profile(profile, self.current_id)

    def action_rename_session(self) -> None:
        self.app.push_screen(TextPrompt("rename session", self.session.title),
                             lambda title: self.rename(title) if title else None)

    def rename(self, title: str) -> None:
        self.book.rename(title)
        self.refresh_sidebar()
        self.refresh_status()

    def action_delete_session(self) -> None:
        session_id = self.current_id

        async def done(yes: bool | None) -> None:
            if yes:
                await self.delete(session_id)

        self.app.push_screen(Confirm(f"delete session {self.session.title!r}?"), done)

    async def delete(self, session_id: str) -> None:
        self.chats.forget(session_id)
        await self.agents.close(session_id)  # stops its task, releases its pin, stops its MCP servers
        self.book.delete(session_id)
        if session_id == self.current_id or self.current_id not in self.sessions:
            await self.show_session(self.book.most_recent().id)
        else:
            self.refresh_sidebar()

    def action_edit_system(self) -> None:
        async def done(text: str | None) -> None:
            if text is not None:
                await self.set_system(text)

        self.app.push_screen(TextPrompt("system prompt", self.session.system_prompt or ""), done)

    async def set_system(self, text: str) -> None:
        if not self._idle("change the system prompt"):
            return
        self.session.set_system_prompt(text)
        self.book.save(self.session)
        await self.show_session(self.current_id)

    async def action_clear_session(self) -> None:
        if not self._idle("clear"):
            return
        self.session.clear()
        self.book.save(self.session)
        await self.show_session(self.current_id)

    def action_save(self) -> None:
        saved = self.book.save_all()
        self.notify(f"saved {saved} session(s) to {self.store.directory}")

    def action_export(self, fmt: str, path: str = "") -> None:
        session = self.session

        def trace() -> dict:  # an agent session's own trace has its tools' latencies
            run = self.agents.runs.get(session.id)
            agent = run.agent if run is not None else None
            return agent.trace(self.host.model_name) if agent is not None else session.trace(self.host.model_name)

        try:
            target = self.book.export(fmt, path, trace)
        except NothingToExport as e:
            self.notify(str(e), severity="warning")
            return
        except ExportFailed as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"exported {session.title!r} to {target}")

    def action_start_server(self) -> None:
        self.app.start_api_server()

    def action_stop_server(self) -> None:
        self.app.stop_api_server()

    def action_toggle_dashboard(self) -> None:
        self.toggle_class("-dashboard")
        self.dashboard.redraw()
        self.dashboard.show_turns(self.session)

    def action_abort(self) -> None:
        if self.agents.abort(self.current_id):  # the model's request ends at once; a running tool finishes first
            return
        if not self.chats.abort(self.current_id):  # the turn's stream closes: the request is aborted, blocks freed
            self.notify("nothing is generating in this session")

    # ---- sidebar / counters
    @on(OptionList.OptionSelected, "#sessions")
    async def session_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and event.option.id != self.current_id:
            await self.show_session(event.option.id)
        self.query_one(PromptInput).focus()

    def on_stats_update(self, message: StatsUpdate) -> None:
        try:
            self.dashboard.update_stats(message.stats, message.memory, message.polled_at, message.experts,
                                        message.ranks)
            self.refresh_status()
        except NoMatches:  # a last poll while the screen is being taken down
            pass
