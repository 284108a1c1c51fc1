"""Rank 0 -> workers: one command per engine call, broadcast on the control group.

A command is a header `[kind, payload length]` (int64) and, when it has one, a payload of int64 words: lists of
integers, packed as `[number of lists, length of each, ...their items]` (`pack` / `unpack`). Integers only, never
pickle: a worker never runs what it receives.

- `STEP`: the step's host lists (`HostStep`) except the block tables, the sequence id of each row, and the change
  to the block tables since the last step (`tsterm.distributed.tables`): the bytes of a decode step depend on the
  batch size, not on the context length or the blocks the sequences hold.
- `COPY_BLOCKS` / `COPY_STATES`: the `(src, dst)` pairs of a copy-on-write or of a fork's state copy.
- `REPORT_TABLES`: each worker writes its block-table mirror to the store (a consistency check).
- The KV tiers (`tsterm.engine.kv_tier`; rank 0 decides, each rank moves its own share of the pool to and from its
  own store): `TIER_OPEN` (no payload: the request is in the store, `tier/open`; each worker answers
  `tier/opened/R`), `TIER_SAVE` (the saves queued since the last command, one list each: a block or a hybrid's
  state snapshot), `TIER_FETCH` (a fetch's serial, then its reads, or one snapshot's; followed by a MIN all-reduce
  on the control group of the leading blocks each rank read), `TIER_LOAD` (`[serial, pool block ids...]` per load,
  `[serial, state slot]` for a snapshot), `TIER_FLUSH` (no payload; followed by an all-reduce once each worker's
  store has written its queue).
- `STOP`: no payload; leave the loop.
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

from tsterm.engine.step_inputs import HostStep

HEADER_BYTES = 16


class Command(IntEnum):
    STEP = 1  # payload: the step's lists and its table updates
    COPY_BLOCKS = 2  # payload: (src, dst) block pairs
    STOP = 3  # no payload: leave the loop
    COPY_STATES = 4  # payload: (src, dst) recurrent-state slot pairs
    REPORT_TABLES = 5  # no payload: write the block-table mirror to the store
    TIER_OPEN = 6  # no payload: open this rank's KV tier as the store's `tier/open` asks
    TIER_SAVE = 7  # payload: the queued saves, one list each
    TIER_FETCH = 8  # payload: [serial], then one list per read; then a MIN all-reduce of the blocks read
    TIER_LOAD = 9  # payload: [serial, block ids...] per load
    TIER_FLUSH = 10  # no payload: write the store's queue; then an all-reduce


def all_reduce_min(group: dist.ProcessGroup, value: int) -> int:
    """Every rank of the control group: the least of their `value`s."""
    tensor = torch.tensor([value], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([tensor], options).wait()
    return int(tensor[0])


def pack(*lists: list[int]) -> list[int]:
    """Lists of integers as one flat list: [count, len_0, ..., len_n-1, items of list 0, items of list 1, ...]."""
    flat = [len(lists), *map(len, lists)]
    for items in lists:
        flat.extend(items)
    return flat


def unpack(words: list[int]) -> list[list[int]]:
    count = words[0]
    lists, start = [], 1 + count
    for length in words[1:1 + count]:
        lists.append(words[start:start + length])
        start += length
    return lists


def pairs(words: list[int]) -> list[tuple[int, int]]:
    return list(zip(words[::2], words[1::2]))


def flatten(pairs_: list[tuple[int, int]]) -> list[int]:
    return [x for pair in pairs_ for x in pair]


# the HostStep lists a STEP carries as they are, in this order (block_tables go as table updates)
STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "sample_rows", "state_slots",
               "snapshot_slots", "snapshot_positions")


def step_payload(step: HostStep, seq_ids: list[int], updates: list[int], freed: list[int]) -> list[int]:
    return pack(*(getattr(step, name) for name in STEP_FIELDS), flatten(step.state_copies), seq_ids, updates, freed)


def parse_step(words: list[int]) -> tuple[HostStep, list[int], list[int], list[int]]:
    """(the step without its block tables, the rows' sequence ids, the table updates, the freed sequence ids)."""
    lists = unpack(words)
    step = HostStep(**dict(zip(STEP_FIELDS, lists)))
    copies, seq_ids, updates, freed = lists[len(STEP_FIELDS):]
    step.state_copies = pairs(copies)
    return step, seq_ids, updates, freed


def send(group: dist.ProcessGroup, kind: Command, payload: list[int] | None = None) -> int:
    """Rank 0: broadcast a command to every worker; the bytes it sent to each."""
    words = payload or []
    group.broadcast([torch.tensor([int(kind), len(words)], dtype=torch.int64)], dist.BroadcastOptions()).wait()
    if words:
        group.broadcast([torch.tensor(words, dtype=torch.int64)], dist.BroadcastOptions()).wait()
    return HEADER_BYTES + 8 * len(words)


def receive(group: dist.ProcessGroup) -> tuple[Command, list[int]]:
    """A worker: wait for rank 0's next command."""
    header = torch.empty(2, dtype=torch.int64)
    group.broadcast([header], dist.BroadcastOptions()).wait()
    kind, size = Command(int(header[0])), int(header[1])
    if not size:
        return kind, []
    data = torch.empty(size, dtype=torch.int64)
    group.broadcast([data], dist.BroadcastOptions()).wait()
    return kind, np.asarray(data).tolist()
