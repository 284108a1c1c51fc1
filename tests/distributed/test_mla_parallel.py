"""DeepSeek-V3's Multi-head Latent Attention on gloo CPU ranks: under tensor parallelism each rank computes its share
of the heads (q_b, kv_b rows; o_proj columns) from the latent every rank computes and caches whole; under expert
parallelism its share of the experts. TP2 x EP2 (4 ranks) gives the one-process tokens and logprobs, serves a
second turn from the latent blocks cached on every rank, and forks (copy-on-write of the latent pool's block)."""
from __future__ import annotations

import pytest

from tsterm import LLM

from tests.distributed.test_parallel import OPTIONS, assert_same, turns
from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("mla_parallel") / "deepseek_v3", "deepseek_v3",
                              dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, n_shared_experts=1, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=24,
                                   qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, vocab_size=387))
    return str(path)


def test_tensor_and_expert_parallel_mla_equals_one_process(checkpoint):
    want = turns(LLM(checkpoint, **OPTIONS))
    llm = LLM(checkpoint, tensor_parallel_size=2, expert_parallel_size=2, **OPTIONS)
    try:
        got = turns(llm)
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert_same(got, want)
    assert got[2][2] >= 16  # the second turn reused the first's latent blocks on every rank
    assert stats["ranks"] == 4 and stats["cow_bytes"] > 0  # the fork's copy ran on every rank's latent pool
