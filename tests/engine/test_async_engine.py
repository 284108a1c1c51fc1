"""AsyncEngine under failure: cancellation during add, a delivery that raises, a failed step, the thread dying,
shutdown with streams pending, a call the engine thread cannot answer.

Every test is sequenced by events, never by sleeping: an engine method is wrapped to block on an Event or to raise
at a chosen call. Waits carry a generous timeout only as a safety net, so a broken AsyncEngine fails instead of
hanging the suite.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from tsterm import LLM, SamplingParams
from tsterm.convert.demo import SPECS, make_random_moe
from tsterm.engine.async_engine import AsyncEngine
from tsterm.errors import EngineStepError, EngineStoppedError, EngineTimeoutError

SAFETY = 300  # seconds: a hang guard, generous for a busy machine; only a broken implementation waits this long
PROMPT_A, PROMPT_B = [10 + i for i in range(12)], [300 + i for i in range(9)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random_moe(tmp_path_factory.mktemp("demo") / "tiny", SPECS["tiny"])


@pytest.fixture
def engine(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128).engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def collect(agen) -> list:
    return [out async for out in agen]


def released(engine) -> tuple[dict, bool, int]:
    """What must be left after a request is gone: no request, nothing to step, no KV block in use."""
    return dict(engine.requests), engine.has_unfinished(), engine.stats()["used"]


def hold_steps(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make every engine step wait for `release`; `in_step` is set once the engine thread is inside one."""
    in_step, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        in_step.set()
        assert release.wait(SAFETY)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    return in_step, release


async def test_cancelled_while_the_engine_thread_adds_it_leaves_nothing_behind(engine, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    add_request = engine.add_request

    def slow_add(*args, **kwargs):
        entered.set()
        assert release.wait(SAFETY)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)
    async_engine = AsyncEngine(engine)
    try:
        task = asyncio.create_task(collect(async_engine.generate(PROMPT_A, greedy(100), request_id="cancelled")))
        assert await asyncio.to_thread(entered.wait, SAFETY)  # the engine thread is inside add_request now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        # Commands run in order: the add, the abort posted by the cancellation, then this call.
        assert await asyncio.to_thread(async_engine._call, lambda: released(engine)) == ({}, False, 0)
        assert not async_engine._streams
    finally:
        release.set()
        async_engine.shutdown()


async def test_cancelled_before_the_engine_thread_took_the_add_never_adds_it(engine, monkeypatch):
    in_step, release = hold_steps(engine, monkeypatch)
    async_engine = AsyncEngine(engine)
    try:
        running = asyncio.create_task(collect(async_engine.generate(PROMPT_A, greedy(3))))
        assert await asyncio.to_thread(in_step.wait, SAFETY)  # the engine thread is inside a step
        added = []
        monkeypatch.setattr(engine, "add_request", lambda *a, **k: added.append(a))
        task = asyncio.create_task(collect(async_engine.generate(PROMPT_B, greedy(3))))
        await asyncio.sleep(0)  # its add command is queued behind the step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert len((await asyncio.wait_for(running, SAFETY))[-1].token_ids) == 3
        assert await asyncio.to_thread(async_engine._call, lambda: released(engine)) == ({}, False, 0)
        assert added == []
    finally:
        release.set()
        async_engine.shutdown()


async def test_a_cancel_that_lands_as_an_output_arrives_is_not_swallowed(engine, monkeypatch):
    release, step, steps = threading.Event(), engine.step, []

    def gated_step():  # after the first token the engine waits: the consumer waits on an empty queue
        steps.append(1)
        if len(steps) == 2:
            assert release.wait(SAFETY)
        return step()

    monkeypatch.setattr(engine, "step", gated_step)
    async_engine = AsyncEngine(engine)
    streamed, outputs = asyncio.Event(), []

    async def consume():
        async for out in async_engine.generate(PROMPT_A, greedy(20), request_id="r"):
            outputs.append(out)
            streamed.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(streamed.wait(), SAFETY)  # the consumer is now waiting for its second output
        async_engine._streams["r"].queue.put_nowait(outputs[0])  # an output arrives, and in the same loop turn
        task.cancel()  # the consumer is cancelled (asyncio.wait_for before 3.12 returns the output instead)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, SAFETY)
        release.set()
        assert await asyncio.to_thread(async_engine._call, lambda: released(engine)) == ({}, False, 0)
    finally:
        release.set()
        async_engine.shutdown()


def test_a_request_whose_delivery_raises_is_aborted_and_the_thread_serves_on(engine, monkeypatch):
    loop_closed, orphan_aborted = threading.Event(), threading.Event()
    step, abort, steps = engine.step, engine.abort, []

    def gated_step():  # the orphan's second token waits until its consumer's loop is closed
        steps.append(1)
        if len(steps) == 2:
            assert loop_closed.wait(SAFETY)
        return step()

    def watched_abort(request_id):
        if request_id == "orphan":
            orphan_aborted.set()
        return abort(request_id)

    monkeypatch.setattr(engine, "step", gated_step)
    monkeypatch.setattr(engine, "abort", watched_abort)
    async_engine = AsyncEngine(engine)
    orphan_loop = asyncio.new_event_loop()
    orphan = async_engine.generate(PROMPT_A, greedy(100), request_id="orphan")
    try:
        first = orphan_loop.run_until_complete(orphan.__anext__())
        assert first.request_id == "orphan" and not first.finished
        orphan_loop.close()  # the consumer is gone: delivering to it raises RuntimeError('Event loop is closed')
        loop_closed.set()
        assert orphan_aborted.wait(SAFETY), "the failed delivery did not abort the request"
        outs = asyncio.run(asyncio.wait_for(collect(async_engine.generate(PROMPT_B, greedy(5))), SAFETY))
        assert outs[-1].finished and len(outs[-1].token_ids) == 5
        assert async_engine._call(lambda: released(engine)) == ({}, False, 0)
    finally:
        loop_closed.set()
        async_engine.shutdown()

        async def close_orphan():  # closed here, so the closed loop's async-generator finalizer never runs
            await orphan.aclose()
        asyncio.run(close_orphan())


