"""Per-step metadata: built once per engine step by the model runner, read by every layer.

`AttentionMetadata` describes the step's rows, contexts and block tables; a hybrid model's step also carries a
`RecurrentPlan`: which sequences of the step start from a clean state, decode a token, run prompt rows (split where a
state is kept), and which states are kept where, as index tensors on the device. The plan is worked out once on the
host (`plan_recurrent_step`, pure arithmetic on the step's host lists) and its indices travel with the step's other
integer inputs (`tsterm.engine.step_inputs`), so the linear-attention layers of a step only launch kernels: none of
them builds a tensor from host data or reads a device value back.
"""
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
    # A hybrid model's step: the recurrent-state layers' index tensors (set with the step inputs; a layer that finds
    # None builds it once from the host lists and stores it here, as for the device copies above)
    recurrent: RecurrentPlan | None = None
    # A model whose sliding layers keep their K/V in a window pool of their own (`tsterm.model.cache.WINDOW_POOL`):
    # the same rows and contexts over that pool's block ids (its own block tables, with a null block for the entries
    # before each window, and slot mapping); the sliding layers read this one. None: no window pool.
    window: AttentionMetadata | None = None

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


# ---------------------------------------------------------------------------------------------------------------
# the recurrent-state layers' plan of a step (hybrid models)

# the plan's index segments, in their order in its flat int64 buffer; those of PLAN_SLOT_SEGMENTS (first) hold
# state-slot ids
PLAN_SLOT_SEGMENTS = ("fresh_slots", "decode_slots", "decode_keep_src", "prefill_slots", "prefill_keep_src",
                      "resume_slots")
PLAN_SEGMENTS = PLAN_SLOT_SEGMENTS + ("decode_rows", "decode_keep_dst", "prefill_bounds", "prefill_keep_dst",
                                      "resume_bounds", "verify_rows", "verify_src", "verify_dst")


@dataclass(slots=True)
class RecurrentPlanShape:
    """The host side of a step's plan: how many entries each segment has, and the flags the layers branch on.

    Sequence i of the step (rows [query_start_loc[i], query_start_loc[i+1])) is *fresh* when its first new token is
    at position 0 (its slot is cleared), *decode* when it has one new row, a *prompt* when it has more. A prompt
    whose rows reach a kept state's position (a snapshot) is cut there: its rows before the cut run first
    (`prefill_*`), the state is kept, then the rows after the cut (`resume_*`). A sequence whose rows each keep their
    state in a slot of their own (a speculative verify step: its last token and its drafts) runs them as decodes, one
    position of every such sequence at a time (`verify_*`, position-major: `waves[j]` entries for position j).
    """

    sizes: dict[str, int]  # segment -> entries (a bounds segment: 2 per sequence)
    every_decode: bool  # every sequence of the step decodes one token: the rows need no index
    waves: tuple[int, ...] = ()  # verify sequences with a row at position 0, 1, ... of their rows

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, offset = {}, 0
        for name in PLAN_SEGMENTS:
            out[name] = (offset, self.sizes[name])
            offset += self.sizes[name]
        return out


@dataclass(slots=True)
class RecurrentPlan:
    """A step's plan on the device: int64 index tensors (views of one buffer), sized by `shape` (host ints).

    Slot tensors hold state-slot ids of the recurrent-state pools; `*_rows` / `*_bounds` hold rows of the step's
    flattened tokens (bounds [N, 2]: each sequence's first and end row); `*_keep_dst` the snapshot slots the states
    in `*_keep_src` are copied into.
    """

    shape: RecurrentPlanShape
    fresh_slots: torch.Tensor  # [F] slots cleared before the step (sequences starting at position 0)
    decode_slots: torch.Tensor  # [D] the decode sequences' slots
    decode_rows: torch.Tensor  # [D] their rows (empty when every sequence decodes: the rows are all rows, in order)
    decode_keep_src: torch.Tensor  # [DK] decode sequences whose new token completes a kept state's position
    decode_keep_dst: torch.Tensor  # [DK]
    prefill_slots: torch.Tensor  # [P] the prompt sequences' slots
    prefill_bounds: torch.Tensor  # [P, 2] their rows up to the cut (or their end)
    prefill_keep_src: torch.Tensor  # [PK] prompt sequences that keep their state at the cut
    prefill_keep_dst: torch.Tensor  # [PK]
    resume_slots: torch.Tensor  # [R] prompt sequences with rows after the cut
    resume_bounds: torch.Tensor  # [R, 2] those rows
    # verify sequences, position-major (`shape.waves`): each row, the slot its decode reads the state from (the
    # sequence's slot, then the previous row's target) and the slot it writes the state after the row into
    verify_rows: torch.Tensor  # [V]
    verify_src: torch.Tensor  # [V]
    verify_dst: torch.Tensor  # [V]

    @classmethod
    def from_buffer(cls, shape: RecurrentPlanShape, flat: torch.Tensor) -> RecurrentPlan:
        """Views of `flat` (int64, holding at least the plan's values) laid out as `shape.offsets()` says."""
        views = {}
        for name, (start, size) in shape.offsets().items():
            view = flat[start:start + size]
            views[name] = view.view(-1, 2) if name.endswith("_bounds") else view
        return cls(shape, **views)


