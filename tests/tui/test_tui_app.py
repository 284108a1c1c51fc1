"""The TUI against a real engine on a tiny random Qwen3-MoE: streaming, reuse, fork, concurrency, abort, restore."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from tests.tui.helpers import (
    chat_screen,
    engine_stats,
    next_message,
    palette,
    say,
    text_of,
    turns_done,
    wait_until,
)
from tsterm import LLM, SamplingParams
from tsterm.chat.plan import PromptPlan
from tsterm.engine.async_engine import AsyncEngine
from tsterm.errors import RequestError
from tsterm.tui import engine_host
from tsterm.tui.messages import TurnFinished, TurnProgress
from tsterm.tui import TstermApp
from tsterm.tui.screens.dialogs import Confirm, TextPrompt
from tsterm.tui.screens.loading import LoadingScreen
from tsterm.tui.thinking import split_thinking
from tsterm.tui.widgets.chat_log import MessageView
from tsterm.tui.widgets.prompt_input import PromptInput
from tsterm.tui.widgets.session_list import SessionList

SIZE = (120, 40)


async def test_message_streams_a_reply_from_an_injected_engine(tiny_checkpoint, make_profile, data_dir, monkeypatch):
    monkeypatch.setattr(engine_host, "PROGRESS_INTERVAL", 0.0)  # every token: the tiny model is faster than 15 Hz
    built = []

    def factory(progress):
        built.append(threading.current_thread())
        return LLM(str(tiny_checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256,
                   progress=progress)

    app = TstermApp(make_profile(max_tokens=40), engine_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert built, "the injected factory built the engine"
        # on a thread of its own that has ended: its OpenMP pool does not outlive the load (see _on_own_thread)
        assert built[0].name == "tsterm-load" and not built[0].is_alive()
        session = screen.session
        assert session.system_prompt == "you are a test"  # from the profile
        permits, step, free = threading.Semaphore(0), app.host.engine.step, threading.Event()

        def step_when_permitted():  # one token per permit: each partial reply is seen before the next token
            if not free.is_set():
                permits.acquire()
            return step()
        app.host.engine.step = step_when_permitted
        try:
            await say(pilot, "hello there")
            reply = await wait_until(pilot, lambda: screen.live_reply, what="a live reply")
            for updates in (1, 2):  # seen mid-stream: the reply updates while its turn is still running
                permits.release()
                await wait_until(pilot, lambda: reply.num_updates >= updates and session.id in screen.turns,
                                 what=f"partial reply {updates}")
        finally:
            free.set()
            permits.release()  # the engine thread may be waiting for one
        await turns_done(pilot, session, 1)
        assert reply.num_updates >= 3  # at least two partial updates before the final one
        turn = session.turns[0]
        assert turn.generated_tokens == 40 and turn.finish_reason == "length" and turn.ttft is not None
        assert session.messages[-1]["role"] == "assistant"
        assert reply.text == split_thinking(session.messages[-1]["content"]).answer
        assert "prompt" in text_of(reply.query_one(".turn-stats")) and "-live" not in reply.classes
        roles = [v.role for v in screen.query(MessageView)]
        assert roles == ["system", "user"]  # + the finished ReplyView
        saved = json.loads((data_dir / "sessions" / f"{session.id}.json").read_text())
        assert saved["token_ids"] == session.token_ids and len(saved["token_ids"]) == turn.prompt_tokens + 40


@pytest.mark.parametrize("uptime", [5.0, 30 * 86400.0])
async def test_streaming_progress_is_throttled_and_the_final_text_still_arrives(tiny_checkpoint, monkeypatch, uptime):
    # time.monotonic() counts from boot: the first progress must post on a machine up for less than the interval too
    start = time.monotonic()
    monkeypatch.setattr(engine_host, "time", SimpleNamespace(monotonic=lambda: uptime + time.monotonic() - start))
    monkeypatch.setattr(engine_host, "PROGRESS_INTERVAL", 3600.0)
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    host = engine_host.EngineHost(AsyncEngine(llm.engine),
                                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    posted = []
    try:
        await host.stream_turn("s", PromptPlan([5, 6, 7], kept_tokens=0), "s/0", posted.append)
    finally:
        host.shutdown()
    progress, finished = posted[:-1], posted[-1]
    assert len(progress) == 1 and isinstance(progress[0], TurnProgress)  # the first token, then none for an hour
    assert isinstance(finished, TurnFinished) and len(finished.token_ids) == 12 and finished.stats is not None


async def test_second_turn_reuses_the_prefix_and_the_dashboard_shows_it(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, session, 1)
        first_ids = list(session.token_ids)
        await say(pilot, "tell me more")
        await turns_done(pilot, session, 2)
        second = session.turns[1]
        assert second.cached_tokens > 0  # the engine's num_cached_tokens: blocks taken by reference
        assert second.new_tokens == second.prompt_tokens - second.cached_tokens
        if not second.miss:
            assert second.kept_tokens == len(first_ids)
        else:  # random weights can emit ids that re-tokenise differently: reported, never silent
            assert second.diverged_at is not None and second.diverged_at >= session.turns[0].prompt_tokens - 1

        await pilot.press("ctrl+t")
        assert screen.has_class("-dashboard")
        dashboard = screen.dashboard
        await wait_until(pilot, lambda: dashboard.latest.get("prefix_hit_tokens", 0) >= second.cached_tokens,
                         what="a stats poll after turn 2")
        row = await wait_until(pilot, lambda: next((line for line in text_of(dashboard.query_one("#reuse")).splitlines()
                                                     if line.split()[:1] == ["2"]), None), what="turn 2's reuse row")
        assert row.split()[1:3] == [str(second.prompt_tokens), str(second.cached_tokens)]
        assert dashboard.last_turn is second
        assert "by reference" in text_of(dashboard.query_one("#copies"))
        assert "blocks" in text_of(dashboard.query_one("#kv-counts"))


async def test_fork_shares_blocks_and_two_sessions_generate_at_once(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=1500))  # long replies: they overlap even on a slow machine
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        parent = screen.session
        await say(pilot, "hello")
        await wait_until(pilot, lambda: len(screen.turns.get(parent.id, ()).token_ids) >= 8, what="8 tokens")
        screen.action_abort()
        await turns_done(pilot, parent, 1)

        await pilot.press("ctrl+b")
        fork = screen.session
        assert fork.id != parent.id and fork.parent_id == parent.id
        assert fork.token_ids == parent.token_ids and fork.messages == parent.messages
        await say(pilot, "from the fork")
        await screen.show_session(parent.id)
        await say(pilot, "from the parent")

        while True:  # re-read on each message (the replies' progress): one batch, the fork's blocks shared
            stats = await engine_stats(app)
            if stats["running"] == 2 and stats["shared"] > 0:
                break
            assert set(screen.turns) == {fork.id, parent.id}, "a reply ended before the other began"
            await next_message(pilot)
        assert "2 generating" in text_of(screen.query_one("#status"))
        screen.action_abort()
        await screen.show_session(fork.id)
        screen.action_abort()
        await turns_done(pilot, parent, 2)
        await turns_done(pilot, fork, 2)  # the fork carries its parent's first turn with that reply
        assert fork.turns[0] == parent.turns[0] and fork.turns[0] is not parent.turns[0]
        assert fork.turns[1].cached_tokens > 0  # the fork's own first turn hit the parent's prefix
        assert fork.turns[1].generated_tokens > 0 and parent.turns[1].generated_tokens > 0
        stats = await engine_stats(app)  # queued on the engine thread behind both aborts, which free the blocks
        assert stats["running"] == 0 and stats["used"] == 0 and stats["shared"] == 0


async def test_escape_aborts_the_running_generation(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=1500))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "write a long story")
        await wait_until(pilot, lambda: session.id in screen.turns and len(screen.turns[session.id].text) > 3,
                         what="some streamed text")
        during = await engine_stats(app)
        assert during["running"] == 1 and during["used"] > 0
        await pilot.press("escape")
        await turns_done(pilot, session, 1)
        turn = session.turns[0]
        assert turn.finish_reason == "abort" and 0 < turn.generated_tokens < 1500
        assert session.messages[-1]["role"] == "assistant"
        stats = await engine_stats(app)  # the engine thread answers after the abort, which freed the blocks
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used"] == 0
        assert "aborted" in text_of(screen.query(".-assistant .role").last())
        await pilot.press("escape")  # nothing left to abort: a notice, no error
        await say(pilot, "still usable")  # the session takes the next turn (aborted again, via the action)
        await wait_until(pilot, lambda: session.id in screen.turns and screen.turns[session.id].text,
                         what="the next reply")
        screen.action_abort()
        await turns_done(pilot, session, 2)
        assert session.turns[1].finish_reason == "abort" and session.turns[1].cached_tokens > 0


async def test_restart_restores_sessions_and_history(make_profile, data_dir):
    profile = make_profile(max_tokens=8)
    app = TstermApp(profile)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        first = screen.session
        await say(pilot, "remember me")
        await turns_done(pilot, first, 1)
        await say(pilot, "/rename kept")
        await say(pilot, "/new second")
        second = screen.session
        saved = {s.id: (s.title, list(s.messages), list(s.token_ids)) for s in screen.sessions.values()}
    assert first.title == "kept" and second.title == "second"

    app = TstermApp(profile)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        restored = {s.id: (s.title, s.messages, s.token_ids) for s in screen.sessions.values()}
        assert restored == saved
        assert screen.current_id == second.id  # the most recently touched one
        await screen.show_session(first.id)
        assert [v.role for v in screen.query(MessageView)] == ["system", "user", "assistant"]
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        await pilot.press("up")
        assert prompt.value == "/new second"
        await pilot.press("up", "up")
        assert prompt.value == "remember me"
        await pilot.press("down", "down", "down")
        assert prompt.value == ""
        await say(pilot, "continue")  # the restored exact ids are reused by the next turn
        await turns_done(pilot, screen.session, 2)
        turn = screen.session.turns[1]
        assert turn.kept_tokens == len(saved[first.id][2]) or turn.miss


async def test_quitting_mid_reply_keeps_the_partial_reply(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=1500))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "a long one")
        await wait_until(pilot, lambda: session.id in screen.turns and len(screen.turns[session.id].token_ids) > 3,
                         what="some tokens")
    saved = json.loads((data_dir / "sessions" / f"{session.id}.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]
    turn = saved["turns"][-1]
    assert turn["finish_reason"] == "abort" and 3 < turn["generated_tokens"] < 1500
    assert len(saved["token_ids"]) == turn["prompt_tokens"] + turn["generated_tokens"]
    assert not app.host.async_engine._thread.is_alive()  # the engine thread stopped with the app


async def test_a_failed_turn_leaves_the_session_intact(make_profile, data_dir, monkeypatch):
    app = TstermApp(make_profile(max_tokens=2))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "short")
        await turns_done(pilot, session, 1)
        before = (list(session.messages), list(session.token_ids))
        generate = app.host.async_engine.generate

        def refuse_once(*args, **kwargs):  # the engine refuses the request (as it does a prompt it cannot hold)
            monkeypatch.setattr(app.host.async_engine, "generate", generate)
            raise RequestError("the engine refused this request")

        monkeypatch.setattr(app.host.async_engine, "generate", refuse_once)
        await say(pilot, "this one fails", wait_turn=False)
        await wait_until(pilot, lambda: screen.query(MessageView).last().role == "error", what="the error notice")
        assert (session.messages, session.token_ids) == before
        assert "the engine refused this request" in screen.query(MessageView).last().text
        await say(pilot, "/clear")  # the session still works: the engine rejected only that request
        await say(pilot, "ok")
        await turns_done(pilot, session, 1)
        assert session.turns[0].generated_tokens == 2


def load_agent_trace_steps(path) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["format"] == "tsterm-agent-trace" and "hi" not in path.read_text()
    return data["steps"]


async def test_commands_palette_and_dialogs(make_profile, data_dir, tmp_path):
    app = TstermApp(make_profile(max_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "/help")
        assert "/export md|json|trace [PATH]" in screen.query(MessageView).last().text
        await say(pilot, "/bogus")
        assert screen.query(MessageView).last().role == "error"
        await say(pilot, "/system be terse")
        assert session.system_prompt == "be terse"
        await say(pilot, "hi")
        await turns_done(pilot, session, 1)
        await say(pilot, f"/export md {tmp_path / 'out.md'}")
        await say(pilot, f"/export json {tmp_path / 'out.json'}")
        await say(pilot, "/export trace")  # for `tsterm bench --trace`: token counts per turn, no text
        trace = load_agent_trace_steps(data_dir / "exports" / f"{session.id}.trace.json")
        assert trace == [{"prompt_tokens": session.turns[0].prompt_tokens, "kept_tokens": 0, "cached_tokens":
                          session.turns[0].cached_tokens, "generated_tokens": 6, "tool_latency_s": []}]
        assert "## user\n\nhi" in (tmp_path / "out.md").read_text()
        assert json.loads((tmp_path / "out.json").read_text())["token_ids"] == session.token_ids
        await say(pilot, "/export md")  # no path: the exports folder of the data dir
        assert (data_dir / "exports" / f"{session.id}.md").read_text() == (tmp_path / "out.md").read_text()
        was_open = screen.has_class("-dashboard")
        await say(pilot, "/stats")
        assert screen.has_class("-dashboard") != was_open
        await say(pilot, "/clear")
        assert session.messages == [{"role": "system", "content": "be terse"}] and session.token_ids == []

        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: isinstance(app.screen, TextPrompt), what="the rename dialog")
        app.screen.query_one("#dialog-input").value = "renamed"
        await pilot.press("enter")
        await wait_until(pilot, lambda: session.title == "renamed", what="the rename")

        await say(pilot, "/new other")
        other = await wait_until(pilot, lambda: screen.session.title == "other" and screen.session, what="/new")
        sidebar = screen.query_one(SessionList)
        sidebar.focus()
        sidebar.highlighted = list(screen.sessions).index(session.id)
        await pilot.press("enter")  # pick a session in the sidebar
        assert screen.current_id == session.id and screen.query_one(PromptInput).has_focus
        assert other.id in screen.sessions

        count = len(screen.sessions)
        await palette(pilot, "fork session")
        await wait_until(pilot, lambda: len(screen.sessions) == count + 1, what="a fork from the palette")
        forked = screen.session
        assert forked.parent_id == session.id

        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, Confirm), what="the delete dialog")
        await pilot.press("y")
        await wait_until(pilot, lambda: forked.id not in screen.sessions, what="the delete")
        assert not (data_dir / "sessions" / f"{forked.id}.json").exists()


async def test_load_failure_is_shown_not_fatal(tmp_path, data_dir):
    profile = tmp_path / "bad.yaml"
    profile.write_text(f"model: {tmp_path / 'missing'}\ndevice: cpu\n")
    app = TstermApp(str(profile))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen)
                                  and app.screen.has_class("-failed") and app.screen, what="the load error")
        assert "does not exist" in text_of(screen.query_one("#loading-error"))
        await pilot.press("r")  # retry: fails the same way, the app stays up
        await wait_until(pilot, lambda: screen.has_class("-failed"), what="the second failure")
        assert app.is_running


async def test_layout_fits_80x24_and_200x60(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await chat_screen(pilot)

        def shown(selector: str) -> bool:
            widget = screen.query_one(selector)
            region = widget.region
            return widget.display and region.width > 0 and region.height > 0 and screen.region.contains_region(region)

        def footer_fits() -> bool:  # every key on screen, none scrolled out of the footer's view
            keys, footer = list(screen.query("FooterKey")), screen.query_one("Footer")
            return (len(keys) >= 9 and footer.max_scroll_x == 0
                    and all(k.region.right <= screen.region.right and k.region.width > 0 for k in keys))

        await say(pilot, "hi")
        await turns_done(pilot, screen.session, 1)
        await wait_until(pilot, footer_fits, what="the footer laid out")  # recomposed as bindings change
        assert all(shown(s) for s in ("#sessions", "#log", "#status", "#prompt"))
        assert not screen.query_one("#dashboard").display
        assert screen.query_one("#prompt").region.height == 3

        await pilot.press("ctrl+t")  # narrow: the dashboard takes the sidebar's place
        await pilot.pause()
        assert shown("#dashboard") and not screen.query_one("#sidebar").display
        assert screen.query_one("#log").region.width >= 30

        await pilot.resize_terminal(200, 60)
        await pilot.pause()
        await wait_until(pilot, footer_fits, what="the footer laid out")
        assert all(shown(s) for s in ("#sessions", "#log", "#dashboard", "#prompt", "#kv-bar"))
        assert screen.query_one("#log").region.width >= 100
