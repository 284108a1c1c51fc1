"""A multi-rank engine in the workstation: the dashboard shows each rank's share of the routed tokens and its
resident memory (one process: no ranks section); quitting ends the engine's worker processes, while an engine handed
to an EngineHost stays its owner's to shut down."""
from __future__ import annotations

import threading

from tests.tui.helpers import chat_screen, say, text_of, turns_done, wait_until
from tsterm.engine.async_engine import AsyncEngine
from tsterm import LLM
from tsterm.config import SamplingParams
from tsterm.tui import TstermApp
from tsterm.tui.engine_host import EngineHost

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
        workers = list(app.host.engine.executor.processes)
        assert workers and all(w.is_alive() for w in workers)
    # the app's host built the engine: quitting shut it down, workers included (not left to garbage collection)
    assert not any(w.is_alive() for w in workers)


def test_an_engine_handed_to_a_host_is_shut_down_by_its_owner(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              expert_parallel_size=2)
    workers = list(llm.engine.executor.processes)
    try:
        host = EngineHost(AsyncEngine(llm.engine), SamplingParams(max_tokens=2))
        host.shutdown()  # its AsyncEngine's thread ends; the engine is not the host's
        assert workers and all(w.is_alive() for w in workers)
    finally:
        llm.engine.shutdown()
    assert not any(w.is_alive() for w in workers)


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


def test_a_dashboard_poll_is_one_engine_call(tiny_checkpoint):
    """Each engine call waits for the engine thread between two steps: the poll asks for the counters, the expert
    load and the ranks at once (AsyncEngine.dashboard), not one after another."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    host = EngineHost(AsyncEngine(llm.engine), SamplingParams(max_tokens=2))
    real, calls, posted, polls = host.async_engine, [], threading.Event(), []

    class Recording:
        def __getattr__(self, name):
            if name in ("dashboard", "stats", "expert_load", "rank_stats"):
                calls.append(name)
            return getattr(real, name)

    host.async_engine = Recording()

    def post(message):
        polls.append(message)
        posted.set()
    try:
        host.start_stats(post, interval=0.01)
        posted.wait()
        host.stop_stats(wait=True)
    finally:
        real.shutdown()
        llm.engine.shutdown()
    update = polls[0]
    assert calls[:1] == ["dashboard"] and set(calls) == {"dashboard"}
    assert "kv_bytes_per_block" in update.stats and len(update.experts) == 2 and update.ranks is None
