"""MXFP4 weights (`tsterm_kernels.quant`'s "mxfp4": gpt-oss's experts as shipped) in every kernel that reads them:
csrc/mxfp4.c (each build this CPU runs), the torch fallback without the C kernels, and the Triton quantized linear
layer and fused MoE (interpreted on tiny shapes), each against a float64 oracle written from the OCP Microscaling
spec (v1.0, sections 5.3.3 and 6.3: an E2M1 element is a sign, two exponent bits of bias 1 and one mantissa bit,
subnormal at exponent 0; an E8M0 scale is 2^(X - 127), X = 255 NaN), not from the kernels' tables.

The C kernel keeps x in float32 and decodes each weight exactly, so it agrees with the exact product to float32
summation order; its order per (row, output) is fixed, so a row is the same bits alone or among many rows (a decode,
a batch, a prefill's panels) and in the AVX-512 and AVX2 builds.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_native, quant, torch_ops
from tsterm_kernels import triton_quant_linear as tql
from tsterm_kernels.quant import QuantizedWeight, mxfp4_interleave, mxfp4_matmul, quantize_mxfp4, quantized_linear

from tests.kernels import oracles
from tests.kernels.conftest import isa_candidates

F64 = torch.float64
BUILDS = {"c-avx512": "native", "c-avx2": "avx2"}


def spec_e2m1(code: int) -> float:
    """One E2M1 element (OCP MX v1.0, 5.3.3): bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa;
    exponent 0 is subnormal: 2^(1 - bias) * (0 + m / 2)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    value = mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -value if sign else value


def spec_e8m0(x: int) -> float:
    """One E8M0 scale (6.3): 2^(X - 127); X = 255 is NaN."""
    return float("nan") if x == 255 else 2.0 ** (x - 127)


def oracle_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The float64 matrix [O, I] an mxfp4 weight stands for, read byte by byte: byte j of block b of row o holds
    input 32 b + 2 j in its low nibble and 32 b + 2 j + 1 in its high one."""
    out_f, in_f = weight.dims
    data, scales = weight.data.tolist(), weight.scale.tolist()
    w = torch.empty(out_f, in_f, dtype=F64)
    for o in range(out_f):
        for b in range(in_f // 32):
            s = spec_e8m0(scales[o][b])
            for j in range(16):
                byte = data[o][b * 16 + j]
                w[o, 32 * b + 2 * j] = spec_e2m1(byte & 15) * s
                w[o, 32 * b + 2 * j + 1] = spec_e2m1(byte >> 4) * s
    return w


def random_mxfp4(out_f: int, in_f: int, seed: int, lead: tuple[int, ...] = ()) -> QuantizedWeight:
    """Random bytes as stored: every code, scales 2^-10 .. 2^3 varying by block."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, out_f, in_f // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 131, (*lead, out_f, in_f // 32), generator=gen).to(torch.uint8)
    return QuantizedWeight.mxfp4(blocks, scales)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> None:
    torch.testing.assert_close(got.to(F64), want, rtol=1e-5, atol=rel * want.abs().max().item())


@pytest.fixture(scope="module")
def native():
    kernels = cpu_native.load()
    assert kernels is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return kernels


@pytest.fixture(params=isa_candidates())
def build(request):
    kernels = cpu_native.load_variant(BUILDS[request.param])
    assert kernels is not None
    return kernels


def test_dequantize_is_the_spec():
    w = random_mxfp4(5, 64, seed=1)
    want = oracle_weight(w)
    assert torch.equal(w.dequantize().to(F64), want)
    assert sorted({spec_e2m1(c) for c in range(16)}) == sorted(set(quant.E2M1_VALUES))
    edges = QuantizedWeight.mxfp4(w.data[:3, :16], torch.tensor([[0], [254], [255]], dtype=torch.uint8))
    # (float32: 3 * 2^127 and more overflow to infinity, as the oracle's values do in float32)
    torch.testing.assert_close(edges.dequantize(), oracle_weight(edges).float(), rtol=0, atol=0, equal_nan=True)


def test_the_c_dequantize_is_the_spec(native):
    w = random_mxfp4(7, 96, seed=2)
    out = torch.empty(w.dims)
    native.mxfp4_dequantize(w.data.data_ptr(), w.scale.data_ptr(), *w.dims, out.data_ptr())
    assert torch.equal(out.to(F64), oracle_weight(w))


@pytest.mark.parametrize("out_f,in_f", [(37, 64), (16, 32), (70, 160)])  # outputs not whole tiles of 4 or 16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 21])  # in registers (<= 4 on AVX-512, 2 on AVX2) and panels
def test_c_kernel_matches_the_spec_oracle(build, out_f, in_f, rows):
    w = random_mxfp4(out_f, in_f, seed=out_f + rows)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)) * 3
    _close(mxfp4_matmul(build, x, w), x.to(F64) @ oracle_weight(w).T)


