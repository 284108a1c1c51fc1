"""The Gated DeltaNet ops of the CPU path (torch_gated_delta): chunked == recurrent == the float64 token-by-token
oracle, and both equal transformers' own torch implementations (the fallbacks of its Qwen3-Next model); the causal conv and its one-step update equal
transformers' conv fallbacks and each other."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tsterm_kernels import torch_gated_delta as gdn

from tests.kernels import oracles

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

# (tokens, key heads, value heads, dk, dv, chunk size): lengths below, at and across chunk boundaries
SHAPES = [(1, 2, 2, 8, 8, 64), (5, 1, 2, 16, 8, 4), (37, 2, 4, 8, 16, 16), (64, 2, 2, 16, 16, 64),
          (70, 1, 3, 8, 4, 64), (9, 2, 2, 8, 8, 8)]


def random_inputs(n, hk, hv, dk, dv, seed, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    # g = -exp(A_log) softplus(a + dt_bias), as the model computes it: mild and strong decays mixed
    g = -torch.rand(hv, generator=gen).mul(4).exp() * F.softplus(torch.randn(n, hv, generator=gen))
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) if with_state else None
    return q, k, v, g, beta, state


@pytest.mark.parametrize("shape", SHAPES, ids=[f"n{s[0]}-hk{s[1]}-hv{s[2]}-dk{s[3]}-dv{s[4]}-c{s[5]}" for s in SHAPES])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_equals_recurrent_equals_oracle(shape, with_state):
    n, hk, hv, dk, dv, chunk = shape
    q, k, v, g, beta, state = random_inputs(n, hk, hv, dk, dv, seed=n, with_state=with_state)
    s_chunk = torch.zeros(hv, dk, dv) if state is None else state.clone()
    o_chunk = gdn.gated_delta_chunked(q, k, v, g, beta, s_chunk, chunk_size=chunk)  # s_chunk: updated in place
    pool = torch.randn(3, hv, dk, dv)  # decode: one token at a time, the state carried in slot 1
    pool[1] = 0 if state is None else state
    others = pool[[0, 2]].clone()
    steps = [gdn.recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool,
                                            torch.tensor([1]))[0] for t in range(n)]
    o_ref, s_ref = oracles.gated_delta_rule(q, k, v, g, beta, state)
    assert o_chunk.shape == (n, hv, dv) and s_chunk.shape == (hv, dk, dv)
    torch.testing.assert_close(o_chunk.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chunk.double(), s_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(steps), o_chunk, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[1], s_chunk, rtol=1e-4, atol=1e-4)
    assert torch.equal(pool[[0, 2]], others)


@pytest.mark.parametrize("slots", [[2, 3, 4], [4, 3, 2], [4, 0, 2], [1, 2, 0]],
                         ids=["one-run", "one-run-descending", "scattered", "one-run-shuffled"])
def test_the_recurrent_step_updates_its_slots_in_place(slots):
    """A batch of sequences in any slots equals each one alone; the other slots stay as they were."""
    rows = [random_inputs(1, 2, 4, 8, 8, seed=10 + i) for i in range(3)]
    batched = [torch.cat(parts) for parts in zip(*(r[:5] for r in rows))]
    pool = torch.randn(6, 4, 8, 8)
    for slot, r in zip(slots, rows):
        pool[slot] = r[5]
    untouched = [s for s in range(6) if s not in slots]
    others = pool[untouched].clone()
    o = gdn.recurrent_gated_delta_rule(*batched, pool, torch.tensor(slots))
    for i, (q, k, v, g, beta, state) in enumerate(rows):
        state = state[None].clone()
        torch.testing.assert_close(o[i], gdn.gated_delta_step(q, k, v, g, beta, state)[0])
        torch.testing.assert_close(pool[slots[i]], state[0])
    assert torch.equal(pool[untouched], others)


def test_the_prompt_op_runs_each_sequence_from_its_slot():
    """`chunk_gated_delta_rule` over the rows of three sequences (one empty) equals each one alone; it writes only
    their rows of out and their slots."""
    lengths, slots, hv, dk, dv = [7, 0, 20], [3, 0, 1], 4, 8, 8
    parts = [random_inputs(n, 2, hv, dk, dv, seed=30 + n) for n in lengths]
    q, k, v, g, beta = (torch.cat([torch.zeros(2, *parts[0][i].shape[1:])] + [p[i] for p in parts]) for i in range(5))
    starts = [2, 9, 9]  # two rows before the first sequence that are none of its business
    bounds = torch.tensor([[s, s + n] for s, n in zip(starts, lengths)])
    pool = torch.randn(5, hv, dk, dv)
    for slot, p in zip(slots, parts):
        pool[slot] = p[5]
    want_pool = pool.clone()
    out = torch.full((29, hv, dv), float("nan"))
    gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor(slots), bounds, out, chunk_size=8)
    for (qi, ki, vi, gi, bi, _), slot, start, n in zip(parts, slots, starts, lengths):
        if n:
            want = gdn.gated_delta_chunked(qi, ki, vi, gi, bi, want_pool[slot], chunk_size=8)
            torch.testing.assert_close(out[start:start + n], want)
    torch.testing.assert_close(pool, want_pool)
    assert out[:2].isnan().all() and not out[2:].isnan().any()


@pytest.mark.parametrize("shape", [(5, 1, 2, 16, 8, 4), (37, 2, 4, 8, 16, 16), (70, 2, 2, 8, 8, 64)])
def test_both_forms_equal_transformers(shape):
    n, hk, hv, dk, dv, chunk = shape
    q, k, v, g, beta, state = random_inputs(n, hk, hv, dk, dv, seed=7 * n)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk,
                                                   initial_state=state[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    s = state.clone()
    o = gdn.gated_delta_chunked(q, k, v, g, beta, s, chunk_size=chunk)
    torch.testing.assert_close(o, ref_o[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, ref_s[0], rtol=1e-4, atol=1e-5)
    ref_o1, ref_s1 = hf.torch_recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], g[None, :1],
                                                         beta[None, :1], initial_state=state[None],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    s1 = state[None].clone()
    o1 = gdn.recurrent_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], s1, torch.tensor([0]))
    torch.testing.assert_close(o1, ref_o1[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, ref_s1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("split", [[9], [3, 1, 5], [1, 1, 1, 6]])
def test_causal_conv_in_pieces_equals_transformers_over_the_whole(kernel, split):
    """A prompt fed in chunks (and tokens) through the state equals transformers' conv over the whole prompt, and its
    final state is the last K-1 inputs."""
    gen = torch.Generator().manual_seed(kernel)
    channels, n = 12, sum(split)
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()  # [n, C]
    pool = torch.randn(3, channels, kernel - 1, generator=gen)
    pool[1] = 0  # the sequence's slot, at its start
    others = pool[[0, 2]].clone()
    out = torch.full((n, channels), float("nan"))
    start = 0
    for size in split:
        if size == 1:  # a decode step
            out[start] = gdn.causal_conv1d_update(x[start:start + 1], weight, pool, torch.tensor([1]))[0]
        else:  # a prompt chunk: the op reads its rows of the whole x
            gdn.causal_conv1d(x, weight, pool, torch.tensor([1]), torch.tensor([[start, start + size]]), out)
        start += size
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[1], x[n - (kernel - 1):].t())
    assert torch.equal(pool[[0, 2]], others)


def test_causal_conv_update_equals_transformers_update():
    gen = torch.Generator().manual_seed(5)
    channels, kernel, seqs = 10, 4, 3
    x = torch.randn(seqs, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    pool = torch.randn(5, channels, kernel - 1, generator=gen)
    slots = torch.tensor([4, 0, 2])
    hf_state = torch.cat((torch.zeros(seqs, channels, 1), pool[slots]), dim=2)  # transformers keeps K columns
    ref = hf.causal_conv1d_update(x[:, :, None], hf_state, weight, None, "silu")[:, :, 0]
    untouched = pool[[1, 3]].clone()
    out = gdn.causal_conv1d_update(x, weight, pool, slots)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots], hf_state[:, :, 1:])
    assert torch.equal(pool[[1, 3]], untouched)
