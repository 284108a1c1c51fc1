"""Tensor and expert parallelism on gloo CPU ranks: the engine's process is rank 0, the others are worker processes.

Each layout runs the same greedy workload as one process on a tiny random checkpoint and must give the same tokens
and logprobs; a second turn that extends the first must be served from the prefix cache exactly as in one process.
Torch runs one thread per rank (the CI machine has two cores).
"""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4
OPTIONS = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=40, distributed_timeout_s=30)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    # Qwen3-MoE with a dense layer (mlp_only_layers) and an odd vocabulary (the last rank's LM-head rows are fewer)
    moe, _ = make_checkpoint(root / "qwen3_moe", "qwen3_moe",
                             dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, mlp_only_layers=[1],
                                  vocab_size=387))
    # Qwen2-MoE: q/k/v biases, a shared expert (split over all 4 ranks), one KV head for 2 tp ranks (replicated)
    shared, _ = make_checkpoint(root / "qwen2_moe", "qwen2_moe",
                                dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                     num_hidden_layers=2, num_key_value_heads=1), seed=1)
    return {"qwen3_moe": moe, "qwen2_moe": shared}


def turns(llm: LLM) -> list[tuple[list[int], list[float], int]]:
    """Two prompts batched, then a second turn extending the first conversation, then a fork (n=2: the samples
    share the prompt's blocks, the partial last one copied on write): (tokens, logprobs, cached) per completion."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    first = llm.generate([list(range(30, 43)), [7, 300, 12, 99, 5]], params)
    follow_up = first[0].prompt_token_ids + first[0].token_ids + [44, 45, 46, 47, 48, 49]
    outputs = first + llm.generate([follow_up], params)
    outputs += llm.generate([[9, 8, 7, 6, 5, 4]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                 logprobs=0, n=2))
    return [(c.token_ids, [lp["logprob"] for lp in c.logprobs], out.num_cached_tokens)
            for out in outputs for c in out.outputs]


@pytest.fixture(scope="module")
def single(checkpoints):
    """The one-process results, per checkpoint."""
    results = {}
    for name, path in checkpoints.items():
        llm = LLM(str(path), **OPTIONS)
        results[name] = turns(llm)
    return results


def assert_same(got, want):
    for (tokens, logprobs, cached), (want_tokens, want_logprobs, want_cached) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert cached == want_cached
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model, tp, ep", [
    ("qwen3_moe", 2, 1),  # heads, dense MLP columns, experts' columns, vocabulary split in two
    ("qwen3_moe", 1, 2),  # experts split in two, each rank everything else
    ("qwen2_moe", 2, 2),  # both: 4 ranks
])
def test_parallel_greedy_equals_one_process(checkpoints, single, model, tp, ep):
    llm = LLM(str(checkpoints[model]), tensor_parallel_size=tp, expert_parallel_size=ep, **OPTIONS)
    try:
        got = turns(llm)
        stats = llm.stats()
        load = llm.engine.expert_load()
        memory = llm.engine.executor.rank_memory()
        rank_load = llm.engine.executor.rank_expert_load()
    finally:
        llm.engine.shutdown()
    assert_same(got, single[model])
    assert got[2][2] >= 16  # the second turn reused the first's blocks on every rank
    assert stats["ranks"] == tp * ep and stats["cow_bytes"] > 0  # the fork's copy ran on every rank
    assert len(load[0]) == 4 and sum(load[0]) > 0  # every expert's load, counted on rank 0
    # each ep group's ranks count their group's experts; the groups together count every routed pair
    assert len(rank_load) == tp * ep and sum(rank_load[::tp]) == sum(map(sum, load))
    assert all(rank_load[r] == rank_load[r - r % tp] for r in range(tp * ep))  # one count per ep group
    assert len(memory) == tp * ep and all(m["anon"] > 0 and m["file"] > 0 for m in memory)  # each rank's process


def test_layouts_the_model_cannot_take_are_refused_before_starting_workers(checkpoints):
    with pytest.raises(ConfigError, match="4 attention heads, not a multiple of 3"):
        LLM(str(checkpoints["qwen3_moe"]), tensor_parallel_size=3, **OPTIONS)
    with pytest.raises(ConfigError, match="4 experts, not a multiple of 3"):
        LLM(str(checkpoints["qwen3_moe"]), expert_parallel_size=3, **OPTIONS)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer"):
        LLM(str(checkpoints["qwen3_moe"]), tensor_parallel_size=0, **OPTIONS)
