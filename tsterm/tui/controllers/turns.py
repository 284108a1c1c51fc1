"""The chat replies being generated: one worker per session streams its turn (EngineHost.stream_turn), whose
progress and end come back as TurnProgress / TurnFinished messages through `post`.

`ChatTurns` owns the in-flight turns (session id -> InFlight) and decides what a message does to its session; the
screen shows the reply.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tsterm.chat.plan import PromptPlan
from tsterm.chat.session import Session, TurnStats
from tsterm.errors import TstermError
from tsterm.tui.controllers.context import ContextBudget
from tsterm.tui.controllers.sessions import SessionBook

if TYPE_CHECKING:
    from textual.worker import Worker

    from tsterm.tui.messages import TurnFinished, TurnProgress

# (work, name, group) -> a started worker (the screen's run_worker); its `cancel()` aborts the turn's request.
RunWorker = Callable[[Coroutine[Any, Any, None], str, str], "Worker"]


class DoesNotFit(ValueError):
    """The message leaves no room for a reply in the context."""

    def __init__(self, prompt_tokens: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens: no room for a reply")
        self.prompt_tokens = prompt_tokens


@dataclass
class InFlight:
    worker: Worker
    request_id: str
    plan: PromptPlan
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    message: dict | None = None  # the reply so far as the assistant message to record (None: one holding `text`)

    def partial_stats(self) -> TurnStats:
        return TurnStats.from_plan(self.plan, self.num_cached_tokens, len(self.token_ids), finish_reason="abort")


@dataclass(frozen=True)
class Ended:
    """What a finished turn did: `session` (None: deleted meanwhile) got its reply, or, `failed`, lost the message
    that asked for it."""

    session: Session | None
    failed: bool


class ChatTurns:
    def __init__(self, host: Any, book: SessionBook, budget: ContextBudget, run_worker: RunWorker,
                 post: Callable[[Any], Any]):
        self.host, self.book, self.budget = host, book, budget
        self.run_worker, self.post = run_worker, post
        self.turns: dict[str, InFlight] = {}  # session id -> its reply being generated
        self._request_ids = itertools.count()

    def prepare(self, session: Session, text: str) -> PromptPlan:
        """Add `text` as the user's message and plan the prompt under the profile's thinking-history policy (the
        plan says which applied, and why `preserve` fell back). A prompt that cannot be planned (TstermError) or
        that leaves no room for a reply (DoesNotFit) raises, with the session as it was."""
        session.add_user(text)
        host = self.host
        try:
            plan = session.plan(host.render, host.tokenizer, host.thinking_history, host.stop_ids)
        except TstermError:
            session.drop_last_user()
            raise
        if not self.budget.fits(len(plan.token_ids)):
            session.drop_last_user()
            raise DoesNotFit(len(plan.token_ids))
        return plan

    def start(self, session: Session, plan: PromptPlan) -> InFlight:
        request_id = f"{session.id}/{len(session.turns)}/{next(self._request_ids)}"
        worker = self.run_worker(self.host.stream_turn(session.id, plan, request_id, self.post),
                                 f"turn {request_id}", "turns")
        self.turns[session.id] = state = InFlight(worker, request_id, plan)
        return state

    def progress(self, message: TurnProgress) -> InFlight | None:
        """Take the reply so far; None for a message of a turn that is no longer in flight."""
        state = self.turns.get(message.session_id)
        if state is None or state.request_id != message.request_id:
            return None
        state.text, state.token_ids, state.message = message.text, message.token_ids, message.message
        state.num_cached_tokens = message.num_cached_tokens
        return state

    def finish(self, message: TurnFinished) -> Ended | None:
        """Record the reply in its session and save it; a failed turn drops the user's message instead. None for a
        message of a turn that is no longer in flight (deleted, or already ended)."""
        state = self.turns.get(message.session_id)
        if state is None or state.request_id != message.request_id:
            return None
        del self.turns[message.session_id]
        session = self.book.sessions.get(message.session_id)
        failed = message.error is not None or message.stats is None
        if session is not None and failed:
            session.drop_last_user()
        elif session is not None:
            session.record_reply(message.plan, message.text, message.token_ids, message.stats, message.message)
            self.book.save(session)
        return Ended(session, failed)

    def abort(self, session_id: str) -> bool:
        """Stop the session's reply: its stream closes, which aborts the request and frees its blocks."""
        state = self.turns.get(session_id)
        if state is None:
            return False
        state.worker.cancel()
        return True

    def forget(self, session_id: str) -> None:
        """The session is deleted: stop its reply, which nobody will record."""
        state = self.turns.pop(session_id, None)
        if state is not None:
            state.worker.cancel()

    def keep_cut_replies(self) -> None:
        """The screen goes (quit, profile switch): each reply cut short is kept in its session, as aborted."""
        for session_id, state in self.turns.items():
            if session_id in self.book.sessions:
                self.book.sessions[session_id].record_reply(state.plan, state.text, state.token_ids,
                                                            state.partial_stats(), state.message)
        self.turns.clear()
