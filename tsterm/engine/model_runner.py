"""Owns the model weights and the paged KV pool; turns a scheduled batch into logits.

A step's inputs go through persistent buffers (`tsterm.engine.step_inputs`): written on the host, uploaded with
one asynchronous copy per dtype (pinned memory on CUDA), so a CUDA step queues its whole forward without waiting
for the device. The step's one wait is the sampler's read-back of the sampled token ids (`sampler._read_back`).
On CUDA with the Triton kernels, pure decode steps replay captured CUDA graphs (`tsterm.engine.cuda_graphs`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tsterm_kernels.dispatch import ops
from tsterm_kernels.metadata import contiguous_runs

from tsterm.config import ModelConfig
from tsterm.engine.cuda_graphs import DecodeGraphs
from tsterm.engine.sequence import Sequence
from tsterm.engine.step_inputs import (
    DeviceBuffers,
    HostStaging,
    HostStep,
    StepInputs,
    StepLayout,
    step_inputs,
)
from tsterm.model.decoder import DecoderModel, forward_context


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
                 max_positions: int, dtype: torch.dtype, device: torch.device, max_num_seqs: int = 64,
                 cuda_graphs: bool = True):
        """cuda_graphs: replay decode steps as CUDA graphs (CUDA and the Triton kernels only; else ignored)."""
        self.cfg, self.block_size, self.device, self.dtype = cfg, block_size, device, dtype
        # The whole pool, allocated once: [L, 2 (k, v), num_blocks, block_size, Hkv, D].
        self.kv_cache = torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device)
        self.model = DecoderModel(cfg, weights, self.kv_cache, max_positions)
        self.moe_layers = [mlp for *_, mlp in self.model.layers if mlp.router is not None]
        self.max_blocks_per_seq = -(-max_positions // block_size)
        self.cow_bytes = 0
        self.staging = HostStaging(device)
        self.buffers = DeviceBuffers(self.staging)
        self.graphs = DecodeGraphs(self, max_num_seqs) if cuda_graphs and device.type == "cuda" else None
        self.graph_steps = 0  # steps replayed from a CUDA graph
        self.eager_steps = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked partial blocks: the only KV data ever copied, and counted."""
        for src, dst in pairs:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
            self.cow_bytes += self.kv_cache[:, :, src].numel() * self.kv_cache.element_size()

    def host_step(self, batch: ScheduledBatch, with_runs: bool) -> HostStep:
        """The batch as host lists. `with_runs`: also the contiguous block runs the torch attention twin reads."""
        step = HostStep()
        for seq, n, slot_mapping in zip(batch.seqs, batch.num_new, batch.slot_mappings):
            start = seq.num_computed_tokens
            step.input_ids.extend(seq.token_ids[start:start + n])
            step.positions.extend(range(start, start + n))
            step.slot_mapping.extend(slot_mapping)
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.seq_lens.append(start + n)
            num_blocks = -(-(start + n) // self.block_size)
            step.block_tables.append(seq.block_table[:num_blocks])
            step.block_runs.append(contiguous_runs(seq.block_table, num_blocks) if with_runs else [])
        step.sample_rows = [step.query_start_loc[i + 1] - 1 for i, sample in enumerate(batch.sample_mask()) if sample]
        return step

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs in the eager device buffers, uploaded without waiting for the device."""
        step = self.host_step(batch, with_runs=ops.name != "triton")
        layout = StepLayout(len(step.input_ids), len(step.seq_lens), step.table_width, len(step.sample_rows))
        self.staging.write(layout, step)
        i64, i32 = self.buffers.reserve(layout)
        self.staging.upload(layout, i64, i32)
        return step_inputs(layout, i64, i32, step, self.block_size)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Computes the batch's KV (written in place) and returns float32 logits [S, V], one row per sampling seq.

        The logits may be a view of a CUDA graph's output: consume them before the next step.
        """
        self.copy_blocks(batch.cow_copies)
        shape = self.graphs.shape_for(batch) if self.graphs is not None and ops.name == "triton" else None
        if shape is not None:
            self.graph_steps += 1
            return self.graphs.get(*shape).replay(batch)
        self.eager_steps += 1
        inputs = self.prepare(batch)
        with forward_context(inputs.meta):
            hidden = self.model.forward(inputs.input_ids, inputs.positions)  # [T, H]
        if inputs.sample_rows.numel() == 0:
            return torch.empty((0, self.cfg.vocab_size), device=self.device)
        return self.model.logits(hidden.index_select(0, inputs.sample_rows))  # [S, V]
