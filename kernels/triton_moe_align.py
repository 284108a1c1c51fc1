"""Token/expert alignment on the device: token-expert pairs sorted by expert, each expert's segment padded to a
multiple of the GEMM tile BLOCK_M, so every M-tile of the fused MoE belongs to one expert.

No host sync: buffers are sized by the upper bound P + min(E, P) * (BLOCK_M - 1) (P = T*k pairs), spare tiles
are marked with expert -1 and padding slots hold the sentinel pair id P. Three small kernels:
  1. per chunk of pairs: how many pairs each expert got in the chunk;
  2. one program: exclusive scan of those counts over chunks, padded expert segment starts, expert of each tile;
  3. per chunk of pairs: scatter each pair id to segment start + pairs of its expert before it.
Within an expert's segment pairs keep their original order (the twin's stable sort).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_PAIRS = 64  # pairs per program in kernels 1 and 3


@triton.jit
def _count_kernel(
    # pointers
    expert_ids_ptr, chunk_counts_ptr,
    # sizes
    num_pairs, num_experts,
    # meta-parameters
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)

    # ---- histogram of this chunk's experts
    expert = tl.load(expert_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)  # [BLOCK_P]
    one_hot = (expert[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, tl.sum(one_hot, axis=0), mask=experts < num_experts)


@triton.jit
def _offsets_kernel(
    # pointers
    chunk_counts_ptr, expert_start_ptr, tile_experts_ptr,
    # sizes
    num_chunks, num_experts, num_tiles,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    expert_valid = experts < num_experts

    # ---- exclusive scan over chunks: chunk_counts[c, e] becomes the pairs of expert e in chunks before c
    total = tl.zeros([BLOCK_E], tl.int32)
    for first in range(0, num_chunks, BLOCK_C):
        chunks = first + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + chunks[:, None] * num_experts + experts[None, :]
        mask = (chunks[:, None] < num_chunks) & expert_valid[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)  # [BLOCK_C, BLOCK_E]
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + total[None, :], mask=mask)
        total += tl.sum(counts, axis=0)

    # ---- padded segments: start of each expert's segment, in slots and in tiles
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M  # [BLOCK_E]
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(expert_start_ptr + experts, start, mask=expert_valid)
    tile_lo = start // BLOCK_M
    tile_hi = tile_lo + padded // BLOCK_M

    # ---- expert of each tile; spare tiles past the last segment get -1
    for first in range(0, num_tiles, BLOCK_TILES):
        tiles = first + tl.arange(0, BLOCK_TILES)
        inside = (tiles[:, None] >= tile_lo[None, :]) & (tiles[:, None] < tile_hi[None, :])  # [BLOCK_TILES, BLOCK_E]
        owner = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(tile_experts_ptr + tiles, tl.where(owned, owner, -1), mask=tiles < num_tiles)


@triton.jit
def _scatter_kernel(
    # pointers
    expert_ids_ptr, chunk_offsets_ptr, expert_start_ptr, sorted_pairs_ptr,
    # sizes
    num_pairs, num_experts,
    # meta-parameters
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)

    # ---- rank of each pair among the chunk's pairs of the same expert
    expert = tl.load(expert_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)  # [BLOCK_P]
    valid = (pairs < num_pairs) & (expert < num_experts)  # id E: another rank's expert, placed nowhere
    one_hot = (expert[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
    rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1  # [BLOCK_P]

    # ---- slot = segment start + pairs of the expert in earlier chunks + rank
    safe_expert = tl.where(valid, expert, 0)
    slot = (tl.load(expert_start_ptr + safe_expert, mask=valid, other=0)
            + tl.load(chunk_offsets_ptr + chunk * num_experts + safe_expert, mask=valid, other=0) + rank)
    tl.store(sorted_pairs_ptr + slot, pairs, mask=valid)


def num_aligned_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the M-tiles of the aligned layout (each non-empty expert wastes < BLOCK_M slots)."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids: [T, k] int. Returns (sorted_pairs [num_tiles * block_m] int32, tile_experts [num_tiles] int32).

    sorted_pairs holds pair ids (token * k + slot) grouped by expert, each expert's segment padded with the
    sentinel T*k up to a multiple of block_m; tile_experts[i] is the expert of tile i, or -1 for a spare tile.
    A pair whose id is `num_experts` (an expert another rank holds) is left out.
    """
    assert expert_ids.dim() == 2 and expert_ids.is_contiguous(), "expert_ids must be a contiguous [T, k] tensor"
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids dtype {expert_ids.dtype} is not an integer"
    assert block_m >= 1 and num_experts >= 1
    device = expert_ids.device
    num_pairs = expert_ids.numel()
    num_tiles = num_aligned_tiles(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    tile_experts = torch.empty((num_tiles,), dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_pairs, tile_experts
    num_chunks = triton.cdiv(num_pairs, BLOCK_PAIRS)
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    expert_start = torch.empty((num_experts,), dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    _count_kernel[(num_chunks,)](
        expert_ids, chunk_counts, num_pairs, num_experts, BLOCK_P=BLOCK_PAIRS, BLOCK_E=block_e, num_warps=4,
    )
    _offsets_kernel[(1,)](
        chunk_counts, expert_start, tile_experts, num_chunks, num_experts, num_tiles,
        BLOCK_M=block_m, BLOCK_C=max(1, min(64, 4096 // block_e)), BLOCK_E=block_e, BLOCK_TILES=64, num_warps=4,
    )
    _scatter_kernel[(num_chunks,)](
        expert_ids, chunk_counts, expert_start, sorted_pairs, num_pairs, num_experts,
        BLOCK_P=BLOCK_PAIRS, BLOCK_E=block_e, num_warps=4,
    )
    return sorted_pairs, tile_experts
