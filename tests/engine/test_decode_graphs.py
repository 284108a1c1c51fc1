"""The step buffers and the decode-graph machinery, exercised for real on the CPU.

A `DecodeGraph` runs eagerly (`run_eager`) exactly what a CUDA graph captures: the batch padded to its bucket,
the block table at its tier's width, launcher decisions taken from the bucket's shape. With the Triton kernels
under the interpreter, that padded step must give the unpadded step's logits, write KV only into the real rows'
slots, and count only the real rows' routed tokens.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.graphs import capture_on_cpu
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.sampling import every_sampler_stage
from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig
from tsterm.engine import cuda_graphs
from tsterm.engine.cuda_graphs import DecodeGraph, DecodeGraphs, batch_buckets
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.sequence import Sequence
from tsterm.errors import ConfigError

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("graphs") / "m", "qwen3_moe",
                              {"num_experts": 5, "num_experts_per_tok": 2, "num_hidden_layers": 2})
    return path


@pytest.fixture
def triton_engine(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48, kernels="triton")
    return llm.engine


def decode_batch(engine, prompt_lens: list[int]) -> ScheduledBatch:
    """Prefill one greedy request per prompt length, then schedule the decode step of all of them."""
    gen = torch.Generator().manual_seed(len(prompt_lens))
    vocab = engine.model_config.vocab_size
    for n in prompt_lens:
        engine.add_request(torch.randint(0, vocab, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_new == [1] * len(prompt_lens)
    return batch


def kv_pool(runner) -> torch.Tensor:
    """[L, 2, num_blocks, block_size, Hkv, D]: the whole paged KV pool of the runner's attention layers."""
    return runner.cache.pools["full_attention"].kv


