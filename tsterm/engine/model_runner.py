"""Owns the model weights and the paged KV pool; turns a scheduled batch into logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tsterm.config import ModelConfig
from tsterm.engine.sequence import Sequence
from tsterm.model.decoder import DecoderModel, forward_context
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: `num_new[i]` tokens of `seqs[i]`, starting at its `num_computed_tokens`."""

    seqs: list[Sequence]
    num_new: list[int]
    slot_mappings: list[list[int]]
    cow_copies: list[tuple[int, int]]  # (src_block, dst_block) pairs to copy before the forward

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def sample_mask(self) -> list[bool]:
        """A sequence samples when this step computes up to its last token (prefill done, or a decode)."""
        return [s.num_computed_tokens + n == len(s.token_ids) for s, n in zip(self.seqs, self.num_new)]


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], num_blocks: int, block_size: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device):
        self.cfg, self.block_size, self.device, self.dtype = cfg, block_size, device, dtype
        # The whole pool, allocated once: [L, 2 (k, v), num_blocks, block_size, Hkv, D].
        self.kv_cache = torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device)
        self.model = DecoderModel(cfg, weights, self.kv_cache, max_positions)
        self.cow_bytes = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked partial blocks: the only KV data ever copied, and counted."""
        for src, dst in pairs:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
            self.cow_bytes += self.kv_cache[:, :, src].numel() * self.kv_cache.element_size()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        runs: list[list[tuple[int, int]]] = []
        tables: list[list[int]] = []
        for seq, n, slot_mapping in zip(batch.seqs, batch.num_new, batch.slot_mappings):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(slot_mapping)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            num_blocks = -(-(start + n) // self.block_size)
            runs.append(contiguous_runs(seq.block_table, num_blocks))
            tables.append(seq.block_table[:num_blocks])
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_runs=runs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=block_tables.to(self.device), block_size=self.block_size,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        last_rows = [query_start_loc[i + 1] - 1 for i, sample in enumerate(batch.sample_mask()) if sample]
        return ids, pos, meta, last_rows

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Computes the batch's KV (written in place) and returns float32 logits [S, V], one row per sampling seq."""
        self.copy_blocks(batch.cow_copies)
        ids, pos, meta, last_rows = self.prepare(batch)
        with forward_context(meta):
            hidden = self.model.forward(ids, pos)  # [T, H]
        if not last_rows:
            return torch.empty((0, self.cfg.vocab_size), device=self.device)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        return self.model.logits(hidden.index_select(0, rows))  # [S, V]
