"""The Gated DeltaNet decode ops writing each new state into another slot than the one they read (`out_slots`: a
speculative verify step keeps each position's state in a slot of its own), torch twin and Triton (interpreted): the
float64 oracle's outputs and states, the source slots untouched; a chain of such steps through k slots leaves the
state after each position in its slot; and the arithmetic is the in-place step's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from tests.kernels import oracles


@pytest.fixture(params=["torch", "triton"])
def kernels(request):
    if request.param == "torch":
        from tsterm_kernels import torch_gated_delta

        return torch_gated_delta
    from tsterm_kernels import triton_gated_delta  # imported after conftest set TRITON_INTERPRET

    return triton_gated_delta


def inputs(num_seqs: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_seqs, 2 * hk * dk + hv * dv, generator=gen)  # q, k, v: views of one projection
    q = qkv[:, :hk * dk].view(num_seqs, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(num_seqs, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(num_seqs, hv, dv)
    g = -torch.rand(num_seqs, hv, generator=gen) * 2
    beta = torch.rand(num_seqs, hv, generator=gen)
    return q, k, v, g, beta, gen


# (source, target) slots per row: out of place in any order, in place beside out of place, consecutive runs of both
CASES = [([3], [5]), ([0, 4], [6, 1]), ([2, 7, 3], [2, 0, 5]), ([1, 2, 3], [4, 5, 6])]


@pytest.mark.parametrize("src, dst", CASES)
def test_recurrent_step_into_other_slots(kernels, poison, src, dst):
    q, k, v, g, beta, gen = inputs(len(src), 1, 2, 8, 16, seed=len(src) + dst[0])
    pool = torch.randn(8, 2, 8, 16, generator=gen)
    before = pool.clone()
    want, stepped = oracles.recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor(src))
    got = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor(src), torch.tensor(dst))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    expect = before.double()
    for s, d in zip(src, dst):
        expect[d] = stepped[s]  # the new state in the target slot; a source that is no target as it was
    torch.testing.assert_close(pool, expect.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("src, dst", CASES)
def test_conv_update_into_other_slots(kernels, poison, src, dst):
    gen = torch.Generator().manual_seed(7 + len(src))
    x = torch.randn(len(src), 12, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    pool = torch.randn(8, 12, 3, generator=gen)
    before = pool.clone()
    want, shifted = oracles.causal_conv1d_update(x, weight, pool, torch.tensor(src))
    got = kernels.causal_conv1d_update(x, weight, pool, torch.tensor(src), torch.tensor(dst))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    expect = before.clone()
    for s, d in zip(src, dst):
        expect[d] = shifted[s]
    torch.testing.assert_close(pool, expect, atol=0, rtol=0)


def test_a_chain_keeps_each_positions_state_and_matches_in_place_decoding_bit_for_bit(kernels):
    """Four tokens of one sequence, each a decode from the previous token's slot into the next (the first in place),
    as a verify step runs them: the outputs and each slot's state equal decoding the tokens one step at a time in
    place, exactly (the same operations); and the oracle's, to float32 rounding."""
    n, hk, hv, dk, dv = 4, 1, 2, 8, 16
    q, k, v, g, beta, gen = inputs(n, hk, hv, dk, dv, seed=11)
    x, weight = torch.randn(n, 24, generator=gen), torch.randn(24, 4, generator=gen)
    states, convs = torch.randn(6, hv, dk, dv, generator=gen), torch.randn(6, 24, 3, generator=gen)
    chain = [2, 5, 0, 3]  # slot 2 is the sequence's own; the others take the later positions' states
    ref_states, ref_convs = states.clone(), convs.clone()
    initial = states[2].double().clone()
    outs, conv_outs, per_position = [], [], []
    for j in range(n):  # the reference: decoding one token per step, in place in slot 2
        one = torch.tensor([2])
        conv_outs.append(kernels.causal_conv1d_update(x[j:j + 1], weight, ref_convs, one))
        outs.append(kernels.recurrent_gated_delta_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1],
                                                       beta[j:j + 1], ref_states, one))
        per_position.append((ref_states[2].clone(), ref_convs[2].clone()))
    for j in range(n):  # the verify step's positions
        src, dst = torch.tensor([chain[max(j - 1, 0)]]), torch.tensor([chain[j]])
        assert torch.equal(kernels.causal_conv1d_update(x[j:j + 1], weight, convs, src, dst), conv_outs[j])
        assert torch.equal(kernels.recurrent_gated_delta_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1],
                                                              beta[j:j + 1], states, src, dst), outs[j])
    for j, slot in enumerate(chain):
        assert torch.equal(states[slot], per_position[j][0]) and torch.equal(convs[slot], per_position[j][1])
    want, final = oracles.gated_delta_rule(q, k, v, g, beta, initial)
    torch.testing.assert_close(torch.cat(outs), want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[chain[-1]], final.float(), atol=1e-5, rtol=1e-5)
