"""The engine core in its own process (tsterm/engine/core_process.py) against the same engine in this process.

Outputs are compared field by field with AsyncEngine's on the same requests (both engines are deterministic and
batch-invariant); the behaviours every front promises (a bad request fails its stream only, leaving early aborts,
calls between steps) run in both modes; the process-only failures (a failed step, a killed core, a load that fails
or dies, shutdown with streams pending, the front dying) are each provoked for real. Waits are on events: a stream's
next output, a call's answer, a process's exit (a pidfd); SAFETY only turns a hang into a failure.
"""
from __future__ import annotations

import asyncio
import functools
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.helpers import core_builds
from tsterm import LLM, SamplingParams
from tsterm.convert.demo import SPECS, make_random_moe
from tsterm.engine.async_engine import AsyncEngine
from tsterm.engine.core_process import EngineCoreProcess
from tsterm.engine.stats import EngineMetrics
from tsterm.errors import EngineStepError, EngineStoppedError, ModelLoadError, RequestError

SAFETY = 300
PROMPT_A, PROMPT_B = [10 + i for i in range(12)], [300 + i for i in range(9)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_random_moe(tmp_path_factory.mktemp("demo") / "tiny", SPECS["tiny"]))


@pytest.fixture(scope="module")
def core(tiny_dir):
    front = EngineCoreProcess(functools.partial(core_builds.tiny, tiny_dir))
    yield front
    front.shutdown()


@pytest.fixture(params=["thread", "process"])
def front(request, tiny_dir):
    """The engine behind AsyncEngine's API in this process, or in its own."""
    if request.param == "thread":
        engine = LLM(tiny_dir, **core_builds.OPTIONS).engine
        made = AsyncEngine(engine)
    else:
        made = EngineCoreProcess(functools.partial(core_builds.tiny, tiny_dir))
    yield made
    made.shutdown()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def collect(agen) -> list:
    return [out async for out in agen]


def idle(front) -> tuple[int, int, int]:
    s = front.stats()
    return s["running"], s["waiting"], s["used"]


def view(out) -> tuple:
    """Everything a consumer reads of an output, but its timings."""
    m = out.metrics
    return (out.request_id, list(out.prompt_token_ids), out.num_cached_tokens, out.finished, out.outputs,
            (m.num_prompt_tokens, m.num_cached_tokens, m.num_generated_tokens, m.num_preemptions,
             len(m.inter_token_latencies)))


REQUESTS = [
    (PROMPT_A, greedy(9, logprobs=2)),
    ("the capital of France is", SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=8,
                                                ignore_eos=True, logprobs=1)),
    (PROMPT_B, SamplingParams(temperature=0, max_tokens=12, stop=["e"], ignore_eos=True)),
    (PROMPT_A + [5, 6, 7, 8], greedy(5)),  # shares PROMPT_A's full blocks: served from the prefix cache
]


async def test_its_outputs_equal_the_in_process_engines_step_by_step(core, tiny_dir):
    inline = AsyncEngine(LLM(tiny_dir, **core_builds.OPTIONS).engine)
    try:
        for i, (prompt, params) in enumerate(REQUESTS):  # one at a time: the same steps in both engines
            there = await asyncio.wait_for(collect(core.generate(prompt, params, request_id=f"r{i}")), SAFETY)
            here = await asyncio.wait_for(collect(inline.generate(prompt, params, request_id=f"r{i}")), SAFETY)
            assert [view(o) for o in there] == [view(o) for o in here], f"request {i}"
            assert there[-1].finished and there[-1].outputs[0].token_ids
            assert "".join(o.outputs[0].delta_text for o in there) == there[-1].outputs[0].text
        assert there[-1].num_cached_tokens == 12  # the last one reused PROMPT_A's 3 full blocks
    finally:
        inline.shutdown()


async def test_a_bad_request_fails_its_stream_only_with_its_field(front):
    with pytest.raises(RequestError, match="outside the vocabulary") as bad:
        await asyncio.wait_for(collect(front.generate([5000], greedy(4))), SAFETY)
    assert bad.value.param == "prompt", bad.value
    outs = await asyncio.wait_for(collect(front.generate(PROMPT_B, greedy(4))), SAFETY)
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    first, second = await asyncio.wait_for(asyncio.gather(
        collect(front.generate(PROMPT_A, greedy(3), request_id="same")),
        collect(front.generate(PROMPT_B, greedy(3), request_id="same")), return_exceptions=True), SAFETY)
    assert first[-1].finished and isinstance(second, RequestError) and "already in use" in str(second)
    assert await asyncio.to_thread(idle, front) == (0, 0, 0)


async def test_leaving_early_and_abort_free_the_request(front):
    async for out in front.generate(PROMPT_A, greedy(400), request_id="left"):
        break  # the consumer leaves after its first output
    assert out.request_id == "left"
    seen, stream = [], front.generate(PROMPT_B, greedy(400), request_id="aborted")
    async for out in stream:
        seen.append(out)
        front.abort("aborted")  # ends the iteration without a final output
    assert len(seen) >= 1 and not seen[-1].finished
    assert await asyncio.to_thread(idle, front) == (0, 0, 0)
    outs = await asyncio.wait_for(collect(front.generate(PROMPT_B, greedy(3), request_id="aborted")), SAFETY)
    assert outs[-1].finished  # the id is free again


