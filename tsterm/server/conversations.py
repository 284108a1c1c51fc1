"""API conversations: the server keeps its recent chat conversations as chat Sessions with the exact ids the engine
computed (prompt + generated ids of each reply), so a client's next request continues them under the history policy
(tsterm/chat/history.py) instead of re-rendering its whole history.

An API client sends its whole history every turn. A request continues a stored conversation when its messages start
with the messages that conversation's kept ids stand for, compared as the model saw them, not byte for byte
(`message_key`): reasoning the client dropped or kept (`strip_reasoning` on both sides: Qwen3-style templates drop
it anyway), tool-call arguments re-serialised (compared as parsed JSON), whitespace around a content, tool-call ids
(clients renumber them) ignored. The longest such conversation wins; a request that continues none is rendered as
sent. Under `preserve` the prompt is the stored kept ids + the template's text for the client's new messages
(`Session.plan`), so a tool loop whose reasoning the template would drop is not computed again; under `template` it
is the template's rendering of the client's messages (the prefix cache still serves what it can).

The store is bounded (`ServerLimits.max_conversations` entries, each forgotten `conversation_ttl_s` after it was
last stored or continued) and keyed by the owner of a request (a digest of the API key it presented when the server
has one, and the OpenAI `user` field), so a client never continues another's conversation. Every method runs on the
server's event loop; planning runs on a worker thread over a copy of a stored session.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tsterm.chat.history import strip_reasoning
from tsterm.chat.session import Session

Key = tuple[Any, ...]


def _arguments(arguments: Any) -> str:
    """A tool call's arguments as canonical JSON (a string of JSON is parsed first: clients re-serialise them)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def message_key(message: Mapping[str, Any]) -> Key:
    """What of a message the continuation match compares: its role, its content without reasoning and surrounding
    whitespace, its name, and its tool calls' names and parsed arguments."""
    m = strip_reasoning(message)
    content = m.get("content")
    content = content.strip() if isinstance(content, str) else "" if content is None else \
        json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
    calls = []
    for call in m.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        calls.append((function.get("name"), _arguments(function.get("arguments", {}))))
    return (m.get("role"), content, m.get("name"), tuple(calls))


def _chain(keys: Sequence[Key]) -> list[str]:
    """Digests of every prefix of `keys`: out[k] stands for keys[:k]."""
    h, out = hashlib.sha256(), [hashlib.sha256().hexdigest()]
    for key in keys:
        h.update(json.dumps(key, ensure_ascii=False, default=str).encode())
        h.update(b"\0")
        out.append(h.copy().hexdigest())
    return out


def owner_of(api_key: str | None, user: str | None = None) -> str:
    """Whose conversations a request may continue: a digest of the API key it presented (never the key itself) and
    the client's `user` field."""
    return hashlib.sha256(f"{api_key or ''}\0{user or ''}".encode()).hexdigest()


@dataclass
class _Entry:
    owner: str
    session: Session
    digest: str  # of the keys of session.messages[:session.kept_messages]
    stored: float  # clock time it was stored or last continued


class ConversationStore:
    """The server's recent conversations, at most `max_conversations`, none older than `ttl_s` (0: keep none)."""

    def __init__(self, max_conversations: int = 64, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_conversations < 0 or ttl_s < 0:
            raise ValueError("max_conversations and ttl_s must be >= 0")
        self.max_conversations, self.ttl_s, self.clock = max_conversations, ttl_s, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently stored first
        self._by_digest: dict[tuple[str, str], set[str]] = {}
        self._next = 0

    def __len__(self) -> int:
        """Entries held (expired ones included until the next find or put): safe to read from another thread."""
        return len(self._entries)

    def find(self, owner: str, messages: Sequence[Mapping[str, Any]]) -> Session | None:
        """A copy of the stored session of `owner` that `messages` continue (they start with the messages its kept ids
        stand for, and add at least one), the one covering the most messages; None when there is none."""
        self._expire()
        if not self._entries:
            return None
        chain = _chain([message_key(m) for m in messages])
        for covered in range(len(messages) - 1, 0, -1):
            ids = self._by_digest.get((owner, chain[covered]))
            if ids:
                entry_id = max(ids, key=lambda i: self._entries[i].stored)
                entry = self._entries[entry_id]
                self._entries.move_to_end(entry_id)
                entry.stored = self.clock()
                return _copy(entry.session)
        return None

    def put(self, owner: str, session: Session) -> None:
        """Keep `session` (its kept ids and the messages they stand for) for `owner`'s next request."""
        if not session.kept_messages or not session.token_ids or self.max_conversations == 0 or self.ttl_s == 0:
            return
        digest = _chain([message_key(m) for m in session.messages[:session.kept_messages]])[-1]
        entry_id, self._next = str(self._next), self._next + 1
        self._entries[entry_id] = _Entry(owner, _copy(session), digest, self.clock())
        self._by_digest.setdefault((owner, digest), set()).add(entry_id)
        while len(self._entries) > self.max_conversations:
            self._drop(next(iter(self._entries)))
        self._expire()

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            entry_id, entry = next(iter(self._entries.items()))
            if now - entry.stored < self.ttl_s:
                return
            self._drop(entry_id)

    def _drop(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id)
        ids = self._by_digest.get((entry.owner, entry.digest))
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self._by_digest[(entry.owner, entry.digest)]


def _copy(session: Session) -> Session:
    """A session a request may change (its messages and ids lists are its own)."""
    copy = Session(id=session.id, title=session.title, messages=[dict(m) for m in session.messages],
                   model=session.model, kind=session.kind)
    copy.token_ids, copy.kept_messages = list(session.token_ids), session.kept_messages
    copy.kept_digest, copy.kept_context = session.kept_digest, session.kept_context
    return copy
