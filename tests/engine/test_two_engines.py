"""Two engines in one process (the TUI and a server, the TUI switching profiles, one engine per rank) share
nothing: stepping at the same time on two threads, or on different kernels, each gives exactly what it gives alone."""
from __future__ import annotations

import threading

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_engines")
    moe, _ = make_checkpoint(root / "qwen3_moe", "qwen3_moe",
                             dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    shared, _ = make_checkpoint(root / "qwen2_moe", "qwen2_moe",
                                dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                     num_hidden_layers=2), seed=1)
    return moe, shared


def workload(seed: int) -> tuple[list[list[int]], SamplingParams]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(8, 380, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    return prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


def run(llm: LLM, seed: int, rounds: int = 1) -> list[tuple[list[int], list[float]]]:
    """`rounds` batches of the seed's workload (prefills, decodes, prefix hits from round 2 on)."""
    prompts, params = workload(seed)
    results = []
    for _ in range(rounds):
        for out in llm.generate(prompts, params):
            results.append((out.token_ids, [lp["logprob"] for lp in out.outputs[0].logprobs]))
    return results


def in_threads(*jobs):
    """Run the jobs on one thread each, started together; re-raise the first error."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def target(i, job):
        try:
            start.wait()
            results[i] = job()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_two_engines_stepping_at_once_on_two_threads_give_what_each_gives_alone(checkpoints):
    moe_dir, shared_dir = checkpoints
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    alone_a = run(LLM(str(moe_dir), **options), seed=1, rounds=3)
    alone_b = run(LLM(str(shared_dir), **options), seed=2, rounds=3)
    a, b = LLM(str(moe_dir), **options), LLM(str(shared_dir), **options)  # fresh: the same prefix-cache history

    together_a, together_b = in_threads(lambda: run(a, seed=1, rounds=3), lambda: run(b, seed=2, rounds=3))

    assert together_a == alone_a  # exactly: token ids and logprobs, bit for bit
    assert together_b == alone_b
    assert a.stats()["prefix_hit_tokens"] > 0 and b.stats()["prefix_hit_tokens"] > 0


def test_two_engines_on_different_kernels_in_one_process(checkpoints):
    """One engine on the torch twins, one on the Triton kernels (interpreted), interleaved: neither switches the
    other's kernels, and each matches a fresh engine of its own kind."""
    moe_dir, _ = checkpoints
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    torch_llm = LLM(str(moe_dir), kernels="torch", **options)
    triton_llm = LLM(str(moe_dir), kernels="triton", **options)  # built second: the last one loaded
    assert (torch_llm.engine.executor.kernels, triton_llm.engine.executor.kernels) == ("torch", "triton")

    got_torch, got_triton = in_threads(lambda: run(torch_llm, seed=3), lambda: run(triton_llm, seed=3))

    assert got_torch == run(LLM(str(moe_dir), kernels="torch", **options), seed=3)
    assert got_triton == run(LLM(str(moe_dir), kernels="triton", **options), seed=3)
    assert [ids for ids, _ in got_torch] == [ids for ids, _ in got_triton]  # same model, same greedy tokens
