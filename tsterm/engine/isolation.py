"""When a step fails: which requests it belongs to, found by running parts of the batch again.

A kernel that raises on one request's shape, a sampler that chokes on one row: the error says nothing about which
request caused it, and failing the whole batch would let one request hurt every other. `isolate` bisects the batch
by request: a part that runs is done (its result stands), a part that fails is split again, and a request that fails
on its own is the one to blame, with its own error. One culprit among n requests costs about 2 log2(n) extra runs of
parts whose sizes add up to the batch at each level; a failure that no part reproduces (a transient one) blames
nobody. `SamplingCheckpoint` makes a failed run leave no trace in the sampling state, so that a part run again draws
exactly what it would have drawn the first time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from tsterm.errors import ExecutorError

Unit = TypeVar("Unit")
Result = TypeVar("Result")


@dataclass
class Isolated(Generic[Unit, Result]):
    done: list[tuple[list[Unit], Result]] = field(default_factory=list)  # the parts that ran, with their results
    failed: list[tuple[Unit, Exception]] = field(default_factory=list)  # the units that fail on their own


def isolate(units: Sequence[Unit], run: Callable[[list[Unit]], Result], error: Exception) -> Isolated[Unit, Result]:
    """`run(units)` raised `error`: run halves of them again until every unit is in a part that ran or fails alone.

    `run` must leave no trace when it raises, and running a part again must compute what it would have computed in
    the first run. An ExecutorError (the executor is broken, not a unit) is raised at once: no part could run."""
    found: Isolated[Unit, Result] = Isolated()

    def split(part: list[Unit], part_error: Exception) -> None:
        if isinstance(part_error, ExecutorError):
            raise part_error
        if len(part) == 1:
            found.failed.append((part[0], part_error))
            return
        middle = len(part) // 2
        for half in (part[:middle], part[middle:]):
            try:
                found.done.append((half, run(half)))
            except Exception as e:  # noqa: BLE001 - whatever a part raises is that part's to bear
                split(half, e)

    split(list(units), error)
    return found


class SamplingCheckpoint:
    """The sampling state a step may advance, saved before it runs: the generators' states and each sample's penalty
    state (the Sampler replaces a state's tensors by views of new ones, never writes them in place, so keeping the
    references keeps the values). `restore()` puts everything back."""

    def __init__(self, generators: Sequence[torch.Generator], holders: Sequence[object]):
        """holders: objects with a `penalty` attribute (the engine's samples)."""
        self.generators = [(g, g.get_state()) for g in dict.fromkeys(generators)]
        self.penalties = [(h, h.penalty, None if h.penalty is None else (h.penalty.seen, h.penalty.counts))
                          for h in holders]

    def restore(self) -> None:
        for generator, state in self.generators:
            generator.set_state(state)
        for holder, penalty, tensors in self.penalties:
            holder.penalty = penalty
            if penalty is not None:
                penalty.seen, penalty.counts = tensors