def plan_recurrent_step(query_start_loc: Sequence[int], seq_lens: Sequence[int], state_slots: Sequence[int] | None,
                        snapshots: Sequence[tuple[int, int]] | None,
                        verify_slots: Sequence[int] | None = None) -> tuple[RecurrentPlanShape, list[int]]:
    """The plan of a step from its host lists: its shape and its flat values (segments in `PLAN_SEGMENTS` order).

    state_slots: each sequence's state slot (host ints); None: the slot segments hold sequence indices instead
    (`RecurrentPlan.build` maps them through the step's device slots). snapshots: per sequence (snapshot slot,
    position), position 0: none; None: no state is kept this step. verify_slots: per row [T], the slot that keeps the
    state after that row, for the rows of verify sequences (-1 elsewhere; None or empty: none): a sequence whose
    first row has one decodes its rows one after the other, row j from the state row j-1 left (row 0 from its slot).
    """
    seg: dict[str, list[int]] = {name: [] for name in PLAN_SEGMENTS}
    slot = (lambda i: i) if state_slots is None else state_slots.__getitem__
    num_seqs = len(seq_lens)
    decode = []
    waves: list[list[tuple[int, int, int]]] = []  # per position: (row, source slot, target slot)
    for i in range(num_seqs):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        count = end - start
        if verify_slots and count and verify_slots[start] >= 0:
            assert state_slots is not None and seq_lens[i] > count and not (snapshots and snapshots[i][1]), \
                f"verify sequence {i}: it continues a state in its slot and keeps no snapshot in the step"
            source = slot(i)
            for j, row in enumerate(range(start, end)):
                if j == len(waves):
                    waves.append([])
                waves[j].append((row, source, verify_slots[row]))
                source = verify_slots[row]
            continue
        if seq_lens[i] == count:  # from position 0: a clean state
            seg["fresh_slots"].append(slot(i))
        if count == 1:
            decode.append(i)
            seg["decode_slots"].append(slot(i))
            seg["decode_rows"].append(start)
            if snapshots and snapshots[i][1] == seq_lens[i]:  # its token completes a block whose state is kept
                seg["decode_keep_src"].append(slot(i))
                seg["decode_keep_dst"].append(snapshots[i][0])
        elif count > 1:
            position = snapshots[i][1] if snapshots else 0
            cut = start + position - (seq_lens[i] - count) if position else end  # the row that reaches it
            seg["prefill_slots"].append(slot(i))
            seg["prefill_bounds"] += [start, cut]
            if position:
                seg["prefill_keep_src"].append(slot(i))
                seg["prefill_keep_dst"].append(snapshots[i][0])
                if cut < end:
                    seg["resume_slots"].append(slot(i))
                    seg["resume_bounds"] += [cut, end]
    for wave in waves:
        for name, values in zip(("verify_rows", "verify_src", "verify_dst"), zip(*wave)):
            seg[name] += values
    every_decode = len(decode) == num_seqs
    if every_decode:
        seg["decode_rows"] = []  # not needed: the rows are 0..S-1
    shape = RecurrentPlanShape({name: len(values) for name, values in seg.items()}, every_decode,
                               tuple(map(len, waves)))
    return shape, [v for name in PLAN_SEGMENTS for v in seg[name]]


def build_recurrent_plan(meta: AttentionMetadata, state_slots: torch.Tensor,
                         snapshots: Sequence[tuple[int, int]] | None) -> RecurrentPlan:
    """A plan for a step whose metadata was built by hand (tests; the model runner's steps carry theirs): uploaded
    once, its slot segments mapped through the step's device `state_slots` [S] (no read-back), stored on `meta`."""
    if meta.recurrent is None:
        device = state_slots.device
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "a captured step needs meta.recurrent set in static buffers"
        shape, values = plan_recurrent_step(meta.query_start_loc, meta.seq_lens, None, snapshots)
        flat = torch.tensor(values, dtype=torch.int64, device=device)
        num_slot_values = sum(shape.sizes[name] for name in PLAN_SLOT_SEGMENTS)
        flat[:num_slot_values] = state_slots.long().index_select(0, flat[:num_slot_values])
        meta.recurrent = RecurrentPlan.from_buffer(shape, flat)
    return meta.recurrent
