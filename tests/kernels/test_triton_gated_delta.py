"""Triton Gated DeltaNet kernels, decode and prefill (interpreted on the CPU), against the float64 oracles: the
rule token by token, the conv position by position."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import oracles
from tests.kernels.cases import TOLERANCE


@pytest.fixture
def kernels():
    from tsterm_kernels import triton_gated_delta  # imported after conftest set TRITON_INTERPRET

    return triton_gated_delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_seqs, channels, kernel", [(1, 24, 4), (3, 40, 2), (2, 300, 3)])
def test_conv_update_matches_the_oracle(kernels, poison, dtype, num_seqs, channels, kernel):
    gen = torch.Generator().manual_seed(channels + kernel)
    wide = torch.randn(num_seqs, channels + 8, generator=gen).to(dtype)
    x = wide[:, 8:]  # a column slice of the fused projection: row stride != C
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    pool = torch.randn(5, channels, kernel - 1, generator=gen).to(dtype)
    slots = torch.tensor([4, 1, 2][:num_seqs])
    want, want_pool = oracles.causal_conv1d_update(x, weight, pool, slots)
    got = kernels.causal_conv1d_update(x, weight, pool, slots)
    torch.testing.assert_close(got, want.to(dtype), **TOLERANCE[dtype])
    torch.testing.assert_close(pool, want_pool, atol=0, rtol=0)  # shifted, and the untouched slots unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_seqs, hk, hv, dk, dv", [(1, 2, 2, 16, 16), (3, 1, 3, 8, 20), (2, 2, 4, 32, 8)])
def test_recurrent_step_matches_the_oracle(kernels, poison, dtype, num_seqs, hk, hv, dk, dv):
    gen = torch.Generator().manual_seed(num_seqs * 100 + dv)
    qkv = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen).to(dtype)  # q, k, v: views of one projection
    q = qkv[:, :hk * dk].view(num_seqs, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(num_seqs, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(num_seqs, hv, dv)
    g = -torch.rand(num_seqs, hv, generator=gen) * 2
    beta = torch.rand(num_seqs, hv, generator=gen)
    pool = torch.randn(5, hv, dk, dv, generator=gen)
    slots = torch.tensor([3, 0, 4][:num_seqs])  # out of order, not a run
    want, want_pool = oracles.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    got = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool.float(), atol=1e-5, rtol=1e-5)  # updated in place, the other slots unchanged


def test_decode_steps_follow_the_chunked_prefill(kernels):
    """A prompt through the chunked kernel, then tokens through the decode kernel, from the state it left in its
    slot: the oracle's outputs for the whole sequence."""
    gen = torch.Generator().manual_seed(9)
    n, prompt, hk, hv, dk, dv = 24, 20, 1, 2, 8, 8  # a prompt of one chunk of 16 and a bit, then 4 tokens
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen))
    beta = torch.rand(n, hv, generator=gen)
    want, _ = oracles.gated_delta_rule(q, k, v, g, beta, None)
    pool = torch.randn(3, hv, dk, dv, generator=gen)
    pool[2] = 0
    rows = slice(0, prompt)
    steps = [kernels.chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, torch.tensor([2]),
                                            torch.tensor([[0, prompt]]), torch.empty(prompt, hv, dv), chunk_size=16)]
    for t in range(prompt, n):
        steps.append(kernels.recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                        beta[t:t + 1], pool, torch.tensor([2])))
    torch.testing.assert_close(torch.cat(steps), want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths, channels, kernel", [([5, 2, 0, 20], 24, 4), ([1, 9], 40, 2), ([3], 300, 3)],
                         ids=["short-empty-long", "k2", "wide"])
