"""A worker that dies or hangs mid-generation ends the run with a DistributedError naming the rank, within the
configured bound; the engine then refuses further steps with the same error instead of waiting on the dead rank."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tsterm import LLM, SamplingParams
from tsterm.errors import DistributedError

from tests.helpers.checkpoints import make_checkpoint

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("faults") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    return path


@pytest.mark.parametrize("fault, message", [
    (signal.SIGKILL, r"worker rank 1 \(pid \d+\) was killed by signal 9"),
    (signal.SIGSTOP, rf"worker rank 1 \(pid \d+\) is stopped and did not answer within {TIMEOUT_S:g} s"),
])
def test_a_failed_worker_ends_the_run_with_a_clear_error_in_bounded_time(checkpoint, fault, message):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S)
    worker = llm.engine.executor.processes[0]
    struck = []

    def strike(out):
        if len(out.token_ids) == 3 and not struck:  # mid-generation: the worker has answered a few steps
            os.kill(worker.pid, fault)
            struck.append(time.monotonic())

    try:
        with pytest.raises(DistributedError, match=message):
            llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         on_output=strike)
        elapsed = time.monotonic() - struck[0]
        assert elapsed < TIMEOUT_S + 3.0
        with pytest.raises(DistributedError, match=message):  # failed for good, at once
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        assert not worker.is_alive()  # the executor stopped it (a stopped one too)
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        llm.engine.shutdown()


GUARD_S = 120.0  # a bound far past the watch's, on waits that the watch must end


def hang_rank0_collectives(executor, strike):
    """Make rank 0's collectives behave as NCCL's do when a peer is gone: the wait never raises and never ends until
    the groups are aborted (an aborted NCCL communicator ends its kernels). `strike()` runs as rank 0 enters the
    first of them, while the worker waits in its own half of the same collective."""
    groups, struck, released = executor.groups, [], []

    def all_reduce_all(tensor):
        if not struck:
            struck.append(strike())
        released.append(groups.aborted.wait(GUARD_S))

    executor.runner.par.all_reduce_all = all_reduce_all
    return released


@pytest.mark.parametrize("fault, how, message", [
    (signal.SIGKILL, "exited", r"worker rank 1 \(pid \d+\) was killed by signal 9"),
    (signal.SIGSTOP, "no heartbeat", rf"worker rank 1 \(pid \d+\) is stopped and did not answer within {TIMEOUT_S:g} s"),
])
def test_the_watch_ends_a_collective_that_would_never_return(checkpoint, fault, how, message):
    # expert parallel: rank 0's only collective is the experts' all-reduce, which this test makes hang
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              expert_parallel_size=2, distributed_timeout_s=TIMEOUT_S)
    executor = llm.engine.executor
    worker = executor.processes[0]
    released = []

    def arm(out):
        if len(out.token_ids) == 3 and not released:  # mid-generation
            released.append(hang_rank0_collectives(executor, lambda: os.kill(worker.pid, fault)))

    try:
        with pytest.raises(DistributedError, match=message):
            llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         on_output=arm)
        assert released[0] and all(released[0])  # the watch's abort ended the hung wait, not the guard
        assert executor.watch.dead == (1, how)  # found by the process's end, or by its missing heartbeat
        assert not worker.is_alive()
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        llm.engine.shutdown()


def test_a_worker_that_dies_while_the_engine_is_idle_fails_the_next_call_at_once(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S)
    executor = llm.engine.executor
    worker = executor.processes[0]
    try:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        os.kill(worker.pid, signal.SIGKILL)
        assert executor.watch.failed.wait(GUARD_S)  # no collective running: the watch alone sees it
        assert executor.groups.aborted.is_set()
        with pytest.raises(DistributedError, match=r"failed between steps: worker rank 1 \(pid \d+\) was killed"):
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    finally:
        llm.engine.shutdown()
