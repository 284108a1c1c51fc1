"""Tensor parallelism over NCCL on real devices, as far as the machine's GPUs allow.

One GPU: the standard groups (`init_process_group` + `new_group`) with an NCCL world of one rank (created, used,
destroyed, created again), and the
distributed executor of one rank (NCCL data group, gloo control group, incremental block tables, the worker watch)
giving one GPU's greedy output. Two GPUs or more: TP=2 over NCCL gives one GPU's output, the workers' block tables
equal rank 0's, and a worker killed while rank 0 waits on NCCL (whose waits never raise) ends the run with a
DistributedError naming it.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest`, as scripts/gpu_check.sh does. Self-contained: no fixtures from conftest files. Float32
throughout, so tokens can be compared exactly.
"""
from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers.checkpoints import make_checkpoint
from tsterm import LLM, SamplingParams
from tsterm import llm as llm_module
from tsterm.distributed import DistributedExecutor
from tsterm.distributed.groups import Groups, connect_store
from tsterm.errors import DistributedError
from tsterm.model.parallel import ParallelLayout

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 over NCCL needs 2 CUDA devices")

OPTIONS = dict(dtype="float32", device="cuda", block_size=4, num_kv_blocks=256, distributed_timeout_s=60)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("nccl") / "qwen3_moe", "qwen3_moe",
                              {"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                               "max_position_embeddings": 512})
    return path


def workload(llm: LLM, on_output=None):
    prompts = [list(range(10, 31)), [5, 9, 200, 7], list(range(40, 49))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0, n=n)
              for m, n in ((24, 1), (16, 2), (9, 1))]
    return llm.generate(prompts, params, on_output=on_output)


def assert_same(got, want) -> None:
    for ours, theirs in zip(got, want, strict=True):
        for a, b in zip(ours.outputs, theirs.outputs, strict=True):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-3)


def test_nccl_groups_of_one_rank_are_created_used_and_destroyed():
    for _ in range(2):  # a process may start another engine once the first is gone
        store = connect_store("127.0.0.1", 0, 1, True, timedelta(seconds=30))
        groups = Groups(store, ParallelLayout(), torch.device("cuda", 0), timedelta(seconds=30))
        try:
            assert dist.get_backend(groups.world) == "nccl" and isinstance(groups.control, dist.ProcessGroupGloo)
            x = torch.arange(4.0, device="cuda")
            groups.world.allreduce([x]).wait()
            header = torch.tensor([7, 0])
            groups.control.broadcast([header], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize()
            assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and header.tolist() == [7, 0]
        finally:
            groups.close()
        assert not dist.is_initialized()


def test_the_distributed_executor_of_one_rank_gives_one_gpus_output(checkpoint, monkeypatch):
    want = workload(LLM(str(checkpoint), **OPTIONS))
    monkeypatch.setattr(llm_module, "executor_for", lambda config: DistributedExecutor)
    llm = LLM(str(checkpoint), **OPTIONS)
    try:
        assert isinstance(llm.engine.executor, DistributedExecutor)
        got = workload(llm)
        assert llm.stats()["control_bytes"] > 0
    finally:
        llm.engine.shutdown()
    assert_same(got, want)


@two_gpus
def test_tp2_over_nccl_gives_one_gpus_output_and_a_dead_worker_is_named(checkpoint):
    want = workload(LLM(str(checkpoint), **OPTIONS))
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **OPTIONS)
    executor = llm.engine.executor
    worker = executor.processes[0]
    checked = []

    def check_tables(out):
        if not checked:
            checked.append(executor.worker_block_tables() == [executor.block_tables()])

    def strike(out):
        if len(out.token_ids) == 3 and worker.is_alive():  # mid-generation, while rank 0 waits on NCCL
            os.kill(worker.pid, signal.SIGKILL)

    try:
        got = workload(llm, on_output=check_tables)
        assert checked == [True]
        with pytest.raises(DistributedError, match=r"worker rank 1 \(pid \d+\) was killed by signal 9"):
            llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         on_output=strike)
        assert executor.watch.dead == (1, "exited")
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        llm.engine.shutdown()
    assert_same(got, want)
