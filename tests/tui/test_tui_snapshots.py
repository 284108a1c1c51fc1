"""Snapshots of the chat and dashboard screens at 80x24 and 200x60 (the format: tests/tui/snapshots.py).

What is real and what is pinned. The app runs the real engine on the tiny model with greedy decoding and fixed
prompts, so the replies, token counts, cache hits and misses, KV blocks, expert routing and step counts on screen
come from that run. Wall-clock values are pinned at their source (never painted over) before the capture:
- every turn's TTFT and inter-token latency (reply footers, the dashboard's latency lines): PINNED_TTFT/PINNED_ITL;
- the stats poller is stopped and the dashboard fed HISTORY + 1 polls at fixed times whose token counters follow
  DECODE/PREFILL_PER_POLL and end at the engine's real counters at rest: the tokens/s figures and sparklines;
- process memory: PINNED_MEMORY.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.tui.helpers import chat_screen, engine_stats, say, turns_done
from tests.tui.snapshots import compare, render_snapshot
from tsterm.tui import TstermApp
from tsterm.tui.widgets.dashboard import HISTORY
from tsterm.tui.widgets.prompt_input import PromptInput

SIZES = [(80, 24), (200, 60)]
PROMPTS = ("hello there", "tell me more")
PINNED_TTFT, PINNED_ITL = 0.020, 0.004
PINNED_MEMORY = {"kind": "cpu", "rss": 300 * 2**20}
POLL_INTERVAL = 0.25
DECODE_PER_POLL = [(5 * i) % 13 + 3 for i in range(HISTORY)]  # tokens decoded between two polls
PREFILL_PER_POLL = [48 if i % 12 == 5 else 0 for i in range(HISTORY)]


def feed_fixed_polls(dashboard, stats: dict, experts: list[list[int]]) -> None:
    """HISTORY + 1 polls (they replace the whole sparkline history) ending at the real counters `stats`."""
    generated = stats["generated_tokens"] - sum(DECODE_PER_POLL)
    prefilled = stats["prefill_tokens"] - sum(PREFILL_PER_POLL)
    dashboard.update_stats(dict(stats, generated_tokens=generated, prefill_tokens=prefilled), PINNED_MEMORY, 0.0)
    for i, (decoded, prefill) in enumerate(zip(DECODE_PER_POLL, PREFILL_PER_POLL, strict=True), 1):
        generated, prefilled = generated + decoded, prefilled + prefill
        dashboard.update_stats(dict(stats, generated_tokens=generated, prefill_tokens=prefilled), PINNED_MEMORY,
                               i * POLL_INTERVAL, experts)
    assert dashboard.latest["generated_tokens"] == stats["generated_tokens"]


async def settled_screen(pilot, dashboard: bool):
    """Two real turns, then the pinned clock; the dashboard shown or hidden; the prompt focused, not blinking."""
    app = pilot.app
    screen = await chat_screen(pilot)
    for n, prompt in enumerate(PROMPTS, 1):
        await say(pilot, prompt)
        await turns_done(pilot, screen.session, n)
    await asyncio.to_thread(app.host.stop_stats, True)
    await pilot.pause()  # a poll posted before the stop is handled now, not after the fixed ones
    for turn in screen.session.turns:
        turn.ttft, turn.mean_itl = PINNED_TTFT, PINNED_ITL
    experts = await asyncio.to_thread(app.host.async_engine.expert_load)
    feed_fixed_polls(screen.dashboard, await engine_stats(app), experts)
    await screen.show_session(screen.current_id)  # the reply footers, re-rendered with the pinned latencies
    if screen.has_class("-dashboard") != dashboard:
        await pilot.press("ctrl+t")
    screen.dashboard.redraw()
    screen.refresh_status()
    prompt = screen.query_one(PromptInput)
    prompt.focus()
    prompt.cursor_blink = False
    app.clear_notifications()
    await pilot.pause()
    return screen


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_chat_screen_snapshot(size, make_profile, data_dir, snapshot):
    app = TstermApp(make_profile(max_tokens=12))
    async with app.run_test(size=size) as pilot:
        screen = await settled_screen(pilot, dashboard=False)
        assert not screen.query_one("#dashboard").display
        snapshot(app, f"chat_{size[0]}x{size[1]}", "chat screen after two turns")


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_dashboard_screen_snapshot(size, make_profile, data_dir, snapshot):
    app = TstermApp(make_profile(max_tokens=12))
    async with app.run_test(size=size) as pilot:
        screen = await settled_screen(pilot, dashboard=True)
        assert screen.query_one("#dashboard").display
        snapshot(app, f"dashboard_{size[0]}x{size[1]}", "dashboard after two turns")


async def test_a_changed_screen_fails_with_a_readable_diff(make_profile, data_dir):
    """The comparison itself: a changed label is a text diff; a changed colour alone is a style diff."""
    app = TstermApp(make_profile(max_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await chat_screen(pilot)
        screen.query_one(PromptInput).cursor_blink = False  # a blinking cursor is a change too
        await asyncio.to_thread(app.host.stop_stats, True)  # no live poll may repaint the status line meanwhile
        await pilot.pause()
        before = render_snapshot(app, "before")
        assert compare(before, render_snapshot(app, "before"), "same") is None
        title = screen.query_one(".pane-title")
        title.update("SESSIONS")
        await pilot.pause()
        report = compare(before, render_snapshot(app, "before"), "label")
        assert "- sessions" in report and "+ SESSIONS" in report and "expected text" in report
        title.update("sessions")
        await pilot.pause()
        before = render_snapshot(app, "before")
        title.styles.text_style = "italic"
        await pilot.pause()
        report = compare(before, render_snapshot(app, "before"), "style")
        assert "expected styles" in report
        assert "-b  bold #a0a0a0 on #121212" in report and "+b  italic #a0a0a0 on #121212" in report
