"""Attention over a bfloat16 KV pool in csrc/attention.c's AMX arithmetic (the "bf16-attention" class's "c-amx": q
and P rounded to bfloat16, both products on AMX tiles, float32 sums). Checked: each output against float64 attention
over the pool's bfloat16 values within what rounding q and P to bfloat16 costs; and the promise the engine keeps, a
row's bits the same whether it ran in a prefill, an extend, a decode alone or batched, on one thread or two, with
sliding windows and sinks, at head sizes that fill AMX's 32-wide tiles and one that does not (48)."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, cpu_select, torch_ops

from tests.kernels import oracles
from tests.kernels.cases import paged_batch
from tests.kernels.test_sink_window_kernels import oracle as sink_window_oracle

_NATIVE = cpu_native.load()
AMX = _NATIVE is not None and "c-amx" in cpu_select.bf16_attention_available(cpu_select.CpuInfo.detect(),
                                                                               _NATIVE.bf16_isa())
pytestmark = pytest.mark.skipif(not AMX, reason="needs AMX-BF16 granted by the OS (csrc/attention.c's AMX code)")

# (seq_lens, query_lens, kv heads, query heads, head size, block size)
CASES = {
    "decode-batch": ([300, 37, 129, 1], [1, 1, 1, 1], 2, 8, 64, 16),
    "prefill-gqa": ([290], [290], 2, 8, 64, 16),
    "extend-and-decode": ([260, 90], [45, 1], 2, 6, 32, 16),
    "head-48": ([200], [200], 1, 3, 48, 32),
}


def _case(name: str, seed: int):
    seq_lens, query_lens, kv_heads, heads, dim, block = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, block, kv_heads, dim, torch.bfloat16, gen)
    q = (torch.randn(sum(query_lens), heads, dim, generator=gen) * 2).to(torch.bfloat16).float()
    return q, k_cache, v_cache, meta, torch.randn(heads, generator=gen), dim ** -0.5


def _amx(q, k_cache, v_cache, meta, scale, sinks=None, window=None):
    """The float32 output of the AMX entry points (decode.c for one token per sequence, else prefill.c per sequence)."""
    if q.shape[0] == len(meta.seq_lens):
        return torch_ops._native_decode_attention(_NATIVE, q, k_cache, v_cache, meta, scale, sinks, window, amx=True)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        start, num_q = meta.query_start_loc[i], meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        assert _NATIVE.prefill_attention_amx(
            q[start].data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables[i].data_ptr(),
            seq_len, num_q, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, out[start].data_ptr(),
            out.stride(0), None if sinks is None else sinks.data_ptr(), window or 0) == 0
    return out


def _float64(q, k_cache, v_cache, meta, scale, sinks=None, window=None):
    if sinks is None and window is None:
        return oracles.paged_attention(q, k_cache.double(), v_cache.double(), meta, scale)
    out = torch.empty(q.shape, dtype=torch.float64)
    tables = meta.block_tables.tolist()
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        keys, values = (oracles.gather_context(c, tables[i], seq_len) for c in (k_cache, v_cache))
        out[start:end] = sink_window_oracle(q[start:end], keys, values, sinks, window, seq_len - (end - start), scale)
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("extra", [{}, {"window": 50, "sinks": True}], ids=["plain", "window-sinks"])
def test_amx_attention_matches_float64_within_bfloat16_rounding(name, extra):
    """bfloat16 q and P (8 significant bits each) put a score off by up to ~2^-9 of |q||k| and a weight by 2^-9 of
    itself: on these unit-scale values the outputs stay within 2e-2 of float64 (the float32 path: ~1e-6), and on
    average within 2e-3."""
    q, k_cache, v_cache, meta, sinks, scale = _case(name, seed=1)
    extra = dict(extra, sinks=sinks) if extra.get("sinks") else extra
    got = _amx(q, k_cache, v_cache, meta, scale, **extra).double()
    want = _float64(q, k_cache, v_cache, meta, scale, **extra)
    err = (got - want).abs()
    assert err.max().item() < 2e-2 and err.mean().item() < 2e-3, (err.max().item(), err.mean().item())


def _rows_alone(q, k_cache, v_cache, meta, scale, positions, **extra):
    """Each query row of a one-sequence prefill decoded alone: its position's context, one new token."""
    rows = []
    for p in positions:
        one = type(meta)([0, 1], [p + 1], meta.block_runs, meta.slot_mapping[p:p + 1], meta.block_tables,
                         meta.block_size)
        rows.append(_amx(q[p:p + 1].contiguous(), k_cache, v_cache, one, scale, **extra))
    return torch.cat(rows)


@pytest.mark.parametrize("name", ["prefill-gqa", "head-48"])
@pytest.mark.parametrize("extra", [{}, {"window": 70, "sinks": True}], ids=["plain", "window-sinks"])
def test_a_row_is_the_same_bits_in_a_prefill_an_extend_and_a_decode(name, extra):
    """One sequence's rows: the whole prompt in one prefill; its last 45 positions as an extend over the rest; each of
    several positions (inside a chunk, at the 128-position split edges, the last) decoded alone, and the same rows
    decoded as one batch of sequences that share the pool; one thread and two."""
    q, k_cache, v_cache, meta, sinks, scale = _case(name, seed=2)
    extra = dict(extra, sinks=sinks) if extra.get("sinks") else extra
    n = meta.seq_lens[0]
    positions = [5, 126, 127, 128, 129, n - 2, n - 1]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = _amx(q, k_cache, v_cache, meta, scale, **extra)
            ext_meta = type(meta)([0, 45], [n], meta.block_runs, meta.slot_mapping[-45:], meta.block_tables,
                                  meta.block_size)
            assert torch.equal(_amx(q[-45:].contiguous(), k_cache, v_cache, ext_meta, scale, **extra), full[-45:])
            assert torch.equal(_rows_alone(q, k_cache, v_cache, meta, scale, positions, **extra), full[positions])
            tables = meta.block_tables.expand(len(positions), -1).contiguous()
            batch = type(meta)(list(range(len(positions) + 1)), [p + 1 for p in positions], meta.block_runs,
                               meta.slot_mapping[positions], tables, meta.block_size)
            assert torch.equal(_amx(q[positions].contiguous(), k_cache, v_cache, batch, scale, **extra),
                               full[positions])
    finally:
        torch.set_num_threads(before)


def test_the_ops_run_the_amx_arithmetic_where_its_class_chose_it(monkeypatch):
    """`paged_attention` over a bfloat16 pool takes the class's choice: forced "c-amx", a decode batch gives the AMX
    entry point's output (rounded); forced "c-bf16", the widened path's, which differs from it."""
    q, k_cache, v_cache, meta, _, scale = _case("decode-batch", seed=3)
    qb = q.to(torch.bfloat16)
    amx = _amx(q, k_cache, v_cache, meta, scale).to(torch.bfloat16)
    monkeypatch.setenv(cpu_select.ENV, "bf16-attention=c-amx")
    assert torch_ops.bf16_attention_amx(8, 2, 64)
    assert torch.equal(torch_ops.paged_attention(qb, k_cache, v_cache, meta, scale), amx)
    monkeypatch.setenv(cpu_select.ENV, "bf16-attention=c-bf16")
    assert not torch_ops.bf16_attention_amx(8, 2, 64)
    widened = torch_ops.paged_attention(qb, k_cache, v_cache, meta, scale)
    assert not torch.equal(widened, amx)
    torch.testing.assert_close(widened.float(), amx.float(), atol=3e-2, rtol=0)
