"""Helpers for driving the TUI under Pilot."""
from __future__ import annotations

import asyncio
import time

from textual.css.query import NoMatches

from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.widgets.prompt_input import PromptInput


async def wait_until(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    """Let the app run until `predicate()` is truthy; fail after `timeout` seconds.

    A predicate that finds no widget counts as not yet: the app may be between taking a view down and mounting
    its replacement (a failed turn re-renders the whole chat log)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except NoMatches:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def engine_stats(app) -> dict:
    return await asyncio.to_thread(app.host.async_engine.stats)


async def chat_screen(pilot) -> ChatScreen:
    screen = await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen) and pilot.app.screen,
                              what="the chat screen")
    await wait_until(pilot, lambda: screen.current_id and screen.live_reply is None, what="the session shown")
    return screen


async def say(pilot, text: str, wait_turn: bool = True) -> None:
    """Submit `text`; for a message, return once its turn has started (or already ended)."""
    screen = pilot.app.screen
    session, done_before = screen.session, len(screen.session.turns)
    prompt = screen.query_one(PromptInput)
    prompt.focus()
    prompt.value = text
    # Submit without pilot.press: a key press waits for the process to go idle, i.e. for the whole reply.
    await prompt.action_submit()
    await wait_until(pilot, lambda: prompt.value == "", what=f"{text!r} submitted")
    if text.startswith("/"):
        await pilot.pause()  # until idle: the command's effects (new views, a switched session) are in place
    elif wait_turn:
        await wait_until(pilot, lambda: session.id in screen.turns or len(session.turns) > done_before,
                         what=f"the turn of {text!r}")


async def turns_done(pilot, session, n: int, timeout: float = 30.0) -> None:
    screen = pilot.app.screen
    await wait_until(pilot, lambda: len(session.turns) >= n and session.id not in screen.turns
                     and not screen.query(".-live"), timeout, what=f"turn {n} of {session.title!r}")


def text_of(widget) -> str:
    return str(widget.render())
