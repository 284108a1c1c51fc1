"""A rank's process groups and the model's collectives over them (`ParallelContext` on torch.distributed).

Each rank builds, in the same order:
- `world`: every rank; the experts' all-reduce, and the tensor-parallel one when there is one tp group;
- `tp`: one per expert-parallel group, when there are several; a rank keeps its own;
- `control`: every rank, always gloo (host tensors); rank 0 broadcasts each step's inputs on it
  (`tsterm.distributed.protocol`). Rank 0 gives it the fault timeout, the workers a long one: a worker waits
  there while the engine is idle.
On CUDA the data groups (`world`, `tp`) are NCCL, built the standard way: `init_process_group(device_id=...)` over
the ranks' store, with the fault timeout (the NCCL watchdog's), then `new_group`. torch.distributed has one default
group per process, so a process runs one CUDA multi-rank engine at a time (a second is refused until the first
shuts down). On the CPU every group is a `ProcessGroupGloo` of its own, made from the store with its timeout (no
default group: two CPU engines may share a process, as the workstation does while it switches profiles).

The data groups use the fault timeout on every rank. On the CPU, a collective that a rank never joins fails
within it. On CUDA an NCCL wait does not block the host, and a collective whose peer is gone never finishes: the
NCCL watchdog aborts it after the timeout (rank 0 in `TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, clean-up only, so the
engine's process lives on to report it; a worker tears itself down), and rank 0's `WorkerWatch`
(`tsterm.distributed.health`) aborts the groups as soon as a worker's process ends or its heartbeat stops.
"""
from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tsterm.errors import DistributedError
from tsterm.model.parallel import ParallelContext, ParallelLayout

IDLE_TIMEOUT = timedelta(days=7)  # a worker's wait for rank 0's next command
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def connect_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.Store:
    """The ranks' shared store, under tsterm's own prefix (a torchrun agent's store holds the agent's keys too)."""
    store = dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore("tsterm/", store)


def backend_for(device: torch.device) -> str:
    """The data groups' backend: NCCL between CUDA devices, gloo between CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


def _gloo(store: dist.Store, name: str, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout)


class Groups:
    """The process groups of one rank (see the module's docstring)."""

    def __init__(self, store: dist.Store, layout: ParallelLayout, device: torch.device, timeout: timedelta):
        rank, world = layout.rank, layout.world_size
        self.aborted = threading.Event()
        self.nccl = backend_for(device) == "nccl"
        several_tp = layout.ep_size > 1 and layout.tp_size > 1
        tp_ranks = [list(range(e * layout.tp_size, (e + 1) * layout.tp_size)) for e in range(layout.ep_size)]
        if self.nccl:
            if dist.is_initialized():  # an engine dropped without shutdown releases its groups when collected
                gc.collect()
            if dist.is_initialized():
                raise DistributedError("this process already runs a CUDA multi-rank engine (torch.distributed has "
                                       "one default process group per process): shut that engine down first")
            # rank 0: the watchdog only aborts the communicators (the engine reports the failure and stays up);
            # a worker tears down at once. Read when the group is created; a user's own setting stands.
            os.environ.setdefault(NCCL_ERROR_HANDLING, "2" if rank == 0 else "1")
            dist.init_process_group("nccl", store=dist.PrefixStore("nccl/", store), rank=rank, world_size=world,
                                    timeout=timeout, device_id=device)
            try:
                self.world = self.tp = dist.group.WORLD
                for ep_rank, ranks in enumerate(tp_ranks if several_tp else []):  # every rank makes every group
                    group = dist.new_group(ranks, timeout=timeout, backend="nccl")
                    if ep_rank == layout.ep_rank:
                        self.tp = group
            except BaseException:
                dist.destroy_process_group()
                raise
        else:
            self.world = self.tp = _gloo(store, "world/", rank, world, timeout)
            if several_tp:
                self.tp = _gloo(store, f"tp{layout.ep_rank}/", layout.tp_rank, layout.tp_size, timeout)
        self.control = _gloo(store, "control/", rank, world, timeout if rank == 0 else IDLE_TIMEOUT)

    def abort(self) -> None:
        """Drop the groups' connections (after a failure: a peer may never answer again). Any thread may call it:
        an aborted NCCL communicator ends the kernels that wait on it."""
        self.aborted.set()
        for group in {id(g): g for g in (self.world, self.tp, self.control)}.values():
            try:
                group.abort()
            except RuntimeError:
                pass

    def close(self) -> None:
        """Release the groups at shutdown (the engine's thread); after it the process may start another engine."""
        try:
            self.control.abort()
            if not self.nccl:
                self.world.abort()
                self.tp.abort()
            elif dist.is_initialized():
                dist.destroy_process_group()
        except RuntimeError:
            pass


class RankContext(ParallelContext):
    """The model's collectives for one rank. `agree`: the smallest value over the ranks, by the store (a rank may
    still be loading its weights, for longer than a collective waits)."""

    def __init__(self, layout: ParallelLayout, groups: Groups, agree: Callable[[int], int]):
        self.layout, self.groups, self._agree = layout, groups, agree

    def all_reduce_tp(self, tensor: torch.Tensor) -> None:
        if self.layout.tp_size > 1:
            self.groups.tp.allreduce([tensor]).wait()

    def all_reduce_all(self, tensor: torch.Tensor) -> None:
        if self.layout.world_size > 1:
            self.groups.world.allreduce([tensor]).wait()

    def all_gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(self.layout.tp_size)]
        self.groups.tp.allgather([parts], [tensor.contiguous()]).wait()
        return torch.stack(parts)  # [tp, *tensor.shape]

    def agree_min(self, value: int) -> int:
        return self._agree(value)