def slot_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_slots, L * 2 * Hkv * D]: everything stored in each KV slot, over layers, K and V."""
    layers, _, num_blocks, block_size = kv_cache.shape[:4]
    return kv_cache.reshape(layers, 2, num_blocks * block_size, -1).permute(2, 0, 1, 3).reshape(num_blocks * block_size, -1)


def expert_loads(engine) -> torch.Tensor:
    return torch.stack([mlp.expert_load for mlp in engine.executor.moe_layers]).clone()  # [L_moe, E]


@pytest.mark.parametrize("batch_size,extra_width", [(4, 0), (8, 3)], ids=["bucket4", "bucket8-wide-table"])
def test_padded_decode_step_matches_the_unpadded_step(triton_engine, batch_size, extra_width):
    engine = triton_engine
    runner = engine.executor
    batch = decode_batch(engine, [5, 10, 3])
    real_slots = sorted(slot for slots in batch.slot_mappings for slot in slots)
    kv_before = kv_pool(runner).clone()
    load_before = expert_loads(engine)

    want = runner.execute(batch).clone()  # the eager, unpadded step (no graphs on the CPU)
    assert runner.graph_steps == 0 and runner.eager_steps > 0
    kv_eager = kv_pool(runner).clone()
    load_eager = expert_loads(engine)
    kv_pool(runner).copy_(kv_before)

    graph = DecodeGraph(runner, batch_size, DecodeGraphs(runner, 64).shape_for(batch)[1] + extra_width)
    got = graph.run_eager(batch)

    assert got.shape == want.shape == (3, engine.model_config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # KV: only the real rows' slots changed, to what the unpadded step wrote there
    changed = (slot_view(kv_pool(runner)) != slot_view(kv_before)).any(dim=1).nonzero().flatten().tolist()
    assert changed == real_slots
    torch.testing.assert_close(kv_pool(runner), kv_eager, atol=1e-5, rtol=1e-5)
    # expert load: the real rows' tokens only, the same count as the unpadded step
    top_k = engine.model_config.num_experts_per_tok
    assert ((expert_loads(engine) - load_eager).sum(dim=1) == 3 * top_k).all()
    assert ((load_eager - load_before).sum(dim=1) == 3 * top_k).all()
    assert all(mlp.expert_load is not None for mlp in runner.moe_layers)


aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
              aten.nonzero.default, aten.masked_select.default, aten._unique2.default}


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value into the host or sizes its output by the data: on CUDA each of
    them waits for the device (what `torch.cuda.set_sync_debug_mode` flags)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_decode_step_through_the_triton_ops_reads_no_tensor_on_the_host(triton_engine):
    """The CPU side of the GPU no-sync test: the same decode step (Triton ops, interpreted; every sampler stage)
    dispatches no op that would wait for the device, so a stray .item() or .nonzero() in the forward fails here.
    Prefill steps, with prefix-cache hits, read none either. Not seen here: .tolist() and .cpu() of CPU data,
    which dispatch nothing; the GPU test covers those."""
    engine = triton_engine
    with HostReads() as probe:
        torch.tensor(3).item()  # the probe sees a host read
    assert probe.seen == ["aten._local_scalar_dense.default"]

    with HostReads() as probe:  # prefill steps, the later prompts served partly from the first one's blocks
        for n, params in zip((8, 13, 5, 21, 10, 7), every_sampler_stage(16)):
            engine.add_request(list(range(1, n + 1)), params)
            engine.step()
        while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()
    assert probe.seen == [] and engine.stats()["prefix_hit_tokens"] > 0
    before = [s.num_output_tokens for s in engine.scheduler.running]
    with HostReads() as probe:
        for _ in range(2):
            assert len(engine.step()) == 6
    assert probe.seen == []
    assert [s.num_output_tokens for s in engine.scheduler.running] == [n + 2 for n in before]


def test_pair_weights_end_with_the_padded_forward_even_on_an_error(triton_engine):
    """A padded step's 0/1 pair weights live in the model's step context only: the next eager step counts every
    pair."""
    runner = triton_engine.executor
    graph = DecodeGraph(runner, 2, 4)

    def failing_forward(input_ids, positions):
        assert runner.model.ctx.pair_weights is graph.inputs.pair_weights
        raise RuntimeError("boom")

    runner.model.forward = failing_forward
    try:
        with pytest.raises(RuntimeError, match="boom"):
            graph.forward()
    finally:
        del runner.model.forward  # back to the class's method
    assert runner.model.ctx.pair_weights is None and runner.model.ctx.meta is None


def test_generation_through_the_step_buffers_matches_the_torch_path(checkpoint):
    """Steps of changing shapes (prefill chunks, decodes, finished requests) reuse the same buffers."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (13, 4, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (5, 2, 4)]

    def generate(kernels: str):
        llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48,
                  max_num_batched_tokens=8, kernels=kernels)
        return llm.generate(prompts, params)

    want, got = generate("torch"), generate("triton")
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_prepare_packs_the_step_into_the_buffers(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48)
    runner = llm.engine.executor
    params = SamplingParams(temperature=0)
    prefill = Sequence(list(range(10, 21)), params)  # 11 tokens, 6 cached: a chunk of 5, then done
    prefill.num_computed_tokens, prefill.block_table = 6, [7, 8, 2]
    decode = Sequence(list(range(30, 39)), params)  # 9 tokens, 8 computed
    decode.num_computed_tokens, decode.block_table = 8, [4, 5, 9]
    decode.state_slot = 3  # as a recurrent-state layer's sequence would hold (the others keep none: -1)
    chunk = Sequence(list(range(40, 60)), params)  # 20 tokens, 4 computed, a chunk of 3: samples nothing
    chunk.num_computed_tokens, chunk.block_table = 4, [11, 12]
    batch = ScheduledBatch([prefill, decode, chunk], [5, 1, 3], [[26, 27, 32, 33, 34], [36], [44, 45, 46]], [])

    inputs = runner.prepare(batch)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == list(range(16, 21)) + [38] + [44, 45, 46]
    assert inputs.positions.tolist() == list(range(6, 11)) + [8] + [4, 5, 6]
    assert meta.slot_mapping.tolist() == [26, 27, 32, 33, 34, 36, 44, 45, 46]
    assert meta.query_start_loc == meta.query_start_loc_device.tolist() == [0, 5, 6, 9]
    assert meta.seq_lens == meta.seq_lens_device.tolist() == [11, 9, 7]
    assert meta.block_tables.tolist() == [[7, 8, 2], [4, 5, 9], [11, 12, -1]]
    assert list(meta.block_runs) == [[(7, 2), (2, 1)], [(4, 2), (9, 1)], [(11, 2)]]
    assert inputs.sample_rows.tolist() == [4, 5]
    assert inputs.state_slots.tolist() == [-1, 3, -1]

    small = ScheduledBatch([decode], [1], [[36]], [])  # a smaller step after a larger one: nothing stale
    inputs = runner.prepare(small)
    assert inputs.input_ids.tolist() == [38] and inputs.positions.tolist() == [8]
    assert inputs.meta.block_tables.tolist() == [[4, 5, 9]] and inputs.meta.seq_lens_device.tolist() == [9]
    assert inputs.sample_rows.tolist() == [0] and inputs.state_slots.tolist() == [3]
    assert runner.graphs is None  # CPU: no graphs, whatever cuda_graphs says


