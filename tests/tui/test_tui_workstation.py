"""Fork from any message, copy a message, switch profiles, the expert heatmap: Pilot against the real engine."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

from textual.widgets import Collapsible

from tests.tui.helpers import (
    chat_screen,
    engine_stats,
    say,
    text_of,
    turns_done,
    wait_until,
)
from tsterm.tui import TstermApp, engine_host
from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.screens.loading import LoadingScreen
from tsterm.tui.widgets.chat_log import MessageView, Selectable
from tsterm.tui.widgets.expert_heatmap import ExpertHeatmap

SIZE = (120, 40)


def notifications(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


def save_thinking_session(data_dir) -> dict:
    """A saved session whose reply has a thinking block; the app opens it at start (the most recent)."""
    restored = {"id": "20250101-000000-abcdef", "title": "thinking", "messages": [
        {"role": "system", "content": "you are a test"}, {"role": "user", "content": "why?"},
        {"role": "assistant", "content": "<think>\nlet me see\n</think>\n\nbecause."}]}
    (data_dir / "sessions").mkdir(parents=True)
    (data_dir / "sessions" / f"{restored['id']}.json").write_text(json.dumps(restored))
    return restored


def reuse_row(dashboard, turn: int) -> list[str]:
    reuse = text_of(dashboard.query_one("#reuse"))
    return next(line.split() for line in reuse.splitlines() if line.split()[:1] == [str(turn)])


async def test_fork_from_an_earlier_message_shares_the_parent_blocks(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        parent = screen.session
        for n, text in enumerate(("hello", "tell me more"), 1):
            await say(pilot, text)
            await turns_done(pilot, parent, n)
        first = parent.turns[0]

        # Keyboard: select the last message, walk up to the first reply (#2), fork there.
        await pilot.press("ctrl+up")
        assert isinstance(app.focused, Selectable) and app.focused.number == 4
        await pilot.press("up", "up")
        assert app.focused.number == 2 and app.focused.role == "assistant" and screen.selected_index() == 2
        await pilot.press("f")
        fork = await wait_until(pilot, lambda: screen.session.id != parent.id and screen.session, what="the fork")
        assert fork.parent_id == parent.id and fork.messages == parent.messages[:3]
        # The exact ids through reply #2, unless the parent's second turn re-rendered them (a template miss: random
        # weights emit ids that re-tokenise differently); then the fork's next turn renders its history, and the
        # prefix cache still serves every block that rendering shares with the parent.
        exact = parent.token_ids[:first.prompt_tokens + first.generated_tokens]
        assert fork.token_ids == ([] if parent.turns[1].miss else exact)
        assert fork.turns == parent.turns[:1] and len(parent.messages) == 5  # the parent is untouched
        assert [v.number for v in screen.query(MessageView)] == [None, 1, 2]
        assert screen.query_one("#prompt").has_focus

        # The fork's first own turn is served from the parent's KV blocks (zero copy); the dashboard shows it.
        await pilot.press("ctrl+t")
        before, kept_ids = (await engine_stats(app))["prefix_hit_tokens"], list(fork.token_ids)
        await say(pilot, "a different question")
        await turns_done(pilot, fork, 2)
        turn = fork.turns[1]
        assert turn.cached_tokens >= 4 * (first.prompt_tokens // 4)  # every full block of the shared first prompt
        assert turn.kept_tokens == len(kept_ids) or turn.miss
        dashboard = screen.dashboard
        assert reuse_row(dashboard, 2)[1:3] == [str(turn.prompt_tokens), str(turn.cached_tokens)]
        await wait_until(pilot, lambda: dashboard.latest.get("prefix_hit_tokens", 0) >= before + turn.cached_tokens,
                         what="a stats poll after the fork's turn")
        await pilot.pause()
        copies = text_of(dashboard.query_one("#copies"))
        assert f"({dashboard.latest['prefix_hit_tokens']} cached tok)" in copies and "by reference 0 B" not in copies

        # /fork N: the same branch point by number; a number out of range is an error, nothing else changes.
        await screen.show_session(parent.id)
        await say(pilot, "/fork 2")
        again = screen.session
        assert again.id not in (parent.id, fork.id) and again.messages == fork.messages[:3]
        assert again.token_ids == kept_ids
        count = len(screen.sessions)
        await say(pilot, "/fork 9")
        assert screen.query(MessageView).last().role == "error" and "no message #9" in screen.query(
            MessageView).last().text
        assert len(screen.sessions) == count

        # Parent and fork generating together hold the shared prefix blocks twice: "shared" on the dashboard.
        app.host.sampling = dataclasses.replace(app.host.sampling, max_tokens=1500)
        await screen.show_session(fork.id)
        await say(pilot, "go on, fork")
        await screen.show_session(parent.id)
        await say(pilot, "go on, parent")

        def sharing() -> bool:
            s = dashboard.latest
            return s.get("running") == 2 and s.get("shared", 0) > 0

        await wait_until(pilot, sharing, what="both generating, sharing blocks")
        await pilot.pause()
        shared = dashboard.latest["shared"]
        assert f"shared {shared}" in text_of(dashboard.query_one("#kv-counts"))
        assert f"{shared} shared" in text_of(screen.query_one("#status"))
        screen.action_abort()
        await screen.show_session(fork.id)
        screen.action_abort()
        await turns_done(pilot, parent, 3)
        await turns_done(pilot, fork, 3)
        assert fork.turns[2].cached_tokens > 0 and parent.turns[2].cached_tokens > 0


async def test_copy_a_message_to_the_clipboard(make_profile, data_dir):
    restored = save_thinking_session(data_dir)
    app = TstermApp(make_profile(max_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert screen.current_id == restored["id"]
        await pilot.press("ctrl+y")  # from the prompt: the last reply, without its thinking block
        assert app.clipboard == "because."
        await say(pilot, "/copy 1")
        assert app.clipboard == "why?"

        await say(pilot, "hello")
        session = screen.session
        await turns_done(pilot, session, 1)
        reply = session.messages[-1]["content"]
        await pilot.press("ctrl+y")
        assert app.clipboard == reply and reply
        await pilot.press("shift+tab")  # select the last message, then walk up to "hello" (#3) and copy it
        assert app.focused.number == 4
        await pilot.press("up", "c")
        assert app.clipboard == "hello"
        await pilot.press("up", "up", "y")
        assert app.clipboard == "why?"
        await pilot.press("enter")  # back to the prompt
        assert screen.query_one("#prompt").has_focus
        await say(pilot, "/copy 9")
        assert "no message #9" in screen.query(MessageView).last().text and app.clipboard == "why?"

        await say(pilot, "/new")
        app.clear_notifications()
        await pilot.press("ctrl+y")  # nothing to copy: a notice, the clipboard unchanged
        assert app.clipboard == "why?" and any("no reply to copy" in n for n in notifications(app))


async def test_profile_ui_options_set_theme_dashboard_thinking_and_poll_rate(make_profile, data_dir, monkeypatch):
    save_thinking_session(data_dir)
    waits, waiting = [], threading.Event()

    class Recording(threading.Event):  # the stats poller's event: what it waits between two polls
        def wait(self, timeout=None):
            waits.append(timeout)
            waiting.set()
            return super().wait(timeout)
    post_init = engine_host.EngineHost.__post_init__

    def recording_post_init(host):
        post_init(host)
        host._stop_stats = Recording()
    monkeypatch.setattr(engine_host.EngineHost, "__post_init__", recording_post_init)
    ui = "{theme: nord, dashboard: hidden, thinking: expanded, stats_interval: 10}"
    app = TstermApp(make_profile(max_tokens=4, ui=ui))
    async with app.run_test(size=(200, 60)) as pilot:  # wide enough that `auto` would open the dashboard
        screen = await chat_screen(pilot)
        assert app.theme == "nord"
        assert not screen.has_class("-dashboard") and not screen.query_one("#dashboard").display
        box = screen.chat_log.query(MessageView).last().query_one(Collapsible)
        assert not box.collapsed and box.title == "thinking"
        await asyncio.to_thread(waiting.wait)  # the poller waits the profile's 10 s before its first poll
        assert waits == [10] and app.host.ui.stats_interval == 10 and screen.dashboard.latest == {}
    default = TstermApp(make_profile(max_tokens=4, name="plain"))
    async with default.run_test(size=(200, 60)) as pilot:
        screen = await chat_screen(pilot)
        assert default.theme == "textual-dark" and screen.query_one("#dashboard").display
        box = screen.chat_log.query(MessageView).last().query_one(Collapsible)
        assert box.collapsed
        await wait_until(pilot, lambda: screen.dashboard.latest, what="a poll at the default rate")


async def test_profile_switch_reloads_the_engine_and_keeps_the_sessions(make_profile, data_dir, tmp_path):
    first = make_profile(max_tokens=6, name="first")
    second = tmp_path / "second.yaml"  # the same tiny model, another pool size, system prompt and sampling
    second.write_text(f"extends: {first}\nnum_kv_blocks: 512\nsystem_prompt: you are the second\n"
                      "sampling:\n  max_tokens: 3\n")
    app = TstermApp(first)
    pushed = []
    push_screen = app.push_screen

    def record_push(screen, *args, **kwargs):
        pushed.append(screen)
        return push_screen(screen, *args, **kwargs)

    app.push_screen = record_push
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, session, 1)
        await say(pilot, "/new other")
        await screen.show_session(session.id)
        old = app.host
        old.sampling = dataclasses.replace(old.sampling, max_tokens=1500)
        # the long reply's steps wait until it is aborted: it is still running when /profile comes, however fast
        # the machine, and short enough that the next message still fits in the context
        held, step = threading.Event(), old.engine.step

        def held_step():
            assert held.wait(600), "the long reply was never aborted"
            return step()
        old.engine.step = held_step
        try:
            await say(pilot, "a long reply")
            await say(pilot, f"/profile {second}")  # not while a session generates: a warning, nothing reloads
            assert app.host is old and app.screen is screen and app.loading is None
            assert any("before switching profiles" in n for n in notifications(app))
            screen.action_abort()
        finally:
            old.engine.step = step
            held.set()
        await turns_done(pilot, session, 2)
        kept = (list(session.messages), list(session.token_ids))

        await say(pilot, f"/profile {second}")
        await wait_until(pilot, lambda: app.host is not old and isinstance(app.screen, ChatScreen)
                         and app.screen is not screen, what="the switched profile")
        new_screen = await chat_screen(pilot)
        assert [s.profile for s in pushed if isinstance(s, LoadingScreen)] == [first, str(second)]
        assert app.host.profile_name == "second" and app.host.engine.config.num_kv_blocks == 512
        await wait_until(pilot, lambda: not old.async_engine._thread.is_alive(), what="the old engine stopped")
        assert new_screen.current_id == session.id and len(new_screen.sessions) == 2
        assert (new_screen.session.messages, new_screen.session.token_ids) == kept  # same model: ids kept
        # App.notify posts a message: the notification lands on a later turn of the event loop
        await wait_until(pilot, lambda: any("profile switched" in n for n in notifications(app)),
                         what="the switch's notification")
        await say(pilot, "and now?")
        await turns_done(pilot, new_screen.session, 3)
        assert new_screen.session.turns[2].generated_tokens == 3  # the second profile's sampling
        assert (await engine_stats(app))["num_blocks"] == 512
        await say(pilot, "/new")
        assert new_screen.session.system_prompt == "you are the second"

        # Bad profiles: a notification naming the problem; the running engine and screen are untouched.
        host, app_screen = app.host, app.screen
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"extends: {first}\nnum_kv_blokcs: 64\n")
        for name, expected in [(str(tmp_path / "missing.yaml"), "missing.yaml"),
                               (str(bad), "bad.yaml:2: unknown key 'num_kv_blokcs'")]:
            app.clear_notifications()
            await say(pilot, f"/profile {name}")
            await wait_until(pilot, lambda: any("not loaded" in n for n in notifications(app)),
                             what=f"the error for {name}")
            error = next(n for n in notifications(app) if "not loaded" in n)
            assert expected in error, error
            assert app.host is host and app.screen is app_screen and app.loading is None
        assert "did you mean 'num_kv_blocks'" in error
        assert host.async_engine._thread.is_alive()
        await say(pilot, "still here")
        await turns_done(pilot, app_screen.session, 1)


async def test_dashboard_shows_the_expert_load_of_the_real_engine(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=6))
    async with app.run_test(size=(200, 60)) as pilot:
        screen = await chat_screen(pilot)
        await say(pilot, "hello")
        await turns_done(pilot, screen.session, 1)
        dashboard = screen.dashboard
        load = await asyncio.to_thread(app.host.async_engine.expert_load)
        await wait_until(pilot, lambda: dashboard.experts == load, what="a poll with the expert load")
        await pilot.pause()
        assert len(load) == 2 and all(len(layer) == 4 for layer in load)  # the tiny model: 2 layers x 4 experts
        assert sum(load[0]) == sum(load[1]) > 0  # every token is routed in every layer
        lines = str(dashboard.query_one(ExpertHeatmap).render()).splitlines()
        assert lines[0].split() == ["0", "1", "2", "3"]
        assert [line.split()[0] for line in lines[1:3]] == ["L0", "L1"] and lines[4].startswith("max/mean ")
