"""A step's model inputs in persistent buffers: written on the host, uploaded with one asynchronous copy per dtype.

The integer inputs of a step (token ids, positions, KV slots, rows to sample; query offsets, context lengths,
recurrent-state slots, block tables) are packed into two flat buffers, int64 and int32, at offsets that depend only on the step's shape
(`StepLayout`); a hybrid model's step adds its recurrent-state plan (`tsterm_kernels.metadata.RecurrentPlan`: the
linear-attention layers' row and slot indices) to the int64 buffer, so its layers never build an index themselves. The host side (`HostStaging`) is pinned memory on CUDA, written through numpy views (no torch op,
so no copy to count and nothing queued); `upload` copies the used prefix of each buffer to its device twin with
`non_blocking=True`, in stream order. Nothing here reads device memory, so preparing a step never waits for the
device, except for the one case spelled out in `HostStaging._writable`.

On the CPU the staging buffers are the inputs themselves: nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tsterm_kernels.metadata import AttentionMetadata, BlockRuns, RecurrentPlan, RecurrentPlanShape, plan_recurrent_step

ALIGN = 16  # elements: every region starts on a 64/128-byte boundary (vector loads, Triton's pointer specialisation)


def _pack(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """name -> (start, size) of consecutive aligned regions, and the total length."""
    regions, offset = {}, 0
    for name, size in sizes.items():
        regions[name] = (offset, size)
        offset += -(-size // ALIGN) * ALIGN
    return regions, offset


class StepLayout:
    """Where each input of a step of this shape lives in the flat int64 and int32 buffers.

    `table_width` is the row stride of the block table; `num_pairs` > 0 only for a padded decode step, whose
    (token, expert) pairs carry a weight in the expert-load count (1 for a real row, 0 for padding).
    A step of a model with recurrent state also places its plan (`plan_state`, which `HostStaging.write` calls):
    a region after the others in the int64 buffer, sized by how the step's sequences split.
    `window`: the model keeps its sliding layers' K/V in a window pool: the step also carries their slot mapping
    [T] and block tables [S, table_width] over that pool's ids (a window table is as long as its block table).
    """

    def __init__(self, num_tokens: int, num_seqs: int, table_width: int, num_samples: int, num_pairs: int = 0,
                 window: bool = False):
        self.num_tokens, self.num_seqs, self.table_width = num_tokens, num_seqs, table_width
        self.num_samples, self.num_pairs, self.window = num_samples, num_pairs, window
        self._i64_sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                           "sample_rows": num_samples, "pair_weights": num_pairs,
                           "window_slot_mapping": num_tokens if window else 0}
        self.i64, self.i64_size = _pack(self._i64_sizes)
        self.i32, self.i32_size = _pack({"query_start_loc": num_seqs + 1, "seq_lens": num_seqs,
                                         "state_slots": num_seqs, "block_tables": num_seqs * table_width,
                                         "window_block_tables": num_seqs * table_width if window else 0})
        self.recurrent: RecurrentPlanShape | None = None  # the plan of the step last written with this layout

    def plan_state(self, step: HostStep) -> list[int]:
        """Place `step`'s recurrent-state plan (none when no sequence has a state slot): returns its values."""
        self.recurrent, values = None, []
        if any(slot >= 0 for slot in step.state_slots):
            snapshots = list(zip(step.snapshot_slots, step.snapshot_positions)) if any(step.snapshot_positions) else None
            self.recurrent, values = plan_recurrent_step(step.query_start_loc, step.seq_lens, step.state_slots, snapshots,
                                                         step.verify_slots)
        self.i64, self.i64_size = _pack({**self._i64_sizes, "recurrent": len(values)})
        return values


