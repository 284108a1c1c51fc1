"""Stored Responses API responses (`store: true`, OpenAI's default), for `GET /v1/responses/{id}` and for a next
request's `previous_response_id`.

A stored response is a tsterm chat Session: the conversation it ended (its instructions as a leading system message,
its input, its reply) with the exact token ids the engine saw and produced (prompt + generated ids), kept as the
session's kept ids. A request continuing it appends only the template's text for its new input to those ids
(`Session.plan` under the `preserve` history policy), so the earlier turns are neither rendered nor tokenised again
and the prefix cache serves all of them.

The store is bounded: at most `max_responses` entries (the oldest go first), each forgotten `ttl_s` after it was made
(0 for either keeps none). Entries belong to an owner (`conversations.owner_of` of the API key the request
presented): another key's response is as unknown as a missing one. Every method runs on the server's event loop;
`len` may be read from another thread. A stored session is never changed after `put` (a request plans on a copy).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tsterm.chat.session import Session


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    body: dict[str, Any]  # the response object as the client received it
    session: Session  # the conversation through the reply, with its exact ids as kept ids
    instructions: str | None  # the request's `instructions` (the session's leading system message when not None)
    created: float  # clock time it was stored


class ResponseStore:
    """The stored responses, at most `max_responses`, none older than `ttl_s` (0 for either: keep none)."""

    def __init__(self, max_responses: int = 64, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic):
        if max_responses < 0 or ttl_s < 0:
            raise ValueError("max_responses and ttl_s must be >= 0")
        self.max_responses, self.ttl_s, self.clock = max_responses, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def keeps(self) -> bool:
        """Whether anything is kept at all (a bound of 0 keeps none)."""
        return self.max_responses > 0 and self.ttl_s > 0

    def put(self, response_id: str, owner: str, body: dict[str, Any], session: Session,
            instructions: str | None) -> bool:
        """Store a response; False when the bounds keep none."""
        if not self.keeps:
            return False
        self._entries[response_id] = StoredResponse(owner, body, session, instructions, self.clock())
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)
        self._expire()
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """`owner`'s response `response_id`, or None (never stored, dropped by a bound, deleted, or another's)."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if now - entry.created < self.ttl_s:
                return
            del self._entries[response_id]
