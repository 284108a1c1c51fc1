"""What a front-end may know of an engine, as plain data, and the questions it may ask it: the same whether the engine
runs in this process (AsyncEngine) or in its own (EngineCoreProcess), so no front-end reads the Engine object.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tsterm.config import EngineConfig

if TYPE_CHECKING:
    from tsterm.engine.engine import Engine, PinResult
    from tsterm.engine.stats import EngineMetrics


@dataclass(frozen=True)
class EngineInfo:
    """The engine's identity and limits, fixed once it has started."""

    config: EngineConfig  # what it was started with (config.model: the model directory)
    device: str  # "cpu", "cuda:0"
    dtype: str  # "float32", "bfloat16"
    max_model_len: int  # prompt + reply tokens of one request
    vocab_size: int  # the embedding's rows (token ids are below it)
    eos_token_ids: frozenset[int]  # the tokenizer's and the model config's end-of-sequence ids
    num_kv_blocks: int
    # why the engine runs in `dtype`: "as configured", or what `dtype: auto` found on this machine ("auto: AMX-BF16
    # granted by the OS, ...": tsterm.cpu)
    dtype_reason: str = "as configured"

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def dtype_line(self) -> str:
        """The dtype and why, in one line: "bfloat16 (auto: AMX-BF16 granted by the OS, ...)"."""
        return f"{self.dtype} ({self.dtype_reason})"

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(engine.config, str(engine.device), str(engine.dtype).removeprefix("torch."), engine.max_model_len,
                   engine.model_config.vocab_size, frozenset(engine.eos_token_ids), engine.executor.num_blocks,
                   engine.dtype_choice.reason)


def memory_info(engine: Engine) -> dict[str, Any]:
    """The engine's device memory in bytes: the CUDA allocator's numbers, or the RSS of the process it runs in."""
    device = engine.device
    if device.type == "cuda":
        import torch

        return {"kind": "cuda", "allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "total": torch.cuda.get_device_properties(device).total_memory}
    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"kind": "cpu", "rss": rss}


def _dashboard(engine: Engine) -> tuple[dict, list[list[int]], list[dict[str, int]] | None, dict[str, Any]]:
    return engine.stats(), engine.expert_load(), engine.rank_stats(), memory_info(engine)


# The calls a front-end makes on the engine between two steps, by name: an engine core in another process runs
# exactly these, and AsyncEngine runs the same functions on its thread.
CALLS: MappingProxyType[str, Callable[..., Any]] = MappingProxyType({
    "stats": lambda engine: engine.stats(),
    # stats and a copy of the metrics, read together between two steps: a consistent snapshot for a scrape, which
    # never sees a histogram half-updated by a step
    "stats_and_metrics": lambda engine: (engine.stats(), copy.deepcopy(engine.metrics)),
    "pin": lambda engine, token_ids, ttl_s, key: engine.pin(token_ids, ttl_s, key),
    "unpin": lambda engine, pin_id: engine.unpin(pin_id),
    "expert_load": lambda engine: engine.expert_load(),
    "rank_stats": lambda engine: engine.rank_stats(),
    # what the dashboard polls, in one call: made one after another, a 4 Hz dashboard waited for a step three times
    # and fell to 1-2 Hz beside a batch of 33
    "dashboard": _dashboard,
})


class EngineCalls:
    """The calls of CALLS as methods, for a front that runs them with `_engine_call(name, *args)` between two steps
    (AsyncEngine on its thread, EngineCoreProcess in the core). Each blocks until the engine answers: call them
    from a worker thread in async code."""

    def _engine_call(self, name: str, *args: Any) -> Any:
        raise NotImplementedError

    def stats(self) -> dict:
        return self._engine_call("stats")

    def stats_and_metrics(self) -> tuple[dict, EngineMetrics]:
        return self._engine_call("stats_and_metrics")

    def pin(self, token_ids: list[int], ttl_s: float = 300.0, key: str | None = None) -> PinResult:
        """Engine.pin: keep the cached full blocks of `token_ids` until `unpin(key)` or the TTL."""
        return self._engine_call("pin", list(token_ids), ttl_s, key)

    def unpin(self, pin_id: str) -> bool:
        return self._engine_call("unpin", pin_id)

    def expert_load(self) -> list[list[int]]:
        return self._engine_call("expert_load")

    def rank_stats(self) -> list[dict[str, int]] | None:
        return self._engine_call("rank_stats")

    def dashboard(self) -> tuple[dict, list[list[int]], list[dict[str, int]] | None, dict[str, Any]]:
        """`stats()`, `expert_load()`, `rank_stats()` and the engine's memory (`memory_info`) in one call."""
        return self._engine_call("dashboard")
