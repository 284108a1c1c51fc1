"""Multi-head Latent Attention in its absorbed form, read in place from the paged latent pool (DeepSeek-V2 / V3,
Kimi-K2): the decode's attention, and a verify step's or a short chunk's (every row the same way).

Twin: `tsterm.model.mla.MLAttention.absorbed` on the torch ops (the ordinary paged attention with the latent row as
one key head that is also the value).

What it computes. Each cached token keeps one row [c | k_rope] (kv_lora_rank R + qk_rope_head_dim DR values) shared by
every query head. A query head arrives absorbed: q_lat = W_UK[h]^T q_nope (R values) and its rotated q_rope (DR); its
scores are q_lat . c + q_rope . k_rope, and its output is the softmax-weighted sum of the latents c (R values: the
caller takes it out through W_UV). The latent tile is loaded once per key tile and used twice (scores, then output),
and the 576-wide row of DeepSeek's sizes is read as 512 + 64, never padded to 1024.

Work split. A program owns one query row (a token of some sequence), BLOCK_H of its heads and one split of the keys
that row sees (positions 0 .. its own). Its sequence is found by binary search over query_start_loc, as in the paged
attention kernel; block tables, query_start_loc and seq_lens are the engine's, on the device. With splits, rows go
in launches of at most ROWS_PER_LAUNCH, which share one buffer of partial outputs (its size bounded whatever the
step's rows).

Splits and the same bits. A row's keys are cut into `num_splits(L)` slices, L the number of keys the row sees (its
position + 1): one per MIN_SPLIT_TOKENS keys begun, at most MAX_SPLITS, of equal length in whole BLOCK_N tiles.
That depends on the row alone, never on the batch beside it, the step's rows of its sequence, or the device's SM
count, and the merge adds the slices in order; so a row's output is the same bits in a decode, in a verify step
(where later draft tokens are already cached) and in any batch. A row of one slice is written directly, bit for bit
the value the merge would give it (weight 1); the grid has as many split programs as the step's longest context
asks (a captured decode graph: its bucket's), and a program past its row's slices writes an empty log-sum-exp. A
padding row of a captured graph (context length 0) sees nothing and gets zeros.

Precision. Loads are cast to float32 at once; dot operands go back to the cache dtype (tensor cores for bf16/fp16)
and float32 dots are exact ("ieee"), like the paged attention kernel. The output is float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.triton_paged_attention import device_metadata

LOG2_E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # keys per split at least: below this a split costs more in merging than it gains
MAX_SPLITS = 8  # splits per row at most
ROWS_PER_LAUNCH = 64  # rows a launch with splits takes (its float32 partial outputs: MAX_SPLITS x 64 x Hq x R)


@triton.jit
def _row_splits(kv_len, MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(splits, keys per split) of a row that sees kv_len keys: a function of kv_len alone."""
    splits = tl.maximum(tl.minimum(tl.cdiv(kv_len, MIN_SPLIT), MAX_SPLITS), 1)
    per_split = tl.cdiv(tl.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N
    return splits, per_split


@triton.jit
def _mla_attention_kernel(
    # pointers
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    # sizes and strides (the last dimension is unit-stride everywhere; lse is [split, token, head], unit head stride)
    num_seqs, num_heads, block_size, qk_scale_log2, first_token,
    stride_ql_token, stride_ql_head, stride_qr_token, stride_qr_head,
    stride_cache_block, stride_cache_slot,
    stride_table_seq,
    stride_out_split, stride_out_token, stride_out_head,
    stride_lse_split, stride_lse_token,
    # meta-parameters
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    local = tl.program_id(0)  # this launch's row (the outputs' index), of the step's row `token`
    token = first_token + local
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    # ---- the sequence owning this row: the last s with query_start_loc[s] <= token
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_at = tl.load(query_start_loc_ptr + mid)
        lo = tl.where(starts_at <= token, mid, lo)
        hi = tl.where(starts_at <= token, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_len = seq_len - q_len + (token - q_start) + 1  # keys this row sees: positions 0 .. its own
    kv_len = tl.where(token - q_start < q_len, tl.maximum(kv_len, 0), 0)
    num_splits, per_split = _row_splits(kv_len, MIN_SPLIT, MAX_SPLITS, BLOCK_N)
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_len)  # empty past the row's last split (and for a padding row)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    r_dims = tl.arange(0, BLOCK_R)
    dr_dims = tl.arange(0, BLOCK_DR)
    r_valid = r_dims < RANK
    dr_valid = dr_dims < ROPE
    dot_dtype = cache_ptr.dtype.element_ty
    row = token.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + row * stride_ql_token + heads[:, None] * stride_ql_head + r_dims[None, :],
                    mask=head_valid[:, None] & r_valid[None, :], other=0.0).to(tl.float32).to(dot_dtype)  # [H, R]
    q_rope = tl.load(q_rope_ptr + row * stride_qr_token + heads[:, None] * stride_qr_head + dr_dims[None, :],
                     mask=head_valid[:, None] & dr_valid[None, :], other=0.0).to(tl.float32).to(dot_dtype)  # [H, DR]

    # ---- online softmax over key tiles, each slot found through the block table
    run_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start in range(kv_lo, kv_hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)  # [N]
        key_valid = key_pos < kv_hi
        block = tl.load(table + key_pos // block_size, mask=key_valid, other=0).to(tl.int64)  # [N]
        slot = block * stride_cache_block + (key_pos % block_size).to(tl.int64) * stride_cache_slot  # [N]
        latent = tl.load(cache_ptr + slot[:, None] + r_dims[None, :], mask=key_valid[:, None] & r_valid[None, :],
                         other=0.0).to(tl.float32).to(dot_dtype)  # [N, R]: the keys' latent part, and the values
        k_rope = tl.load(cache_ptr + slot[:, None] + RANK + dr_dims[None, :],
                         mask=key_valid[:, None] & dr_valid[None, :], other=0.0).to(tl.float32).to(dot_dtype)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")  # [H, N]
        scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision="ieee") * qk_scale_log2  # log2 units
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))  # [H]; finite: every tile has a valid key
        correction = tl.exp2(run_max - new_max)
        p = tl.exp2(scores - new_max[:, None])  # [H, N]
        run_sum = run_sum * correction + tl.sum(p, axis=1)
        acc = tl.dot(p.to(dot_dtype), latent, acc * correction[:, None], input_precision="ieee")  # [H, R]
        run_max = new_max

    # ---- normalise and write: the output itself, or this split's partial output and log2-sum-exp
    seen = run_sum > 0
    o = acc / tl.where(seen, run_sum, 1.0)[:, None]
    out_rows = (split.to(tl.int64) * stride_out_split + local.to(tl.int64) * stride_out_token
                + heads * stride_out_head)  # [H]
    tl.store(out_ptr + out_rows[:, None] + r_dims[None, :], o, mask=head_valid[:, None] & r_valid[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, run_max + tl.log2(tl.where(seen, run_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + split.to(tl.int64) * stride_lse_split + local.to(tl.int64) * stride_lse_token + heads,
                 lse, mask=head_valid)


@triton.jit
def _merge_splits_kernel(
    # pointers
    partial_ptr, lse_ptr, out_ptr,
    # sizes and strides
    num_heads, num_splits, first_token,
    stride_partial_split, stride_partial_token, stride_partial_head,
    stride_lse_split, stride_lse_token,
    stride_out_token, stride_out_head,
    # meta-parameters
    RANK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    local = tl.program_id(0).to(tl.int64)  # this launch's row, of the step's row first_token + local
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_R)
    head_valid = heads < num_heads
    mask = head_valid[:, None] & (dims[None, :] < RANK)

    # ---- the largest log-sum-exp over the splits (a split past the row's last, or an empty one, holds -inf)
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_ptr + split * stride_lse_split + local * stride_lse_token + heads, mask=head_valid,
                      other=float("-inf"))
        top = tl.maximum(top, lse)
    base = tl.where(top == float("-inf"), 0.0, top)

    # ---- each split's normalised output weighted by its share of the softmax mass, in split order; an empty split
    # (weight 0, output zeros) adds exactly zero
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_ptr + split * stride_lse_split + local * stride_lse_token + heads, mask=head_valid,
                      other=float("-inf"))
        weight = tl.exp2(lse - base)  # [H]
        split_at = local * 0 + split  # (int64, like `local`)
        partial = tl.load(partial_ptr + split_at * stride_partial_split + local * stride_partial_token
                          + heads[:, None] * stride_partial_head + dims[None, :], mask=mask, other=0.0)
        acc += weight[:, None] * partial
        total += weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + (first_token + local) * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out, mask=mask)


