"""A hybrid model (Gated DeltaNet + gated attention) on gloo CPU ranks: with expert parallelism each rank keeps every
sequence's whole recurrent state in its own state pool (the linear-attention layers are replicated); with tensor
parallelism each rank holds its heads of both mixers and their share of each state slot. The engine on rank 0 hands
out the slots for all of them, and the tokens and logprobs equal one process's, for both checkpoint layouts
(Qwen3-Next's per-key-head projections, Qwen3.5's flat ones). A size that does not divide the key heads is refused
before any worker starts."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_hybrid_checkpoint

OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=40, distributed_timeout_s=30)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_parallel") / "m", "qwen3_next",
                                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    return str(path)


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([list(range(30, 43)), [7, 300, 12, 99, 5], [3]], params)
    return [(o.token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs]


def forked(llm: LLM) -> list[list[int]]:
    """n = 2 seeded samples: the second starts from a copy of the first one's state, made on every rank."""
    params = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=6, ignore_eos=True)
    return [c.token_ids for c in llm.generate([list(range(50, 61))], params)[0].outputs]


def test_expert_parallel_hybrid_equals_one_process(hybrid):
    one = LLM(hybrid, **OPTIONS)
    want, want_forked = run(one), forked(one)
    llm = LLM(hybrid, expert_parallel_size=2, **OPTIONS)
    try:
        got, got_forked = run(llm), forked(llm)
        stats, single = llm.stats(), one.stats()
    finally:
        llm.engine.shutdown()
    assert got_forked == want_forked
    # every rank holds each slot of the replicated layers and keeps its snapshots: twice one process's bytes
    assert stats["state_bytes"] == 2 * single["state_bytes"] > 0
    assert stats["state_snapshot_bytes"] == 2 * single["state_snapshot_bytes"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def hybrid35(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid35_parallel") / "m", "qwen3_5_moe_text",
                                     dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]))
    return str(path)


@pytest.mark.parametrize("checkpoint,sizes", [("hybrid", dict(tensor_parallel_size=2)),
                                               ("hybrid35", dict(tensor_parallel_size=2, expert_parallel_size=2))],
                         ids=["qwen3_next-tp2", "qwen3_5_moe_text-tp2xep2"])
def test_tensor_parallel_hybrid_equals_one_process(request, checkpoint, sizes):
    model = request.getfixturevalue(checkpoint)
    one = LLM(model, **OPTIONS)
    want = run(one)
    llm = LLM(model, **sizes, **OPTIONS)
    try:
        got = run(llm)
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)
    # each tp rank holds half of every state slot; each ep group holds all of it
    assert stats["state_bytes"] == sizes.get("expert_parallel_size", 1) * one.stats()["state_bytes"]


def test_a_tensor_parallel_size_that_does_not_divide_the_key_heads_is_refused_before_starting_workers(hybrid):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4: .* has 2 linear-attention key heads, not a "
                                          r"multiple of 4"):
        LLM(hybrid, tensor_parallel_size=4, **OPTIONS)