async def test_a_failed_step_fails_the_requests_in_flight_and_the_thread_serves_on(engine, monkeypatch):
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    async_engine = AsyncEngine(engine)
    try:
        with pytest.raises(EngineStepError, match="step failed .RuntimeError: kernel exploded") as failed:
            await asyncio.wait_for(collect(async_engine.generate(PROMPT_A, greedy(10))), SAFETY)
        assert isinstance(failed.value.__cause__, RuntimeError)
        outs = await asyncio.wait_for(collect(async_engine.generate(PROMPT_B, greedy(4))), SAFETY)
        assert len(outs[-1].token_ids) == 4
        assert await asyncio.to_thread(async_engine._call, lambda: released(engine)) == ({}, False, 0)
    finally:
        async_engine.shutdown()


async def test_shutdown_fails_every_pending_stream_with_a_clear_error(engine, monkeypatch):
    step, seen = engine.step, set()

    def step_until_both_streamed():  # then no more progress: both requests are still pending at shutdown
        if seen >= {"a", "b"}:
            threading.Event().wait(0.001)
            return []
        outs = step()
        seen.update(out.request_id for out in outs)
        return outs

    monkeypatch.setattr(engine, "step", step_until_both_streamed)
    async_engine = AsyncEngine(engine)
    first = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def consume(request_id, prompt):
        async for _ in async_engine.generate(prompt, greedy(100), request_id=request_id):
            first[request_id].set()

    tasks = [asyncio.create_task(consume("a", PROMPT_A)), asyncio.create_task(consume("b", PROMPT_B))]
    try:
        await asyncio.wait_for(asyncio.gather(first["a"].wait(), first["b"].wait()), SAFETY)
        await asyncio.to_thread(async_engine.shutdown)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY)
    finally:
        async_engine.shutdown()
    for result in results:
        assert isinstance(result, EngineStoppedError) and "shut down" in str(result)
    assert released(engine) == ({}, False, 0)  # the engine thread aborted them on its way out
    with pytest.raises(EngineStoppedError, match="shut down"):
        await collect(async_engine.generate(PROMPT_A, greedy(2)))
    with pytest.raises(EngineStoppedError, match="shut down"):
        async_engine.stats()


async def test_the_engine_thread_dying_fails_pending_streams(engine, monkeypatch):
    has_unfinished, streamed = engine.has_unfinished, threading.Event()
    step = engine.step

    def noting_step():
        outs = step()
        streamed.set()
        return outs

    def dying_has_unfinished():
        if streamed.is_set():
            raise MemoryError("out of memory")
        return has_unfinished()

    monkeypatch.setattr(engine, "step", noting_step)
    monkeypatch.setattr(engine, "has_unfinished", dying_has_unfinished)
    async_engine = AsyncEngine(engine)
    try:
        with pytest.raises(EngineStoppedError, match=r"unexpected error \(MemoryError: out of memory\)"):
            await asyncio.wait_for(collect(async_engine.generate(PROMPT_A, greedy(50))), SAFETY)
        with pytest.raises(EngineStoppedError, match="unexpected error"):
            await collect(async_engine.generate(PROMPT_B, greedy(2)))
    finally:
        async_engine.shutdown()
    assert not engine.requests  # aborted on the thread's way out


async def test_a_call_the_engine_thread_cannot_answer_times_out(engine, monkeypatch):
    in_step, release = hold_steps(engine, monkeypatch)
    async_engine = AsyncEngine(engine)
    try:
        task = asyncio.create_task(collect(async_engine.generate(PROMPT_A, greedy(2))))
        assert await asyncio.to_thread(in_step.wait, SAFETY)
        async_engine.call_timeout = 0.2
        with pytest.raises(EngineTimeoutError, match="did not answer within 0.2 s"):
            await asyncio.to_thread(async_engine.stats)
        release.set()
        assert len((await asyncio.wait_for(task, SAFETY))[-1].token_ids) == 2
        assert (await asyncio.to_thread(async_engine.stats))["used"] == 0  # the timed-out call did no harm
    finally:
        release.set()
        async_engine.shutdown()


async def test_pin_and_unpin_run_on_the_engine_thread(engine):
    aengine = AsyncEngine(engine, call_timeout=SAFETY)
    try:
        [*_, last] = await collect(aengine.generate(PROMPT_A, greedy(6)))
        full = PROMPT_A + last.token_ids
        threads = []
        pin = engine.pin

        def pin_on_engine_thread(*args, **kwargs):
            threads.append(threading.current_thread())
            return pin(*args, **kwargs)

        engine.pin = pin_on_engine_thread
        result = await asyncio.to_thread(aengine.pin, full, 60.0, "agent:x")
        assert threads == [aengine._thread]
        assert result.pin_id == "agent:x" and result.num_tokens == (len(full) - 1) // 4 * 4
        assert aengine.stats()["pinned_blocks"] == result.num_blocks > 0
        assert await asyncio.to_thread(aengine.unpin, "agent:x") is True
        assert aengine.stats()["pinned_blocks"] == 0
        assert await asyncio.to_thread(aengine.unpin, "agent:x") is False
    finally:
        aengine.shutdown()
