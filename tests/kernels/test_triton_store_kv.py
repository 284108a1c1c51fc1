"""Triton KV store against the oracle (a slot-by-slot copy): scattered slots of a poisoned pool, strided k/v views;
and a negative slot (padding) skipped by both implementations."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import torch_ops

from tests.kernels import oracles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim", [(1, 1, 16), (9, 2, 32), (5, 4, 24)])
def test_store_kv_matches_the_oracle(triton_ops, dtype, num_tokens, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens + 10 * num_kv_heads)
    num_blocks, block_size = 6, 4
    kv_size = num_kv_heads * head_dim
    # k and v are column slices of one fused projection, as the model produces them
    fused = torch.randn(num_tokens, 3 * kv_size, generator=gen).to(dtype)
    k = fused[:, kv_size:2 * kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, 2 * kv_size:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, 1e4)
    want_k, want_v = oracles.store_kv(k, v, k_cache, v_cache, slots)

    triton_ops.store_kv(k, v, k_cache, v_cache, slots)

    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


@pytest.mark.parametrize("torch_path", [False, True], ids=["triton", "torch_ops"])
def test_store_kv_skips_negative_slots(triton_ops, torch_path):
    store = torch_ops.store_kv if torch_path else triton_ops.store_kv
    k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    store(k, v, k_cache, v_cache, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache.view(-1, 16)[5], k[0, 0]) and torch.equal(v_cache.view(-1, 16)[2], v[2, 0])
    assert torch.count_nonzero(k_cache.view(-1, 16).abs().sum(-1)) == 2
