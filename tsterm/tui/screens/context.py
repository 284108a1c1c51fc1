"""A chat that outgrows its context: the status line shows how full it is, a notice comes once it passes
`WARN_AT`, and a message that no longer fits opens a choice - drop the oldest exchanges (the system prompt stays),
continue in a new chat carrying the last ones, or cancel - with the message kept in the prompt either way.

A mixin, like SessionActions: it relies on the ChatScreen attributes (`session`, `host`, `send`, `add_session`,
`show_session`, `notice`, ...).
"""
from __future__ import annotations

from tsterm.chat.session import Session, new_session_id
from tsterm.tui.screens.dialogs import ContextFull
from tsterm.tui.widgets.prompt_input import PromptInput

WARN_AT = 0.8  # of the context: one notice per session past this
REPLY_ROOM = 32  # tokens a reply needs at least: a prompt leaving less is "full" (its reply would be cut at once)


class ContextLimits:
    @property
    def context_limit(self) -> int:
        return self.host.engine.max_model_len

    def reply_room(self) -> int:
        return min(REPLY_ROOM, self.host.sampling.max_tokens, self.context_limit // 4)

    def fits(self, prompt_tokens: int) -> bool:
        return prompt_tokens + self.reply_room() <= self.context_limit

    def prompt_tokens(self, messages: list[dict]) -> int:
        return len(self.host.tokenizer.encode(self.host.render(messages)))

    def warn_if_filling(self, session: Session) -> None:
        used, limit = len(session.token_ids), self.context_limit
        if used >= WARN_AT * limit and session.id not in self.context_warned:
            self.context_warned.add(session.id)
            self.notify(f"{session.title} uses {used * 100 // limit}% of the context ({used} of {limit} tokens). "
                        "When a message no longer fits, you can drop the oldest exchanges or continue in a new chat.",
                        title="context filling up", severity="warning", timeout=10)

    async def context_full(self, session: Session, text: str, prompt_tokens: int) -> None:
        """`text` did not fit (`prompt_tokens` with it): keep it in the prompt and offer the ways out."""
        prompt = self.query_one(PromptInput)
        prompt.value = text
        limit, user = self.context_limit, [{"role": "user", "content": text}]
        exchanges = session.exchanges()
        system = session.messages[:exchanges[0][0]] if exchanges else list(session.messages)
        drop, after = None, 0
        for count in range(1, len(exchanges) + 1):  # the fewest oldest exchanges to drop so that it fits
            rest = session.messages[exchanges[count - 1][1]:]
            after = self.prompt_tokens(system + rest + user)
            if self.fits(after):
                drop = count
                break
        if drop is None:
            await self.notice(f"your message is too long for this model's context: with only the system prompt it "
                              f"needs {after or prompt_tokens} tokens, and the context holds {limit} (with room for "
                              "a reply). Shorten it (it is still in the prompt).", "error")
            return
        keep = len(exchanges) - drop
        summary = (f"Your message does not fit: with it this chat has {prompt_tokens} tokens, and the context holds "
                   f"{limit} (with room for a reply).")
        drop_text = (f"Drop oldest: forget the first {drop} exchange(s) of this chat (the system prompt stays). The "
                     f"chat then starts differently, so this turn computes all {after} prompt tokens again instead of "
                     "reusing them; later turns reuse as before.")
        new_text = (f"New chat: continue in a new chat with the system prompt and the last {keep} exchange(s); this "
                    f"chat stays as it is. Its first turn computes {after} tokens.")

        async def chosen(choice: str | None) -> None:
            if choice is None:
                return
            prompt.value = ""
            if choice == "drop":
                session.drop_oldest(drop)
                self.save(session)
                await self.show_session(session.id)
            else:
                child = session.carry_over(new_session_id(), keep)
                self.add_session(child)
                await self.show_session(child.id)
            await self.send(text)

        await self.app.push_screen(ContextFull(summary, drop_text, new_text), chosen)
