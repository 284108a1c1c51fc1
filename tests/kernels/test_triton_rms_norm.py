"""Triton RMSNorm (+ fused residual add) against the float64 oracle."""
from __future__ import annotations

import pytest
import torch

from tests.kernels import oracles
from tests.kernels.cases import TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows, hidden_size", [(1, 64), (7, 48), (37, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_oracle(triton_ops, poison, dtype, num_rows, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(num_rows * hidden_size)
    # x is a column slice of a wider activation (as q/k of a fused qkv projection): row stride != H
    wide = (torch.randn(num_rows, hidden_size + 8, generator=gen) * 3).to(dtype)
    x = wide[:, 4:4 + hidden_size]
    weight = (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(num_rows, hidden_size, generator=gen).to(dtype) if with_residual else None

    out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    want, want_residual = oracles.rms_norm(x, weight, 1e-6, residual)

    torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype])
    if with_residual:
        torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    else:
        assert new_residual is None


def test_rms_norm_leaves_inputs_alone(triton_ops):
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    x0, residual0 = x.clone(), residual.clone()
    triton_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(x, x0) and torch.equal(residual, residual0)


def test_rms_norm_rejects_mismatched_weight(triton_ops):
    with pytest.raises(AssertionError, match="weight"):
        triton_ops.rms_norm(torch.randn(2, 32), torch.ones(16), 1e-6)
