"""The torch twin's attention with sinks and a sliding window (`torch_ops.paged_attention(sinks=, window=)`, gpt-oss)
against a float64 oracle written from the definition, over scattered block tables, several sequences mixing prompt
chunks (the masked path, its blocks of rows split: `_SINK_QUERY_ROWS` made small) and decode rows (the row-alone
path); and a verify's rows have the bits of the same positions decoded one at a time."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import torch_ops
from tsterm_kernels.metadata import AttentionMetadata, BlockRuns

BLOCK = 4


def oracle(q, keys, values, sinks, window, first_pos):
    """q [nq, Hq, D], keys / values [n, Hkv, D] (the whole context) -> [nq, Hq, D] float64, one row at a time."""
    nq, Hq, D = q.shape
    group = Hq // keys.shape[1]
    out = torch.zeros(nq, Hq, D, dtype=torch.float64)
    for r in range(nq):
        pos = first_pos + r
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(Hq):
            k, v = keys[lo:pos + 1, h // group].double(), values[lo:pos + 1, h // group].double()
            logits = k @ q[r, h].double() * D ** -0.5
            weights = torch.exp(logits)
            denom = weights.sum() + (torch.exp(sinks[h].double()) if sinks is not None else 0.0)
            out[r, h] = (weights / denom) @ v
    return out


def build(seq_specs, Hq, Hkv, D, num_blocks=64, seed=0):
    """seq_specs: (context length, new tokens) per sequence; K/V written at shuffled blocks. Returns the pool, q,
    the metadata and each sequence's whole K/V."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BLOCK, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, Hkv, D, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, contexts, starts = [], [], [0]
    for seq_len, new in seq_specs:
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        tables.append(blocks)
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)])
        contexts.append((k_cache.view(-1, Hkv, D)[slots], v_cache.view(-1, Hkv, D)[slots]))
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=[s for s, _ in seq_specs], block_runs=BlockRuns(tables),
                             slot_mapping=torch.zeros(starts[-1], dtype=torch.int64), block_tables=block_tables,
                             block_size=BLOCK)
    q = torch.randn(starts[-1], Hq, D, generator=gen)
    return k_cache, v_cache, q, meta, contexts


@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_sink_window_attention_matches_the_oracle(window, with_sinks, monkeypatch):
    monkeypatch.setattr(torch_ops, "_SINK_ROWS_ALONE", 3)  # the 13- and 6-token chunks run masked, in blocks ...
    monkeypatch.setattr(torch_ops, "_SINK_QUERY_ROWS", 4)  # ... split mid-sequence; the others row by row
    Hq, Hkv, D = 6, 2, 8
    specs = [(13, 13), (9, 1), (17, 6), (2, 2)]  # a prompt, a decode row, a chunk after cached tokens, a short one
    k_cache, v_cache, q, meta, contexts = build(specs, Hq, Hkv, D)
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    if not with_sinks and window is None:
        sinks = torch.full((Hq,), -1e30)  # (the sink path with a sink that weighs nothing: plain causal attention)
    out = torch_ops.paged_attention(q, k_cache, v_cache, meta, D ** -0.5, sinks=sinks, window=window)
    for i, (seq_len, new) in enumerate(specs):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        want = oracle(q[rows], *contexts[i], sinks if with_sinks else None, window, seq_len - new)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-6)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """Each row of a 9-token extend (a verify of 8 drafts) equals the same position run as a one-row decode, bit for
    bit."""
    Hq, Hkv, D = 5, 1, 16
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(4))
    k_cache, v_cache, q, meta, _ = build([(20, 9)], Hq, Hkv, D)
    for window in (None, 4):
        together = torch_ops.paged_attention(q, k_cache, v_cache, meta, D ** -0.5, sinks=sinks, window=window)
        for r in range(9):
            one = AttentionMetadata(query_start_loc=[0, 1], seq_lens=[20 - 8 + r], block_runs=meta.block_runs,
                                    slot_mapping=meta.slot_mapping[:1], block_tables=meta.block_tables,
                                    block_size=BLOCK)
            alone = torch_ops.paged_attention(q[r:r + 1], k_cache, v_cache, one, D ** -0.5, sinks=sinks,
                                              window=window)
            assert torch.equal(alone[0], together[r]), (window, r)


def test_a_rows_bits_do_not_depend_on_where_its_blocks_are():
    """The same context in one run of blocks and scattered over the pool (another engine, another allocation): a
    decode row and a verify's rows come out bit for bit the same."""
    Hq, Hkv, D, seq_len = 6, 2, 16, 23
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(seq_len, Hkv, D, generator=gen), torch.randn(seq_len, Hkv, D, generator=gen)
    q, sinks = torch.randn(4, Hq, D, generator=gen), torch.randn(Hq, generator=gen)
    outs = []
    for blocks in (list(range(2, 8)), [9, 3, 14, 6, 11, 1]):  # 6 blocks of 4: one run, or six
        k_cache, v_cache = torch.zeros(16, BLOCK, Hkv, D), torch.zeros(16, BLOCK, Hkv, D)
        for p in range(seq_len):
            k_cache[blocks[p // BLOCK], p % BLOCK], v_cache[blocks[p // BLOCK], p % BLOCK] = keys[p], values[p]
        table = torch.tensor([blocks], dtype=torch.int32)
        step = []
        for rows in (1, 4):  # a decode of the last position; a verify of the last four
            meta = AttentionMetadata(query_start_loc=[0, rows], seq_lens=[seq_len], block_runs=BlockRuns([blocks]),
                                     slot_mapping=torch.zeros(rows, dtype=torch.int64), block_tables=table,
                                     block_size=BLOCK)
            step += [torch_ops.paged_attention(q[4 - rows:], k_cache, v_cache, meta, D ** -0.5, sinks=sinks,
                                               window=window) for window in (None, 5)]
        outs.append(step)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