def test_the_extreme_scales_are_the_specs(native):
    """E8M0 0 is 2^-127 (a float32 subnormal, kept), 254 is 2^127, 255 NaN (its row's output only)."""
    blocks = torch.full((3, 2, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    scales = torch.tensor([[0, 0], [254, 0], [255, 127]], dtype=torch.uint8)
    w = QuantizedWeight.mxfp4(blocks, scales)
    x = torch.full((1, 64), 2.0 ** -10)
    y = mxfp4_matmul(native, x, w)[0].tolist()
    want = (x.to(F64) @ oracle_weight(w).T)[0].tolist()
    assert y[0] == want[0] == 64 * 2.0 ** -137  # the products are float32 subnormals, summed exactly
    assert y[1] == want[1] == 2.0 ** 122  # 32 * 2^127 * 2^-10 (the subnormal block's part is far below its ulp)
    assert y[2] != y[2] and want[2] != want[2]  # NaN


@pytest.mark.parametrize("out_f,in_f", [(48, 128), (37, 96)])
def test_a_row_is_the_same_bits_alone_or_among_many(build, out_f, in_f):
    """The engine's invariance promise: a decode's row (registers) equals the same row in a batch of any size and in
    a prefill's panels, in every build."""
    w = random_mxfp4(out_f, in_f, seed=3)
    x = torch.randn(40, in_f, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([mxfp4_matmul(build, x[i:i + 1], w) for i in range(40)])
    for rows in (2, 3, 4, 5, 8, 17, 40):
        assert torch.equal(mxfp4_matmul(build, x[:rows], w), alone[:rows]), rows


def test_the_avx512_and_avx2_builds_give_the_same_bits():
    if len(isa_candidates()) < 2:
        pytest.skip("this CPU runs one build only")
    w = random_mxfp4(53, 160, seed=5)
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(6))
    for rows in (1, 3, 11):
        a, b = (mxfp4_matmul(cpu_native.load_variant(v), x[:rows], w) for v in ("native", "avx2"))
        assert torch.equal(a, b)


def test_linear_runs_the_c_kernel_on_an_expert_of_a_stack_read_in_place(native):
    """The model's seam (`torch_ops.linear`) takes an mxfp4 expert of a stack: views of the stack's bytes, the C
    kernel's result, bias added; bfloat16 x comes back bfloat16."""
    stack = random_mxfp4(24, 64, seed=7, lead=(3,))
    expert = stack[1]
    assert expert.data.data_ptr() == stack.data[1].data_ptr() and expert.scale.data_ptr() == stack.scale[1].data_ptr()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(24, generator=torch.Generator().manual_seed(9))
    got = torch_ops.linear(x, expert, bias)
    assert torch.equal(got, mxfp4_matmul(native, x, expert) + bias)
    _close(got, x.to(F64) @ oracle_weight(expert).T + bias.to(F64))
    assert torch_ops.linear(x.bfloat16(), expert).dtype == torch.bfloat16


def test_blocks_as_loaded_are_kept_without_a_copy():
    """QuantizedWeight.mxfp4 keeps a checkpoint's contiguous _blocks / _scales as they are (a mapped file's views)."""
    blocks = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 8, 3), dtype=torch.uint8)
    w = QuantizedWeight.mxfp4(blocks, scales)
    assert w.dims == (2, 8, 96) and w.data.shape == (2, 8, 48)
    assert w.data.data_ptr() == blocks.data_ptr() and w.scale.data_ptr() == scales.data_ptr()
    assert w.nbytes * 8 / (2 * 8 * 96) == 4.25  # bits a weight
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight.mxfp4(blocks, scales[..., :2])
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight.mxfp4(blocks.to(torch.int8), scales)


def test_without_the_c_kernels_a_weight_is_dequantized_once_and_kept(monkeypatch):
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    stack = random_mxfp4(16, 64, seed=10, lead=(2,))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(11))
    assert stack.float_nbytes == 0
    y = quantized_linear(x, stack[1])
    assert torch.equal(y, F.linear(x, oracle_weight(stack[1]).float()))
    kept = stack.float_slots[1]
    assert kept is not None and stack.float_nbytes == 16 * 64 * 4
    quantized_linear(x, stack[1])
    assert stack.float_slots[1] is kept  # not dequantized again


