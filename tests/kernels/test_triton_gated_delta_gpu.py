"""The Gated DeltaNet decode kernels compiled on a CUDA device, at Qwen3.5-397B-A17B's linear-attention sizes (16 key
heads / 64 value heads of 128, conv kernel 4), bfloat16 activations, float32 states, against their torch twins on the
same device.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest tests/kernels/test_triton_gated_delta_gpu.py`, as scripts/gpu_check.sh does. Self-contained: no
fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch
from tsterm_kernels import reference, triton_ops

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

BF16 = torch.bfloat16
SEQS, KEY_HEADS, VALUE_HEADS, HEAD_DIM, KERNEL = 8, 16, 64, 128, 4
CHANNELS = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM


def test_conv_update_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SEQS, CHANNELS + 64, generator=gen).to(BF16).cuda()[:, :CHANNELS]  # a slice of the projection
    weight = torch.randn(CHANNELS, KERNEL, generator=gen).to(BF16).cuda()
    pool = torch.randn(2 * SEQS, CHANNELS, KERNEL - 1, generator=gen).to(BF16).cuda()
    slots = torch.randperm(2 * SEQS, generator=gen)[:SEQS].cuda()
    want_pool = pool.clone()
    want = reference.causal_conv1d_update(x, weight, want_pool, slots)
    got = triton_ops.causal_conv1d_update(x, weight, pool, slots)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool, want_pool, atol=0, rtol=0)


def test_recurrent_step_bf16_inputs_float32_state():
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(SEQS, CHANNELS, generator=gen).to(BF16).cuda()
    key_size = KEY_HEADS * HEAD_DIM
    q = qkv[:, :key_size].view(SEQS, KEY_HEADS, HEAD_DIM)
    k = qkv[:, key_size:2 * key_size].view(SEQS, KEY_HEADS, HEAD_DIM)
    v = qkv[:, 2 * key_size:].view(SEQS, VALUE_HEADS, HEAD_DIM)
    g = (-torch.rand(SEQS, VALUE_HEADS, generator=gen) * 3).cuda()
    beta = torch.rand(SEQS, VALUE_HEADS, generator=gen).cuda()
    pool = (torch.randn(2 * SEQS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1).cuda()
    slots = torch.randperm(2 * SEQS, generator=gen)[:SEQS].cuda()
    want_pool = pool.clone()
    want = reference.recurrent_gated_delta_rule(q, k, v, g, beta, want_pool, slots)
    got = triton_ops.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(pool, want_pool, atol=1e-3, rtol=1e-3)
