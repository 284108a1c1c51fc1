"""A multi-rank engine in the workstation: the dashboard shows each rank's share of the routed tokens and its
resident memory (one process: no ranks section)."""
from __future__ import annotations

from tests.tui.helpers import chat_screen, say, text_of, turns_done, wait_until
from tsterm.tui import TstermApp

SIZE = (200, 60)


async def test_the_dashboard_shows_each_ranks_expert_share_and_memory(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=4), engine_options={"expert_parallel_size": 2})
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        assert app.host.engine.config.expert_parallel_size == 2  # the command line's option over the profile
        await say(pilot, "hello")
        await turns_done(pilot, screen.session, 1)
        ranks = screen.dashboard.query_one("#ranks")
        text = await wait_until(pilot, lambda: "rank 1" in text_of(ranks) and "%" in text_of(ranks)
                                and text_of(ranks), what="the ranks section")
        lines = text.splitlines()
        assert [line.split()[:2] for line in lines] == [["rank", "0"], ["rank", "1"]]
        shares = [float(line.split()[3].rstrip("%")) for line in lines]
        assert abs(sum(shares) - 100) < 0.2 and " MiB" in lines[1]


async def test_one_process_has_no_ranks_section(make_profile, data_dir):
    app = TstermApp(make_profile(max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        await wait_until(pilot, lambda: screen.dashboard.latest, what="a poll")
        assert not screen.dashboard.query_one("#ranks").display


async def test_a_dead_rank_is_named_and_the_chats_are_kept(make_profile, data_dir):
    import os
    import signal

    from tsterm.tui.widgets.chat_log import MessageView

    app = TstermApp(make_profile(max_tokens=4, distributed_timeout_s=5), engine_options={"expert_parallel_size": 2})
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        session = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, session, 1)
        before = list(session.messages)
        [worker] = app.host.engine.executor.processes
        os.kill(worker.pid, signal.SIGKILL)
        await say(pilot, "are you there?", wait_turn=False)
        error = await wait_until(pilot, lambda: (last := screen.chat_log.query(MessageView).last()).role == "error"
                                 and last.text, what="the failed turn")
        assert "rank 1" in error and "killed" in error
        assert session.messages == before  # the chat is kept as it was, on screen and in the store
        assert (data_dir / "sessions" / f"{session.id}.json").exists()