def fake_runner(max_positions: int) -> SimpleNamespace:
    return SimpleNamespace(block_size=BLOCK, max_blocks_per_seq=-(-max_positions // BLOCK))


def decoding(context_lens: list[int]) -> ScheduledBatch:
    seqs = []
    for n in context_lens:
        seq = Sequence(list(range(n)), SamplingParams())
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * len(seqs), [[0]] * len(seqs), [])


def test_batch_buckets_reach_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # every 16 past 32, and the cap
    assert batch_buckets(40) == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    assert batch_buckets(100) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 100)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    for max_num_seqs in range(1, 130):  # every decode batch up to the cap has a bucket
        buckets = batch_buckets(max_num_seqs)
        assert buckets[-1] == max_num_seqs and list(buckets) == sorted(set(buckets))


def test_graph_shapes_bucket_the_batch_and_tier_the_context(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 32)  # tiers of 8, 16, 32... blocks of 4 tokens
    graphs = DecodeGraphs(fake_runner(max_positions=200), max_num_seqs=12)
    assert graphs.shape_for(decoding([5])) == (1, 8)
    assert graphs.shape_for(decoding([5, 3, 9])) == (4, 8)
    assert graphs.shape_for(decoding([33])) == (1, 16)  # 33 tokens: 9 blocks -> the 16-block tier
    assert graphs.shape_for(decoding([64, 65])) == (2, 32)
    assert graphs.shape_for(decoding([199])) == (1, 50)  # the last tier stops at the longest context
    assert graphs.shape_for(decoding([4] * 12)) == (12, 8)
    assert graphs.shape_for(decoding([4] * 13)) is None  # larger than the largest bucket: eager
    prefill = decoding([5, 6])
    prefill.num_new[1], prefill.seqs[1].num_computed_tokens = 2, 4
    assert graphs.shape_for(prefill) is None  # not a pure decode step: eager
    chunk = decoding([5])
    chunk.seqs[0].token_ids.append(1)  # one token computed, more to come: samples nothing
    assert graphs.shape_for(chunk) is None


def test_cuda_graphs_option_is_validated():
    assert EngineConfig(model="m").cuda_graphs is True
    assert EngineConfig(model="m", cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(model="m", cuda_graphs="no")


def test_engine_decodes_through_graph_replays(checkpoint, monkeypatch):
    """The runner's graph path end to end (bucketing, tiers, capture on first use, upload, replay, the logits
    view), with a CPU stand-in for the CUDA graph: its replay re-runs the forward that capture would record."""
    monkeypatch.setattr(DecodeGraph, "capture", capture_on_cpu())
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 8)  # tiers of 2, 4, 8 blocks of 4 tokens
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 6, 2, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (20, 2, 5, 3)]

    def generate(graphs: bool):
        llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48,
                  kernels="triton", max_num_seqs=4)
        if graphs:
            llm.engine.executor.graphs = DecodeGraphs(llm.engine.executor, 4)
            llm.engine.executor.graphs.pool = ()  # no CUDA memory pool or capture stream on the CPU
        return llm, llm.generate(prompts, params)

    eager, want = generate(graphs=False)
    graphed, got = generate(graphs=True)
    runner = graphed.engine.executor
    assert eager.engine.executor.graph_steps == 0 and runner.graph_steps == 19  # every decode step
    assert sorted(runner.graphs.graphs) == [(1, 2), (1, 4), (1, 8), (2, 2), (4, 2)]  # buckets 4, 2, 1; three tiers
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    assert graphed.engine.expert_load() == eager.engine.expert_load()


def test_a_failed_capture_falls_back_to_eager_once_per_shape(checkpoint, monkeypatch, caplog):
    """A capture that fails (here: the real one, on a machine without CUDA) is logged once and remembered: every
    step of that shape decodes eagerly with the same tokens, and the capture is never tried again. (The torch ops
    keep it fast: no graph is ever replayed.)"""
    attempts: list[tuple[int, int]] = []
    capture = DecodeGraph.capture

    def counted_capture(self, pool, stream, out):
        attempts.append((self.batch_size, self.table_width))
        return capture(self, pool, stream, out)

    monkeypatch.setattr(DecodeGraph, "capture", counted_capture)
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 8)
    prompts = [[5, 9, 2], [7, 7, 1, 3, 8]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48).generate(prompts,
                                                                                                           params)
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=48)
    runner = llm.engine.executor
    runner.graphs = DecodeGraphs(runner, 4)  # forced on
    runner.graphs.pool = ()  # past the pool: the capture itself fails (no CUDA stream in the CPU build of torch)
    with caplog.at_level("WARNING", logger="tsterm.engine.cuda_graphs"):
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert runner.graph_steps == 0 and runner.graphs.graphs == {}
    assert sorted(attempts) == sorted(runner.graphs.failed) == [(2, 2), (2, 4)]  # each shape tried once
    warnings = [r.getMessage() for r in caplog.records if "capture" in r.getMessage()]
    assert len(warnings) == 2 and "run eagerly" in warnings[0]
