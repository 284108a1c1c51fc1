"""Triton Gated DeltaNet decode kernels (interpreted on the CPU) against their torch twins."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tsterm_kernels import reference_gated_delta as twin

from tests.kernels.cases import TOLERANCE


@pytest.fixture
def kernels():
    from tsterm_kernels import triton_gated_delta  # imported after conftest set TRITON_INTERPRET

    return triton_gated_delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_seqs, channels, kernel", [(1, 24, 4), (3, 40, 2), (2, 300, 3)])
def test_conv_update_matches_twin(kernels, poison, dtype, num_seqs, channels, kernel):
    gen = torch.Generator().manual_seed(channels + kernel)
    wide = torch.randn(num_seqs, channels + 8, generator=gen).to(dtype)
    x = wide[:, 8:]  # a column slice of the fused projection: row stride != C
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    pool = torch.randn(5, channels, kernel - 1, generator=gen).to(dtype)
    slots = torch.tensor([4, 1, 2][:num_seqs])
    want_pool = pool.clone()
    want = twin.causal_conv1d_update(x, weight, want_pool, slots)
    got = kernels.causal_conv1d_update(x, weight, pool, slots)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(pool, want_pool, atol=0, rtol=0)  # shifted, and the untouched slots unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_seqs, hk, hv, dk, dv", [(1, 2, 2, 16, 16), (3, 1, 3, 8, 20), (2, 2, 4, 32, 8)])
def test_recurrent_step_matches_twin(kernels, poison, dtype, num_seqs, hk, hv, dk, dv):
    gen = torch.Generator().manual_seed(num_seqs * 100 + dv)
    qkv = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen).to(dtype)  # q, k, v: views of one projection
    q = qkv[:, :hk * dk].view(num_seqs, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(num_seqs, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(num_seqs, hv, dv)
    g = -torch.rand(num_seqs, hv, generator=gen) * 2
    beta = torch.rand(num_seqs, hv, generator=gen)
    pool = torch.randn(5, hv, dk, dv, generator=gen)
    slots = torch.tensor([3, 0, 4][:num_seqs])  # out of order, not a run
    want_pool = pool.clone()
    want = twin.recurrent_gated_delta_rule(q, k, v, g, beta, want_pool, slots)
    got = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)  # updated in place, the other slots unchanged


def test_decode_steps_follow_the_chunked_prefill(kernels):
    """A prompt through the chunked twin, then tokens through the kernels: the outputs the twin gives for the whole."""
    gen = torch.Generator().manual_seed(9)
    n, hk, hv, dk, dv = 12, 1, 2, 8, 8
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen))
    beta = torch.rand(n, hv, generator=gen)
    want = twin.gated_delta_chunked(q, k, v, g, beta, torch.zeros(hv, dk, dv), chunk_size=4)
    pool = torch.randn(3, hv, dk, dv, generator=gen)
    pool[2] = 0
    steps = [twin.gated_delta_chunked(q[:8], k[:8], v[:8], g[:8], beta[:8], pool[2], chunk_size=4)]
    for t in range(8, n):
        steps.append(kernels.recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                        beta[t:t + 1], pool, torch.tensor([2])))
    torch.testing.assert_close(torch.cat(steps), want, atol=1e-5, rtol=1e-5)
