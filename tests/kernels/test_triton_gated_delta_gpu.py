"""The Gated DeltaNet kernels (decode and prefill) compiled on a CUDA device, at Qwen3.5-397B-A17B's
linear-attention sizes (16 key heads / 64 value heads of 128, conv kernel 4), bfloat16 activations, float32 states,
against the float64 oracles (tests/kernels/oracles.py: the rule token by token) on the same device.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest tests/kernels/test_triton_gated_delta_gpu.py`, as scripts/gpu_check.sh does. Self-contained: no
fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch
from tsterm_kernels import triton_ops

from tests.kernels import oracles

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
    want, want_pool = oracles.causal_conv1d_update(x, weight, pool, slots)
    got = triton_ops.causal_conv1d_update(x, weight, pool, slots)
    torch.testing.assert_close(got, want.to(BF16), atol=2e-2, rtol=2e-2)
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
    want, want_pool = oracles.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    got = triton_ops.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(got, want.float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(pool, want_pool.float(), atol=1e-3, rtol=1e-3)


def prompt_rows(gen, lengths):
    """[N, 2] int32 row bounds of sequences of these lengths, one after another, and their N random slots."""
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    bounds = torch.stack((starts, starts + torch.tensor(lengths)), dim=1).to(torch.int32).cuda()
    return bounds, torch.randperm(2 * len(lengths), generator=gen)[:len(lengths)].cuda()


def test_conv_prefill_bf16():
    gen = torch.Generator().manual_seed(2)
    lengths = [300, 2, 64, 77]  # several row blocks; fewer rows than K-1; whole blocks; a ragged end
    bounds, slots = prompt_rows(gen, lengths)
    rows = sum(lengths)
    x = torch.randn(rows, CHANNELS + 64, generator=gen).to(BF16).cuda()[:, :CHANNELS]
    weight = torch.randn(CHANNELS, KERNEL, generator=gen).to(BF16).cuda()
    pool = torch.randn(2 * len(lengths), CHANNELS, KERNEL - 1, generator=gen).to(BF16).cuda()
    out = torch.zeros(rows, CHANNELS, dtype=BF16, device="cuda")
    want, want_pool = oracles.causal_conv1d(x, weight, pool, slots, bounds, out)
    got = triton_ops.causal_conv1d(x, weight, pool, slots, bounds, out)
    torch.testing.assert_close(got, want.to(BF16), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool, want_pool, atol=0, rtol=0)


def test_chunked_prefill_bf16_inputs_float32_state():
    """Several prompts (a long one, a ragged one, one token past a chunk) from nonzero states: the kernel's chunked
    form against the rule token by token, outputs and final states."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1000, 37, 65]
    bounds, slots = prompt_rows(gen, lengths)
    rows, key_size = sum(lengths), KEY_HEADS * HEAD_DIM
    qkv = torch.randn(rows, CHANNELS, generator=gen).to(BF16).cuda()
    q = qkv[:, :key_size].view(rows, KEY_HEADS, HEAD_DIM)
    k = qkv[:, key_size:2 * key_size].view(rows, KEY_HEADS, HEAD_DIM)
    v = qkv[:, 2 * key_size:].view(rows, VALUE_HEADS, HEAD_DIM)
    g = (-torch.rand(rows, VALUE_HEADS, generator=gen) * 0.5).cuda()
    beta = torch.rand(rows, VALUE_HEADS, generator=gen).cuda()
    pool = (torch.randn(2 * len(lengths), VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1).cuda()
    out = torch.zeros(rows, VALUE_HEADS, HEAD_DIM, device="cuda")
    want, want_pool = oracles.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, out)
    got = triton_ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, out)
    torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(pool, want_pool.float(), atol=2e-3, rtol=2e-3)
