"""The CPU fast paths of torch_ops (the C kernels, the row-split matmul, the host-grouped MoE) equal the plain
torch computation they replace and the float64 oracles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tsterm_kernels import torch_ops

from tests.kernels import oracles


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33])
@pytest.mark.parametrize("out_features", [96, 30, 4])  # 30: not a multiple of the split count, plain F.linear
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 48, generator=gen)
    w = torch.randn(out_features, 48, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = torch_ops.linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert y.is_contiguous()  # callers split and view the projection's columns


def test_linear_on_a_non_contiguous_weight_falls_back():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen).t()  # [64, 48], transposed view
    x = torch.randn(1, 48, generator=gen)
    torch.testing.assert_close(torch_ops.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40])  # 40 x 2 pairs: past the host-grouped decode path
def test_fused_moe_accumulates_every_pair(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter, experts, top_k = 32, 24, 5, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    weights, expert_ids = torch_ops.moe_route(torch.randn(num_tokens, experts, generator=gen), top_k, True)
    if num_tokens >= 3:
        expert_ids[0], expert_ids[1] = expert_ids[1].clone(), expert_ids[1].clone()  # shared experts in one step
    start = torch.randn(num_tokens, hidden, generator=gen)
    out = start.clone()
    assert torch_ops.fused_moe(x, w13, w2, weights, expert_ids, out) is out
    torch.testing.assert_close(out.double(), oracles.fused_moe(x, w13, w2, weights, expert_ids, start),
                               rtol=1e-5, atol=1e-5)


def _torch_loop_moe(x, w13, w2, weights, expert_ids, out):
    """fused_moe's torch loop, on a copy of out: ids that are not contiguous turn csrc/moe.c away."""
    ids = expert_ids.t().contiguous().t()  # the same values, column-major
    assert not ids.is_contiguous() or ids.shape[1] == 1
    if ids.is_contiguous():  # [T, 1] is contiguous either way: a strided view of a wider tensor
        ids = torch.cat([expert_ids, expert_ids], 1)[:, :1]
    return torch_ops.fused_moe(x, w13, w2, weights, ids, out.clone())


@pytest.mark.parametrize("num_tokens,top_k,hidden,inter", [(40, 2, 32, 24), (300, 4, 48, 40), (80, 1, 40, 16)])
def test_fused_moe_in_c_is_the_torch_loop_bit_for_bit(native_spy, cpu_isa, num_tokens, top_k, hidden, inter):
    """csrc/moe.c against the loop it replaces: experts with no rows, with 1-4 (the GEMV), with many (the GEMM), and
    pairs naming another rank's expert (id E), which add nothing."""
    gen = torch.Generator().manual_seed(num_tokens)
    experts = 8
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, experts, generator=gen)
    logits[:, 5] -= 100.0  # expert 5 gets no token
    logits[:3, 6] += 100.0  # expert 6 gets three (the GEMV's row counts)
    weights, expert_ids = torch_ops.moe_route(logits, top_k, True)
    expert_ids[::5, 0] = experts  # another rank's expert
    start = torch.randn(num_tokens, hidden, generator=gen)
    want = _torch_loop_moe(x, w13, w2, weights, expert_ids, start)
    spy = native_spy("moe_prefill")
    out = start.clone()
    assert torch_ops.fused_moe(x, w13, w2, weights, expert_ids, out) is out
    assert spy.calls == 1  # the C path ran
    assert torch.equal(out, want)
    torch.testing.assert_close(out.double(), oracles.fused_moe(x, w13, w2, weights, expert_ids, start),
                               rtol=1e-5, atol=1e-5)