async def test_calls_between_steps_answer_as_the_engine_does(front):
    outs = await asyncio.wait_for(collect(front.generate(PROMPT_A + PROMPT_B, greedy(2))), SAFETY)
    prompt = outs[-1].prompt_token_ids
    pinned = await asyncio.to_thread(front.pin, prompt, 60.0, "session")
    assert (pinned.pin_id, pinned.num_blocks, pinned.num_tokens) == ("session", 5, 20)
    stats, metrics = await asyncio.to_thread(front.stats_and_metrics)
    assert stats["pinned_blocks"] == 5 and isinstance(metrics, EngineMetrics)
    stats, experts, ranks, memory = await asyncio.to_thread(front.dashboard)
    assert stats["generated_tokens"] == 2 and len(experts) == 4 and ranks is None  # tiny: 4 MoE layers
    assert memory["kind"] == "cpu" and memory["rss"] > 0
    assert await asyncio.to_thread(front.unpin, "session") is True
    assert await asyncio.to_thread(front.unpin, "session") is False
    assert front.info.max_model_len == 512 and front.info.device == "cpu" and front.info.dtype == "float32"
    assert front.tokenizer.encode("hello")  # the model's tokenizer, in this process


async def test_an_id_reused_right_after_its_abort_gets_only_its_own_outputs(tiny_dir, tmp_path):
    """The old request's outputs of the step in flight reach the front after the new stream under its id is
    registered: they are not the new request's."""
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    core = EngineCoreProcess(functools.partial(core_builds.gated_step, tiny_dir, str(fifo), 2))
    try:
        old = core.generate(PROMPT_A, greedy(400), request_id="same")
        assert (await asyncio.wait_for(old.__anext__(), SAFETY)).prompt_token_ids == PROMPT_A  # step 1 done
        core.abort("same")  # the core is in step 2, held at the gate: this waits behind it
        new = asyncio.ensure_future(collect(core.generate(PROMPT_B, greedy(3), request_id="same")))
        await asyncio.sleep(0)  # the new stream is registered and its add sent
        await asyncio.to_thread(fifo.write_bytes, b"x")  # step 2 ends: its output of the old request comes first
        outs = await asyncio.wait_for(new, SAFETY)
        assert all(out.prompt_token_ids == PROMPT_B for out in outs) and outs[-1].finished
        assert len(outs[-1].token_ids) == 3
        await old.aclose()
    finally:
        core.shutdown()


async def test_a_failed_step_fails_the_requests_in_flight_and_the_core_serves_on(tiny_dir):
    core = EngineCoreProcess(functools.partial(core_builds.failing_step, tiny_dir, 2))
    try:
        with pytest.raises(EngineStepError, match="step failed .RuntimeError: kernel exploded") as failed:
            await asyncio.wait_for(collect(core.generate(PROMPT_A, greedy(10))), SAFETY)
        assert isinstance(failed.value.__cause__, RuntimeError)
        outs = await asyncio.wait_for(collect(core.generate(PROMPT_B, greedy(4))), SAFETY)
        assert len(outs[-1].token_ids) == 4
        assert await asyncio.to_thread(idle, core) == (0, 0, 0)
    finally:
        core.shutdown()


async def test_a_killed_core_fails_the_pending_stream_and_every_later_call(tiny_dir):
    core = EngineCoreProcess(functools.partial(core_builds.tiny, tiny_dir))
    try:
        stream = core.generate(PROMPT_A, greedy(400))
        await asyncio.wait_for(stream.__anext__(), SAFETY)  # it is decoding
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(EngineStoppedError, match=r"exited unexpectedly \(exit code -9\)"):
            await asyncio.wait_for(collect(stream), SAFETY)
        with pytest.raises(EngineStoppedError, match="exit code -9"):
            await collect(core.generate(PROMPT_B, greedy(2)))
        with pytest.raises(EngineStoppedError, match="exit code -9"):
            core.stats()
    finally:
        core.shutdown()


def test_a_load_that_fails_raises_its_error_and_one_that_dies_names_its_exit_code(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        EngineCoreProcess(functools.partial(core_builds.tiny, str(tmp_path / "missing")))
    seen = []
    with pytest.raises(EngineStoppedError, match=r"exited while loading \(exit code 3\)"):
        EngineCoreProcess(functools.partial(core_builds.dying_load, 3), progress=lambda *a: seen.append(a))
    assert seen == [(0, 1, "weights")]  # the load's progress reached the front


async def test_shutdown_fails_the_pending_streams_and_ends_the_process(tiny_dir):
    core = EngineCoreProcess(functools.partial(core_builds.tiny, tiny_dir))
    stream = core.generate(PROMPT_A, greedy(400))
    await asyncio.wait_for(stream.__anext__(), SAFETY)
    await asyncio.to_thread(core.shutdown)
    with pytest.raises(EngineStoppedError, match="shut down"):
        await asyncio.wait_for(collect(stream), SAFETY)
    assert core._process.returncode == 0
    with pytest.raises(EngineStoppedError, match="shut down"):
        core.stats()


def test_the_core_ends_when_its_front_dies(tiny_dir, tmp_path):
    """A front killed without a shutdown (no atexit runs) leaves no core behind: the core reads the end of the pipe."""
    script = textwrap.dedent(f"""
        import functools, os, sys
        from tests.helpers import core_builds
        from tsterm.engine.core_process import EngineCoreProcess
        core = EngineCoreProcess(functools.partial(core_builds.tiny, {tiny_dir!r}))
        print(core.pid, flush=True)
        sys.stdin.read()  # until the test kills this process
    """)
    front = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, text=True)
    try:
        core_pid = int(front.stdout.readline())
        pidfd = os.pidfd_open(core_pid)
        front.kill()
        front.wait(SAFETY)
        readable, _, _ = select.select([pidfd], [], [], SAFETY)  # a pidfd turns readable when its process exits
        assert readable, "the core outlived its front"
        os.close(pidfd)
    finally:
        front.kill()
