"""The Triton absorbed-MLA attention (kernels/triton_mla.py), interpreted, against a float64 oracle written here from
the definition: each query row of a sequence sees the cached rows [latent | k_rope] at positions 0 .. its own; head
h scores q_lat[h] . latent + q_rope[h] . k_rope, times the scale; its output is the softmax-weighted sum of the
latents. Ragged batches (decodes, a verify-like chunk, one-token contexts) over shuffled block tables whose unused
slots hold NaN, odd head counts (one and several head blocks, a partial one), widths that are not powers of two,
block sizes that are not either, several splits per row (and more split programs than a row uses), float16.
A row's output is the same bits alone, in a verify chunk and beside longer sequences; a captured graph's padding row
(context 0) gets zeros."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import triton_mla
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

from tests.kernels.cases import paged_batch

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def oracle(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """[T, Hq, R] float64, row by row, head by head, from the block tables (not the kernel's runs or splits)."""
    rank = q_lat.shape[2]
    block_size = cache.shape[1]
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for s, seq_len in enumerate(meta.seq_lens):
        table = meta.block_tables[s].tolist()
        first, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        for row in range(first, end):
            position = seq_len - (end - first) + (row - first)
            keys = [cache[table[p // block_size], p % block_size, 0].double() for p in range(position + 1)]
            if not keys:
                continue
            rows = torch.stack(keys)  # [n, R + DR]
            latent, k_rope = rows[:, :rank], rows[:, rank:]
            for h in range(q_lat.shape[1]):
                scores = (latent @ q_lat[row, h].double() + k_rope @ q_rope[row, h].double()) * scale  # [n]
                weights = torch.exp(scores - scores.max())
                out[row, h] = (weights / weights.sum()) @ latent
    return out


def batch(seq_lens, query_lens, heads, rank, rope, block_size, dtype, seed):
    """(q_lat [T, Hq, R] as a strided view, q_rope [T, Hq, DR], NaN-poisoned pool, meta)."""
    gen = torch.Generator().manual_seed(seed)
    cache, _, meta = paged_batch(seq_lens, query_lens, block_size, 1, rank + rope, dtype, gen)
    tokens = sum(query_lens)
    q_lat = torch.randn(heads, tokens, rank, generator=gen).to(dtype).transpose(0, 1)  # [T, Hq, R], head-major
    q_rope = torch.randn(tokens, heads, rope, generator=gen).to(dtype)
    return q_lat, q_rope, cache, meta


# (seq_lens, query_lens)
DECODE = ([37, 5, 20, 1], [1, 1, 1, 1])  # several blocks, partial last blocks, a one-token context
MIXED = ([13, 30, 9], [13, 1, 4])  # a whole prompt, a decode, a verify-like chunk over a cached prefix
LONG = ([300, 41], [2, 1])  # past MIN_SPLIT_TOKENS: the long rows take two splits at the kernel's own constants


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [5, 17])  # one head block (11 rows masked), two (the second nearly empty)
@pytest.mark.parametrize("case", [DECODE, MIXED, LONG], ids=["decode", "mixed", "long"])
def test_matches_the_oracle(poison, dtype, heads, case):
    rank, rope, block_size = 24, 8, 5
    q_lat, q_rope, cache, meta = batch(*case, heads, rank, rope, block_size, dtype, seed=heads)
    scale = 0.3
    out = triton_mla.mla_attention(q_lat, q_rope, cache, meta, scale)
    assert out.dtype == torch.float32 and out.shape == q_lat.shape
    torch.testing.assert_close(out.double(), oracle(q_lat, q_rope, cache, meta, scale), **TOLERANCE[dtype])
    assert meta.query_start_loc_device.tolist() == meta.query_start_loc  # built once, kept for the step's layers


@pytest.mark.parametrize("rank, rope, rows_per_launch", [(20, 12, 64), (32, 16, 5)])
def test_many_splits_per_row(poison, monkeypatch, rank, rope, rows_per_launch):
    """Splits of 16 keys, at most 3 a row: rows of 1, 2, 3 splits and capped ones (more keys per split) in one
    step; the grid has 3 split programs per row, so the short rows' extra ones are empty and must add nothing. The
    12 rows in one launch, and in launches of 5, 5 and 2 rows sharing one buffer of partial outputs."""
    monkeypatch.setattr(triton_mla, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(triton_mla, "MAX_SPLITS", 3)
    monkeypatch.setattr(triton_mla, "ROWS_PER_LAUNCH", rows_per_launch)
    q_lat, q_rope, cache, meta = batch([9, 30, 47, 90, 61], [1, 1, 3, 1, 6], 3, rank, rope, 4, torch.float32, seed=5)
    out = triton_mla.mla_attention(q_lat, q_rope, cache, meta, 0.25)
    torch.testing.assert_close(out.double(), oracle(q_lat, q_rope, cache, meta, 0.25), **TOLERANCE[torch.float32])


def _sub(meta: AttentionMetadata, cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int],
         query_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    return AttentionMetadata(starts, seq_lens, [contiguous_runs(t, len(t)) for t in tables],
                             torch.zeros(starts[-1], dtype=torch.int64),
                             torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
                             meta.block_size)


@pytest.mark.parametrize("min_split, max_splits, other_len", [(16, 2, 130), (256, 8, 300)])
def test_a_row_is_the_same_bits_alone_in_a_verify_chunk_and_in_a_batch(monkeypatch, min_split, max_splits,
                                                                         other_len):
    """The row at position 40 of a sequence: decoded alone (context 41), as the first of a 30-row verify-like chunk
    (context 70, the later rows cached: at 2 splits a row, its splits would be cut elsewhere if the sequence's
    length chose them), and beside a longer sequence that gives the step more split programs."""
    monkeypatch.setattr(triton_mla, "MIN_SPLIT_TOKENS", min_split)
    monkeypatch.setattr(triton_mla, "MAX_SPLITS", max_splits)
    q_lat, q_rope, cache, meta = batch([70, other_len], [30, 1], 3, 24, 8, 4, torch.float32, seed=9)
    table, other = ([b for b in meta.block_tables[s].tolist() if b >= 0] for s in (0, 1))
    alone_meta = _sub(meta, cache, [table[:11]], [41], [1])
    alone = triton_mla.mla_attention(q_lat[:1], q_rope[:1], cache, alone_meta, 0.3)
    verify = triton_mla.mla_attention(q_lat[:30], q_rope[:30], cache, _sub(meta, cache, [table], [70], [30]), 0.3)
    both = triton_mla.mla_attention(torch.cat((q_lat[:1], q_lat[30:])), torch.cat((q_rope[:1], q_rope[30:])), cache,
                                    _sub(meta, cache, [table[:11], other], [41, other_len], [1, 1]), 0.3)
    assert torch.equal(verify[0], alone[0]) and torch.equal(both[0], alone[0])
    torch.testing.assert_close(alone.double(), oracle(q_lat[:1], q_rope[:1], cache, alone_meta, 0.3),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("min_split", [16, 256])
def test_a_padding_row_gets_zeros(poison, monkeypatch, min_split):
    """A captured decode graph's padding rows: one query row each, context length 0 (no block)."""
    monkeypatch.setattr(triton_mla, "MIN_SPLIT_TOKENS", min_split)
    q_lat, q_rope, cache, meta = batch([23, 1, 1], [1, 1, 1], 5, 24, 8, 4, torch.float32, seed=3)
    meta.seq_lens = [23, 0, 0]
    meta.block_tables[1:] = -1
    out = triton_mla.mla_attention(q_lat, q_rope, cache, meta, 0.3)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    meta.seq_lens = [23]
    want = oracle(q_lat[:1], q_rope[:1], cache, _sub(meta, cache, [meta.block_tables[0].tolist()[:6]], [23], [1]), 0.3)
    torch.testing.assert_close(out[:1].double(), want, **TOLERANCE[torch.float32])


def test_bad_inputs_are_refused_by_name():
    q_lat, q_rope, cache, meta = batch([9], [1], 3, 24, 8, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="R \\+ DR = 36"):
        triton_mla.mla_attention(q_lat, torch.zeros(1, 3, 12), cache, meta, 0.3)
    with pytest.raises(ValueError, match="share T and Hq"):
        triton_mla.mla_attention(q_lat, q_rope[:, :2], cache, meta, 0.3)
    with pytest.raises(ValueError, match="unit last stride"):
        triton_mla.mla_attention(q_lat.transpose(1, 2).contiguous().transpose(1, 2), q_rope, cache, meta, 0.3)
    with pytest.raises(ValueError, match="query_start_loc"):
        triton_mla.mla_attention(torch.cat((q_lat, q_lat)), torch.cat((q_rope, q_rope)), cache, meta, 0.3)


def test_the_triton_ops_carry_the_kernel_and_the_torch_ops_do_not():
    from tsterm_kernels import dispatch

    assert dispatch.load("triton").mla_attention is triton_mla.mla_attention
    assert dispatch.load("torch").mla_attention is None  # the MLA layer composes it from the paged attention
