"""The engine's seam to the model: an executor turns a scheduled batch into logits.

The engine owns scheduling, the KV bookkeeping (block tables, prefix cache, copy-on-write decisions) and
sampling; an executor owns the weights, the kernels, the cache pools and the forward. `ModelRunner`
(`tsterm.engine.model_runner`) is the single-process executor. Tensor- and expert-parallel executors plug in
behind the same interface: the launcher hands the engine an `ExecutorFactory`, so the engine never imports
torch.distributed and its scheduler, KV manager and sampler do not change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tsterm.config import EngineConfig, ModelConfig
from tsterm.engine.batch import ScheduledBatch
from tsterm.model.loader import ProgressFn

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class ExecutorSpec:
    """What the engine asks an executor to be."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    progress: ProgressFn | None = None


class Executor(ABC):
    """Runs the model for one engine. Constructed from an `ExecutorSpec`; when the constructor returns, the
    weights are loaded and the cache is allocated, and these attributes are set:

    - `num_blocks`: KV blocks of `config.block_size` tokens in the cache (the engine's block pool mirrors them);
    - `max_model_len`: the longest sequence the cache and the model's positions can hold;
    - `kv_bytes_per_block`: device bytes one block costs over every layer (all ranks together);
    - `kernels`: the name of the kernel implementation the model runs ("torch" or "triton");
    - `num_state_slots`: recurrent-state slots the model holds (0: it keeps no such state; else the engine hands
      them out, `Sequence.state_slot` and its snapshots, `tsterm.model.cache.num_state_slots`), and `state_bytes`
      they cost in all.

    Calls come from one thread (the engine's), one step at a time.
    """

    num_blocks: int
    max_model_len: int
    kv_bytes_per_block: int
    kernels: str
    num_state_slots: int = 0
    state_bytes: int = 0

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch: write its new tokens' KV in place and return float32 logits [S, V], one row per
        sequence that samples this step (`batch.sample_mask()`), in batch order. The result may be a view that
        the next call overwrites: consume it first."""

    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked partial blocks, `(src, dst)` block ids, before the step that writes them."""

    @abstractmethod
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent states `(src, dst)` slot to slot now, before any later step (a fork's child starts from
        its parent's state as it is at the fork; the parent's next step changes it). Counted in
        `state_copy_bytes`."""

    @abstractmethod
    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert since start, per MoE layer ([] for a dense model)."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Monotonic counters for the engine's stats: at least `cow_bytes` (bytes copied by `copy_blocks`)."""

    def rank_stats(self) -> list[dict[str, int]] | None:
        """Per rank of a multi-rank executor, rank 0 first: `expert_tokens` (tokens routed to that rank's experts
        since start), `anon` and `file` (resident bytes). None for one process."""
        return None

    def shutdown(self) -> None:
        """Release workers and device memory; the executor is unusable after. Idempotent."""


ExecutorFactory = Callable[[ExecutorSpec], Executor]


def size_cache(spec: ExecutorSpec, bytes_per_block: int,
               agree: Callable[[int], int] = lambda num_blocks: num_blocks,
               reserved_bytes: int = 0) -> tuple[int, int]:
    """(num_blocks, max_model_len) for a cache of `bytes_per_block` per block, from the engine options.

    Call it after loading the weights: on CUDA the default budget is a fraction of the memory still free. A
    sequence never outgrows the pool, so one request alone always fits (no self-preemption loop). `agree`: the
    block count every rank can hold, from this rank's (a multi-rank executor passes its ranks' minimum).
    `reserved_bytes`: what the budget holds besides KV blocks (recurrent-state slots), taken off it first."""
    config = spec.config
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory
        if budget is None:
            if spec.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(spec.device)
                budget = int(free * config.kv_cache_fraction)
            else:
                budget = CPU_DEFAULT_KV_BYTES
        num_blocks = max(2, max(budget - reserved_bytes, 0) // max(bytes_per_block, 1))
    num_blocks = agree(num_blocks)
    max_model_len = min(config.max_model_len or spec.model_config.max_position_embeddings,
                        num_blocks * config.block_size)
    return num_blocks, max_model_len
