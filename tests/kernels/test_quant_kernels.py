"""Weight-only int8 / int4 / fp16 matmuls (`tsterm_kernels.quant`) against their references.

int8 / int4 run the C kernels (csrc/gemv.c) for any number of rows, which quantize x to int8 per block of 32: they
are checked against the oracle `int8_rows_matmul`, the same arithmetic with float64 sums (so only float32 summation
order differs), and against F.linear on the dequantized weight within the activation rounding; a row's result is
the same bits alone or among many. For a weight marked `prefill_gemm` (`deterministic: false`), more than
NATIVE_MAX_ROWS rows run csrc/gemm.c's float32 GEMM on panels dequantized from the blocks: F.linear of the dequantized weight, to float32 summation order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_native, quant
from tsterm_kernels.quant import (NATIVE_MAX_ROWS, QuantizedWeight, quantize_fp16, quantize_int4, quantize_int8,
                                  quantized_linear)
from tsterm_kernels.torch_ops import expert_mlp, linear

from tests.kernels import oracles
from tests.kernels.oracles import int8_rows_matmul


def _weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=gen) * torch.rand(out_f, 1, generator=gen)  # rows of varied scale


@pytest.fixture(scope="module")
def native():
    kernels = cpu_native.load()
    assert kernels is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return kernels


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("out_f,in_f", [(48, 128), (37, 32), (200, 96)])  # outputs not a multiple of the 16-row tile
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, NATIVE_MAX_ROWS])
def test_c_kernel_is_the_reference_arithmetic(native, quantize, out_f, in_f, rows):
    q = quantize(_weight(out_f, in_f))
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)) * 3
    got, ref = quantized_linear(x, q), int8_rows_matmul(x, q).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6 * ref.abs().max())  # float32 rounding of the sums
    # and it is the float matmul of the dequantized weight up to x's int8 rounding (half a step of max|x| / 127
    # per block): far inside the weight's own quantization error
    want = F.linear(x, q.dequantize())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("quantize", [quantize_fp16, quantize_int8, quantize_int4], ids=["fp16", "int8", "int4"])
def test_many_rows(quantize):
    """fp16: the float matmul of the dequantized weight. int8 / int4: the int8-row arithmetic however many rows
    (the oracle `int8_rows_matmul`), and the float matmul of the dequantized weight for a weight marked `prefill_gemm`
    (`deterministic: false`)."""
    weight, bias = _weight(48, 128), torch.randn(48)
    q = quantize(weight)
    x = torch.randn(NATIVE_MAX_ROWS + 7, 128, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, q.dequantize(), bias)
    if q.kind != "fp16":
        ref = (int8_rows_matmul(x, q) + bias.double()).float()
        torch.testing.assert_close(quantized_linear(x, q, bias), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, q, bias), ref, rtol=1e-5, atol=1e-5)  # the model's seam sends it there
        torch.testing.assert_close(quantized_linear(x, quant.allow_prefill_gemm(q), bias), want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(quantized_linear(x, q, bias), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, q, bias), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("out_f,in_f", [(40, 96), (200, 576)])
def test_a_row_is_the_same_bits_alone_or_among_many(native, quantize, out_f, in_f):
    """The invariance promise at the matmul: row i of a 300-row call (a prefill) equals row i run alone (a decode) and
    in a batch of 5, bit for bit."""
    q = quantize(_weight(out_f, in_f))
    x = torch.randn(300, in_f, generator=torch.Generator().manual_seed(3))
    many = quantized_linear(x, q)
    for i in (0, 7, 151, 299):
        assert torch.equal(quantized_linear(x[i:i + 1], q)[0], many[i])
        assert torch.equal(quantized_linear(x[i:i + 5], q)[0], many[i])


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("rows,out_f,in_f", [(NATIVE_MAX_ROWS + 1, 40, 96), (300, 200, 576), (400, 37, 288)])
def test_prefill_rows_run_the_float_gemm_on_panels_dequantized_from_the_blocks(native, quantize, rows, out_f, in_f):
    """A weight marked `prefill_gemm`, more rows than NATIVE_MAX_ROWS: csrc/gemm.c dequantizes each 16-row panel as it packs it (no float
    copy of the weight); the same kernel on the dequantized weight gives the same bits. Shapes: a tail of fewer than
    16 outputs, more inputs than one 256-input block (not a multiple of it), more rows than one 384-row pass."""
    q = quantize(_weight(out_f, in_f))
    x = torch.randn(rows + 3, in_f, generator=torch.Generator().manual_seed(2))[3:]  # rows at an offset
    got = quantized_linear(x, quant.allow_prefill_gemm(q))
    assert torch.equal(got, cpu_native.f32_gemm(native, x, q.dequantize()))
    torch.testing.assert_close(got, F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
def test_c_dequantize_equals_the_torch_dequantize(native, quantize):
    q = quantize(_weight(40, 96))
    assert torch.equal(quant.dequantize(q, native), q.dequantize())


def test_without_the_c_kernels_every_path_is_the_dequantized_matmul(monkeypatch):
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    q = quantize_int4(_weight(48, 64))
    x = torch.randn(2, 64)
    torch.testing.assert_close(quantized_linear(x, q), F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
def test_without_the_c_kernels_a_weight_is_dequantized_once_and_kept(monkeypatch, quantize):
    """The torch fallback (no compiler, ARM) keeps each matrix's float32 weight after its first matmul: later calls,
    of any row count, dequantize nothing; a stack's experts, indexed anew at every call, share their stack's
    copies; the kept bytes are counted (float_nbytes)."""
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    stack = quantize(torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(5)))
    single = quantize(_weight(40, 64))
    calls = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda self: calls.append(self.dims) or real(self))
    x = torch.randn(9, 64)
    for rows in (1, 9, 2):
        torch.testing.assert_close(quantized_linear(x[:rows], single).double(),
                                   oracles.linear(x[:rows], oracles.dequantize(single).float()), rtol=1e-5, atol=1e-5)
        for e in (2, 0):
            torch.testing.assert_close(quantized_linear(x[:rows], stack[e]).double(),
                                       oracles.linear(x[:rows], oracles.dequantize(stack)[e].float()),
                                       rtol=1e-5, atol=1e-5)
    assert calls == [(40, 64), (48, 64), (48, 64)]  # once per matrix: the single weight, experts 2 and 0
    assert single.float_nbytes == 40 * 64 * 4 and stack.float_nbytes == 2 * 48 * 64 * 4  # expert 1 never ran
    assert stack[1].float_nbytes == stack.float_nbytes  # one set of copies for the stack and its views


def test_int8_rounds_each_weight_to_its_block_grid():
    weight = _weight(32, 64)
    q = quantize_int8(weight)
    assert q.data.dtype == torch.int8 and q.data.shape == (32, 64) and q.scale.shape == (32, 2)
    assert q.scale.dtype == torch.float16 and q.nbytes == 32 * 64 + 32 * 2 * 2
    assert q.data.view(32, 2, 32).abs().amax(-1).ge(126).all()  # each block's largest weight uses the range
    step = q.scale.float().repeat_interleave(32, dim=1)  # [O, I]: each weight's block scale
    err = (q.dequantize() - weight).abs()
    assert (err <= step / 2 * (1 + 1e-3) + 1e-7).all() and err.max() > 0


def test_int4_rounds_each_weight_to_its_block_grid_in_ggufs_nibble_order():
    weight = _weight(32, 128)
    q = quantize_int4(weight)
    assert q.data.dtype == torch.uint8 and q.data.shape == (32, 64) and q.scale.shape == (32, 4, 2)
    d, m = q.scale.float().unbind(-1)
    err = (q.dequantize() - weight).abs()
    assert (err <= d.repeat_interleave(32, dim=1) / 2 * (1 + 1e-2) + 1e-3 * weight.abs().max()).all()
    assert err.max() > 0  # it is lossy: the check above is not vacuous
    # byte j of a block: input j in the low nibble, input j + 16 in the high one (GGUF Q4_1's qs)
    byte = int(q.data[3, 16 + 5])  # block 1 of row 3, byte 5
    codes = torch.round((weight[3, 32:64] - m[3, 1]) / d[3, 1]).clamp(0, 15).int()
    assert (byte & 15, byte >> 4) == (int(codes[5]), int(codes[21]))


def test_blocks_checks_the_layout():
    codes, scales = torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 2, 2, dtype=torch.float16)
    assert QuantizedWeight.blocks("int4", codes, scales).shape == (8, 64)
    with pytest.raises(ValueError, match="float16 scales of shape"):
        QuantizedWeight.blocks("int4", codes, scales.float())
    with pytest.raises(ValueError, match="kind must be"):
        QuantizedWeight.blocks("q3", codes, scales)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_int8(torch.randn(4, 48))


def test_a_stack_of_experts_is_indexed_in_place():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(3, 64, 32, generator=gen) * 0.2, torch.randn(3, 32, 32, generator=gen) * 0.2
    for quantize in (quantize_fp16, quantize_int8, quantize_int4):
        q13, q2 = quantize(w13), quantize(w2)
        assert isinstance(q13[1], QuantizedWeight) and q13.shape == (3, 64, 32) and q13[1].shape == (64, 32)
        if q13.kind != "fp16":
            assert q13[1].data.data_ptr() == q13.data[1].data_ptr()  # a view, not a copy
            torch.testing.assert_close(q13[2].dequantize(), quantize(w13[2]).dequantize())
        x = torch.randn(2, 32, generator=gen)
        want = expert_mlp(x, q13.dequantize()[2], q2.dequantize()[2])
        torch.testing.assert_close(expert_mlp(x, q13[2], q2[2]), want, rtol=0.03, atol=0.03 * want.abs().max())


def test_fp16_weights_are_the_half_precision_values():
    weight = _weight(32, 64)
    q = quantize_fp16(weight)
    assert torch.equal(q.dequantize(), weight.half().float()) and q.nbytes == 32 * 64 * 2
    assert not torch.equal(q.dequantize(), weight)
