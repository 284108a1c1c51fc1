"""Triton paged attention against the float64 oracle (dense causal attention over each gathered context): decode,
extend and prefill in one ragged batch, shuffled block tables over a NaN-poisoned pool, GQA ratios 1/2/4, with and
without split-K."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels.triton_paged_attention import launch_paged_attention

from tests.kernels import oracles
from tests.kernels.cases import TOLERANCE, paged_batch

# (seq_lens, query_lens): context lengths including the new tokens, and new tokens per sequence
DECODE = ([37, 5, 20], [1, 1, 1])
MIXED = ([13, 7, 30, 1], [13, 2, 1, 1])  # prefill, extend over a cached prefix, long decode, one-token prefill
EXTEND = ([29], [17])  # a long extend: several query tiles of one sequence
MANY = ([5, 1, 9, 17, 3, 12, 8, 2, 20], [1, 1, 9, 2, 3, 1, 1, 2, 1])  # nine sequences: a deeper tile search


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("batch", [DECODE, MIXED, EXTEND, MANY], ids=["decode", "mixed", "extend", "many"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_matches_the_oracle(poison, dtype, group, batch, num_splits):
    seq_lens, query_lens = batch
    gen = torch.Generator().manual_seed(group * 100 + len(seq_lens))
    num_kv_heads, head_dim, block_size = 2, 16, 4
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)

    out = launch_paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, num_splits=num_splits)
    want = oracles.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5).to(dtype)

    torch.testing.assert_close(out, want, **TOLERANCE[dtype])


def test_paged_attention_odd_shapes_through_ops(triton_ops, poison):
    """Block size 5 (not a power of two), head_dim 24 (padded tile), a strided q view, via dispatch."""
    gen = torch.Generator().manual_seed(7)
    seq_lens, query_lens = [11, 23], [4, 1]
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, 5, 1, 24, torch.float32, gen)
    qkv = torch.randn(5, 4 * 24 + 2 * 24, generator=gen)
    q = qkv[:, :4 * 24].view(5, 4, 24)  # row stride 144, not 96

    out = triton_ops.paged_attention(q, k_cache, v_cache, meta, 0.2)
    want = oracles.paged_attention(q, k_cache, v_cache, meta, 0.2).float()

    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])
    assert meta.query_start_loc_device.tolist() == [0, 4, 5] and meta.seq_lens_device.tolist() == [11, 23]
