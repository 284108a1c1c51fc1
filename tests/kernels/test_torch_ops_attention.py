"""torch_ops.paged_attention (the CPU path: torch's flash kernel on views of the pool, runs merged by log-sum-exp,
or plain matmuls) against the float64 oracle: dense causal attention over the gathered context."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import torch_ops
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

from tests.kernels import oracles


def dense_reference(q, k_cache, v_cache, table, seq_len, scale):
    k, v = oracles.gather_context(k_cache, table, seq_len), oracles.gather_context(v_cache, table, seq_len)
    return oracles.attention(q, k, v, scale).float()


@pytest.mark.parametrize("flash", [True, False], ids=["flash-kernel", "matmul"])
@pytest.mark.parametrize("num_q", [1, 4, 8, 9, 12, 20, 27])  # decode, extend (from 8: causal pieces), prefill
def test_runs_merged_by_lse_equal_dense_attention(monkeypatch, flash, num_q):
    if not flash:
        monkeypatch.setattr(torch_ops, "_FLASH_CPU", None)
    torch.manual_seed(num_q)
    block, kv_heads, group, dim = 4, 2, 3, 16
    k_cache, v_cache = torch.randn(32, block, kv_heads, dim), torch.randn(32, block, kv_heads, dim)
    table = [5, 6, 9, 10, 11, 2, 3]  # three runs of consecutive blocks, out of order
    seq_len = 27  # the last block is partial
    q = torch.randn(num_q, kv_heads * group, dim)
    meta = AttentionMetadata([0, num_q], [seq_len], [contiguous_runs(table, len(table))],
                             torch.zeros(num_q, dtype=torch.int64), torch.tensor([table], dtype=torch.int32), block)
    out = torch_ops.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(out, dense_reference(q, k_cache, v_cache, table, seq_len, dim ** -0.5),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_pieces_accumulate_in_float32(dtype):
    """The unmasked + causal pieces of a prefill over a cached prefix, on a half-precision pool."""
    torch.manual_seed(3)
    block, kv_heads, group, dim, num_q = 4, 2, 2, 16, 12
    k_cache = torch.randn(16, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn(16, block, kv_heads, dim).to(dtype)
    table, seq_len = [3, 4, 5, 9, 10], 19  # two runs; the first new token (position 7) lies inside the first run
    q = torch.randn(num_q, kv_heads * group, dim).to(dtype)
    meta = AttentionMetadata([0, num_q], [seq_len], [contiguous_runs(table, len(table))],
                             torch.zeros(num_q, dtype=torch.int64), torch.tensor([table], dtype=torch.int32), block)
    out = torch_ops.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    assert out.dtype == dtype
    want = dense_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_len, dim ** -0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("flash", [True, False], ids=["flash-kernel", "matmul"])
def test_batch_of_one_run_and_split_contexts(monkeypatch, flash):
    """A batch as the decoder passes it: q a strided view of its q/k buffer; decodes over one run of blocks and
    over three runs, next to an extend. Each sequence's rows equal dense attention over its own context."""
    if not flash:
        monkeypatch.setattr(torch_ops, "_FLASH_CPU", None)
    torch.manual_seed(5)
    block, kv_heads, group, dim = 4, 2, 3, 16
    k_cache, v_cache = torch.randn(40, block, kv_heads, dim), torch.randn(40, block, kv_heads, dim)
    tables = [[20, 21, 22, 23, 24], [5, 6, 9, 10, 11, 2, 3], [30, 31, 32]]  # one run, three runs, one run
    seq_lens, num_qs = [18, 27, 12], [1, 1, 9]
    starts = [0, 1, 2, 11]
    qk = torch.randn(starts[-1], kv_heads * group + kv_heads, dim)  # [T, Hq + Hkv, D]: q rows then k rows
    q = qk[:, :kv_heads * group]  # non-contiguous over tokens
    width = max(map(len, tables))
    meta = AttentionMetadata(starts, seq_lens, [contiguous_runs(t, len(t)) for t in tables],
                             torch.zeros(starts[-1], dtype=torch.int64),
                             torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32), block)
    out = torch_ops.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    for i, (table, seq_len) in enumerate(zip(tables, seq_lens)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows], dense_reference(q[rows], k_cache, v_cache, table, seq_len, dim ** -0.5),
                                   atol=2e-5, rtol=1e-4)
