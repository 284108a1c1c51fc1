"""Start-up on the CPU: the profile run, then the pool sized from what it left; the checks of an explicit size against
free memory; the decode-graph capture plan and its progress; the pool unchanged where there is no memory probe.

The device's memory is a fake (`ExecutorSpec.memory`): the forward and the sampler really run, on the CPU, and the
fake's numbers stand for what CUDA would report, so the arithmetic and the order are checked exactly.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.graphs import capture_on_cpu
from tests.helpers.checkpoints import make_checkpoint
from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig
from tsterm.engine import cuda_graphs, executor, model_runner
from tsterm.engine.cuda_graphs import DecodeGraph, DecodeGraphs, capture_plan, graph_memory_estimate
from tsterm.engine.engine import Engine
from tsterm.engine.executor import MemoryProbe, MemoryProfile, size_cache
from tsterm.engine.model_runner import ModelRunner
from tsterm.engine.sampler import Sampler
from tsterm.errors import ConfigError

BLOCK = 4
MiB = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("startup") / "m", "qwen3_moe",
                              {"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2})
    return path


class FakeMemory(MemoryProbe):
    """A device with `free` bytes free, whose step peaks `step` bytes over `allocated`; logs every reading."""

    def __init__(self, events: list, free: int, step: int, allocated: int = 7 * MiB):
        self.events, self.free, self.step, self.allocated = events, free, step, allocated

    def free_bytes(self) -> int:
        self.events.append("free")
        return self.free

    def allocated_bytes(self) -> int:
        self.events.append("allocated")
        return self.allocated

    def reset_peak(self) -> None:
        self.events.append("reset_peak")

    def peak_bytes(self) -> int:
        self.events.append("peak")
        return self.allocated + self.step

    def release_cached(self) -> None:
        self.events.append("release")


@pytest.fixture
def recorded(monkeypatch):
    """Events of start-up, in order: memory readings, caches made (their block counts), forwards (their token and
    row counts) and sampler calls (their rows)."""
    events: list = []
    cache_class, run_step, sample = model_runner.ModelCache, ModelRunner.run_step, Sampler.__call__

    class Cache(cache_class):
        def __init__(self, *args, **kwargs):
            events.append(("cache", args[2]))  # (cfg, layer_types, num_blocks, ...)
            super().__init__(*args, **kwargs)

    def counted_run_step(self, step, logits=True):
        events.append(("forward", len(step.input_ids), len(step.sample_rows)))
        return run_step(self, step, logits)

    def counted_sample(self, logits, rows):
        events.append(("sample", len(rows)))
        return sample(self, logits, rows)

    monkeypatch.setattr(model_runner, "ModelCache", Cache)
    monkeypatch.setattr(ModelRunner, "run_step", counted_run_step)
    monkeypatch.setattr(Sampler, "__call__", counted_sample)
    return events


def engine_with(checkpoint, memory: MemoryProbe | None, progress=None, **options) -> Engine:
    config = EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, **options)
    return Engine(config, progress, executor=lambda spec: ModelRunner(dataclasses.replace(spec, memory=memory)))


def test_the_pool_gets_what_the_profile_run_leaves(checkpoint, recorded):
    free, step = 64 * MiB, 5 * MiB
    memory = FakeMemory(recorded, free, step)
    messages = []
    engine = engine_with(checkpoint, memory, lambda done, total, what: messages.append((done, total, what)),
                         kv_cache_fraction=0.25, max_num_batched_tokens=40, max_num_seqs=6)
    assert messages[-1] == (0, 0, "measuring memory: a forward of 40 tokens")  # after the weights' progress
    runner = engine.executor
    profile = runner.memory_profile
    assert profile == MemoryProfile(free, step, 0, 0, num_tokens=40, num_rows=6)  # no graphs on the CPU
    assert engine.kv.pool.num_blocks == runner.num_blocks == (free // 4 - step) // runner.kv_bytes_per_block

    # the order: free memory read with the weights loaded, a throw-away cache for one chunk (35 tokens: 9 blocks of
    # 4, and 5 one-token rows) and a model over it (what it allocates besides: read around them), the peak reset, the
    # chunk's forward (40 tokens, 6 rows), the sampler over its 6 rows, the peak read; only then the pool, of the
    # size the numbers give
    assert recorded[:recorded.index("peak") + 1] == [
        "release", "free", "allocated", ("cache", 14), "allocated", "reset_peak", ("forward", 40, 6), ("sample", 6),
        "peak"]
    assert recorded[recorded.index("peak") + 1:] == ["release", ("cache", runner.num_blocks)]
    assert runner.eager_steps == 0 and all(not layer.expert_load.any() for layer in runner.moe_layers)

    # and the engine runs as one whose pool was given: the profile run left nothing behind
    prompts = [[5, 9, 2, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64).generate(prompts,
                                                                                                            params)
    for prompt, output in zip(prompts, want):
        engine.add_request(prompt, params)
    finished = {}
    while engine.has_unfinished():
        finished.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    assert [finished["req-0"], finished["req-1"]] == [o.token_ids for o in want]


def test_a_fraction_that_leaves_no_room_names_the_numbers(checkpoint, recorded):
    memory = FakeMemory(recorded, free=64 * MiB, step=40 * MiB)
    with pytest.raises(ConfigError) as e:
        engine_with(checkpoint, memory, kv_cache_fraction=0.5, max_num_batched_tokens=40, max_num_seqs=6)
    message = str(e.value)
    assert "kv_cache_fraction 0.5" in message and "0.03 GiB" in message  # allows 32 MiB
    assert "0.06 GiB free after the weights" in message and "needs 0.04 GiB" in message  # 64 MiB free, 40 MiB step
    assert "max_num_batched_tokens" in message
    assert not any(event[0] == "cache" and event[1] > 14 for event in recorded if isinstance(event, tuple))


def test_an_absolute_kv_cache_memory_is_checked_against_free_memory(checkpoint, recorded):
    memory = FakeMemory(recorded, free=64 * MiB, step=5 * MiB)
    with pytest.raises(ConfigError) as e:
        engine_with(checkpoint, memory, kv_cache_memory=60 * MiB, max_num_batched_tokens=40, max_num_seqs=6)
    message = str(e.value)
    assert f"kv_cache_memory {60 * MiB} bytes" in message and "does not fit" in message
    assert f"lower kv_cache_memory to at most {59 * MiB} bytes" in message  # 64 free - 5 for the step
    engine = engine_with(checkpoint, memory, kv_cache_memory=59 * MiB, max_num_batched_tokens=40, max_num_seqs=6)
    assert engine.executor.num_blocks == 59 * MiB // engine.executor.kv_bytes_per_block


def test_an_exact_num_kv_blocks_is_checked_too(checkpoint, recorded):
    memory = FakeMemory(recorded, free=1 * MiB, step=0)
    with pytest.raises(ConfigError, match="lower num_kv_blocks"):
        engine_with(checkpoint, memory, num_kv_blocks=100_000, max_num_batched_tokens=16, max_num_seqs=2)


def test_without_a_probe_the_cpu_pool_keeps_its_default_budget(checkpoint, recorded, monkeypatch):
    monkeypatch.setattr(executor, "CPU_DEFAULT_KV_BYTES", 8 * MiB)
    engine = engine_with(checkpoint, None)
    runner = engine.executor
    assert runner.memory_profile is None and runner.graphs is None
    assert not any(isinstance(event, tuple) and event[0] in ("forward", "sample") for event in recorded)
    assert runner.num_blocks == 8 * MiB // runner.kv_bytes_per_block


def test_size_cache_arithmetic():
    spec = SimpleNamespace(config=EngineConfig(model="m", kv_cache_fraction=0.5, block_size=16),
                           model_config=SimpleNamespace(max_position_embeddings=1 << 20), device=torch.device("cuda"))
    profile = MemoryProfile(free_bytes=1000_000, step_bytes=90_000, graph_bytes=50_000, model_bytes=10_000)
    # 0.5 x 1,000,000 - 150,000 working - 30,000 state slots = 320,000: 32 blocks of 10,000
    assert size_cache(spec, 10_000, reserved_bytes=30_000, profile=profile) == (32, 32 * 16)
    assert size_cache(spec, 10_000, agree=lambda n: n - 2, profile=profile)[0] == 33  # the ranks' minimum
    with pytest.raises(ConfigError, match="recurrent-state slots"):
        size_cache(spec, 10_000, reserved_bytes=340_000, profile=profile)
    exact = dataclasses.replace(spec.config, num_kv_blocks=84)
    assert size_cache(SimpleNamespace(**{**vars(spec), "config": exact}), 10_000, profile=profile)[0] == 84
    too_many = dataclasses.replace(spec.config, num_kv_blocks=86)  # 860,000 + 150,000 > 1,000,000
    with pytest.raises(ConfigError, match="lower num_kv_blocks"):
        size_cache(SimpleNamespace(**{**vars(spec), "config": too_many}), 10_000, profile=profile)


def fake_runner(max_model_len: int, vocab_size: int = 100) -> SimpleNamespace:
    return SimpleNamespace(block_size=BLOCK, max_blocks_per_seq=-(-max_model_len // BLOCK),
                           cfg=SimpleNamespace(vocab_size=vocab_size))


def test_the_capture_plan_covers_every_batch_up_to_max_num_seqs_largest_first(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 32)  # tiers of 8, 16, 25 blocks of 4 tokens
    graphs = DecodeGraphs(fake_runner(max_model_len=100), max_num_seqs=40)
    assert graphs.buckets == (1, 2, 4, 8, 12, 16, 24, 32, 40) and graphs.widths == (8, 16, 25)
    plan = graphs.plan()
    assert plan[:3] == [(40, 25), (32, 25), (24, 25)] and plan[-1] == (1, 8) and len(plan) == 27
    assert sorted(plan) == sorted({(b, w) for b in graphs.buckets for w in graphs.widths})
    for batch_size in range(1, 41):  # every decode batch has a planned shape, whatever its context
        for context in (1, 32, 33, 99):
            decode = SimpleNamespace(seqs=[SimpleNamespace(num_computed_tokens=context - 1)] * batch_size,
                                     num_new=[1] * batch_size, sample_mask=lambda n=batch_size: [True] * n)
            assert graphs.shape_for(decode) in plan

    captured, messages = [], []
    monkeypatch.setattr(DecodeGraphs, "get", lambda self, b, w: captured.append((b, w)))
    graphs.capture_all(lambda done, total, what: messages.append((done, total, what)))
    assert captured == plan
    assert messages[0] == (0, 0, "capturing CUDA graphs 1/27: decode of 40 sequences, contexts up to 100 tokens")
    assert messages[-1] == (0, 0, "capturing CUDA graphs 27/27: decode of 1 sequence, contexts up to 32 tokens")
    assert len(messages) == 27


def test_graph_memory_estimate():
    plan = capture_plan((1, 2, 4), (8, 16))
    estimate = graph_memory_estimate(plan, vocab_size=1000, step_bytes=64_000, step_tokens=64)
    # the fixed part, the shared output (4 x 1000 float32 = 16,000), the inputs, and the 4-row decode's working memory
    # (4/64 of the step, 4,000, and its own logits, 16,000)
    inputs = estimate - cuda_graphs.GRAPH_BASE_BYTES - 16_000 - 20_000
    assert 0 < inputs < 8_000  # six graphs of at most 4 rows and 16-block tables: a few KB
    assert graph_memory_estimate([], 1000, 64_000, 64) == 0
    # the decode's working memory never above the step's
    assert graph_memory_estimate(plan, 1000, 10_000, 64) == cuda_graphs.GRAPH_BASE_BYTES + 16_000 + inputs + 10_000


def test_after_the_start_up_capture_a_request_captures_nothing(checkpoint, monkeypatch):
    """The CPU stand-in for a graph (its replay re-runs the forward the capture would record): every shape is
    captured by `capture_all`, and generation afterwards replays graphs without capturing any."""
    captures: list[tuple[int, int]] = []
    monkeypatch.setattr(DecodeGraph, "capture", capture_on_cpu(captures))
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 8)  # tiers of 2, 4, 8 blocks of 4 tokens
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48, kernels="triton",
              max_num_seqs=3, max_model_len=32)
    runner = llm.engine.executor
    runner.graphs = DecodeGraphs(runner, 3)
    runner.graphs.pool = ()  # no CUDA memory pool or capture stream on the CPU
    assert runner.graphs.capture_all() == 9 and captures == runner.graphs.plan()  # buckets 3, 2, 1 x three tiers
    outputs = llm.generate([[5, 9, 2], [7, 7, 1, 3, 8], [4]], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outputs)
    assert len(captures) == 9 and runner.graph_steps > 0