def _tiles(on_gpu: bool, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages). tl.dot needs 16 rows: 16 heads a program (DeepSeek-V3's 128: 8
    programs per row and split). A float32 pool's exact dots take more registers: smaller key tiles, more warps
    (at R = 512 neither spills on sm_90). The interpreter takes small key tiles (its cost is per element)."""
    if not on_gpu:
        return 16, 16, 4, 1
    return (16, 32, 4, 2) if dtype.itemsize <= 2 else (16, 16, 8, 2)


def num_splits(kv_len: int) -> int:
    """The splits of a row that sees kv_len keys (the kernel's `_row_splits`), which no shorter row's exceeds."""
    return max(1, min(-(-kv_len // MIN_SPLIT_TOKENS), MAX_SPLITS))


def mla_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """Absorbed MLA attention of each sequence's new tokens over its whole context, read in place from the latent pool.

    q_lat: [T, Hq, R] (the queries absorbed through W_UK), q_rope: [T, Hq, DR] (rotated), any token and head strides,
    unit last stride, any float dtype (cast to the pool's for the dots); cache: [num_blocks, block_size, 1, R + DR],
    the rows [latent | k_rope], already holding the new tokens'; meta: the step's (block tables, query_start_loc,
    seq_lens). Returns [T, Hq, R] float32: each head's softmax-weighted latents (take them out through W_UV).
    """
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat [T, Hq, R] and q_rope [T, Hq, DR] must share T and Hq; got {tuple(q_lat.shape)} "
                         f"and {tuple(q_rope.shape)}")
    if q_lat.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError(f"q_lat and q_rope need a unit last stride; got {q_lat.stride()} and {q_rope.stride()}")
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_rope.shape[2]
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != rank + rope or cache.stride(3) != 1:
        raise ValueError(f"cache must be [num_blocks, block_size, 1, R + DR = {rank + rope}] with a unit last stride; "
                         f"got {tuple(cache.shape)}")
    block_size = cache.shape[1]
    if meta.block_size != block_size:
        raise ValueError(f"meta.block_size {meta.block_size} != the pool's block size {block_size}")
    num_seqs = meta.num_seqs
    if len(meta.query_start_loc) != num_seqs + 1 or meta.query_start_loc[-1] != num_tokens:
        raise ValueError(f"query_start_loc {meta.query_start_loc} does not cover the {num_tokens} query rows")
    tables = meta.block_tables
    if tables.dim() != 2 or tables.shape[0] != num_seqs or tables.dtype != torch.int32 or tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs = {num_seqs}, width] int32 with a unit last stride; got "
                         f"{tuple(tables.shape)} {tables.dtype}")
    if not q_lat.device == q_rope.device == cache.device == tables.device:
        raise ValueError(f"q_lat, q_rope, cache and block_tables must share a device; got {q_lat.device}, "
                         f"{q_rope.device}, {cache.device}, {tables.device}")
    out = torch.empty((num_tokens, num_heads, rank), dtype=torch.float32, device=q_lat.device)
    if num_tokens == 0:
        return out
    query_start_loc, seq_lens = device_metadata(meta, q_lat.device)

    block_h, block_n, num_warps, num_stages = _tiles(q_lat.device.type == "cuda", cache.dtype)
    grid_splits = num_splits(max(meta.seq_lens))  # the longest row's; a shorter row's extra splits are empty
    head_blocks = triton.cdiv(num_heads, block_h)
    block_r, block_dr = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    # one launch for every row, or, with splits, launches of at most ROWS_PER_LAUNCH rows sharing one buffer of partial
    # outputs (bounded whatever the step's rows; a row's arithmetic is the same in any launch)
    rows_per_launch = num_tokens if grid_splits == 1 else min(num_tokens, ROWS_PER_LAUNCH)
    if grid_splits == 1:
        partial, lse, stride_lse, stride_partial = out, out, (0, 0), (0, out.stride(0), out.stride(1))
    else:
        partial = torch.empty((grid_splits, rows_per_launch, num_heads, rank), dtype=torch.float32,
                              device=q_lat.device)
        lse = torch.empty((grid_splits, rows_per_launch, num_heads), dtype=torch.float32, device=q_lat.device)
        stride_lse, stride_partial = lse.stride()[:2], partial.stride()[:3]
    for first in range(0, num_tokens, rows_per_launch):
        rows = min(rows_per_launch, num_tokens - first)
        _mla_attention_kernel[(rows, head_blocks, grid_splits)](
            q_lat, q_rope, cache, tables, query_start_loc, seq_lens, partial, lse,
            num_seqs, num_heads, block_size, scale * LOG2_E, first,
            q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
            cache.stride(0), cache.stride(1),
            tables.stride(0),
            *stride_partial,
            *stride_lse,
            RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_N=block_n,
            MIN_SPLIT=MIN_SPLIT_TOKENS, MAX_SPLITS=MAX_SPLITS, WRITE_LSE=grid_splits > 1,
            num_warps=num_warps, num_stages=num_stages,
        )
        if grid_splits > 1:
            _merge_splits_kernel[(rows, head_blocks)](
                partial, lse, out,
                num_heads, grid_splits, first,
                *partial.stride()[:3],
                *lse.stride()[:2],
                out.stride(0), out.stride(1),
                RANK=rank, BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4,
            )
    return out
