"""External conversations on the chat screen: each conversation an API client holds with the workstation's server
(tsterm.tui.api_server) is a live session of kind "api" in the sidebar, with its streaming reply, its per-turn
reuse and the client's own history; the dashboard counts them with the local sessions.

A client sends its whole history every turn. A request whose prompt ids start with an API session's last prompt (and
go on) is that conversation's next turn; anything else starts a new one. The session keeps the exact ids the engine
saw and produced, so its per-turn line shows what the client's re-rendering kept (`kept`) and where it diverged
(a template miss), like a local chat's. An API session is read-only here: fork it to continue it yourself.

The server plans each chat request under the thinking-history policy (tsterm/chat/history.py, server/conversations.py)
and says on its RequestInfo which applied (`history_policy`: None for a request that continues no conversation the
server stored, rendered as sent) and why `preserve` fell back (`history_fallback`); the turn line shows both. The
session records its ids as the kept ids of its messages (Session.keep), so a fork of it continues them under the
profile's policy.

`ApiConversations` owns the requests being generated (request id -> ApiTurn) and applies the server's messages to the
sessions of the book; the screen shows them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tsterm.chat.history import render_context
from tsterm.chat.plan import first_divergence
from tsterm.chat.session import Session, TurnStats, new_session_id
from tsterm.tui.controllers.sessions import SessionBook

if TYPE_CHECKING:
    from tsterm.tui.messages import ApiTurnFinished, ApiTurnProgress, ApiTurnStarted

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
    info = message.info
    return TurnStats(prompt_tokens=len(prompt), cached_tokens=out.num_cached_tokens if out else 0, kept_tokens=kept,
                     generated_tokens=len(message.token_ids), miss=miss, diverged_at=kept if miss else None,
                     ttft=out.metrics.ttft if out else None, mean_itl=out.metrics.mean_itl if out else None,
                     finish_reason=finish, policy_applied=info.history_policy, fallback_reason=info.history_fallback)


class ApiConversations:
    """`host`: the engine host (the model a session must have been made with to be continued)."""

    def __init__(self, host: Any, book: SessionBook):
        self.host, self.book = host, book
        self.turns: dict[str, ApiTurn] = {}  # request id -> an API client's request being generated

    @property
    def busy(self) -> set[str]:
        return {turn.session_id for turn in self.turns.values()}

    def turn_of(self, session_id: str) -> ApiTurn | None:
        return next((t for t in self.turns.values() if t.session_id == session_id), None)

    def session_for(self, prompt_ids: list[int]) -> Session | None:
        """The idle API session this prompt continues (the longest match), if any."""
        best, length, busy = None, 0, self.busy
        for session in self.book.sessions.values():
            if session.kind == "api" and session.id not in busy and session.model == self.host.model_key:
                n = session.continued_by(prompt_ids)
                if n > length:
                    best, length = session, n
        return best

    def _session(self, message: ApiTurnStarted | ApiTurnFinished) -> Session:
        session = self.session_for(message.info.prompt_ids)
        if session is None:
            session = Session(id=new_session_id(), title=title_of(message.messages, message.info.api),
                              model=self.host.model_key, kind="api")
            self.book.sessions[session.id] = session
        return session

    def started(self, message: ApiTurnStarted) -> Session:
        """A request began: the conversation it continues (or a new one) shows its messages while it generates."""
        session = self._session(message)
        session.messages = [dict(m) for m in message.messages]
        session.touch()
        self.turns[message.info.request_id] = ApiTurn(session.id, message.info.request_id)
        return session

    def progress(self, message: ApiTurnProgress) -> ApiTurn | None:
        turn = self.turns.get(message.request_id)
        if turn is not None:
            turn.text, turn.generated_tokens = message.text, message.generated_tokens
        return turn

    def finished(self, message: ApiTurnFinished) -> tuple[Session, TurnStats | None]:
        """A request ended: its session holds the client's history, the reply and the exact ids (saved). The turn's
        stats are None when it ended before any output."""
        turn = self.turns.pop(message.info.request_id, None)
        session = self.book.sessions.get(turn.session_id) if turn is not None else None
        if session is None:  # its start reached another screen (a profile switch), or the session was deleted
            session = self._session(message)
        session.messages = [dict(m) for m in message.messages]
        stats = None
        if message.output is not None:
            stats = turn_stats(session, message)
            session.messages.append({"role": "assistant", "content": message.text})
            # the exact ids the engine holds for the messages through the reply, with the template context the
            # server rendered them in (the client's tools included)
            session.keep(list(message.info.prompt_ids) + list(message.token_ids), len(session.messages),
                         message.info.history_context or render_context(self.host.render))
            session.turns.append(stats)
        session.touch()
        self.book.save(session, quiet=True)
        return session, stats
