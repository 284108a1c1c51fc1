"""Builders shared by the kernel tests: random paged KV pools with shuffled block tables."""
from __future__ import annotations

import torch

from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

# Tolerances for outputs compared in the input dtype.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def paged_batch(seq_lens: list[int], query_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, generator: torch.Generator, device: str | torch.device = "cpu",
                spare_blocks: int = 3):
    """A pool holding each sequence's context (new tokens included, as after store_kv) in shuffled blocks.

    Every slot that belongs to no context - spare blocks, the tail of each last block - holds NaN, so a kernel
    that reads past a context fails. Returns (k_cache, v_cache, meta).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    in_context = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    tables, slots, first = [], [], 0
    for seq_len, query_len, count in zip(seq_lens, query_lens, blocks_per_seq):
        table = order[first:first + count]
        first += count
        tables.append(table)
        positions = torch.arange(seq_len)
        seq_slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size  # [seq_len]
        in_context[seq_slots] = True
        slots.append(seq_slots[seq_len - query_len:])
    k_cache.view(-1, num_kv_heads, head_dim)[~in_context] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~in_context] = float("nan")
    width = max(len(t) for t in tables)
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=list(seq_lens),
        block_runs=[contiguous_runs(t, len(t)) for t in tables],
        slot_mapping=torch.cat(slots).to(device),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        block_size=block_size,
    )
    return k_cache.to(device), v_cache.to(device), meta
