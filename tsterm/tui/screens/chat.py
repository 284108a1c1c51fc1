"""The chat screen: sessions sidebar, streaming conversation, prompt, and the dashboard panel."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.command import Provider
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, OptionList, Static
from textual.worker import Worker

from tsterm.chat.plan import PromptPlan
from tsterm.chat.session import Session, TurnStats
from tsterm.chat.store import SessionStore
from tsterm.errors import TstermError
from tsterm.tui.commands import CommandError, parse_command, unescape_message
from tsterm.tui.engine_host import EngineHost
from tsterm.tui.messages import StatsUpdate, TurnFinished, TurnProgress
from tsterm.tui.palette import ChatCommands
from tsterm.tui.screens.actions import SessionActions
from tsterm.tui.screens.agent import AgentRun, AgentSessions
from tsterm.tui.screens.api_sessions import READ_ONLY, ApiSessions, ApiTurn
from tsterm.tui.screens.context import ContextLimits
from tsterm.tui.widgets.chat_log import (
    ChatLog,
    MessageView,
    ReplyView,
    Selectable,
    miss_notice,
    reply_note,
    turn_summary,
)
from tsterm.tui.widgets.agent_log import ToolCallView
from tsterm.tui.widgets.dashboard import Dashboard
from tsterm.tui.widgets.prompt_input import PromptHistory, PromptInput
from tsterm.tui.widgets.session_list import SessionList

NARROW = 110  # below this many columns the dashboard replaces the sidebar
WIDE = 150  # from this many columns the dashboard starts open
WELCOME = ("Type a message and press enter. /help lists the commands; ctrl+p opens the palette; "
           "ctrl+t shows the dashboard.")


@dataclass
class InFlight:
    worker: Worker
    request_id: str
    plan: PromptPlan
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0

    def partial_stats(self) -> TurnStats:
        return TurnStats(len(self.plan.token_ids), self.num_cached_tokens, self.plan.kept_tokens,
                         len(self.token_ids), self.plan.miss, self.plan.diverged_at, finish_reason="abort")


class ChatScreen(ContextLimits, ApiSessions, AgentSessions, SessionActions, Screen):
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

    def __init__(self, host: EngineHost, store: SessionStore, current_id: str | None = None):
        """`current_id`: the session to show first (default: the most recently touched one)."""
        super().__init__()
        self.host, self.store = host, store
        self.sessions: dict[str, Session] = {}
        self.current_id = current_id or ""
        self.turns: dict[str, InFlight] = {}  # session id -> its reply being generated
        self.live_reply: ReplyView | None = None
        self.agent_runs: dict[str, AgentRun] = {}  # agent session id -> its loop and tools (after its first task)
        self.agent_reply: ReplyView | None = None  # the shown agent session's step being generated
        self.call_views: dict[str, ToolCallView] = {}  # the shown agent session's tool blocks, by call id
        self.api_turns: dict[str, ApiTurn] = {}  # request id -> an API client's request being generated
        self.api_reply: ReplyView | None = None  # the shown API session's reply being generated
        self.context_warned: set[str] = set()  # sessions told that their context is filling up
        self.tool_profiles: list[str] | None = None  # installed profiles whose templates show tools, once looked up
        self._request_ids = itertools.count()
        # Key bindings and palette commands run in the app's task, message handlers in this screen's: whatever
        # rebuilds or appends to the chat log holds this lock, so a streaming reply never writes to a removed view.
        self._log_lock = asyncio.Lock()

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
        sessions, errors = self.store.load_all()
        for error in errors:
            self.notify(error, title="session file", severity="error", timeout=15)
        for session in sessions:
            if session.bind_model(self.host.model_key):
                self.notify(f"{session.title}: made with another model; its history will be re-tokenised",
                            severity="warning")
            self.sessions[session.id] = session
        shown = {"auto": self.app.size.width >= WIDE, "shown": True, "hidden": False}[self.host.ui.dashboard]
        self.set_class(shown, "-dashboard")
        self.set_class(self.app.size.width < NARROW, "-narrow")
        if not self.sessions:
            self.add_session(self.new_session())
        if self.current_id not in self.sessions:
            self.current_id = max(self.sessions.values(), key=lambda s: s.updated).id
        await self.show_session(self.current_id)
        self.host.start_stats(self.post_message)

    async def on_unmount(self) -> None:
        self.host.stop_stats()
        await self.close_agents()  # their pins and MCP servers; the engine is shut down after the screens
        for session_id, state in self.turns.items():  # a reply cut by quitting is kept, as aborted
            if session_id in self.sessions:
                self.sessions[session_id].record_reply(state.plan, state.text, state.token_ids, state.partial_stats())
        self.turns.clear()
        for session in self.sessions.values():
            self.save(session, quiet=True)

    def on_resize(self) -> None:
        self.set_class(self.size.width < NARROW, "-narrow")

    # ---- accessors
    @property
    def collapse_thinking(self) -> bool:
        return self.host.ui.thinking == "collapsed"

    @property
    def session(self) -> Session:
        return self.sessions[self.current_id]

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
                views.append(MessageView("assistant", m["content"], turn_summary(stats) if stats else "",
                                         miss=bool(stats and stats.miss), index=index, number=number,
                                         collapse_thinking=self.collapse_thinking, note=reply_note(stats)))
            else:
                views.append(MessageView(m["role"], m["content"], index=index, number=number))
        if not any(m["role"] != "system" for m in session.messages) and session.id not in self.turns:
            views.append(Static(WELCOME, classes="welcome"))
        self.live_reply = None
        in_flight = self.turns.get(session_id)
        if in_flight is not None:
            self.live_reply = live = ReplyView(self.collapse_thinking)
            views.append(live)
        await self.chat_log.show_messages(views)
        if in_flight is not None and live.is_attached:
            await live.show(in_flight.text)
        self.dashboard.show_turns(session)
        self.refresh_sidebar()
        self.refresh_status()

    async def _show_agent_session(self, session: Session) -> None:
        views, self.call_views = self.agent_views(session)
        if not any(m["role"] != "system" for m in session.messages) and session.id not in self.running_agents:
            views.append(Static(await self.agent_welcome(), classes="welcome"))
        self.live_reply = None
        await self.chat_log.show_messages(views)
        run = self.agent_runs.get(session.id)
        if self.agent_reply is not None and run is not None and self.agent_reply.is_attached:
            await self.agent_reply.show(run.text)
        self.dashboard.show_turns(session)
        self.refresh_sidebar()
        self.refresh_status()

    @property
    def busy(self) -> set[str]:
        """Sessions generating a chat reply, running an agent task or answering an API client."""
        return set(self.turns) | self.running_agents | self.api_busy

    def refresh_sidebar(self) -> None:
        """Every change to the sessions or to what generates ends here: the sidebar, and the dashboard's counts."""
        self.query_one(SessionList).show(self.sessions.values(), self.current_id, self.busy)
        self.refresh_sessions_count()
        self.refresh_bindings()  # "esc Stop" is live only while this session generates

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "abort":  # an API client's request stops when the client disconnects
            return True if self.current_id in set(self.turns) | self.running_agents else None
        return True

    def refresh_status(self) -> None:
        s = self.dashboard.latest
        kv = f" · KV {s.get('used', 0)}/{s.get('num_blocks', 0)} used, {s.get('shared', 0)} shared" if s else ""
        busy = f" · {len(self.busy)} generating" if self.busy else ""
        used = len(self.session.token_ids)
        busy = f" · context {used}/{self.context_limit}{busy}" if used else busy
        server = f" · API {self.app.api_server.url}" if self.app.api_server is not None else ""
        self.query_one("#status", Static).update(
            f"{self.session.title} · {self.host.model_name} · {self.host.device}{busy}{kv}{server}")

    def selected_index(self) -> int | None:
        """The index (in the current session) of the focused message, if a message has the focus."""
        focused = self.focused
        if isinstance(focused, Selectable) and focused.index is not None and focused in self.chat_log.children:
            return focused.index
        return None

    async def action_next_session(self, step: int) -> None:
        """Show the next (or previous) session of the sidebar, wrapping around."""
        order = list(self.sessions)
        if len(order) > 1:
            await self.show_session(order[(order.index(self.current_id) + step) % len(order)])

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

    # ---- turns
    async def send(self, text: str) -> None:
        session = self.session
        if session.kind == "api":
            await self.notice(READ_ONLY, "error")
            return
        if session.kind == "agent":
            await self.send_task(text)
            return
        if session.id in self.turns:
            self.notify("this session is still replying: wait, or press esc to abort it", severity="warning")
            return
        session.add_user(text)
        try:
            plan = session.plan(self.host.render, self.host.tokenizer)
        except TstermError as e:
            session.drop_last_user()
            await self.notice(str(e), "error")
            return
        if not self.fits(len(plan.token_ids)):
            session.drop_last_user()
            await self.context_full(session, text, len(plan.token_ids))
            return
        if plan.miss and not session.num_misses:  # the first one per session; the turn line shows every one
            self.notify(miss_notice(plan.diverged_at, len(session.token_ids) - plan.diverged_at),
                        title="less reuse this turn", severity="warning")
        index = len(session.messages) - 1
        async with self._log_lock:
            await self.chat_log.add(MessageView("user", text, index=index, number=session.number_of(index)))
            self.live_reply = ReplyView(self.collapse_thinking)
            await self.chat_log.add(self.live_reply)
        request_id = f"{session.id}/{len(session.turns)}/{next(self._request_ids)}"
        worker = self.run_worker(self.host.stream_turn(session.id, plan, request_id, self.post_message),
                                 name=f"turn {request_id}", group="turns", exit_on_error=False)
        self.turns[session.id] = InFlight(worker, request_id, plan)
        self.refresh_sidebar()
        self.refresh_status()

    async def on_turn_progress(self, message: TurnProgress) -> None:
        state = self.turns.get(message.session_id)
        if state is None or state.request_id != message.request_id:
            return
        state.text, state.token_ids = message.text, message.token_ids
        state.num_cached_tokens = message.num_cached_tokens
        async with self._log_lock:
            if message.session_id == self.current_id and self.live_reply is not None:
                with contextlib.suppress(NoMatches):  # the screen is being taken down
                    await self.live_reply.show(message.text)

    async def on_turn_finished(self, message: TurnFinished) -> None:
        state = self.turns.get(message.session_id)
        if state is None or state.request_id != message.request_id:
            return
        del self.turns[message.session_id]
        session = self.sessions.get(message.session_id)
        failed = message.error is not None or message.stats is None
        if session is not None and failed:
            session.drop_last_user()
        elif session is not None:
            session.record_reply(message.plan, message.text, message.token_ids, message.stats)
            self.save(session)
            self.warn_if_filling(session)
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

    def action_abort(self) -> None:
        if self.abort_agent(self.current_id):  # the model's request ends at once; a running tool finishes first
            return
        state = self.turns.get(self.current_id)
        if state is None:
            self.notify("nothing is generating in this session")
            return
        state.worker.cancel()  # the turn's stream closes, which aborts the request and frees its blocks

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
