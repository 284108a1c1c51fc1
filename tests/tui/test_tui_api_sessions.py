"""The workstation's API server: `--serve` starts it on the TUI's engine; each conversation an API client (the
official `openai` and `anthropic` clients here) holds with it shows as a live `⇄` session with its streaming reply and
per-turn reuse; its next turn finds the same session; the dashboard counts API and local sessions; `/serve stop`
stops it; a port in use is an error notification, not a crash."""
from __future__ import annotations

import asyncio
import socket
import threading

import anthropic
import openai

from tests.tui.helpers import chat_screen, engine_stats, say, text_of, wait_until
from tsterm.tui import TstermApp
from tsterm.tui.widgets.chat_log import MessageView
from tsterm.tui.widgets.session_list import SessionList

SIZE = (160, 45)  # wide: the dashboard is open


def notifications(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


def api_sessions(screen) -> list:
    return [s for s in screen.sessions.values() if s.kind == "api"]


async def serving(pilot):
    app = pilot.app
    await wait_until(pilot, lambda: app.api_server is not None, what="the API server")
    return app.api_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


async def test_an_api_conversation_is_a_live_session_and_its_next_turn_reuses_the_prefix(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12), serve={"port": 0})
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        local = screen.session
        server = await serving(pilot)
        api = client(server)
        assert server.model_name == "tiny" and "API http://127.0.0.1:" in text_of(screen.query_one("#status"))
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about paris"}]
        first = await asyncio.to_thread(api.chat.completions.create, model="tiny", messages=messages,
                                        max_tokens=10, temperature=0)
        [session] = await wait_until(pilot, lambda: [s for s in api_sessions(screen) if s.turns]
                                     and not screen.api_busy and api_sessions(screen), what="the API session")
        assert session.title == "tell me about paris" and screen.current_id == local.id  # shown, not switched to
        assert session.messages == [*messages, {"role": "assistant", "content": first.choices[0].message.content}]
        option = screen.query_one(SessionList).get_option(session.id)
        assert "⇄" in str(option.prompt) and "⇄" not in str(screen.query_one(SessionList).get_option(local.id).prompt)
        counts = text_of(screen.dashboard.query_one("#session-counts"))
        assert "1 local · 1 api" in counts and server.url in counts

        # the client's next turn: its whole history again, plus a new message -> the same session, prefix reused
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and rome?"}]
        second = await asyncio.to_thread(api.chat.completions.create, model="tiny", messages=messages,
                                         max_tokens=10, temperature=0)
        await wait_until(pilot, lambda: len(session.turns) == 2 and not screen.api_busy, what="turn 2")
        assert len(api_sessions(screen)) == 1
        turn = session.turns[1]
        assert turn.cached_tokens == second.usage.prompt_tokens_details.cached_tokens > 0
        assert turn.prompt_tokens == second.usage.prompt_tokens and turn.kept_tokens >= session.turns[0].prompt_tokens
        assert session.token_ids[:turn.prompt_tokens] == list(session.token_ids[:turn.prompt_tokens])

        # shown while it streams: the reply grows in the log, the sidebar marks the session busy
        await screen.show_session(session.id)
        assert [v.role for v in screen.chat_log.query(MessageView) if v.role != "assistant"] == ["system", "user",
                                                                                                "user"]
        messages += [{"role": "assistant", "content": second.choices[0].message.content},
                     {"role": "user", "content": "count to a hundred"}]

        def stream() -> str:
            chunks = api.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        app.api_observer.interval = 0.0  # every token shows (the tiny model outruns the 15 Hz throttle)
        hold, step, steps = threading.Event(), app.host.engine.step, []

        def held_step():  # the engine stops after a few tokens until the test has seen them stream
            steps.append(1)
            if len(steps) > 8:
                hold.wait()
            return step()
        app.host.engine.step = held_step
        streamed = asyncio.ensure_future(asyncio.to_thread(stream))
        try:
            live = await wait_until(pilot, lambda: screen.api_reply is not None and screen.api_reply.text
                                    and screen.api_reply, what="the live reply")
            assert session.id in screen.busy and screen.query(".-live")
        finally:
            hold.set()
        text = await streamed
        await wait_until(pilot, lambda: len(session.turns) == 3 and not screen.api_busy, what="turn 3")
        assert session.messages[-1] == {"role": "assistant", "content": text} and session.turns[2].cached_tokens > 0
        replies = await wait_until(pilot, lambda: (views := [v for v in screen.chat_log.query(MessageView)
                                                             if v.role == "assistant"]) and len(views) == 3 and views,
                                   what="the log re-rendered with the finished reply")
        assert " · cached " in text_of(replies[-1].query_one(".turn-stats")) and not live.is_attached
        assert replies[-1].text == text  # the finished reply replaces the live one

        # typing into it is refused (it is the client's); a fork is a local chat on the same ids
        await say(pilot, "hello?", wait_turn=False)
        assert len(session.turns) == 3 and "API client" in screen.chat_log.query(MessageView).last().text
        await pilot.press("ctrl+b")
        await wait_until(pilot, lambda: screen.session.parent_id == session.id, what="the fork")
        assert screen.session.kind == "chat" and screen.session.token_ids == session.token_ids
        stats = await engine_stats(app)
        assert stats["used"] == 0 and stats["running"] == 0


async def test_anthropic_clients_leaving_clients_and_stopping_the_server(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=12), serve={"port": 0})
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        server = await serving(pilot)
        claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0)
        reply = await asyncio.to_thread(claude.messages.create, model="tiny", max_tokens=8,
                                        messages=[{"role": "user", "content": "hi from claude code"}])
        [session] = await wait_until(pilot, lambda: [s for s in api_sessions(screen) if s.turns], what="a session")
        assert session.messages[-1] == {"role": "assistant", "content": reply.content[0].text}

        def leave() -> None:  # a client that reads two chunks of a long reply, then hangs up
            chunks = client(server).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "a long story"}], max_tokens=2000,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            for i, _ in enumerate(chunks):
                if i == 2:
                    break
            chunks.close()

        await asyncio.to_thread(leave)
        await wait_until(pilot, lambda: len(api_sessions(screen)) == 2 and not screen.api_busy, what="the cut one")
        cut = next(s for s in api_sessions(screen) if s.id != session.id)
        assert cut.title == "a long story" and cut.turns[0].finish_reason == "abort"
        await wait_until(pilot, lambda: any("client left" in n for n in notifications(app)), what="the notice")
        stats = await engine_stats(app)
        assert stats["used"] == 0 and stats["running"] == 0  # its blocks were freed at once

        url = server.url
        await say(pilot, "/serve stop")
        await wait_until(pilot, lambda: app.api_server is None and not app._server_busy, what="the stop")
        try:
            await asyncio.to_thread(client(server).models.list)
            raise AssertionError(f"{url} still answers")
        except openai.APIConnectionError:
            pass
        assert "API server off" in text_of(screen.dashboard.query_one("#session-counts"))


async def test_a_port_in_use_is_a_notification_and_the_workstation_goes_on(make_profile, data_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = TstermApp(make_profile(max_tokens=4), serve={"port": port})
        async with app.run_test(size=SIZE) as pilot:
            await chat_screen(pilot)
            await wait_until(pilot, lambda: any("cannot listen" in n for n in notifications(app)),
                             what="the bind error")
            assert app.api_server is None and not app._server_busy
            assert any(f"127.0.0.1:{port}" in n for n in notifications(app))
