"""The sessions the chat screen holds: which exist, which one is shown, and their files.

`SessionBook` owns the `sessions` dict and `current_id`; every other controller reads sessions through it. A file that
cannot be written is reported through `report_error` (the screen's notification); nothing here touches a widget.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tsterm.chat.session import Session, new_session_id
from tsterm.chat.store import SessionStore, atomic_write
from tsterm.tui.thinking import split_thinking

EXPORT_SUFFIXES = {"md": "md", "json": "json", "trace": "trace.json"}


class NothingToExport(ValueError):
    """A trace asked of a session without turns."""


class ExportFailed(OSError):
    """The export could not be written (the message names the target)."""


class SessionBook:
    """`host` gives the model a session is bound to and the profile's system prompt (read when needed: a profile
    switch builds a new screen, and tests change the host's settings while it runs)."""

    def __init__(self, host: Any, store: SessionStore, report_error: Callable[[str], None],
                 current_id: str | None = None):
        self.host, self.store = host, store
        self.report_error = report_error
        self.sessions: dict[str, Session] = {}
        self.current_id = current_id or ""

    @property
    def current(self) -> Session:
        return self.sessions[self.current_id]

    def load(self) -> tuple[list[str], list[str]]:
        """Read the store, and pick the session shown first: `current_id` if it is there, else the most recently
        touched one (a new chat when there is none). Returns (errors of the files that could not be read, titles of
        the sessions made with another model: their history will be re-tokenised)."""
        sessions, errors = self.store.load_all()
        rebound = []
        for session in sessions:
            if session.bind_model(self.host.model_key):
                rebound.append(session.title)
            self.sessions[session.id] = session
        if not self.sessions:
            self.add(self.new_chat())
        if self.current_id not in self.sessions:
            self.current_id = self.most_recent().id
        return errors, rebound

    def most_recent(self) -> Session:
        return max(self.sessions.values(), key=lambda s: s.updated)

    def neighbour(self, step: int) -> str | None:
        """The session `step` places after the shown one in the sidebar's order, wrapping around (None: only one)."""
        order = list(self.sessions)
        if len(order) < 2:
            return None
        return order[(order.index(self.current_id) + step) % len(order)]

    # ---- new, save, delete
    def new_chat(self, title: str | None = None) -> Session:
        return self._new(title or "new chat", "chat")

    def new_agent(self, title: str | None = None) -> Session:
        return self._new(title or "new agent", "agent")

    def _new(self, title: str, kind: str) -> Session:
        session = Session(id=new_session_id(), title=title, model=self.host.model_key, kind=kind)
        session.set_system_prompt(self.host.system_prompt)
        return session

    def add(self, session: Session) -> None:
        self.sessions[session.id] = session
        self.save(session)

    def save(self, session: Session, quiet: bool = False) -> bool:
        try:
            self.store.save(session)
            return True
        except OSError as e:
            if not quiet:
                self.report_error(f"could not save {session.title}: {e}")
            return False

    def save_all(self, quiet: bool = False) -> int:
        return sum(self.save(session, quiet) for session in list(self.sessions.values()))

    def delete(self, session_id: str) -> None:
        """Forget the session and its file; the book never ends up empty (a new chat takes the last one's place)."""
        self.sessions.pop(session_id, None)
        try:
            self.store.delete(session_id)
        except OSError as e:
            self.report_error(f"could not delete the session file: {e}")
        if not self.sessions:
            self.add(self.new_chat())

    # ---- edits of the shown session
    def rename(self, title: str) -> None:
        session = self.current
        session.title = title
        session.touch()
        self.save(session)

    def fork(self, index: int | None) -> Session:
        """Branch the shown session after message `index` (None: after its last) and add the branch. An API
        client's conversation stays the client's: the branch is a chat, yours to type into."""
        parent = self.current
        child = parent.fork(new_session_id(), index)
        if parent.kind == "api":
            child.kind = "chat"
        titles = {s.title for s in self.sessions.values()}
        child.title = next(t for n in range(1, len(titles) + 2)
                           if (t := f"{parent.title} (fork{f' {n}' if n > 1 else ''})") not in titles)
        self.add(child)
        return child

    def copy_text(self, index: int | None) -> tuple[int, str] | None:
        """(index, text) of message `index` of the shown session (None: its last reply); a reply without its
        thinking block. None when there is nothing to copy."""
        messages = self.current.messages
        if index is None:
            index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
        if index is None:
            return None
        message = messages[index]
        text = message["content"]
        if message["role"] == "assistant":
            text = split_thinking(text).answer or text
        return index, text

    def export(self, fmt: str, path: str, trace: Callable[[], dict[str, Any]]) -> Path:
        """Write the shown session as `fmt` (md, json, or trace: what `trace()` returns) to `path` (default: the
        exports folder next to the sessions). Raises NothingToExport, ExportFailed."""
        session = self.current
        suffix = EXPORT_SUFFIXES[fmt]
        target = (Path(path).expanduser() if path
                  else self.store.directory.parent / "exports" / f"{session.id}.{suffix}")
        if fmt == "md":
            text = session.to_markdown()
        elif fmt == "json":
            text = json.dumps(session.to_dict(), ensure_ascii=False, indent=1)
        else:  # token counts per turn (agent step) and its tools' latencies, for `tsterm bench --trace`
            if not session.turns:
                raise NothingToExport("this session has no turns yet: nothing to trace")
            text = json.dumps(trace(), indent=1)
        try:
            atomic_write(target, text)
        except OSError as e:
            raise ExportFailed(f"could not export to {target}: {e}") from e
        return target


def fork_notice(parent: Session, child: Session, index: int | None) -> str:
    """What a fork tells the user: where it branched, and that its prefix comes from the cache by reference."""
    at = "" if index is None else f" after #{parent.number_of(index) or 0}"
    if child.token_ids:
        return (f"forked{at}: the branch starts from the parent's {len(child.token_ids)} tokens, taken from the cache "
                "by reference (nothing is copied or computed again)")
    return (f"forked{at}: the branch's next turn takes what it shares with the parent from the cache (nothing is "
            "copied) and computes only the rest")
