"""Attention sinks and sliding windows (gpt-oss) in the C kernels (csrc/attention.c, prefill.c, decode.c through
`torch_ops.paged_attention(sinks=, window=)`), against a float64 oracle written here from the definition:

    out[p, h] = sum_{j in W(p)} e^{s_j} v_j / (sum_{j in W(p)} e^{s_j} + e^{sink_h}),  s_j = scale q_p . k_j,
    W(p) = {j : p - window < j <= p}  (every j <= p without a window)

over scattered block tables: windows shorter than the prompt, window edges inside a block and on a 128-position
split's edge, sinks with grouped query heads, prefill, extend and decode steps. Then the properties the engine relies
on: a query row's bits are the same in a prefill, an extend and a decode (alone or batched, one thread or two), and
the blocks wholly before a row's window are never read (their table entries may be gone: item 3 of issue 36). The
Triton kernel (`triton_paged_attention`, interpreted on tiny shapes) against the same oracle, with and without
split-K."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import cpu_native, torch_ops
from tsterm_kernels.metadata import AttentionMetadata, BlockRuns
from tsterm_kernels.triton_paged_attention import launch_paged_attention

from tests.kernels.cases import TOLERANCE, paged_batch


def oracle(q, keys, values, sinks, window, first_pos, scale):
    """q [nq, Hq, D] (positions first_pos ...), keys / values [n, Hkv, D] the whole context -> [nq, Hq, D] float64."""
    nq, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    out = torch.zeros(nq, num_heads, head_dim, dtype=torch.float64)
    for r in range(nq):
        pos = first_pos + r
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            k, v = keys[lo:pos + 1, h // group].double(), values[lo:pos + 1, h // group].double()
            logits = (k @ q[r, h].double()) * scale
            top = logits.max() if sinks is None else torch.maximum(logits.max(), sinks[h].double())
            weights = torch.exp(logits - top)
            denom = weights.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - top))
            out[r, h] = (weights / denom) @ v
    return out


class Pool:
    """Sequences' K/V written at shuffled blocks of one pool, and a query for every position of each."""

    def __init__(self, lengths, num_heads, num_kv_heads, head_dim, block, seed=0):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // block) for n in lengths) + 3
        self.block = block
        self.k_cache = torch.randn(num_blocks, block, num_kv_heads, head_dim, generator=gen)
        self.v_cache = torch.randn(num_blocks, block, num_kv_heads, head_dim, generator=gen)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // block))] for n in lengths]
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen) * 2 for n in lengths]

    def slots(self, i, n):
        """The pool slots of sequence i's first n positions [n]."""
        return torch.tensor([self.tables[i][p // self.block] * self.block + p % self.block for p in range(n)])

    def context(self, i, n):
        slots = self.slots(i, n)
        return self.k_cache.flatten(0, 1)[slots], self.v_cache.flatten(0, 1)[slots]

    def step(self, pieces, tables=None):
        """(q, meta) of one step: pieces are (sequence, context length, new tokens)."""
        q = torch.cat([self.q[i][n - new:n] for i, n, new in pieces])
        starts = [0]
        for _, _, new in pieces:
            starts.append(starts[-1] + new)
        tables = tables or [self.tables[i][:-(-n // self.block)] for i, n, _ in pieces]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(starts, [n for _, n, _ in pieces], BlockRuns(tables),
                                 torch.zeros(len(q), dtype=torch.long), block_tables, self.block)
        return q, meta


def attend(pool, pieces, sinks, window, scale, tables=None):
    q, meta = pool.step(pieces, tables)
    out = torch_ops.paged_attention(q, pool.k_cache, pool.v_cache, meta, scale, sinks=sinks, window=window)
    return [out[a:b] for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])]


def sink_logits(num_heads, seed=7):
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


# (name, Hq, Hkv, D, block, sequence lengths, window, sinks)
CASES = [
    ("window-5-in-blocks-of-4-gqa3", 6, 2, 16, 4, (13, 17, 2), 5, True),
    ("window-130-over-splits-gqa4", 8, 2, 32, 16, (600, 450), 130, True),
    ("window-128-on-a-split-edge", 4, 4, 16, 8, (300,), 128, False),
    ("sinks-only-mqa", 5, 1, 16, 4, (40, 9), None, True),
]


@pytest.mark.parametrize("name,Hq,Hkv,D,block,lengths,window,with_sinks", CASES, ids=[c[0] for c in CASES])
def test_the_c_kernels_match_the_float64_oracle(cpu_isa, native_spy, name, Hq, Hkv, D, block, lengths, window,
                                                with_sinks):
    pool = Pool(lengths, Hq, Hkv, D, block)
    sinks = sink_logits(Hq) if with_sinks else None
    scale = D ** -0.5
    prefill, decode = native_spy("prefill_attention_sw"), native_spy("decode_attention_sw")
    # a step of prompts and chunks: the first sequence whole, the others' last tokens after their cached ones
    pieces = [(0, lengths[0], lengths[0])] + [(i, n, min(n, 37)) for i, n in enumerate(lengths) if i]
    outs = attend(pool, pieces, sinks, window, scale)
    assert prefill.calls == len(pieces) and decode.calls == 0
    for (i, n, new), got in zip(pieces, outs):
        want = oracle(pool.q[i][n - new:n], *pool.context(i, n), sinks, window, n - new, scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
    # a decode step: one new token per sequence, at lengths around the window's and the splits' edges
    lens = sorted({min(lengths[0], n) for n in (1, 2, 5, 6, 127, 128, 129, 130, 131, 257, 258, 259, lengths[0])})
    pieces = [(0, n, 1) for n in lens] + [(i, n, 1) for i, n in enumerate(lengths) if i]
    outs = attend(pool, pieces, sinks, window, scale)
    assert decode.calls == 1
    for (i, n, _), got in zip(pieces, outs):
        want = oracle(pool.q[i][n - 1:n], *pool.context(i, n), sinks, window, n - 1, scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)


def test_the_torch_twin_matches_the_oracle_over_splits():
    """Without the C kernels (another dtype or device takes this path) the same long case: the twin's masked
    128-row blocks and its one-row decode against the oracle."""
    Hq, Hkv, D, block, window = 8, 2, 32, 16, 130
    pool = Pool((400,), Hq, Hkv, D, block, seed=1)
    sinks, scale = sink_logits(Hq), D ** -0.5
    saved = cpu_native.load
    try:
        cpu_native.load = lambda: None
        got = attend(pool, [(0, 400, 400)], sinks, window, scale)[0]
        one = attend(pool, [(0, 300, 1)], sinks, window, scale)[0]
    finally:
        cpu_native.load = saved
    torch.testing.assert_close(got.double(), oracle(pool.q[0], *pool.context(0, 400), sinks, window, 0, scale),
                               rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(one.double(), oracle(pool.q[0][299:300], *pool.context(0, 300), sinks, window, 299,
                                                    scale), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_query_rows_bits_are_the_same_in_prefill_extend_and_decode(cpu_isa, threads):
    """With sinks and a window of 200 (rows past position 327 skip the first 128-position split whole; a row's
    window starts mid-split and mid-block), each row's output is the bits of the same row in a prefill of the whole
    sequence, an extend of its last tokens, a decode alone, among other decodes, or beside a prompt chunk."""
    LEN, window = 700, 200
    Hq, Hkv, D, block = 9, 3, 32, 16
    pool = Pool((LEN, LEN), Hq, Hkv, D, block, seed=2)
    pool.q[1] = pool.q[0]  # a second copy of the sequence under other blocks
    for cache in (pool.k_cache, pool.v_cache):
        cache.flatten(0, 1)[pool.slots(1, LEN)] = cache.flatten(0, 1)[pool.slots(0, LEN)]
    sinks, scale = sink_logits(Hq, seed=8), D ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the C kernels' OpenMP threads follow torch's (one libgomp)
    try:
        whole = attend(pool, [(0, LEN, LEN)], sinks, window, scale)[0]
        for p in (0, 1, 127, 128, 199, 200, 201, 327, 328, 329, 455, 456, 600, LEN - 1):
            n = p + 1
            alone = attend(pool, [(0, n, 1)], sinks, window, scale)[0][0]
            batched = attend(pool, [(0, LEN, 1), (1, n, 1), (0, 300, 1)], sinks, window, scale)[1][0]
            mixed = attend(pool, [(0, 250, 40), (1, n, 1)], sinks, window, scale)[1][0]
            extend = attend(pool, [(1, n, min(n, 37))], sinks, window, scale)[0][-1]
            for got in (alone, batched, mixed, extend):
                assert torch.equal(got, whole[p]), p
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_blocks_wholly_before_every_window_are_never_read(cpu_isa, path):
    """An extend of 20 tokens and decodes far past the window: the blocks wholly before the first new token's window
    are filled with NaN and left out of the block table (-1, as a block given back to the pool may be); the outputs
    are the bits of the intact run, so those blocks were skipped, not masked."""
    Hq, Hkv, D, block, window, LEN = 6, 2, 16, 8, 100, 500
    pool = Pool((LEN,), Hq, Hkv, D, block, seed=3)
    sinks, scale = sink_logits(Hq, seed=9), D ** -0.5
    steps = [[(0, LEN, 20)], [(0, LEN, 1), (0, 450, 1)]]
    saved = cpu_native.load
    try:
        if path == "torch":
            cpu_native.load = lambda: None
        intact = [attend(pool, pieces, sinks, window, scale) for pieces in steps]
        first_seen = min(n - new for pieces in steps for _, n, new in pieces) - window + 1  # any row's first key
        gone = first_seen // block  # blocks [0, gone) hold no key of any row's window
        assert gone >= 40
        for b in pool.tables[0][:gone]:
            pool.k_cache[b], pool.v_cache[b] = float("nan"), float("nan")
        table = [-1] * gone + pool.tables[0][gone:]
        for pieces, want in zip(steps, intact):
            got = attend(pool, pieces, sinks, window, scale, tables=[table[:-(-n // block)] for _, n, _ in pieces])
            for g, w in zip(got, want):
                assert torch.equal(g, w)
    finally:
        cpu_native.load = saved


def test_bad_windows_and_sinks_are_refused_by_name():
    pool = Pool((10,), 4, 2, 16, 4)
    q, meta = pool.step([(0, 10, 10)])
    with pytest.raises(ValueError, match="window"):
        torch_ops.paged_attention(q, pool.k_cache, pool.v_cache, meta, 0.25, window=0)
    with pytest.raises(ValueError, match="sinks"):
        torch_ops.paged_attention(q, pool.k_cache, pool.v_cache, meta, 0.25, sinks=torch.zeros(3))


# ---- the Triton kernel (interpreted on the CPU: tiny shapes), against the same oracle

TRITON_BATCHES = {  # (context lengths, new tokens): windows shorter than the prompts, decodes far past the window
    "decode": ([37, 5, 20], [1, 1, 1]),
    "mixed": ([13, 7, 30, 1], [13, 2, 1, 1]),
    "extend": ([41], [19]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", list(TRITON_BATCHES), ids=list(TRITON_BATCHES))
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,with_sinks", [(5, True), (7, False), (None, True)])
def test_the_triton_kernel_matches_the_oracle(poison, dtype, batch, num_splits, window, with_sinks):
    seq_lens, query_lens = TRITON_BATCHES[batch]
    gen = torch.Generator().manual_seed(len(seq_lens) * 10 + num_splits)
    num_kv_heads, group, head_dim, block = 2, 3, 16, 4  # GQA: 3 query heads per KV head (padded to 4 rows)
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, block, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    sinks = sink_logits(num_kv_heads * group) if with_sinks else None
    out = launch_paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, num_splits=num_splits, sinks=sinks,
                                 window=window)
    tables = [[b for b in row if b >= 0] for row in meta.block_tables.tolist()]
    for i, (n, new) in enumerate(zip(seq_lens, query_lens)):
        slots = torch.tensor([tables[i][p // block] * block + p % block for p in range(n)])
        keys, values = k_cache.flatten(0, 1)[slots].float(), v_cache.flatten(0, 1)[slots].float()
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        want = oracle(q[rows].float(), keys, values, sinks, window, n - new, head_dim ** -0.5).to(dtype)
        torch.testing.assert_close(out[rows], want, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_the_triton_kernel_never_reads_the_tiles_before_every_window(poison, num_splits):
    """A decode at position 60 and an extend of 3 tokens at 47..49 with a window of 6: the blocks wholly before the
    first key any of these rows sees (42: blocks 0..9, the last two inside the first tile the extend reads, 32..47)
    are NaN and out of the table (-1); the output is the intact run's."""
    Hq, Hkv, D, block, window = 4, 2, 16, 4, 6
    pool = Pool((61, 50), Hq, Hkv, D, block, seed=4)
    sinks, scale = sink_logits(Hq, seed=5), D ** -0.5
    pieces = [(0, 61, 1), (1, 50, 3)]
    q, meta = pool.step(pieces)
    intact = launch_paged_attention(q, pool.k_cache, pool.v_cache, meta, scale, num_splits=num_splits, sinks=sinks,
                                    window=window)
    gone = (47 - window + 1) // block
    tables = []
    for i, n, _ in pieces:
        for b in pool.tables[i][:gone]:
            pool.k_cache[b], pool.v_cache[b] = float("nan"), float("nan")
        tables.append([-1] * gone + pool.tables[i][gone:-(-n // block)])
    q, meta = pool.step(pieces, tables)
    got = launch_paged_attention(q, pool.k_cache, pool.v_cache, meta, scale, num_splits=num_splits, sinks=sinks,
                                 window=window)
    assert torch.equal(got, intact)


def test_the_triton_kernel_refuses_bad_sinks_and_windows(triton_ops):
    pool = Pool((10,), 4, 2, 16, 4)
    q, meta = pool.step([(0, 10, 10)])
    with pytest.raises(ValueError, match="window"):
        triton_ops.paged_attention(q, pool.k_cache, pool.v_cache, meta, 0.25, window=0)
    with pytest.raises(ValueError, match="sinks"):
        triton_ops.paged_attention(q, pool.k_cache, pool.v_cache, meta, 0.25, sinks=torch.zeros(4, dtype=torch.float64))
