"""External conversations on the chat screen: each conversation an API client holds with the workstation's server
(tsterm.tui.api_server) is a live session of kind "api" in the sidebar, with its streaming reply, its per-turn
reuse and the client's own history; the dashboard counts them with the local sessions.

A client sends its whole history every turn. A request whose prompt ids start with an API session's last prompt (and
go on) is that conversation's next turn; anything else starts a new one. The session keeps the exact ids the engine
saw and produced, so its per-turn line shows what the client's re-rendering kept (`kept`) and where it diverged
(a template miss), like a local chat's. An API session is read-only here: fork it to continue it yourself.

A mixin, like SessionActions: it relies on the ChatScreen attributes (`sessions`, `current_id`, `host`, `chat_log`,
`dashboard`, `_log_lock`, `save`, `notice`, `refresh_sidebar`, ...).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from textual.css.query import NoMatches
from textual.widgets import Static

from tsterm.chat.plan import first_divergence
from tsterm.chat.session import Session, TurnStats, new_session_id
from tsterm.tui.messages import ApiTurnFinished, ApiTurnProgress, ApiTurnStarted
from tsterm.tui.widgets.agent_log import agent_history_views
from tsterm.tui.widgets.chat_log import ReplyView

API_WELCOME = "A conversation an API client holds with this workstation's server; it shows here as the client talks."
READ_ONLY = ("this conversation belongs to an API client: it is shown here, not typed into. Fork it (ctrl+b) to "
             "continue it yourself")
API_NAMES = {"chat.completions": "chat", "completions": "completion", "messages": "messages"}


@dataclass
class ApiTurn:
    """One external request being generated, and the session it belongs to."""

    session_id: str
    request_id: str
    text: str = ""
    generated_tokens: int = 0


def title_of(messages: list[dict], api: str) -> str:
    first = next((m["content"] for m in messages if m["role"] == "user" and m["content"].strip()), "")
    return " ".join(first.split())[:40] or f"api {API_NAMES.get(api, api)}"


def turn_stats(session: Session, message: ApiTurnFinished) -> TurnStats:
    """The request's turn line: prompt, cached, kept (the leading ids equal to what the session held) and a miss
    when the client's history diverged from the ids the engine produced for it."""
    prompt, held = message.info.prompt_ids, session.token_ids
    at = first_divergence(held, prompt)
    kept = min(len(held), len(prompt)) if at is None else at
    miss = bool(session.turns) and kept < len(held)
    out = message.output
    first = out.outputs[0] if out is not None and out.outputs else None
    finish = first.finish_reason if first is not None and first.finish_reason else "abort"
    return TurnStats(prompt_tokens=len(prompt), cached_tokens=out.num_cached_tokens if out else 0, kept_tokens=kept,
                     generated_tokens=len(message.token_ids), miss=miss, diverged_at=kept if miss else None,
                     ttft=out.metrics.ttft if out else None, mean_itl=out.metrics.mean_itl if out else None,
                     finish_reason=finish)


class ApiSessions:
    @property
    def api_busy(self) -> set[str]:
        return {turn.session_id for turn in self.api_turns.values()}

    def api_session_for(self, prompt_ids: list[int]) -> Session | None:
        """The idle API session this prompt continues (the longest match), if any."""
        best, length, busy = None, 0, self.api_busy
        for session in self.sessions.values():
            if session.kind == "api" and session.id not in busy and session.model == self.host.model_key:
                n = session.continued_by(prompt_ids)
                if n > length:
                    best, length = session, n
        return best

    def _api_session(self, message: ApiTurnStarted | ApiTurnFinished) -> Session:
        session = self.api_session_for(message.info.prompt_ids)
        if session is None:
            session = Session(id=new_session_id(), title=title_of(message.messages, message.info.api),
                              model=self.host.model_key, kind="api")
            self.sessions[session.id] = session
        return session

    # ---- the server's messages
    async def on_api_turn_started(self, message: ApiTurnStarted) -> None:
        session = self._api_session(message)
        session.messages = [dict(m) for m in message.messages]  # shown while it generates
        session.touch()
        self.api_turns[message.info.request_id] = ApiTurn(session.id, message.info.request_id)
        with contextlib.suppress(NoMatches):  # the screen is being taken down
            if session.id == self.current_id:
                await self.show_session(session.id)
            self.refresh_sidebar()
            self.refresh_status()

    async def on_api_turn_progress(self, message: ApiTurnProgress) -> None:
        turn = self.api_turns.get(message.request_id)
        if turn is None:
            return
        turn.text, turn.generated_tokens = message.text, message.generated_tokens
        async with self._log_lock:
            if turn.session_id == self.current_id and self.api_reply is not None:
                with contextlib.suppress(NoMatches):
                    await self.api_reply.show(message.text)

    async def on_api_turn_finished(self, message: ApiTurnFinished) -> None:
        turn = self.api_turns.pop(message.info.request_id, None)
        session = self.sessions.get(turn.session_id) if turn is not None else None
        if session is None:  # its start reached another screen (a profile switch), or the session was deleted
            session = self._api_session(message)
        session.messages = [dict(m) for m in message.messages]
        stats = None
        if message.output is not None:
            stats = turn_stats(session, message)
            session.messages.append({"role": "assistant", "content": message.text})
            session.token_ids = list(message.info.prompt_ids) + list(message.token_ids)
            session.turns.append(stats)
        session.touch()
        self.save(session, quiet=True)
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

    # ---- showing
    async def _show_api_session(self, session: Session) -> None:
        views, _ = agent_history_views(session, self.collapse_thinking)
        self.call_views, self.agent_reply, self.live_reply = {}, None, None
        turn = next((t for t in self.api_turns.values() if t.session_id == session.id), None)
        if not session.messages:
            views.append(Static(API_WELCOME, classes="welcome"))
        self.api_reply = ReplyView(self.collapse_thinking) if turn is not None else None
        if self.api_reply is not None:
            views.append(self.api_reply)
        await self.chat_log.show_messages(views)
        if self.api_reply is not None and self.api_reply.is_attached:
            await self.api_reply.show(turn.text)
        self.dashboard.show_turns(session)
        self.refresh_sidebar()
        self.refresh_status()

    def refresh_sessions_count(self) -> None:
        api = [s for s in self.sessions.values() if s.kind == "api"]
        local = len(self.sessions) - len(api)
        server = self.app.api_server
        lines = [f"{local} local · {len(api)} api · {len(self.busy)} generating"]
        if server is not None:
            lines.append(f"serving {server.model_name} at {server.url}")
            lines.append(f"{len(self.api_turns)} api request(s) generating")
        else:
            lines.append("API server off (/serve starts it)")
        self.dashboard.show_sessions("\n".join(lines))
