"""The CUDA decode path on a real device: decode steps that never wait for the device, CUDA-graph replays equal
to eager steps, and the whole tiny model's greedy output on CUDA equal to the CPU reference.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest`, as scripts/gpu_check.sh does. Self-contained: no fixtures from conftest files. Float32
throughout (exact "ieee" dots in the kernels, no TF32 in cuBLAS), so tokens can be compared exactly; the bf16
path at real sizes runs in benchmarks/gpu_decode.py, which also checks a bf16 step for host syncs.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.sampling import every_sampler_stage
from tsterm import LLM, SamplingParams
from tsterm.engine import cuda_graphs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

ARCHS = {
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2, "max_position_embeddings": 512},
    "qwen2_moe": {"num_experts": 5, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 24,
                  "num_hidden_layers": 2, "max_position_embeddings": 512},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_decode")
    return {name: make_checkpoint(root / name, name, overrides)[0] for name, overrides in ARCHS.items()}


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


def cuda_llm(path, **options) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=4, num_kv_blocks=256, **options)
    assert llm.engine.executor.kernels == "triton"
    return llm


def assert_same_generation(got, want, logprob_tol: float) -> None:
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=logprob_tol)


def routed_tokens(llm) -> list[int]:
    return [sum(layer) for layer in llm.engine.expert_load()]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_on_cuda_matches_the_cpu_reference(checkpoints, arch):
    batch = prompts([11, 30, 5], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (24, 16, 7)]
    want = LLM(str(checkpoints[arch]), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256,
               kernels="torch").generate(batch, params)
    llm = cuda_llm(checkpoints[arch])
    got = llm.generate(batch, params)
    assert llm.engine.executor.graph_steps > 0  # decode batches of 3, 2 and 1 replayed graphs of 4, 2 and 1 rows
    assert_same_generation(got, want, logprob_tol=1e-3)


def test_graph_replays_match_eager_steps_across_buckets_and_context_tiers(checkpoints, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_CONTEXT", 16)  # tiers of 4, 8, 16, 32... blocks: several per run
    # 7 sequences, finishing one by one: buckets 8, 4, 2, 1; the longest context grows from 12 to 42 tokens,
    # through the 4-, 8- and 16-block tiers (block size 4)
    batch = prompts([3, 12, 7, 9, 4, 10, 6], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (40, 9, 26, 2, 20, 14, 5)]
    eager = cuda_llm(checkpoints["qwen3_moe"], cuda_graphs=False, max_num_seqs=8)
    want = eager.generate(batch, params)
    graphed = cuda_llm(checkpoints["qwen3_moe"], max_num_seqs=8)
    got = graphed.generate(batch, params)

    runner = graphed.engine.executor
    assert eager.engine.executor.graph_steps == 0 and eager.engine.executor.graphs is None
    assert runner.graph_steps >= 30
    sizes = {size for size, _ in runner.graphs.graphs}
    widths = {width for _, width in runner.graphs.graphs}
    assert len(sizes) >= 3 and len(widths) >= 3, sorted(runner.graphs.graphs)
    assert_same_generation(got, want, logprob_tol=1e-4)
    # padding rows are not counted as routed tokens: both engines routed exactly the tokens they computed
    assert routed_tokens(graphed) == routed_tokens(eager)


def test_padded_replay_writes_only_the_real_slots(checkpoints):
    llm = cuda_llm(checkpoints["qwen3_moe"])
    engine, runner = llm.engine, llm.engine.executor
    for prompt in prompts([9, 14, 6], seed=3):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step captures the 4-row graph
    batch = engine.scheduler.schedule()
    assert batch.num_new == [1, 1, 1]

    kv_before = runner.cache.pools["full_attention"].kv.clone()
    graphed = runner.execute(batch).clone()
    assert runner.graph_steps == 2 and (4, runner.graphs.shape_for(batch)[1]) in runner.graphs.graphs
    slots = kv_before.shape[2] * kv_before.shape[3]
    changed = (runner.cache.pools["full_attention"].kv != kv_before).reshape(-1, 2, slots, runner.cache.pools["full_attention"].kv[0, 0, 0, 0].numel())
    changed = changed.any(dim=3).any(dim=1).any(dim=0).nonzero().flatten().tolist()
    assert changed == sorted(slot for slot_mapping in batch.slot_mappings for slot in slot_mapping)

    kv_graphed = runner.cache.pools["full_attention"].kv.clone()
    runner.cache.pools["full_attention"].kv.copy_(kv_before)
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(batch)
    runner.graphs = graphs
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_graphed, runner.cache.pools["full_attention"].kv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_decode_steps_never_wait_for_the_device(checkpoints, use_graphs):
    """Forward and sampling of a decode step queue their work without a host sync; the step's one wait is the
    read-back of the sampled ids through pinned memory and an event, which sync debug mode does not flag."""
    llm = cuda_llm(checkpoints["qwen3_moe"], cuda_graphs=use_graphs)
    engine = llm.engine
    for prompt, params in zip(prompts([8, 13, 5, 21, 10, 7], seed=4), every_sampler_stage(20)):
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # warm-up decode steps: Triton compiles, the 8-row graph is captured
        engine.step()
    torch.cuda.synchronize()
    graph_steps = engine.executor.graph_steps
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            outputs = engine.step()
            assert len(outputs) == 6
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.executor.graph_steps - graph_steps == (4 if use_graphs else 0)
    assert all(len(out.outputs[0].token_ids) == 7 for out in outputs)
