"""Per-step attention metadata: built once per engine step by the model runner, read by every layer."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A flattened batch of T new tokens from S sequences.

    Sequence i owns query rows `[query_start_loc[i], query_start_loc[i+1])`; its new tokens sit at the last
    positions of its context of `seq_lens[i]` tokens, whose KV lives in the blocks of its block table.
    """

    query_start_loc: list[int]  # [S+1] host ints
    seq_lens: list[int]  # [S] context length including the new tokens (a decode graph's padding rows: 0 on the device)
    block_runs: Sequence[list[tuple[int, int]]]  # per sequence: (first_block, num_blocks) runs of consecutive ids
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block * block_size + offset) of each new token; -1: none
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with -1 (device kernels read this)
    block_size: int
    # Device copies of the host lists, for device kernels. The model runner sets them (views of its step buffers;
    # in a captured decode graph the host lists describe the graph's bucket while these hold the real values).
    # Elsewhere optional: a launcher that needs them and finds None builds them once and stores them here, so the
    # layers of one step share them.
    query_start_loc_device: torch.Tensor | None = None  # [S+1] int32, on the KV pool's device
    seq_lens_device: torch.Tensor | None = None  # [S] int32, on the KV pool's device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def contiguous_runs(block_table: list[int], num_blocks: int) -> list[tuple[int, int]]:
    """Split the first `num_blocks` ids of a block table into runs of consecutive ids.

    The CPU attention path views each run of the pool as one `[run_len * block_size, Hkv, D]` tensor (no
    copy), so a context in few runs costs few matmuls.
    """
    runs: list[tuple[int, int]] = []
    for block in block_table[:num_blocks]:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


class BlockRuns(Sequence):
    """Each sequence's `contiguous_runs` of its host block table, computed the first time an attention path asks for
    that sequence's: the torch twins read runs, the C and Triton kernels read the block tables and never ask (a
    decode step at 16K positions spent 0.35 ms a sequence building runs nobody read)."""

    __slots__ = ("_tables", "_runs")

    def __init__(self, tables: list[list[int]]):
        self._tables = tables  # [S], each exactly the blocks its context uses
        self._runs: list[list[tuple[int, int]] | None] = [None] * len(tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, i: int) -> list[tuple[int, int]]:
        runs = self._runs[i]
        if runs is None:
            runs = self._runs[i] = contiguous_runs(self._tables[i], len(self._tables[i]))
        return runs
