"""gpt-oss's experts through the compiled Triton fused MoE on a CUDA device, at gpt-oss-20b's widths (H = I = 2880,
top-4; fewer experts to keep the float64 oracle small), bfloat16 and MXFP4 stacks with bfloat16 biases: against the
float64 oracle written from the definition (test_triton_clamped_moe.py) and no further from it than the per-expert
torch loop it replaces (`tsterm.model.clamped_swiglu.experts_loop`, run on the same device); and the model's seam,
`clamped_swiglu_experts`, sends CUDA tensors to the fused kernel.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/kernels/test_triton_clamped_moe_gpu.py` (listed in scripts/gpu_check.sh's GPU_TESTS).
Self-contained: no fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see the module docstring)"),
]

F64, BF16 = torch.float64, torch.bfloat16
HIDDEN, INTER, EXPERTS, TOP_K, ALPHA, LIMIT = 2880, 2880, 6, 4, 1.702, 7.0


def _case(kind: str, num_tokens: int, seed: int):
    """(x, w13, b13, w2, b2, weights, ids, start) on the device in bf16 (stacks bf16 or MXFP4), and the stacks'
    float64 values in tsterm's layout (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I])."""
    from tsterm_kernels.quant import QuantizedWeight

    from tests.kernels.test_mxfp4 import random_mxfp4
    from tests.kernels.test_triton_clamped_moe import spec_dequantize

    gen = torch.Generator().manual_seed(seed)
    if kind == "bf16":
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 4 * HIDDEN ** -0.5).to(BF16)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).to(BF16)
        w13_64, w2_64 = w13.to(F64), w2.to(F64)
        w13, w2 = w13.cuda(), w2.cuda()
    else:
        q13, q2 = random_mxfp4(2 * INTER, HIDDEN, seed, (EXPERTS,)), random_mxfp4(HIDDEN, INTER, seed + 1, (EXPERTS,))
        w13_64, w2_64 = spec_dequantize(q13), spec_dequantize(q2)
        w13, w2 = (QuantizedWeight.mxfp4(q.data.cuda(), q.scale.cuda()) for q in (q13, q2))
    scale = 1.0 if kind == "bf16" else 0.02  # (MXFP4's random scales reach 2^3: smaller inputs, the clamp still cut)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * scale).to(BF16)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=gen).to(BF16)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen).to(BF16)
    ids = torch.rand(num_tokens, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K].contiguous()
    weights = torch.rand(num_tokens, TOP_K, generator=gen).softmax(-1)
    start = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16)
    device = [t.cuda() for t in (x, b13, b2, weights, ids, start)]
    return device, (w13, w2), (w13_64, w2_64)


def _oracle(x, b13, b2, weights, ids, start, w13_64, w2_64) -> torch.Tensor:
    """test_triton_clamped_moe's oracle (HF's layout) on the stored values."""
    from tests.kernels.test_triton_clamped_moe import oracle_experts

    gate_up = torch.stack((w13_64[:, :INTER], w13_64[:, INTER:]), 2).flatten(1, 2).transpose(1, 2)  # [E, H, 2I]
    b = b13.cpu().to(F64)
    gate_up_bias = torch.stack((b[:, :INTER], b[:, INTER:]), 2).flatten(1, 2)
    return oracle_experts(x.cpu().to(F64), gate_up, gate_up_bias, w2_64.transpose(1, 2), b2.cpu().to(F64),
                          weights.cpu(), ids.cpu(), ALPHA, LIMIT, start.cpu().to(F64))


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_the_fused_kernel_is_as_close_to_the_oracle_as_the_loop(kind, num_tokens):
    from tsterm_kernels.triton_fused_moe import fused_moe

    from tsterm.model.clamped_swiglu import experts_loop

    (x, b13, b2, weights, ids, start), (w13, w2), floats = _case(kind, num_tokens, seed=num_tokens)
    want = _oracle(x, b13, b2, weights, ids, start, *floats)
    fused = fused_moe(x, w13, w2, weights, ids, start.clone(), w13_bias=b13, w2_bias=b2,
                      clamped_swiglu=(ALPHA, LIMIT))
    loop = start.clone()
    experts_loop(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT, loop)
    torch.cuda.synchronize()
    h = torch.einsum("th,eih->tei", x.cpu().to(F64), floats[0]) + b13.cpu().to(F64)[None]
    assert (h[..., :INTER] > LIMIT).any() or (h[..., INTER:].abs() > LIMIT).any()  # the clamp is reached
    scale = want.abs().max().item()
    fused_err, loop_err = ((got.cpu().to(F64) - want).abs() for got in (fused, loop))
    assert fused_err.max().item() <= 2e-2 * scale, (fused_err.max().item(), scale)  # a few bf16 steps at most
    # on average no further than the loop (the same roundings; only the order of the float32 sums and of the
    # atomic adds differ)
    assert fused_err.mean().item() <= 1.25 * loop_err.mean().item() + 1e-4 * scale, \
        (fused_err.mean().item(), loop_err.mean().item(), scale)


def test_the_models_seam_runs_the_fused_kernel_on_cuda(monkeypatch):
    """`clamped_swiglu_experts` on CUDA tensors: one call of the fused kernel (not the loop), its result in `out`."""
    from tsterm_kernels import triton_fused_moe

    from tsterm.model import clamped_swiglu

    (x, b13, b2, weights, ids, start), (w13, w2), _ = _case("bf16", 3, seed=9)
    weights, ids = weights[:, :1].contiguous(), ids[:, :1].contiguous()  # one atomic add a row: the same bits each run
    calls = []
    real = triton_fused_moe.fused_moe
    monkeypatch.setattr(triton_fused_moe, "fused_moe", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(clamped_swiglu, "experts_loop", lambda *a: pytest.fail("the per-expert loop ran on CUDA"))
    out = start.clone()
    clamped_swiglu.clamped_swiglu_experts(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT, out)
    want = real(x, w13, w2, weights, ids, start.clone(), w13_bias=b13, w2_bias=b2, clamped_swiglu=(ALPHA, LIMIT))
    assert len(calls) == 1 and calls[0]["clamped_swiglu"] == (ALPHA, LIMIT)
    assert torch.equal(out, want)
