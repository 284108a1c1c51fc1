"""Helpers for driving the TUI under Pilot.

Waits here wait on the app's messages, never on the clock: every change a test waits for reaches the app as a Message
(engine progress and turn ends, stats polls, workers' state changes, timers, refreshes), so each wait re-checks its
condition once the app has handled what woke it. No deadline ends a wait: one still waiting after HANG_S is reported
as a hang, and pytest-timeout (pyproject.toml) guards everything else.
"""
from __future__ import annotations

import asyncio
import weakref

from textual.app import App, ComposeResult
from textual.command import CommandList, CommandPalette
from textual.css.query import NoMatches

from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.widgets.prompt_input import PromptInput

# Not how a wait ends, only how a hang is reported (with what it waited for): below pytest-timeout's per-test limit.
HANG_S = 600.0
_dispatched: weakref.WeakKeyDictionary[App, asyncio.Event] = weakref.WeakKeyDictionary()


class Harness(App):
    """An app that shows only the given widgets (a widget's own tests)."""

    def __init__(self, *widgets):
        super().__init__()
        self.widgets = widgets

    def compose(self) -> ComposeResult:
        yield from self.widgets


def message_hook(app: App):
    """run_test's `message_hook` for `app` (tests/tui/conftest.py passes it to every app): wakes the waits below."""
    event = _dispatched.setdefault(app, asyncio.Event())
    return lambda message: event.set()


async def next_message(pilot) -> None:
    """Return once the app has dispatched another message and handled everything queued on its screen."""
    event = _dispatched[pilot.app]
    event.clear()
    await event.wait()
    await pilot.pause(0)  # the message's handler has run (pause(0) waits for the screen's queues, not the clock)


async def wait_until(pilot, predicate, what: str = "condition"):
    """Let the app run until `predicate()` is truthy, re-checking it after each message the app handles.

    A predicate that finds no widget counts as not yet: the app may be between taking a view down and mounting
    its replacement (a failed turn re-renders the whole chat log)."""
    async def until():
        await pilot.pause(0)
        while True:
            try:
                value = predicate()
            except NoMatches:
                value = None
            if value:
                return value
            await next_message(pilot)

    try:
        return await asyncio.wait_for(until(), HANG_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"hung: {HANG_S:g} s of the app's messages did not bring {what}") from None


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


async def palette(pilot, query: str) -> None:
    """Type `query` into the command palette and run the command it finds (its search runs on a worker)."""
    await pilot.press("ctrl+p")
    await pilot.press(*query)

    def found() -> bool:
        screen = pilot.app.screen
        if not isinstance(screen, CommandPalette):
            return False
        commands = screen.query_one(CommandList)
        top = None if commands.highlighted is None else commands.get_option_at_index(commands.highlighted)
        return top is not None and query.lower() in str(top.hit.text).lower()
    await wait_until(pilot, found, what=f"{query!r} in the palette")
    await pilot.press("enter")


async def turns_done(pilot, session, n: int) -> None:
    screen = pilot.app.screen
    await wait_until(pilot, lambda: len(session.turns) >= n and session.id not in screen.turns
                     and not screen.query(".-live"), what=f"turn {n} of {session.title!r}")


def text_of(widget) -> str:
    return str(widget.render())
