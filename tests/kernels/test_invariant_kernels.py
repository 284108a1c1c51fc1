"""The CPU kernels' invariance promise, op by op: a row's result is the same bits whatever else is computed with it.

A query row's attention gives the same bits in a prefill of the whole sequence, an extend of its last tokens, a
decode of it alone and a decode batched with other sequences, on one thread or two; a row of a float32 linear is
the same alone and in a GEMM of hundreds; a token's mixture of experts is the same alone and among forty. Here the
reference is the kernel itself run another way; the float64 oracles (tests/kernels/oracles.py) keep the shared
answer honest.
"""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, torch_ops
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

from tests.kernels import oracles

LEN = 1300  # positions: past ten 128-position splits
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2's attention


@pytest.fixture(scope="module")
def native():
    kernels = cpu_native.load()
    assert kernels is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return kernels


@pytest.fixture(scope="module")
def pool():
    """One sequence's K/V in shuffled blocks (its context in many runs) and a query for every position."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = LEN // BLOCK + 8
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:-(-LEN // BLOCK)].tolist()
    q = torch.randn(LEN, HEADS, HEAD_DIM, generator=gen) * 2
    return q, k_cache, v_cache, table


def _attend(pool, pieces):
    """paged_attention of one step: `pieces` are (seq_len, num new tokens) of sequences sharing the pool's table."""
    q_all, k_cache, v_cache, table = pool
    q = torch.cat([q_all[n - new:n] for n, new in pieces])
    starts = [0]
    for _, new in pieces:
        starts.append(starts[-1] + new)
    tables = [table[:-(-n // BLOCK)] for n, _ in pieces]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(starts, [n for n, _ in pieces], [contiguous_runs(t, len(t)) for t in tables],
                             torch.zeros(len(q), dtype=torch.long), block_tables, BLOCK)
    out = torch_ops.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    return [out[a:b] for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_query_rows_attention_is_the_same_bits_in_prefill_extend_and_decode(native, cpu_isa, pool, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the C kernels' OpenMP threads follow torch's (one libgomp)
    try:
        prefill = _attend(pool, [(LEN, LEN)])[0]  # every position's row, one prefill
        for p in (0, 5, 127, 128, 129, 511, 512, 513, 1023, 1024, LEN - 1):
            n = p + 1
            decode = _attend(pool, [(n, 1)])[0][0]  # alone: the decode kernel
            batched = _attend(pool, [(LEN, 1), (n, 1), (300, 1)])[1][0]  # among other decodes
            mixed = _attend(pool, [(200, 40), (n, 1)])[1][0]  # a decode row in a step with a prefill chunk
            extend = _attend(pool, [(n, min(n, 37))])[0][-1]  # the last row of an extend
            for got in (decode, batched, mixed, extend):
                assert torch.equal(got, prefill[p]), p
    finally:
        torch.set_num_threads(before)


def test_the_shared_attention_is_a_causal_softmax(pool):
    """What every path agrees on is attention: float64 from scratch, the keys gathered densely."""
    q, k_cache, v_cache, table = pool
    got = _attend(pool, [(LEN, LEN)])[0]
    k, v = oracles.gather_context(k_cache, table, LEN), oracles.gather_context(v_cache, table, LEN)
    want = oracles.attention(q, k, v, HEAD_DIM ** -0.5)
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("out_f,in_f", [(96, 64), (37, 100), (200, 576), (48, 1000)])
def test_a_float32_linear_row_is_the_same_bits_alone_or_in_a_gemm(native, cpu_isa, out_f, in_f):
    """Few rows take gemm.c's register-transposed path, many the packed GEMM: one summation order (tails of outputs
    and inputs included, more inputs than one 256-input block)."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(out_f, in_f, generator=gen), torch.randn(300, in_f, generator=gen)
    many = torch_ops.linear(x, weight)
    for i in (0, 5, 150, 299):
        for rows in (1, 2, 3, 4, 7):
            assert torch.equal(torch_ops.linear(x[i:i + rows], weight)[0], many[i]), (i, rows)
    torch.testing.assert_close(many.double(), oracles.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_a_tokens_experts_are_the_same_bits_alone_or_among_many(native, cpu_isa, renormalize):
    """Routing (the C softmax and top-k) and the sum of a token's experts (ascending id, each w * y rounded) do not
    depend on the other tokens: decode's one token, a prefill's forty, and the C call or the host-grouped path."""
    gen = torch.Generator().manual_seed(2)
    tokens, hidden, inter, experts, top_k = 40, 64, 32, 8, 3
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    router = torch.randn(experts, hidden, generator=gen)

    def moe(rows: torch.Tensor) -> torch.Tensor:
        weights, ids = torch_ops.moe_route(torch_ops.linear(rows, router), top_k, renormalize)
        return torch_ops.fused_moe(rows, w13, w2, weights, ids, torch.zeros_like(rows))

    many = moe(x)
    weights, ids = torch_ops.moe_route(torch_ops.linear(x, router), top_k, renormalize)
    want_weights, want_ids = oracles.moe_route(oracles.linear(x, router), top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(many.double(), oracles.fused_moe(x, w13, w2, weights, ids, torch.zeros_like(x)),
                               rtol=1e-5, atol=1e-5)
    for i in (0, 13, 39):
        assert torch.equal(moe(x[i:i + 1]), many[i:i + 1])
        assert torch.equal(moe(x[i:i + 3])[0], many[i])
