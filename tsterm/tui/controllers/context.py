"""A chat that outgrows its context: the status line shows how full it is, a notice comes once it passes `WARN_AT`,
and a message that no longer fits opens a choice - drop the oldest exchanges (the system prompt stays), continue in
a new chat carrying the last ones, or cancel - with the message kept in the prompt either way.

`ContextBudget` does the arithmetic and owns which sessions were warned already; the screen shows the notice and the
dialog and carries out the choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tsterm.chat.session import Session

WARN_AT = 0.8  # of the context: one notice per session past this
REPLY_ROOM = 32  # tokens a reply needs at least: a prompt leaving less is "full" (its reply would be cut at once)


class TooLong(ValueError):
    """The message does not fit even with only the system prompt before it."""


@dataclass(frozen=True)
class WayOut:
    """How a message that did not fit can: drop the `drop` oldest exchanges, or carry the last `keep` into a new
    chat; either way the prompt then has `after` tokens."""

    drop: int
    keep: int
    after: int
    summary: str
    drop_text: str
    new_text: str


class ContextBudget:
    """`host`: the engine host (its context length, sampling, tokenizer and chat template, read when needed)."""

    def __init__(self, host: Any):
        self.host = host
        self.warned: set[str] = set()  # sessions told that their context is filling up

    @property
    def limit(self) -> int:
        return self.host.info.max_model_len

    def reply_room(self) -> int:
        return min(REPLY_ROOM, self.host.sampling.max_tokens, self.limit // 4)

    def fits(self, prompt_tokens: int) -> bool:
        return prompt_tokens + self.reply_room() <= self.limit

    def prompt_tokens(self, messages: list[dict]) -> int:
        return len(self.host.tokenizer.encode(self.host.render(messages)))

    def filling(self, session: Session) -> str | None:
        """The notice for a session past WARN_AT of the context, the first time it gets there; else None."""
        used, limit = len(session.token_ids), self.limit
        if used < WARN_AT * limit or session.id in self.warned:
            return None
        self.warned.add(session.id)
        return (f"{session.title} uses {used * 100 // limit}% of the context ({used} of {limit} tokens). When a "
                "message no longer fits, you can drop the oldest exchanges or continue in a new chat.")

    def way_out(self, session: Session, text: str, prompt_tokens: int) -> WayOut:
        """`text` did not fit (`prompt_tokens` with it): the fewest oldest exchanges to drop so that it does.
        Raises TooLong when even dropping them all would not do."""
        limit, user = self.limit, [{"role": "user", "content": text}]
        exchanges = session.exchanges()
        system = session.messages[:exchanges[0][0]] if exchanges else list(session.messages)
        drop, after = None, 0
        for count in range(1, len(exchanges) + 1):
            rest = session.messages[exchanges[count - 1][1]:]
            after = self.prompt_tokens(system + rest + user)
            if self.fits(after):
                drop = count
                break
        if drop is None:
            raise TooLong(f"your message is too long for this model's context: with only the system prompt it needs "
                          f"{after or prompt_tokens} tokens, and the context holds {limit} (with room for a reply). "
                          "Shorten it (it is still in the prompt).")
        keep = len(exchanges) - drop
        return WayOut(
            drop, keep, after,
            summary=(f"Your message does not fit: with it this chat has {prompt_tokens} tokens, and the context holds "
                     f"{limit} (with room for a reply)."),
            drop_text=(f"Drop oldest: forget the first {drop} exchange(s) of this chat (the system prompt stays). The "
                       f"chat then starts differently, so this turn computes all {after} prompt tokens again instead "
                       "of reusing them; later turns reuse as before."),
            new_text=(f"New chat: continue in a new chat with the system prompt and the last {keep} exchange(s); this "
                      f"chat stays as it is. Its first turn computes {after} tokens."))
