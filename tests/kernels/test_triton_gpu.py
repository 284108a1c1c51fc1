"""The Triton kernels compiled on a CUDA device, in bfloat16 at real model sizes (Qwen3-30B-A3B layer shapes).

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest tests/kernels/test_triton_gpu.py`, as scripts/gpu_check.sh does. Self-contained: no
fixtures from conftest files.

Accuracy is judged against a float32 evaluation of the same bf16 inputs, next to the torch twin run in bf16: the
kernel may not be much worse than the twin.
"""
from __future__ import annotations

import os

import pytest
import torch
from tsterm_kernels import dispatch, reference, triton_ops
from tsterm_kernels.triton_paged_attention import launch_paged_attention

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
    ours_err = (ours.float() - exact).abs().max().item()
    twin_err = (twin.float() - exact).abs().max().item()
    assert ours_err <= 2 * twin_err + slack, f"max error {ours_err:.3e} vs the bf16 twin's {twin_err:.3e}"


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    ranks = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)  # a permutation per row
    return (ranks.float() * (8.0 / num_experts) - 4.0).to(BF16).cuda()  # exact in bf16: no ties


def test_rms_norm_bf16():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(257, HIDDEN, generator=gen).to(BF16).cuda()
    residual = torch.randn(257, HIDDEN, generator=gen).to(BF16).cuda()
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(BF16).cuda()
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    want, want_residual = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    # per-head q/k norm: many short rows
    q = torch.randn(257 * HEADS, HEAD_DIM, generator=gen).to(BF16).cuda()
    w = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(BF16).cuda()
    torch.testing.assert_close(triton_ops.rms_norm(q, w, 1e-6)[0], reference.rms_norm(q, w, 1e-6)[0],
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
    want_k, want_v = k_cache.clone(), v_cache.clone()
    triton_ops.store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, want_k, want_v, slots)
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
    exact = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    twin = reference.paged_attention(q, k_cache, v_cache, meta, scale)
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
    exact = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_moe_route_bf16(num_tokens):
    logits = distinct_logits(num_tokens, EXPERTS, torch.Generator().manual_seed(num_tokens))
    weights, expert_ids = triton_ops.moe_route(logits, TOP_K, True)
    want_weights, want_ids = reference.moe_route(logits, TOP_K, True)
    torch.testing.assert_close(expert_ids, want_ids, atol=0, rtol=0)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300, 2048])
def test_fused_moe_bf16(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(BF16).cuda()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).to(BF16).cuda()
    weights, expert_ids = reference.moe_route(distinct_logits(num_tokens, EXPERTS, gen), TOP_K, True)
    start = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16).cuda()
    out = start.clone()
    triton_ops.fused_moe(x, w13, w2, weights, expert_ids, out)
    twin = reference.fused_moe(x, w13, w2, weights, expert_ids, start.clone())
    exact = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, expert_ids, start.float())
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
    torch.testing.assert_close(out, reference.rms_norm(x, torch.ones_like(x[0]), 1e-6)[0], atol=2e-2, rtol=2e-2)