@dataclass(slots=True)
class HostStep:
    """A step's inputs as host lists, as the scheduler describes them (real rows first, then any padding)."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    slot_mapping: list[int] = field(default_factory=list)  # [T]; -1: a padding token, written nowhere
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # [S+1]
    seq_lens: list[int] = field(default_factory=list)  # [S]; 0: a padding row, which attends to nothing
    block_tables: list[list[int]] = field(default_factory=list)  # [S][<= width], the blocks the context uses
    sample_rows: list[int] = field(default_factory=list)  # rows of the hidden states that the sampler reads
    state_slots: list[int] = field(default_factory=list)  # [S] each sequence's recurrent-state slot; -1: none
    # hybrid models with prefix caching: [S] the slot that keeps each sequence's state at [S] position (0: none),
    # and (snapshot slot, state slot) pairs copied before the forward (a cached prefix resumed)
    snapshot_slots: list[int] = field(default_factory=list)
    snapshot_positions: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # hybrid models verifying drafts: [T] the slot that keeps the state after each row of a verify sequence (-1 for
    # the other rows; empty: no verify this step), `plan_recurrent_step`
    verify_slots: list[int] = field(default_factory=list)
    # a model with a window pool: the sliding layers' slot mapping [T] and block tables [S] over its ids (each table
    # as long as the sequence's block table, the entries before its window the null block), and the copy-on-write
    # pairs of window blocks copied before the forward
    window_slot_mapping: list[int] = field(default_factory=list)
    window_block_tables: list[list[int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def table_width(self) -> int:
        return max((len(t) for t in self.block_tables), default=0)

    def pad_decode(self, batch_size: int) -> None:
        """Append padding rows up to `batch_size`: token 0 at position 0, KV slot -1, context length 0."""
        for _ in range(batch_size - len(self.seq_lens)):
            self.input_ids.append(0)
            self.positions.append(0)
            self.slot_mapping.append(-1)
            self.query_start_loc.append(self.query_start_loc[-1] + 1)
            self.seq_lens.append(0)
            self.block_tables.append([])
            self.state_slots.append(-1)
            self.snapshot_slots.append(-1)
            self.snapshot_positions.append(0)
            if self.window_block_tables:
                self.window_slot_mapping.append(-1)
                self.window_block_tables.append([])


@dataclass(slots=True)
class StepInputs:
    """Views of one step's inputs in a device buffer pair, and the attention metadata over them."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    sample_rows: torch.Tensor  # [N] int64
    pair_weights: torch.Tensor  # [P] int64 (empty unless the layout has pairs)
    state_slots: torch.Tensor  # [S] int32: each sequence's slot in the recurrent-state pools (-1: none)
    meta: AttentionMetadata