def test_conv_prefill_matches_the_oracle(kernels, poison, dtype, lengths, channels, kernel):
    """Several sequences' prompt rows (fewer than K-1 of them, none, several row blocks), each from its slot."""
    gen = torch.Generator().manual_seed(channels + len(lengths))
    rows = 3 + sum(lengths)  # 3 rows first that belong to no sequence here (a decode token's, say)
    x = torch.randn(rows, channels + 8, generator=gen).to(dtype)[:, 8:]  # a column slice: row stride != C
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    pool = torch.randn(6, channels, kernel - 1, generator=gen).to(dtype)
    slots = torch.tensor([5, 0, 3, 2][:len(lengths)])
    starts = torch.tensor([3] + lengths[:-1]).cumsum(0)
    bounds = torch.stack((starts, starts + torch.tensor(lengths)), dim=1)
    got = torch.full((rows, channels), float("nan"), dtype=dtype)
    want, want_pool = oracles.causal_conv1d(x, weight, pool, slots, bounds, got)
    kernels.causal_conv1d(x, weight, pool, slots, bounds, got)
    torch.testing.assert_close(got, want.to(dtype), equal_nan=True, **TOLERANCE[dtype])
    torch.testing.assert_close(pool, want_pool, atol=0, rtol=0)  # the last K-1 inputs; the other slots unchanged


# (key heads, value heads, dk, dv, chunk size): GQA, head dims below a tile and not powers of 2, several chunks
PREFILL_SHAPES = [(2, 2, 16, 16, 16), (1, 3, 8, 20, 16), (2, 4, 32, 8, 32)]


@pytest.mark.parametrize("num_k_heads, num_v_heads, dk, dv, chunk", PREFILL_SHAPES,
                         ids=[f"hk{s[0]}-hv{s[1]}-dk{s[2]}-dv{s[3]}-c{s[4]}" for s in PREFILL_SHAPES])
def test_chunked_prefill_matches_the_oracle(kernels, poison, num_k_heads, num_v_heads, dk, dv, chunk):
    """Sequences of different lengths (one chunk and a bit, less than one, none, exactly two), each resuming from
    the state in its slot, their rows interleaved with rows of no sequence."""
    gen = torch.Generator().manual_seed(dk * dv + chunk)
    lengths = [chunk + 5, 3, 0, 2 * chunk]
    rows = 2 + sum(lengths)
    qkv = torch.randn(rows, 2 * num_k_heads * dk + num_v_heads * dv, generator=gen)  # q, k, v: views of one projection
    key_size = num_k_heads * dk
    q = qkv[:, :key_size].view(rows, num_k_heads, dk)
    k = qkv[:, key_size:2 * key_size].view(rows, num_k_heads, dk)
    v = qkv[:, 2 * key_size:].view(rows, num_v_heads, dv)
    g = -torch.rand(num_v_heads, generator=gen).mul(3).exp() * torch.rand(rows, num_v_heads, generator=gen)
    beta = torch.rand(rows, num_v_heads, generator=gen)
    pool = torch.randn(6, num_v_heads, dk, dv, generator=gen)
    slots = torch.tensor([4, 1, 0, 3])
    starts = torch.tensor([2] + lengths[:-1]).cumsum(0)
    bounds = torch.stack((starts, starts + torch.tensor(lengths)), dim=1)
    got = torch.full((rows, num_v_heads, dv), float("nan"))
    want, want_pool = oracles.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, got)
    kernels.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, got, chunk_size=chunk)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(pool, want_pool.float(), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_of_a_repeated_token(kernels):
    """The same key again and again with beta near 1 and no decay: the within-chunk system is as ill-conditioned as
    it gets ((I + A) is all ones below the diagonal), and the kernel still follows the rule."""
    gen = torch.Generator().manual_seed(2)
    n, hv, dk, dv = 40, 2, 16, 16
    q = torch.randn(n, 1, dk, generator=gen)
    k = torch.randn(1, 1, dk, generator=gen).expand(n, 1, dk).contiguous()
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = torch.zeros(n, hv), torch.full((n, hv), 0.999)
    pool, slots, bounds = torch.randn(1, hv, dk, dv, generator=gen), torch.tensor([0]), torch.tensor([[0, n]])
    want, want_pool = oracles.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, torch.empty(n, hv, dv))
    got = kernels.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, torch.empty(n, hv, dv), chunk_size=32)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool, want_pool.float(), atol=1e-4, rtol=1e-4)
