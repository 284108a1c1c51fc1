"""csrc/gemm.c on AVX-512: a GEMM whose rows of x overflow the pair-at-a-time order's 1 MB runs in equal passes of
rows that fit (W packed once a pass). Each row's result must be the bits it gets alone, in whichever pass it falls,
and float32-close to a float64 matmul; both builds this CPU runs give the same bits."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import cpu_native


def _builds():
    builds = [("native", cpu_native.load())]
    avx2 = cpu_native.load_variant("avx2")
    if avx2 is not None:
        builds.append(("avx2", avx2))
    assert builds[0][1] is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return builds


def _gemm(native, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    native.f32_gemm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
    return y


# rows x in_features over 1 MB: 600 x 513 (two passes of 304 and 296 rows), 1100 x 300 (two of 552 and 548)
@pytest.mark.parametrize("rows,in_f,out_f", [(600, 513, 70), (1100, 300, 40)])
def test_rows_in_passes_keep_their_bits(rows, in_f, out_f):
    gen = torch.Generator().manual_seed(rows + in_f)
    x = torch.randn(rows, in_f, generator=gen)
    w = torch.randn(out_f, in_f, generator=gen)
    want = (x.double() @ w.double().t()).float()
    outs = []
    for name, native in _builds():
        y = _gemm(native, x, w)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * in_f ** 0.5, msg=lambda m: f"{name}: {m}")
        for r in (0, 7, 303, 304, 551, 552, 599, rows - 1):  # the passes' first and last rows
            assert torch.equal(_gemm(native, x[r:r + 1], w), y[r:r + 1]), f"{name}: row {r} alone"
        for a, b in ((290, 310), (540, 560)):  # a few rows across a pass boundary, on their own
            assert torch.equal(_gemm(native, x[a:b], w), y[a:b]), f"{name}: rows {a}-{b - 1} alone"
        outs.append(y)
    for y in outs[1:]:
        assert torch.equal(y, outs[0]), "the AVX2 and native builds differ"
