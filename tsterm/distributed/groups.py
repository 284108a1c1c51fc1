"""A rank's process groups and the model's collectives over them (`ParallelContext` on torch.distributed).

The groups are built from a store, not through `torch.distributed.init_process_group`: that sets a process-wide
default group, and two engines in one process must not share one. Each rank builds, in the same order:
- `world`: every rank; the experts' all-reduce (and the tensor-parallel one when there is one tp group);
- `tp`: the ranks of its expert-parallel group, when there are several such groups;
- `control`: every rank; rank 0 broadcasts each step's inputs on it (`tsterm.distributed.protocol`). Rank 0 gives
  it the fault timeout, the workers a long one: a worker waits there while the engine is idle.
The data groups use the fault timeout on every rank: a collective that a rank never joins fails within it.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tsterm.model.parallel import ParallelContext, ParallelLayout

IDLE_TIMEOUT = timedelta(days=7)  # a worker's wait for rank 0's next command


def connect_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.Store:
    """The ranks' shared store, under tsterm's own prefix (a torchrun agent's store holds the agent's keys too)."""
    store = dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore("tsterm/", store)


def _gloo(store: dist.Store, name: str, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout)


def _nccl(store: dist.Store, name: str, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size, options)


# device type -> the backend the data groups use; the control group is always gloo (host tensors)
BACKENDS: dict[str, Callable[..., dist.ProcessGroup]] = {"cpu": _gloo, "cuda": _nccl}


class Groups:
    """The process groups of one rank."""

    def __init__(self, store: dist.Store, layout: ParallelLayout, device: torch.device, timeout: timedelta):
        data = BACKENDS[device.type]
        rank, world = layout.rank, layout.world_size
        self.world = data(store, "world/", rank, world, timeout)
        self.tp = self.world
        if layout.ep_size > 1 and layout.tp_size > 1:
            self.tp = data(store, f"tp{layout.ep_rank}/", layout.tp_rank, layout.tp_size, timeout)
        self.control = _gloo(store, "control/", rank, world, timeout if rank == 0 else IDLE_TIMEOUT)

    def abort(self) -> None:
        """Drop the groups' connections (after a failure: a peer may never answer again)."""
        for group in {id(g): g for g in (self.world, self.tp, self.control)}.values():
            try:
                group.abort()
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
