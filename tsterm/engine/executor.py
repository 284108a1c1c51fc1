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
from tsterm.errors import ConfigError
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
    memory: MemoryProbe | None = None  # what measures the device's memory (None: `memory_probe`'s default)


class Executor(ABC):
    """Runs the model for one engine. Constructed from an `ExecutorSpec`; when the constructor returns, the
    weights are loaded, the cache is allocated (on a device with a `MemoryProbe`, sized after a profile run:
    `size_cache`), any decode graphs are captured, and these attributes are set:

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
        sequence that samples this step (`batch.sample_mask()`), in batch order; a sequence verifying k drafts
        (speculative decoding) has k+1 rows, one per position. The result may be a view that the next call
        overwrites: consume it first."""

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


class MemoryProbe(ABC):
    """What the executor reads of its device's memory to size the cache after a profile run. `CudaMemory` reads a CUDA
    device; tests pass fakes (`ExecutorSpec.memory`) to check the arithmetic and the order on the CPU."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Device memory free now (after `release_cached`: what the process does not hold)."""

    @abstractmethod
    def allocated_bytes(self) -> int:
        """Bytes the process's tensors hold on the device now."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Start measuring `peak_bytes` from now."""

    @abstractmethod
    def peak_bytes(self) -> int:
        """The most `allocated_bytes` has been since `reset_peak`."""

    def release_cached(self) -> None:
        """Give memory the allocator caches but no tensor holds back to the device (so `free_bytes` counts it)."""


class CudaMemory(MemoryProbe):
    """torch's view of one CUDA device: `mem_get_info` and the caching allocator's counters."""

    def __init__(self, device: torch.device):
        self.device = device

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def memory_probe(spec: ExecutorSpec) -> MemoryProbe | None:
    """The probe the executor measures with: the spec's own (a test's fake), else the CUDA device's; None on the CPU,
    where the cache keeps a fixed default budget and no profile run is made."""
    if spec.memory is not None:
        return spec.memory
    return CudaMemory(spec.device) if spec.device.type == "cuda" else None


def gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class MemoryProfile:
    """What a profile run measured, after the weights were loaded and before the cache is allocated.

    - `free_bytes`: device memory free after the weights (the allocator's cache released);
    - `step_bytes`: the peak of the largest step over what was allocated before it: a prefill chunk of
      `max_num_batched_tokens` tokens (activations, the kernels' workspaces), the logits of `max_num_seqs` rows and
      the sampler's temporaries over them;
    - `graph_bytes`: held for the CUDA graphs captured after the cache (their memory pool and static buffers; an
      estimate, `cuda_graphs.graph_memory_estimate`; 0 without graphs);
    - `model_bytes`: what the model allocates besides its weights and cache (its rotary tables for the longest
      context), measured on the profile's model.
    """

    free_bytes: int
    step_bytes: int
    graph_bytes: int = 0
    model_bytes: int = 0  # what the model allocates besides its cache and weights (rotary tables)
    num_tokens: int = 0  # the profile step's tokens and sampled rows (for the messages)
    num_rows: int = 0

    @property
    def working_bytes(self) -> int:
        """What the engine needs besides its caches while it runs."""
        return self.step_bytes + self.graph_bytes + self.model_bytes

    def describe(self) -> str:
        return (f"{gib(self.free_bytes)} free after the weights; the largest step (a prefill chunk of "
                f"{self.num_tokens} tokens, {self.num_rows} rows sampled) needs {gib(self.step_bytes)}, CUDA graphs "
                f"{gib(self.graph_bytes)}, the model's tables {gib(self.model_bytes)}")


def size_cache(spec: ExecutorSpec, bytes_per_block: int,
               agree: Callable[[int], int] = lambda num_blocks: num_blocks,
               reserved_bytes: int = 0, profile: MemoryProfile | None = None) -> tuple[int, int]:
    """(num_blocks, max_model_len) for a cache of `bytes_per_block` per block, from the engine options.

    `profile`: what the profile run measured (on CUDA; None on the CPU). With it, the default budget is what
    `kv_cache_fraction` of the memory free after the weights leaves once the profile's working memory is taken off,
    and an explicit size (`kv_cache_memory`, `num_kv_blocks`) is checked against the free memory: a ConfigError names
    the numbers when it cannot fit. Without it the default budget is `CPU_DEFAULT_KV_BYTES`. A sequence never outgrows
    the pool, so one request alone always fits (no self-preemption loop). `agree`: the block count every rank can
    hold, from this rank's (a multi-rank executor passes its ranks' minimum). `reserved_bytes`: what the budget holds
    besides KV blocks (recurrent-state slots), taken off it first."""
    config = spec.config
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory
        if budget is None and profile is not None:
            allowed = int(profile.free_bytes * config.kv_cache_fraction)
            budget = allowed - profile.working_bytes
            if budget - reserved_bytes < 2 * bytes_per_block:
                raise ConfigError(
                    f"no room for the KV cache: kv_cache_fraction {config.kv_cache_fraction:g} of the memory free "
                    f"after the weights allows {gib(allowed)}; {profile.describe()}"
                    + (f", recurrent-state slots {gib(reserved_bytes)}" if reserved_bytes else "")
                    + f"; the cache needs at least 2 blocks ({gib(2 * bytes_per_block)}). Raise kv_cache_fraction, "
                    "or lower max_num_batched_tokens or max_num_seqs")
        elif budget is None:
            budget = CPU_DEFAULT_KV_BYTES
        num_blocks = max(2, max(budget - reserved_bytes, 0) // max(bytes_per_block, 1))
    if profile is not None:
        check_fits(config, profile, num_blocks * bytes_per_block, reserved_bytes)
    num_blocks = agree(num_blocks)
    max_model_len = min(config.max_model_len or spec.model_config.max_position_embeddings,
                        num_blocks * config.block_size)
    return num_blocks, max_model_len


def check_fits(config: EngineConfig, profile: MemoryProfile, kv_bytes: int, reserved_bytes: int) -> None:
    """A ConfigError, naming the numbers, when the cache and the profile's working memory do not fit in the free
    memory."""
    need = kv_bytes + reserved_bytes + profile.working_bytes
    if need <= profile.free_bytes:
        return
    what = (f"kv_cache_memory {config.kv_cache_memory} bytes ({gib(config.kv_cache_memory)})"
            if config.num_kv_blocks is None and config.kv_cache_memory is not None
            else f"a KV cache of {gib(kv_bytes)}")
    room = profile.free_bytes - reserved_bytes - profile.working_bytes
    fix = (f"lower kv_cache_memory to at most {max(room, 0)} bytes" if config.num_kv_blocks is None
           else "lower num_kv_blocks")
    raise ConfigError(f"{what} does not fit on the device: {profile.describe()}"
                      + (f", recurrent-state slots {gib(reserved_bytes)}" if reserved_bytes else "")
                      + f", {gib(need)} in all; {fix}, or lower max_num_batched_tokens or max_num_seqs")
