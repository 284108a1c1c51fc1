"""Paged attention for decode and extend/prefill: K/V read in place through the block table, GQA, causal,
split-K over long contexts with a log-sum-exp merge.

Twin: `tsterm_kernels.torch_ops.paged_attention`.

Work split. A program owns one KV head, one split of the context and one query tile: BLOCK_Q consecutive new
tokens of one sequence times the G query heads that share the KV head (rows = BLOCK_Q * G_PAD), so each K/V
tile is loaded once for the whole group. Query tiles of all sequences are numbered on one axis: sequence s owns
tile slots [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1), an upper bound of its tile count, so the grid
is sized from T and S alone and each program finds its sequence by binary search over query_start_loc.

Split-K. With few programs (decode of a handful of long sequences) the context is cut into NUM_SPLITS slices
processed in parallel; each writes its normalised partial output and log2-sum-exp, and a second kernel merges
them. With one split the first kernel writes the output directly.

Precision. Loads are cast to float32 at once; dot operands go back to the cache dtype (tensor cores for bf16/fp16)
and float32 dots are exact ("ieee", not tf32), like the twin's float32 matmuls.

Sinks and sliding windows (gpt-oss). A sink (a learned logit per query head) joins the denominator once: in the
normalisation of a one-split launch, else in the merge. A window (WINDOW, a compile-time constant: one per layer)
masks keys at or before query - WINDOW, and a tile's context starts at the BLOCK_N-aligned tile holding its first
row's first key: the tiles wholly before every row's window are never loaded (nor their block-table entries read),
and the KV tiles keep their positions (multiples of BLOCK_N), whatever the window.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from tsterm_kernels.metadata import AttentionMetadata

LOG2_E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in merging than it gains
MAX_SPLITS = 64


@triton.jit
def _paged_attention_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sinks_ptr,  # [Hq] float32 sink logits (read only with HAS_SINKS)
    # sizes and strides (head_dim is unit-stride everywhere; lse is [split, token, head] with unit head stride)
    num_seqs, num_splits, group_size, block_size, qk_scale_log2,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_split, stride_out_token, stride_out_head,
    stride_lse_split, stride_lse_token,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # ---- find the sequence owning this tile slot: the last s with qsl[s] // BLOCK_Q + s <= tile
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owns_from = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(owns_from <= tile, mid, lo)
        hi = tl.where(owns_from <= tile, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of this tile, within the sequence
    if first >= q_len:  # a spare slot of the upper bound
        return
    context_before = seq_len - q_len  # cached tokens before the new ones

    # ---- rows of the tile: (token, head of the group); load Q
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = first + rows // GROUP_PAD  # [M] token within the sequence's new tokens
    head = kv_head * group_size + rows % GROUP_PAD  # [M] query head
    row_valid = (token < q_len) & (rows % GROUP_PAD < group_size)
    query_pos = context_before + token  # [M] position of each row's token in its context
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)  # [M, D]
    dot_dtype = k_cache_ptr.dtype.element_ty
    q = q.to(dot_dtype)

    # ---- this split's slice of the keys the tile may see (causal: up to its last token; with a window, from its
    # first token's first key, in tiles at multiples of BLOCK_N)
    kv_end = context_before + tl.minimum(first + BLOCK_Q, q_len)
    kv_start = context_before * 0
    if WINDOW > 0:
        kv_start = tl.maximum(context_before + first - WINDOW + 1, 0)
    kv_base = kv_start // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_base, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = kv_base + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)

    # ---- online softmax over KV tiles, each slot found through the block table
    run_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start in range(kv_lo, kv_hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)  # [N]
        key_valid = key_pos < kv_hi
        if WINDOW > 0:  # (the keys before every row's window in the first tile: not read)
            key_valid = key_valid & (key_pos >= kv_start)
        block = tl.load(table + key_pos // block_size, mask=key_valid, other=0).to(tl.int64)  # [N]
        slot_offset = (block * stride_cache_block + (key_pos % block_size) * stride_cache_slot
                       + kv_head * stride_cache_head)  # [N]
        k = tl.load(k_cache_ptr + slot_offset[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0).to(tl.float32)  # [D, N]
        scores = tl.dot(q, k.to(dot_dtype), input_precision="ieee") * qk_scale_log2  # [M, N], log2 units
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if WINDOW > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))  # [M]
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that have seen nothing yet stay at 0
        correction = tl.exp2(run_max - base)
        p = tl.exp2(scores - base[:, None])  # [M, N]
        run_sum = run_sum * correction + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slot_offset[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)  # [N, D]
        acc = tl.dot(p.to(dot_dtype), v.to(dot_dtype), acc * correction[:, None], input_precision="ieee")
        run_max = new_max

    # ---- the sink (one split only: with several, the merge adds it once), in log2 units like the scores
    if HAS_SINKS and not WRITE_LSE:
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634  # [M]
        top = tl.maximum(run_max, sink)
        alpha = tl.exp2(run_max - top)  # 0 for a row that saw no key
        run_sum = run_sum * alpha + tl.exp2(sink - top)
        acc = acc * alpha[:, None]
        run_max = top

    # ---- normalise and write: the output itself, or this split's partial output and log2-sum-exp
    seen = run_sum > 0
    o = acc / tl.where(seen, run_sum, 1.0)[:, None]
    out_rows = split * stride_out_split + (q_start + token) * stride_out_token + head * stride_out_head  # [M]
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, run_max + tl.log2(tl.where(seen, run_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_lse_split + (q_start + token) * stride_lse_token + head, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    # pointers
    partial_ptr, lse_ptr, out_ptr, sinks_ptr,
    # sizes and strides
    num_heads, num_splits,
    stride_partial_split, stride_partial_token, stride_partial_head,
    stride_lse_split, stride_lse_token,
    stride_out_token, stride_out_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < num_heads
    mask = head_valid[:, None] & (dims[None, :] < HEAD_DIM)

    # ---- largest log-sum-exp over splits (splits past a sequence's context hold -inf)
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_ptr + split * stride_lse_split + token * stride_lse_token + heads,
                      mask=head_valid, other=float("-inf"))
        top = tl.maximum(top, lse)
    if HAS_SINKS:  # each head's sink logit, in log2 units: one more term of the denominator, with no value
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    base = tl.where(top == float("-inf"), 0.0, top)

    # ---- weight each split's normalised output by its share of the softmax mass
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_ptr + split * stride_lse_split + token * stride_lse_token + heads,
                      mask=head_valid, other=float("-inf"))
        weight = tl.exp2(lse - base)  # [BLOCK_H]
        partial = tl.load(partial_ptr + split * stride_partial_split + token * stride_partial_token
                          + heads[:, None] * stride_partial_head + dims[None, :], mask=mask, other=0.0)
        acc += weight[:, None] * partial
        total += weight
    if HAS_SINKS:
        total += tl.exp2(sink - base)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits(num_programs: int, max_kv_len: int, device: torch.device) -> int:
    """Splits of the context that fill the device about twice over, with at least MIN_TOKENS_PER_SPLIT each."""
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * _num_sms(device), num_programs)
    return max(1, min(wanted, triton.cdiv(max_kv_len, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def _tiles(device: torch.device, group_pad: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N). tl.dot needs at least 16 rows, so a decode tile pads the group up to 16 rows."""
    on_gpu = device.type == "cuda"
    target_rows = (64 if on_gpu else 32) if max_query_len > 1 else 16
    block_q = max(1, 16 // group_pad, min(target_rows // group_pad, triton.next_power_of_2(max_query_len)))
    return block_q, (64 if on_gpu else 16)


def device_metadata(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc and seq_lens as int32 device tensors, built once per step and kept on `meta`.

    The model runner sets both from its step buffers; building them here (callers that pass host lists only) is
    an upload from a temporary pinned tensor, which a CUDA graph must not capture.
    """
    if meta.query_start_loc_device is None or meta.seq_lens_device is None:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "a captured step needs meta.query_start_loc_device and meta.seq_lens_device set in static buffers"
        host = torch.tensor(list(meta.query_start_loc) + list(meta.seq_lens), dtype=torch.int32)
        if device.type == "cuda":  # pinned + non_blocking: no wait on the kernels already queued
            host = host.pin_memory()
        both = host.to(device, non_blocking=True)
        num_seqs = len(meta.seq_lens)
        meta.query_start_loc_device, meta.seq_lens_device = both[:num_seqs + 1], both[num_seqs + 1:]
    return meta.query_start_loc_device, meta.seq_lens_device


def launch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, num_splits: int | None = None, sinks: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """`paged_attention` with the number of context splits forced (None: chosen for the device)."""
    assert q.dim() == 3 and q.stride(2) == 1, f"q must be [T, Hq, D] with unit last stride, got {q.stride()}"
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache, v_cache must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} {tuple(v_cache.shape)}"
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, \
        f"q heads {num_heads}x{head_dim} do not fit KV heads {num_kv_heads}x{cache_head_dim}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches need equal strides, unit head_dim"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    assert meta.block_size == block_size, f"meta.block_size {meta.block_size} != pool block size {block_size}"
    num_seqs = meta.num_seqs
    assert len(meta.query_start_loc) == num_seqs + 1 and meta.query_start_loc[-1] == num_tokens, \
        f"query_start_loc {meta.query_start_loc} does not cover the {num_tokens} query rows"
    tables = meta.block_tables
    assert tables.dim() == 2 and tables.shape[0] == num_seqs and tables.dtype == torch.int32 and tables.stride(1) == 1
    assert q.device == k_cache.device == tables.device
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"paged_attention: window must be a positive number of positions, got {window!r}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != q.device or sinks.dtype != torch.float32
                              or not sinks.is_contiguous()):
        raise ValueError(f"paged_attention: sinks must be a contiguous float32 [{num_heads}] tensor on {q.device}, "
                         f"got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    query_start_loc, seq_lens = device_metadata(meta, q.device)

    group_size = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group_size)
    max_query_len = max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:]))
    block_q, block_n = _tiles(q.device, group_pad, max_query_len)
    num_tile_slots = num_tokens // block_q + num_seqs
    if num_splits is None:  # (a window bounds what a tile reads: its keys and its rows')
        longest = max(meta.seq_lens) if window is None else min(max(meta.seq_lens), window + block_q + block_n)
        num_splits = num_kv_splits(num_tile_slots * num_kv_heads, longest, q.device)
    if num_splits == 1:
        partial, lse = out, out  # lse unused
        stride_lse = (0, 0)
        stride_partial = (0, out.stride(0), out.stride(1))
    else:
        partial = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        stride_lse = lse.stride()[:2]
        stride_partial = partial.stride()[:3]

    _paged_attention_kernel[(num_tile_slots, num_kv_heads, num_splits)](
        q, k_cache, v_cache, tables, query_start_loc, seq_lens, partial, lse, out if sinks is None else sinks,
        num_seqs, num_splits, group_size, block_size, scale * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        *stride_partial,
        *stride_lse,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, WRITE_LSE=num_splits > 1, HAS_SINKS=sinks is not None,
        WINDOW=window or 0, num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            partial, lse, out, out if sinks is None else sinks,
            num_heads, num_splits,
            *partial.stride()[:3],
            *lse.stride()[:2],
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(head_dim), HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """The twin's contract (`torch_ops.paged_attention`), sinks and window included."""
    return launch_paged_attention(q, k_cache, v_cache, meta, scale, sinks=sinks, window=window)
