"""The Triton kernels compiled on a CUDA device, in bfloat16 at real model sizes (Qwen3-30B-A3B layer shapes).

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest tests/kernels/test_triton_gpu.py`, as scripts/gpu_check.sh does. Self-contained: no
fixtures from conftest files.

Accuracy is judged against the float64 oracles (tests/kernels/oracles.py) on the same bf16 inputs; where bf16
rounding inside the op makes an absolute tolerance arbitrary, next to the torch path (torch_ops) run in bf16: the
kernel may not be much worse than it.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import dispatch, quant, torch_ops, triton_ops
from tsterm_kernels import triton_quant_linear as tql
from tsterm_kernels.triton_paged_attention import launch_paged_attention

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint
from tests.kernels import oracles
from tests.kernels.cases import paged_batch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

BF16 = torch.bfloat16
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16


def no_worse_than_twin(ours: torch.Tensor, twin: torch.Tensor, exact: torch.Tensor, slack: float) -> None:
    """ours' largest error from the oracle's `exact` (float64) within twice the bf16 torch path's, plus slack."""
    ours_err = (ours.double() - exact).abs().max().item()
    twin_err = (twin.double() - exact).abs().max().item()
    assert ours_err <= 2 * twin_err + slack, f"max error {ours_err:.3e} vs the bf16 torch path's {twin_err:.3e}"


def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's renormalised top-k routing, its weights in float32 as the kernels receive them."""
    weights, expert_ids = oracles.moe_route(logits, TOP_K, True)
    return weights.float(), expert_ids


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    ranks = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)  # a permutation per row
    return (ranks.float() * (8.0 / num_experts) - 4.0).to(BF16).cuda()  # exact in bf16: no ties


