"""Start-up on a real device: the profile run before the pool is sized, a pool (and all start-up took) within what
kv_cache_fraction allows, a captured CUDA graph for every decode batch size up to max_num_seqs before the first
request, and no capture during requests.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest`, as scripts/gpu_check.sh does. Self-contained: no fixtures from conftest files. The same
start-up is checked on the CPU, against a fake memory probe, in tests/engine/test_startup.py.
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from tsterm import SamplingParams
from tsterm.config import EngineConfig
from tsterm.engine import model_runner
from tsterm.engine.cuda_graphs import DecodeGraph
from tsterm.engine.engine import Engine
from tsterm.engine.executor import CudaMemory
from tsterm.engine.model_runner import ModelRunner

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

MAX_NUM_SEQS = 40  # buckets 1, 2, 4, 8, 12, 16, 24, 32 and 40
FRACTION = 0.02


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("gpu_startup") / "m", "qwen3_moe",
                              {"num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                               "max_position_embeddings": 512})
    return path


class RecordingMemory(CudaMemory):
    """The real probe, logging its readings among the start-up's other events."""

    def __init__(self, device: torch.device, events: list):
        super().__init__(device)
        self.events = events

    def free_bytes(self) -> int:
        self.events.append("free")
        return super().free_bytes()

    def reset_peak(self) -> None:
        self.events.append("reset_peak")
        super().reset_peak()

    def peak_bytes(self) -> int:
        self.events.append("peak")
        return super().peak_bytes()


def decoding(batch_size: int, context: int) -> SimpleNamespace:
    """What `DecodeGraphs.shape_for` reads of a decode step of `batch_size` sequences of `context` tokens."""
    return SimpleNamespace(seqs=[SimpleNamespace(num_computed_tokens=context - 1)] * batch_size,
                           num_new=[1] * batch_size, sample_mask=lambda: [True] * batch_size)


def test_start_up_profiles_sizes_the_pool_then_captures_every_decode_shape(checkpoint, monkeypatch):
    events: list = []
    cache_class, capture = model_runner.ModelCache, DecodeGraph.capture

    class Cache(cache_class):
        def __init__(self, *args, **kwargs):
            events.append(("cache", args[2]))  # (cfg, layer_types, num_blocks, ...)
            super().__init__(*args, **kwargs)

    def counted_capture(self, pool, stream, out):
        events.append(("capture", self.batch_size, self.table_width))
        return capture(self, pool, stream, out)

    monkeypatch.setattr(model_runner, "ModelCache", Cache)
    monkeypatch.setattr(DecodeGraph, "capture", counted_capture)
    messages: list[str] = []
    config = EngineConfig(model=str(checkpoint), dtype="float32", device="cuda", block_size=16,
                          kv_cache_fraction=FRACTION, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256)
    engine = Engine(config, progress=lambda done, total, what: messages.append(what),
                    executor=lambda spec: ModelRunner(dataclasses.replace(spec, memory=RecordingMemory(spec.device,
                                                                                                      events))))
    runner = engine.executor
    assert runner.kernels == "triton" and runner.graphs is not None
    free_after_start = torch.cuda.mem_get_info(runner.device)[0]

    # the profile run (its throw-away cache, the peak reset and read around the step), then the pool, then captures
    caches = [i for i, event in enumerate(events) if event[0] == "cache"]
    captures = [i for i, event in enumerate(events) if event[0] == "capture"]
    assert len(caches) == 2 and caches[0] < events.index("reset_peak") < events.index("peak") < caches[1]
    assert events[caches[1]] == ("cache", runner.num_blocks) and caches[1] < captures[0]
    profile = runner.memory_profile
    assert profile.num_tokens == 256 and profile.num_rows == MAX_NUM_SEQS and profile.step_bytes > 0
    assert profile.graph_bytes > 0 and profile.model_bytes > 0  # (the rotary tables)

    # the pool is what the fraction leaves after the working memory, to the block; and all that start-up took since
    # the weights (the pool, the graphs, the capture's own memory) stays within what the fraction allows
    allowed = int(profile.free_bytes * FRACTION)
    kv = runner.num_blocks * runner.kv_bytes_per_block
    assert kv + profile.working_bytes <= allowed < kv + runner.kv_bytes_per_block + profile.working_bytes
    used = profile.free_bytes - free_after_start
    assert kv <= used <= allowed, (kv, used, allowed, profile, runner.graph_bytes)

    # every decode batch up to max_num_seqs, at every context, has a graph captured at start-up
    graphs = runner.graphs
    assert graphs.failed == set() and graphs.captured_at_start == len(graphs.plan()) == len(captures)
    for batch_size in range(1, MAX_NUM_SEQS + 1):
        for context in (1, 17, runner.max_model_len):
            shape = graphs.shape_for(decoding(batch_size, context))
            assert shape is not None and graphs.graphs[shape].graph is not None, (batch_size, context)
    capture_lines = [m for m in messages if m.startswith("capturing CUDA graphs")]
    assert len(capture_lines) == len(captures)
    assert messages.index("measuring memory: a forward of 256 tokens") < messages.index(capture_lines[0])
    assert capture_lines[-1].startswith(f"capturing CUDA graphs {len(captures)}/{len(captures)}: decode of 1 sequence")

    # requests replay them: no capture, every decode step from a graph
    gen = torch.Generator().manual_seed(0)
    for n in (5, 12, 30, 3, 21):
        engine.add_request(torch.randint(0, 300, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len([e for e in events if e[0] == "capture"]) == len(captures)
    assert runner.graph_steps >= 9 and graphs.failed == set()
