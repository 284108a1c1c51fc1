"""gpt-oss's sink / sliding-window attention in a padded decode-graph step (`DecodeGraph.run_eager`: what a CUDA
graph captures, the batch padded to its bucket, padding rows at context 0, the block table at its tier's width, the
Triton kernel's split count from the bucket's shape) gives the unpadded step's logits and writes only the real rows'
KV. (The family's CUDA graphs stay off for its experts: `clamped_swiglu_experts` reads its counts on the host.)"""
from __future__ import annotations

import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.cuda_graphs import DecodeGraph, DecodeGraphs
from tsterm_kernels import triton_paged_attention

from tests.helpers.checkpoints import make_checkpoint


def test_a_padded_decode_step_matches_the_unpadded_one(tmp_path, monkeypatch):
    model_dir, _ = make_checkpoint(tmp_path / "m", "gpt_oss", dict(
        num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1, sliding_window=4,
        num_hidden_layers=2))
    # (no window pool: a decode graph's static step buffers carry no window tables, `StepLayout(window=...)`)
    engine = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=48,
                 kernels="triton", window_kv_blocks=0).engine
    runner = engine.executor
    gen = torch.Generator().manual_seed(0)
    for n in (5, 10, 3):  # windows of 4: two of the three contexts are longer
        engine.add_request(torch.randint(0, 300, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_new == [1, 1, 1]
    kv = runner.cache.pools["full_attention"].kv
    before = kv.clone()
    want = runner.execute(batch).clone()
    after_eager = kv.clone()
    kv.copy_(before)
    graph = DecodeGraph(runner, 4, DecodeGraphs(runner, 8).shape_for(batch)[1] + 3)
    windows = []
    launch = triton_paged_attention.launch_paged_attention

    def counted(*args, **kwargs):
        windows.append(kwargs.get("window"))
        return launch(*args, **kwargs)
    monkeypatch.setattr(triton_paged_attention, "launch_paged_attention", counted)
    got = graph.run_eager(batch)
    assert sorted(windows, key=str) == [4, None]  # the sliding and the full layer, each through the Triton kernel
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv, after_eager, atol=1e-5, rtol=1e-5)