def test_quantize_follows_the_spec():
    """quantize_mxfp4: the block's scale 2^(floor(log2 max|w|) - 2), values rounded to nearest e2m1 (ties to the even
    code), so values already on the grid come back exactly; every other value to its nearest grid point."""
    gen = torch.Generator().manual_seed(12)
    grid = torch.tensor([spec_e2m1(c) for c in range(16)])
    values = grid[torch.randint(0, 16, (4, 2, 32), generator=gen)].double()  # [row, block, 32]
    values[..., 0] = torch.tensor([6.0, -6.0])  # each block's largest magnitude: its scale is 2^k exactly
    k = torch.randint(-3, 3, (4, 2, 1), generator=gen).double()
    on_grid = (values * 2.0 ** k).reshape(4, 64).float()
    q = quantize_mxfp4(on_grid)
    assert torch.equal(oracle_weight(q), on_grid.to(F64))
    w = torch.randn(3, 32, generator=gen)
    q = quantize_mxfp4(w)
    back = oracle_weight(q)
    for r in range(3):
        scale = 2.0 ** (torch.floor(torch.log2(w[r].abs().max())).item() - 2)
        candidates = torch.unique(grid.to(F64)) * scale
        nearest = (w[r].to(F64)[:, None] - candidates).abs().min(-1).values
        assert torch.all((back[r] - w[r].to(F64)).abs() <= nearest + 1e-12)


def test_ggufs_nibble_order_converts():
    """GGUF's MXFP4 block: byte j holds input j (low) and j + 16 (high); mxfp4_interleave gives this module's."""
    codes = torch.randint(0, 16, (5, 32), generator=torch.Generator().manual_seed(13), dtype=torch.uint8)
    gguf = codes[:, :16] | (codes[:, 16:] << 4)
    ours = mxfp4_interleave(gguf)
    assert torch.equal(ours & 15, codes[:, 0::2]) and torch.equal(ours >> 4, codes[:, 1::2])


def test_the_torch_fused_moe_runs_mxfp4_stacks(native):
    """ops.fused_moe on the CPU takes mxfp4 expert stacks (each expert through the C kernel) = the oracle on them."""
    gen = torch.Generator().manual_seed(14)
    hidden, inter, experts = 64, 32, 4
    w13, w2 = random_mxfp4(2 * inter, hidden, 15, (experts,)), random_mxfp4(hidden, inter, 16, (experts,))
    x = torch.randn(5, hidden, generator=gen) * 0.05
    expert_ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 3]])
    weights = torch.rand(5, 2, generator=gen)
    got = torch_ops.fused_moe(x, w13, w2, weights, expert_ids, torch.zeros(5, hidden))
    w13f = torch.stack([oracle_weight(w13[e]) for e in range(experts)])
    w2f = torch.stack([oracle_weight(w2[e]) for e in range(experts)])
    want = oracles.fused_moe(x, w13f, w2f, weights, expert_ids, torch.zeros(5, hidden))
    torch.testing.assert_close(got.to(F64), want.to(F64), rtol=1e-4, atol=1e-5 * want.abs().max().item())


# ---- Triton (interpreted on CPU tensors; float32 and float16 on tiny shapes)

@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_quant_linear_matches_the_spec_oracle(poison, rows, dtype):
    w = random_mxfp4(37, 96, seed=20 + rows)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 104, generator=gen) * 0.5).to(dtype)[:, 8:]  # a strided view, as after a split
    bias = torch.randn(37, generator=gen).to(dtype)
    got = tql.quant_linear(x, w, bias)
    want = (x.to(F64) @ oracle_weight(w).T + bias.to(F64))
    assert got.dtype == dtype
    if dtype == torch.float32:
        _close(got, want)
    else:  # one rounding of the output to float16
        torch.testing.assert_close(got.to(F64), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_triton_reads_the_extreme_scales_as_the_spec(poison):
    blocks = torch.randint(0, 256, (3, 2, 16), generator=torch.Generator().manual_seed(21), dtype=torch.uint8)
    w = QuantizedWeight.mxfp4(blocks, torch.tensor([[1, 130], [254, 100], [255, 127]], dtype=torch.uint8))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(22)) * 2.0 ** -20  # 2^127 * x stays finite
    got, want = tql.quant_linear(x, w).to(F64), x.to(F64) @ oracle_weight(w).T
    torch.testing.assert_close(got[:, :2], want[:, :2], rtol=1e-5, atol=0)
    assert torch.isnan(got[:, 2]).all()


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 6, 2), (19, 5, 3)])
def test_triton_fused_moe_reads_mxfp4_stacks(triton_ops, poison, num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 64, 32
    w13 = random_mxfp4(2 * inter, hidden, 23, (num_experts,))
    w2 = random_mxfp4(hidden, inter, 24, (num_experts,))
    x = torch.randn(num_tokens, hidden, generator=gen) * 0.05
    expert_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k].contiguous()
    weights = torch.rand(num_tokens, top_k, generator=gen)
    start = torch.randn(num_tokens, hidden, generator=gen)
    got = triton_ops.fused_moe(x, w13, w2, weights, expert_ids, start.clone())
    w13f = torch.stack([oracle_weight(w13[e]) for e in range(num_experts)])
    w2f = torch.stack([oracle_weight(w2[e]) for e in range(num_experts)])
    want = oracles.fused_moe(x, w13f, w2f, weights, expert_ids, start).to(F64)
    torch.testing.assert_close(got.to(F64), want, rtol=1e-4, atol=2e-5 * want.abs().max().item())
