"""Rank 0 -> workers: one command per engine call, broadcast on the control group.

A command is a header `[kind, payload bytes]` (int64) and, when it has one, a JSON payload (uint8): a step's
`HostStep` (the host lists every rank builds its step inputs from), the `(src, dst)` pairs of a copy-on-write or
of a fork's state copy, or nothing for `STOP`. JSON, not pickle: the payload is integers only, and a worker never
runs what it receives.
"""
from __future__ import annotations

import dataclasses
import json
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from tsterm.engine.step_inputs import HostStep


class Command(IntEnum):
    STEP = 1  # payload: HostStep
    COPY_BLOCKS = 2  # payload: list[(src, dst)]
    STOP = 3  # no payload: leave the loop
    COPY_STATES = 4  # payload: list[(src, dst)] recurrent-state slots


def send(group: dist.ProcessGroup, kind: Command, payload: Any = None) -> None:
    """Rank 0: broadcast a command to every worker."""
    if isinstance(payload, HostStep):
        payload = {f.name: getattr(payload, f.name) for f in dataclasses.fields(HostStep)}
    data = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    group.broadcast([torch.tensor([int(kind), len(data)], dtype=torch.int64)], dist.BroadcastOptions()).wait()
    if data:
        group.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dist.BroadcastOptions()).wait()


def receive(group: dist.ProcessGroup) -> tuple[Command, Any]:
    """A worker: wait for rank 0's next command."""
    header = torch.empty(2, dtype=torch.int64)
    group.broadcast([header], dist.BroadcastOptions()).wait()
    kind, size = Command(int(header[0])), int(header[1])
    if not size:
        return kind, None
    data = torch.empty(size, dtype=torch.uint8)
    group.broadcast([data], dist.BroadcastOptions()).wait()
    payload = json.loads(data.numpy().tobytes())
    if kind == Command.STEP:
        return kind, HostStep(**payload)
    return kind, [tuple(pair) for pair in payload]  # COPY_BLOCKS
