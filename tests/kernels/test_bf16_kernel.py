"""csrc/bf16.c, the CPU's bfloat16 linear (y = bf16(x) @ w.T, float32 sums), on every instruction set this machine
runs (AMX where the OS grants it, AVX512-BF16 where the build has it, plain C always): against a float64 oracle on the
same bfloat16-rounded inputs, and bit for bit across row counts, splits of the rows and thread counts (a row's
result does not depend on the rows beside it: README "Same answer whatever the cache or the batch"); and the ops that
run a bfloat16 model on the CPU (tsterm_kernels.torch_ops) through it."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, cpu_select, torch_ops

from tests.kernels import oracles

ISA_NAMES = {2: "amx", 1: "avx512-bf16", 0: "plain"}


def _native() -> cpu_native.NativeKernels:
    native = cpu_native.load()
    assert native is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return native


def _isas() -> list[int]:
    bits = _native().bf16_isa()
    return [isa for isa in (2, 1) if bits & isa] + [0]


@pytest.fixture(params=_isas(), ids=lambda isa: ISA_NAMES[isa])
def isa(request) -> int:
    return request.param


def _gemm(x: torch.Tensor, w: torch.Tensor, isa: int) -> torch.Tensor:
    return torch_ops._bf16_gemm(_native(), isa, x, w)


def _case(rows: int, in_f: int, out_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen).to(torch.bfloat16)


def _check_oracle(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """float32 sums of exact products (a bfloat16 product fits a float32): |error| <= gamma_K * sum |x w|, with K the
    inputs summed into one output (doubled: the lanes' / tiles' partial sums add once more)."""
    xr = x.to(torch.bfloat16)
    want = oracles.linear(xr.double(), w.double())
    bound = xr.double().abs() @ w.double().abs().T
    k = x.shape[1]
    gamma = 2 * k * 2.0 ** -24 / (1 - 2 * k * 2.0 ** -24)
    err = (y.double() - want).abs()
    assert y.dtype is torch.float32 and y.shape == want.shape
    assert bool((err <= gamma * bound + 1e-30).all()), f"max error {float((err - gamma * bound).max())} over bound"


@pytest.mark.parametrize("rows,in_f,out_f", [(1, 64, 16), (3, 96, 40), (17, 100, 33), (40, 31, 7), (5, 576, 72)])
def test_the_kernel_matches_the_float64_oracle(isa, rows, in_f, out_f):
    """Whole tiles and every tail: rows past a tile, inputs past 32 (or 16), outputs past 16."""
    x, w = _case(rows, in_f, out_f)
    _check_oracle(_gemm(x, w, isa), x, w)


def test_bfloat16_and_float32_inputs_round_alike(isa):
    """x in float32 is rounded to nearest even in the kernel: the bits of torch's .to(bfloat16) given as bfloat16,
    and of rows read at a stride (a view of wider rows)."""
    x, w = _case(9, 70, 20, seed=1)
    x[0, :4] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 3.0e38])  # ties, a near-max
    wide = torch.randn(9, 90)
    wide[:, :70] = x
    want = _gemm(x, w, isa)
    assert torch.equal(_gemm(x.to(torch.bfloat16), w, isa), want)
    assert torch.equal(_gemm(wide[:, :70], w, isa), want)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(isa):
    """Each of 1..40 rows alone, in every prefix of a 1,000-row batch, and the batch cut into uneven pieces: the same
    bits as the whole batch."""
    x, w = _case(1000, 104, 50, seed=2)
    whole = _gemm(x, w, isa)
    for n in range(1, 41):
        assert torch.equal(_gemm(x[:n], w, isa), whole[:n]), f"{n} rows"
        assert torch.equal(_gemm(x[n - 1:n], w, isa), whole[n - 1:n]), f"row {n - 1} alone"
    cuts = [0, 1, 7, 16, 17, 300, 333, 1000]
    pieces = torch.cat([_gemm(x[a:b], w, isa) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(pieces, whole)


def test_one_thread_gives_the_bits_of_two(isa):
    x, w = _case(70, 200, 90, seed=3)
    two = _gemm(x, w, isa)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the C kernels' OpenMP threads too (one libgomp)
        one = _gemm(x, w, isa)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_an_instruction_set_the_build_lacks_is_refused():
    x, w = _case(2, 32, 16)
    y = torch.empty(2, 16)
    native = _native()
    missing = [isa for isa in (2, 1) if not native.bf16_isa() & isa] + [7]
    for isa in missing:
        assert native.bf16_gemm(x.data_ptr(), 0, 32, 2, 32, w.data_ptr(), 16, y.data_ptr(), 16, isa) == -2


@pytest.mark.parametrize("candidate", ["c-amx", "c-bf16"])
def test_linear_takes_the_kernel_its_class_chose(candidate, monkeypatch):
    """`linear` of a bfloat16 weight: the class's forced candidate (TSTERM_CPU_KERNELS=bf16=...) is what runs, its
    output rounded to x's dtype once (the bias added to the float32 sums first)."""
    if candidate not in cpu_select.bf16_available(cpu_select.CpuInfo.detect(), torch_ops._bf16_bits()):
        pytest.skip(f"{candidate} does not run on this machine")
    monkeypatch.setenv(cpu_select.ENV, f"bf16={candidate}")
    x, w = _case(6, 64, 48, seed=4)
    bias = torch.randn(48).to(torch.bfloat16)
    sums = _gemm(x, w, torch_ops._bf16_isa(candidate))
    assert torch.equal(torch_ops.linear(x.to(torch.bfloat16), w, bias), (sums + bias.float()).to(torch.bfloat16))
    assert torch.equal(torch_ops.linear(x, w), sums)  # float32 x: float32 out


def test_bfloat16_experts_and_norm_match_the_float64_oracles():
    """fused_moe and rms_norm on bfloat16 tensors: within bfloat16's rounding of the float64 oracles on the same
    (rounded) values, and the one-token and many-token calls give a token the same bits."""
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, top_k = 12, 64, 32, 6, 2
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].contiguous()
    weights = torch.rand(tokens, top_k, generator=gen)
    out = torch_ops.fused_moe(x, w13, w2, weights, ids, torch.zeros_like(x))
    want = oracles.fused_moe(x, w13, w2, weights, ids, torch.zeros(tokens, hidden))
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=0.03, atol=0.02)
    for t in (0, 5, 11):
        alone = torch_ops.fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], torch.zeros_like(x[:1]))
        assert torch.equal(alone, out[t:t + 1]), f"token {t}"
    norm_w = torch.rand(hidden, generator=gen).to(torch.bfloat16) + 0.5
    residual = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    normed, new_residual = torch_ops.rms_norm(x, norm_w, 1e-6, residual.clone())
    summed = (x + residual)
    assert torch.equal(new_residual, summed)
    want = oracles.rms_norm(summed, norm_w, 1e-6)[0]
    torch.testing.assert_close(normed.double(), want, rtol=0.01, atol=0.01)
    assert torch.equal(torch_ops.rms_norm(x[3:4], norm_w, 1e-6, residual[3:4].clone())[0], normed[3:4])
