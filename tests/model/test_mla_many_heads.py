"""MLA with more query heads on one rank than the CPU's C decode kernel takes in a call (DeepSeek-V3 has 128, the
kernel 64: `tsterm_kernels.cpu_stack.MAX_HEADS`): the absorbed form attends in groups of heads, a decode row and the
rows of a verify-like chunk equal the float64 oracle of tests/model/test_mla.py, and each head's bits are those it
gets in a call of its own group."""
from __future__ import annotations

import torch
from tsterm_kernels.cpu_stack import MAX_HEADS

from tsterm.config import ModelConfig

from tests.model.test_mla import layer, meta_for, oracle, queries


def config(heads: int) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=heads,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=16, q_lora_rank=16,
        kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10))


def test_more_heads_than_one_c_call_takes():
    heads = MAX_HEADS + 3
    cfg = config(heads)  # a latent row of 24 + 8: the C decode kernel's width
    mla = layer(cfg, num_blocks=24)
    table = [7, 8, 3, 11, 12, 13]
    for m, seq_len in ((1, 22), (5, 22)):
        q_nope, q_rope = queries(mla, m, seed=m)
        got = mla.absorbed(q_nope, q_rope, meta_for([(table, seq_len, m)]), torch.float32)
        torch.testing.assert_close(got.double(), oracle(mla, q_nope, q_rope, table, seq_len), rtol=1e-4, atol=1e-5)
    # the first group's heads alone: the same bits
    small = layer(config(MAX_HEADS), num_blocks=24)
    small.cache.copy_(mla.cache)
    small.w_uk_t, small.w_uv = mla.w_uk_t[:MAX_HEADS], mla.w_uv[:MAX_HEADS]
    q_nope, q_rope = queries(mla, 1, seed=1)
    meta = meta_for([(table, 22, 1)])
    alone = small.absorbed(q_nope[:, :MAX_HEADS].contiguous(), q_rope[:, :MAX_HEADS].contiguous(), meta, torch.float32)
    assert torch.equal(mla.absorbed(q_nope, q_rope, meta, torch.float32)[:, :MAX_HEADS], alone)
