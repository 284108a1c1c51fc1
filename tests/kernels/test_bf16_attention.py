"""Attention over a bfloat16 KV pool on the CPU (csrc/attention.c through decode.c's and prefill.c's `_bf16` entry
points): the C kernels read the pool in place, each K / V row widened to float32 as it is loaded. A row's result must be
the bits of the float32 kernels on the pool converted to float32 (`torch_ops._bf16_attention_converted`, the path
before, which copied the step's blocks per layer), on every C build this CPU runs, in decodes (batched, over contexts
crossing 128-position splits) and prefills / extends, with attention sinks and sliding windows; against a float64
oracle on the same bfloat16 values; and with no copy of the pool (the converting path is never taken)."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, cpu_select, torch_ops

from tests.kernels import oracles
from tests.kernels.cases import paged_batch
from tests.kernels.test_sink_window_kernels import oracle as sink_window_oracle

# (seq_lens, query_lens, kv heads, query heads, head size, block size): decodes (one new token each) and prefills
CASES = {
    "decode-batch": ([300, 37, 129, 1], [1, 1, 1, 1], 2, 6, 32, 16),
    "decode-one-long": ([700], [1], 1, 4, 64, 32),
    "prefill": ([150], [150], 2, 4, 16, 16),
    "extend-and-decode": ([260, 90], [45, 1], 2, 8, 32, 16),
}


def _case(name: str, seed: int = 0):
    seq_lens, query_lens, kv_heads, heads, dim, block = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, block, kv_heads, dim, torch.bfloat16, gen)
    q = (torch.randn(sum(query_lens), heads, dim, generator=gen) * 2).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen)
    return q, k_cache, v_cache, meta, sinks, dim ** -0.5


@pytest.fixture
def widened(cpu_isa, monkeypatch) -> str:
    """cpu_isa's build, with the bfloat16 pools' attention class held to the widened arithmetic (on an AMX machine its
    measurement would choose AMX's, tests/kernels/test_amx_attention.py)."""
    monkeypatch.setenv(cpu_select.ENV, f"{cpu_isa},bf16-attention=c-bf16")
    return cpu_isa


def _never_converted(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the bfloat16 pool was converted to float32 (the path that copies the step's blocks)")
    monkeypatch.setattr(torch_ops, "_bf16_attention_converted", refuse)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("sink_window", [{}, {"window": 40}, {"sinks": True, "window": 129}, {"sinks": True}],
                         ids=["plain", "window", "sinks-window", "sinks"])
def test_reading_the_pool_in_place_gives_the_converted_pools_bits(widened, monkeypatch, name, sink_window):
    q, k_cache, v_cache, meta, sinks, scale = _case(name)
    extra = dict(sink_window, sinks=sinks) if "sinks" in sink_window else dict(sink_window)
    want = torch_ops._bf16_attention_converted(q, k_cache, v_cache, meta, scale, extra.get("sinks"),
                                               extra.get("window"))
    _never_converted(monkeypatch)
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, scale, **extra)
    assert got.dtype is torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernels_unrounded_output_matches_the_float64_oracle(cpu_isa, name):
    """The C calls' float32 output (before rounding to bfloat16) against float64 attention over the pool's bfloat16
    values, within float32 accuracy; with sinks and a window against the definition's oracle."""
    q, k_cache, v_cache, meta, sinks, scale = _case(name, seed=1)
    native = cpu_native.load_variant(cpu_select.VARIANT_OF[cpu_isa])
    qf = q.float()
    want = oracles.paged_attention(qf, k_cache.double(), v_cache.double(), meta, scale)
    for extra in ({}, {"sinks": sinks.contiguous(), "window": 50}):
        out = _call(native, qf, k_cache, v_cache, meta, scale, **extra)
        if extra:
            want = _sink_window_want(qf, k_cache, v_cache, meta, scale, **extra)
        torch.testing.assert_close(out.double(), want, atol=3e-6, rtol=1e-5)


def _call(native, qf, k_cache, v_cache, meta, scale, sinks=None, window=None):
    """csrc's bfloat16 entry points called directly: decode.c for one token per sequence, else prefill.c."""
    if qf.shape[0] == len(meta.seq_lens):
        return torch_ops._native_decode_attention(native, qf, k_cache, v_cache, meta, scale, sinks, window)
    out = torch.empty_like(qf)
    for i, seq_len in enumerate(meta.seq_lens):
        start, num_q = meta.query_start_loc[i], meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        assert native.prefill_attention_bf16(
            qf[start].data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables[i].data_ptr(),
            seq_len, num_q, qf.shape[1], k_cache.shape[2], qf.shape[2], k_cache.shape[1], scale,
            out[start].data_ptr(), out.stride(0), None if sinks is None else sinks.data_ptr(), window or 0) == 0
    return out


def _sink_window_want(qf, k_cache, v_cache, meta, scale, sinks, window):
    out = torch.empty(qf.shape, dtype=torch.float64)
    tables = meta.block_tables.tolist()
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        keys = oracles.gather_context(k_cache, tables[i], seq_len)
        values = oracles.gather_context(v_cache, tables[i], seq_len)
        out[start:end] = sink_window_oracle(qf[start:end], keys, values, sinks, window, seq_len - (end - start), scale)
    return out


def test_a_decode_row_is_the_bits_of_the_same_row_in_a_prefill(cpu_isa):
    """The bfloat16 path keeps the float32 kernels' promise: the last position's row of a prefill over the pool, and
    the same row decoded (alone, one thread or two), give the same bits."""
    q, k_cache, v_cache, meta, _, scale = _case("prefill", seed=2)
    native = cpu_native.load_variant(cpu_select.VARIANT_OF[cpu_isa])
    qf = q.float()
    prefill = _call(native, qf, k_cache, v_cache, meta, scale)
    last = qf[-1:].contiguous()
    decode_meta = type(meta)([0, 1], meta.seq_lens, meta.block_runs, meta.slot_mapping[-1:], meta.block_tables,
                             meta.block_size)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(_call(native, last, k_cache, v_cache, decode_meta, scale), prefill[-1:])
    finally:
        torch.set_num_threads(before)
