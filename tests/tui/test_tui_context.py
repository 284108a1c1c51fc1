"""A chat that outgrows its context is not a dead end: the status line counts it, a notice comes as it fills, and a
message that no longer fits opens a choice (drop the oldest exchanges, continue in a new chat, or cancel) with the
message kept in the prompt."""
from __future__ import annotations

from tests.tui.helpers import chat_screen, text_of, turns_done, wait_until
from tsterm.tui import TstermApp
from tsterm.tui.screens.dialogs import ContextFull
from tsterm.tui.widgets.prompt_input import PromptInput

SIZE = (120, 40)
MESSAGE = "tell me a story about the sea and the sky"


async def submit(pilot, text: str) -> None:
    """Submit `text` (not waiting for the prompt to clear: a message that does not fit stays in it)."""
    prompt = next(s for s in pilot.app.screen_stack if hasattr(s, "chat_log")).query_one(PromptInput)
    prompt.value = text
    await prompt.action_submit()
    await pilot.pause()


async def fill(pilot, screen, session) -> None:
    """Send MESSAGE until the dialog opens instead of a turn."""
    for turn in range(len(session.turns) + 1, 40):
        await submit(pilot, MESSAGE)
        done = await wait_until(pilot, lambda: "dialog" if isinstance(pilot.app.screen, ContextFull) else (
            len(session.turns) >= turn and session.id not in screen.turns and "reply"), what=f"turn {turn}")
        if done == "dialog":
            return
    raise AssertionError("the context never filled")


def notifications(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_a_full_context_offers_drop_new_chat_or_cancel_and_keeps_the_message(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12, max_model_len=128))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await fill(pilot, screen, session)
        dialog = pilot.app.screen
        turns, messages = len(session.turns), list(session.messages)
        assert "does not fit" in text_of(dialog.query_one(".approve-title")) and "holds 128" in dialog.summary
        assert "computes all" in dialog.drop and "the system prompt stays" in dialog.drop
        assert screen.query_one(PromptInput).value == MESSAGE  # kept
        assert any("context filling up" in n for n in notifications(app))
        assert f"/{128}" in text_of(screen.query_one("#status"))

        await pilot.press("escape")  # cancel: nothing changes, the message waits in the prompt
        await wait_until(pilot, lambda: not isinstance(app.screen, ContextFull), what="the dialog closed")
        assert session.messages == messages and screen.query_one(PromptInput).value == MESSAGE

        await submit(pilot, MESSAGE)  # again: this time drop the oldest exchanges
        await wait_until(pilot, lambda: isinstance(app.screen, ContextFull), what="the dialog again")
        await pilot.press("d")
        await turns_done(pilot, session, turns + 1)
        assert session.messages[0] == messages[0] and len(session.messages) < len(messages) + 2
        assert session.messages[-2] == {"role": "user", "content": MESSAGE} and not session.turns[-1].miss
        assert session.turns[-1].cached_tokens < session.turns[-1].prompt_tokens  # computed again, once
        assert screen.query_one(PromptInput).value == ""

        await fill(pilot, screen, session)  # and again: continue in a new chat
        kept = list(session.messages)
        await pilot.press("n")
        await wait_until(pilot, lambda: screen.session.id != session.id, what="the new chat")
        child = screen.session
        await turns_done(pilot, child, 1)
        assert session.messages == kept and child.parent_id == session.id and child.title.endswith("(continued)")
        assert child.messages[0]["role"] == "system" and child.messages[-2] == {"role": "user", "content": MESSAGE}
        assert child.messages[1:-2] == kept[len(kept) - (len(child.messages) - 3):]  # the last exchanges


async def test_a_message_too_long_for_any_history_is_an_error_and_stays_in_the_prompt(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12, max_model_len=64))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        text = " ".join(["word"] * 200)
        await submit(pilot, text)
        await wait_until(pilot, lambda: "too long for this model's context" in screen.chat_log.children[-1].text,
                         what="the error")
        assert screen.query_one(PromptInput).value == text and not screen.session.turns
        assert not isinstance(app.screen, ContextFull)