def test_rms_norm_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(257, HIDDEN, generator=gen).to(BF16).cuda()
    residual = torch.randn(257, HIDDEN, generator=gen).to(BF16).cuda()
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(BF16).cuda()
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    want, want_residual = oracles.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, want.to(BF16), atol=2e-2, rtol=2e-2)
    # per-head q/k norm: many short rows
    q = torch.randn(257 * HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    w = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(BF16).cuda()
    torch.testing.assert_close(triton_ops.rms_norm(q, w, 1e-6)[0], oracles.rms_norm(q, w, 1e-6)[0].to(BF16),
                               atol=2e-2, rtol=2e-2)


def test_store_kv_bf16():
    gen = torch.Generator().manual_seed(1)
    num_tokens = 300
    fused = torch.randn(num_tokens, 3 * KV_HEADS * HEAD_DIM, generator=gen).to(BF16).cuda()
    k = fused[:, KV_HEADS * HEAD_DIM:2 * KV_HEADS * HEAD_DIM].view(num_tokens, KV_HEADS, HEAD_DIM)
    v = fused[:, 2 * KV_HEADS * HEAD_DIM:].view(num_tokens, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(512 * BLOCK, generator=gen)[:num_tokens].cuda()
    k_cache = torch.full((512, BLOCK, KV_HEADS, HEAD_DIM), 7.0, dtype=BF16, device="cuda")
    v_cache = torch.full_like(k_cache, -7.0)
    want_k, want_v = oracles.store_kv(k, v, k_cache, v_cache, slots)
    triton_ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [
    ([4096, 4000, 37, 2500], [1, 1, 1, 1]),  # decode at 4K: split-K
    ([1000, 700, 4096, 90], [1000, 129, 1, 90]),  # prefill, extend, decode, short prefill
], ids=["decode", "mixed"])
def test_paged_attention_bf16(group, batch):
    seq_lens, query_lens = batch
    gen = torch.Generator().manual_seed(group)
    k_cache, v_cache, meta = paged_batch(seq_lens, query_lens, BLOCK, KV_HEADS, HEAD_DIM, BF16, gen, device="cuda")
    q = torch.randn(sum(query_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(BF16).cuda()
    scale = HEAD_DIM ** -0.5
    out = triton_ops.paged_attention(q, k_cache, v_cache, meta, scale)
    exact = oracles.paged_attention(q, k_cache, v_cache, meta, scale)
    twin = torch_ops.paged_attention(q, k_cache, v_cache, meta, scale)
    assert not out.isnan().any()
    no_worse_than_twin(out, twin, exact, slack=4e-3)
    for splits in (1, 7):  # forced split counts agree too
        forced = launch_paged_attention(q, k_cache, v_cache, meta, scale, num_splits=splits)
        no_worse_than_twin(forced, twin, exact, slack=4e-3)


def test_paged_attention_decode_32k():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, meta = paged_batch([32768, 20000], [1, 1], BLOCK, KV_HEADS, HEAD_DIM, BF16, gen, device="cuda")
    q = torch.randn(2, HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    out = triton_ops.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    exact = oracles.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), exact.float(), atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_moe_route_bf16(num_tokens):
    logits = distinct_logits(num_tokens, EXPERTS, torch.Generator().manual_seed(num_tokens))
    weights, expert_ids = triton_ops.moe_route(logits, TOP_K, True)
    want_weights, want_ids = oracles.moe_route(logits, TOP_K, True)
    torch.testing.assert_close(expert_ids, want_ids, atol=0, rtol=0)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300, 2048])
def test_fused_moe_bf16(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(BF16).cuda()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).to(BF16).cuda()
    weights, expert_ids = route(distinct_logits(num_tokens, EXPERTS, gen))
    start = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    out = start.clone()
    triton_ops.fused_moe(x, w13, w2, weights, expert_ids, out)
    twin = torch_ops.fused_moe(x, w13, w2, weights, expert_ids, start.clone())
    exact = oracles.fused_moe(x, w13, w2, weights, expert_ids, start)
    no_worse_than_twin(out, twin, exact, slack=1e-2)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_quantized_bf16(kind, num_tokens):
    """Expert stacks read as stored, against the oracle on the dequantized stacks, next to the torch path on them in
    bf16 (cuBLAS)."""
    gen = torch.Generator().manual_seed(num_tokens + len(kind))
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    w13 = QUANTIZE[kind]((torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).cuda())
    w2 = QUANTIZE[kind]((torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).cuda())
    weights, expert_ids = route(distinct_logits(num_tokens, EXPERTS, gen))
    start = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    out = start.clone()
    triton_ops.fused_moe(x, w13, w2, weights, expert_ids, out)
    f13, f2 = oracles.dequantize(w13), oracles.dequantize(w2)  # float64
    twin = torch_ops.fused_moe(x, f13.to(BF16), f2.to(BF16), weights, expert_ids, start.clone())
    exact = oracles.fused_moe(x, f13, f2, weights, expert_ids, start)
    no_worse_than_twin(out, twin, exact, slack=1e-2)


def test_forward_ops_never_sync_the_host():
    """Routing, alignment, fused MoE, attention, KV store and norms queue work without waiting on the device."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, meta = paged_batch([3000, 40], [1, 40], BLOCK, KV_HEADS, HEAD_DIM, BF16, gen, device="cuda")
    q = torch.randn(41, HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    kv = torch.randn(41, KV_HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    x = torch.randn(41, HIDDEN, generator=gen).to(BF16).cuda()
    norm_weight = torch.ones(HIDDEN, dtype=BF16, device="cuda")
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02).to(BF16).cuda()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.03).to(BF16).cuda()
    logits = distinct_logits(41, EXPERTS, gen)

    def step() -> None:
        meta.query_start_loc_device = meta.seq_lens_device = None  # rebuilt from the host lists, as each step
        normed, _residual = triton_ops.rms_norm(x, norm_weight, 1e-6, x)
        triton_ops.store_kv(kv, kv, k_cache, v_cache, meta.slot_mapping)
        triton_ops.paged_attention(q, k_cache, v_cache, meta, 0.1)
        weights, expert_ids = triton_ops.moe_route(logits, TOP_K, True)
        triton_ops.fused_moe(normed, w13, w2, weights, expert_ids, torch.zeros_like(x))

    step()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_dispatch_loads_triton_on_cuda():
    ops = dispatch.load("triton")
    x = torch.randn(4, HIDDEN, dtype=BF16, device="cuda")
    out, _ = ops.rms_norm(x, torch.ones(HIDDEN, dtype=BF16, device="cuda"), 1e-6)
    torch.testing.assert_close(out, oracles.rms_norm(x, torch.ones_like(x[0]), 1e-6)[0].to(BF16), atol=2e-2, rtol=2e-2)


QUANTIZE = {"int8": quant.quantize_int8, "int4": quant.quantize_int4, "fp8": quant.quantize_fp8}


@pytest.mark.parametrize("kind", list(QUANTIZE))
@pytest.mark.parametrize("num_rows, out_f, in_f", [
    (1, 4096, 2048), (64, 4096, 2048), (1, 2048, 4096), (300, 2048, 4096),
    (17, 1000, 1824),  # odd tiles; fp8: partial 128-blocks both ways
])
def test_quant_linear_bf16(monkeypatch, kind, num_rows, out_f, in_f):
    gen = torch.Generator().manual_seed(num_rows + out_f)
    weight = QUANTIZE[kind]((torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).cuda())
    x = torch.randn(num_rows, in_f, generator=gen).to(BF16).cuda()
    bias = torch.randn(out_f, generator=gen).to(BF16).cuda()
    calls = []
    kernel = tql.quant_linear
    monkeypatch.setattr(tql, "quant_linear", lambda *args: calls.append(args) or kernel(*args))
    out = quant.quantized_linear(x, weight, bias)  # the model's seam sends CUDA inputs to the kernel
    assert len(calls) == 1 and out.dtype == BF16 and out.shape == (num_rows, out_f)
    dequantized = oracles.dequantize(weight)  # float64
    exact = oracles.linear(x, dequantized, bias)
    twin = F.linear(x, dequantized.to(BF16), bias)  # the same weights in bf16 through cuBLAS
    assert not out.isnan().any()
    no_worse_than_twin(out, twin, exact, slack=1e-2)


def test_quant_linear_float32_matches_the_oracle():
    gen = torch.Generator().manual_seed(7)
    for kind, quantize in QUANTIZE.items():
        weight = quantize(torch.randn(1000, 1824, generator=gen).cuda())
        x = torch.randn(33, 1824, generator=gen).cuda()
        want = oracles.linear(x, oracles.dequantize(weight)).float()
        torch.testing.assert_close(tql.quant_linear(x, weight), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_quant_linear_never_syncs_and_replays_in_a_graph():
    gen = torch.Generator().manual_seed(8)
    weights = [quantize((torch.randn(2048, 1024, generator=gen) * 0.03).cuda()) for quantize in QUANTIZE.values()]
    x = torch.randn(1, 1024, generator=gen).to(BF16).cuda()
    eager = [quant.quantized_linear(x, w) for w in weights]  # compiles outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        [quant.quantized_linear(x, w) for w in weights]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [quant.quantized_linear(x, w) for w in weights]
    graph.replay()
    torch.cuda.synchronize()
    for ours, want in zip(captured, eager):
        assert torch.equal(ours, want)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_model_decodes_through_the_kernel(tmp_path, monkeypatch, mode):
    """A tiny MoE model with a shared expert, quantized on the GPU (experts too), CUDA graphs on, against the same
    quantized model run by the torch kernels, whose matmuls dequantize the weight per call and run cuBLAS (float32:
    same tokens)."""
    path, _ = make_checkpoint(tmp_path / "m", "qwen2_moe", dict(
        num_experts=5, num_experts_per_tok=2, shared_expert_intermediate_size=32, num_hidden_layers=2,
        hidden_size=64, head_dim=16, moe_intermediate_size=32, max_position_embeddings=512))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (13, 5, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def generate(kernels: str, **options):
        llm = LLM(str(path), dtype="float32", device="cuda", block_size=4, num_kv_blocks=256, quantization=mode,
                  kernels=kernels, **options)
        assert llm.engine.executor.kernels == kernels
        return llm.generate(prompts, params)

    got = generate("triton")
    monkeypatch.setattr(quant, "runs_on_triton", lambda x, weight: False)
    want = generate("torch", cuda_graphs=False)
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