class HostStaging:
    """The pinned host side of the step buffers, shared by every upload target (eager buffers, captured graphs)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.i64 = self.i32 = torch.empty(0)
        self._i64_np = self._i32_np = np.empty(0)
        self._uploaded: torch.cuda.Event | None = None  # recorded after the last upload

    def _writable(self, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
        """The staging buffers as numpy arrays, grown for `layout` and safe to overwrite.

        An upload reads its staging buffer when the stream reaches it. Before overwriting it we wait for the last
        upload's event; in the engine loop the previous step's token read-back has already waited for more than
        that, so this returns at once (it can block only after a step that sampled nothing).
        """
        if self._uploaded is not None:
            self._uploaded.synchronize()
        if self.i64.numel() < layout.i64_size:
            self.i64 = torch.empty(max(layout.i64_size, 2 * self.i64.numel()), dtype=torch.int64, pin_memory=self.pinned)
            self._i64_np = self.i64.numpy()
        if self.i32.numel() < layout.i32_size:
            self.i32 = torch.empty(max(layout.i32_size, 2 * self.i32.numel()), dtype=torch.int32, pin_memory=self.pinned)
            self._i32_np = self.i32.numpy()
        return self._i64_np, self._i32_np

    def write(self, layout: StepLayout, step: HostStep, pair_weights: list[int] | None = None) -> None:
        recurrent = layout.plan_state(step)  # (before the buffers are sized: the plan may grow the int64 one)
        i64, i32 = self._writable(layout)
        _put(i64, layout.i64["recurrent"], recurrent)
        _put(i64, layout.i64["input_ids"], step.input_ids)
        _put(i64, layout.i64["positions"], step.positions)
        _put(i64, layout.i64["slot_mapping"], step.slot_mapping)
        _put(i64, layout.i64["sample_rows"], step.sample_rows)
        _put(i64, layout.i64["pair_weights"], pair_weights or [])
        _put(i32, layout.i32["query_start_loc"], step.query_start_loc)
        _put(i32, layout.i32["seq_lens"], step.seq_lens)
        _put(i32, layout.i32["state_slots"], step.state_slots)
        _tables(i32, layout, "block_tables", step.block_tables)
        if layout.window:
            _put(i64, layout.i64["window_slot_mapping"], step.window_slot_mapping)
            _tables(i32, layout, "window_block_tables", step.window_block_tables)

    def upload(self, layout: StepLayout, i64: torch.Tensor, i32: torch.Tensor) -> None:
        """Copy what `write` staged into the device buffers `i64`, `i32` (no-op when they are the staging itself)."""
        if i64 is self.i64:
            return
        i64[:layout.i64_size].copy_(self.i64[:layout.i64_size], non_blocking=True)
        i32[:layout.i32_size].copy_(self.i32[:layout.i32_size], non_blocking=True)
        if self.device.type == "cuda":
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))


def _tables(i32: np.ndarray, layout: StepLayout, name: str, block_tables: list[list[int]]) -> None:
    start, size = layout.i32[name]
    tables = i32[start:start + size].reshape(layout.num_seqs, layout.table_width)
    tables.fill(-1)
    assert len(block_tables) == layout.num_seqs, f"{len(block_tables)} {name} for a step of {layout.num_seqs}"
    for row, table in zip(tables, block_tables):
        row[:len(table)] = table


def _put(buffer: np.ndarray, region: tuple[int, int], values: list[int]) -> None:
    start, size = region
    assert len(values) == size, f"step input of {len(values)} values for a region of {size}"
    buffer[start:start + size] = values


class DeviceBuffers:
    """The eager steps' device buffers, grown on demand (graphs own fixed ones). On the CPU: the staging itself."""

    def __init__(self, staging: HostStaging):
        self.staging = staging
        self.i64 = torch.empty(0, dtype=torch.int64, device=staging.device)
        self.i32 = torch.empty(0, dtype=torch.int32, device=staging.device)

    def reserve(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        if self.staging.device.type == "cpu":
            return self.staging.i64, self.staging.i32
        # Growing drops the old buffer while queued kernels may still read it: the caching allocator reuses its
        # memory only for work queued after them on the same stream, so that is safe.
        if self.i64.numel() < layout.i64_size:
            self.i64 = torch.empty(max(layout.i64_size, 2 * self.i64.numel()), dtype=torch.int64, device=self.i64.device)
        if self.i32.numel() < layout.i32_size:
            self.i32 = torch.empty(max(layout.i32_size, 2 * self.i32.numel()), dtype=torch.int32, device=self.i32.device)
        return self.i64, self.i32


def step_inputs(layout: StepLayout, i64: torch.Tensor, i32: torch.Tensor, step: HostStep, block_size: int) -> StepInputs:
    """The views of `layout` in the buffers, with attention metadata whose host lists are `step`'s."""
    def view64(name: str) -> torch.Tensor:
        start, size = layout.i64[name]
        return i64[start:start + size]

    def view32(name: str) -> torch.Tensor:
        start, size = layout.i32[name]
        return i32[start:start + size]

    meta = AttentionMetadata(
        query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_runs=BlockRuns(step.block_tables),
        slot_mapping=view64("slot_mapping"),
        block_tables=view32("block_tables").view(layout.num_seqs, layout.table_width), block_size=block_size,
        query_start_loc_device=view32("query_start_loc"), seq_lens_device=view32("seq_lens"),
        recurrent=None if layout.recurrent is None else RecurrentPlan.from_buffer(layout.recurrent, view64("recurrent")),
    )
    if layout.window:  # the sliding layers' view of the step: the same rows over the window pool's blocks
        meta.window = AttentionMetadata(
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
            block_runs=BlockRuns(step.window_block_tables), slot_mapping=view64("window_slot_mapping"),
            block_tables=view32("window_block_tables").view(layout.num_seqs, layout.table_width),
            block_size=block_size, query_start_loc_device=meta.query_start_loc_device,
            seq_lens_device=meta.seq_lens_device)
    return StepInputs(view64("input_ids"), view64("positions"), view64("sample_rows"), view64("pair_weights"),
                      view32("state_slots"), meta)
