"""Weight-only int8 / int4 kernels (`tsterm_kernels.quant`) against F.linear on the dequantized weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels.quant import QuantizedWeight, quantize_fp16, quantize_int4, quantize_int8, quantized_linear
from tsterm_kernels.reference import expert_mlp, linear


def _weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=gen) * torch.rand(out_f, 1, generator=gen)  # rows of varied scale


@pytest.mark.parametrize("quantize", [quantize_fp16, quantize_int8, lambda w: quantize_int4(w, 32),
                                      lambda w: quantize_int4(w, 64)], ids=["fp16", "int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_quantized_linear_equals_linear_of_the_dequantized_weight(quantize, rows):
    weight, bias = _weight(48, 128), torch.randn(48)
    q = quantize(weight)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, q.dequantize(), bias)
    torch.testing.assert_close(quantized_linear(x, q, bias), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, q, bias), want, rtol=1e-5, atol=1e-5)  # the model's seam sends it there


def test_int8_rounds_each_weight_to_its_row_grid():
    weight = _weight(32, 64)
    q = quantize_int8(weight)
    assert q.data.dtype == torch.int8 and q.data.shape == (32, 64) and q.scale.shape == (32,)
    assert q.data.abs().amax(1).eq(127).all()  # each row's largest weight uses the whole range
    err = (q.dequantize() - weight).abs()
    assert (err <= q.scale[:, None] / 2 * (1 + 1e-5)).all()


def test_int4_rounds_each_weight_to_its_group_grid():
    weight = _weight(32, 128)
    q = quantize_int4(weight, 32)
    assert q.data.dtype == torch.uint8 and q.data.numel() == 32 * 128 // 2  # two weights per byte
    scale = q.scale[..., 0].t().repeat_interleave(32, dim=1)  # [O, I]: each weight's group scale
    err = (q.dequantize() - weight).abs()
    assert (err <= scale / 2 * (1 + 1e-4) + 1e-6).all()
    assert err.max() > 0  # it is lossy: the check above is not vacuous


def test_a_stack_of_experts_is_indexed_in_place():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(3, 64, 32, generator=gen) * 0.2, torch.randn(3, 32, 32, generator=gen) * 0.2
    for quantize in (quantize_fp16, quantize_int8, lambda w: quantize_int4(w, 32)):
        q13, q2 = quantize(w13), quantize(w2)
        assert isinstance(q13[1], QuantizedWeight) and q13.shape == (3, 64, 32) and q13[1].shape == (64, 32)
        if q13.kind != "fp16":
            assert q13[1].data.data_ptr() == q13.data[1].data_ptr()  # a view, not a copy
        x = torch.randn(2, 32, generator=gen)
        torch.testing.assert_close(expert_mlp(x, q13[2], q2[2]), expert_mlp(x, q13.dequantize()[2], q2.dequantize()[2]),
                                   rtol=1e-5, atol=1e-5)


def test_int4_pads_rows_torch_cannot_pack_and_refuses_partial_groups():
    weight = _weight(40, 64)  # torch packs rows in sixteens: padded to 48, the output cut back to 40
    q = quantize_int4(weight, 32)
    assert q.shape == (40, 64) and q.dequantize().shape == (40, 64)
    x = torch.randn(2, 64)
    torch.testing.assert_close(quantized_linear(x, q), F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-5)
    assert ((q.dequantize() - weight).abs() < 0.5).all()  # the real rows, not the padding
    with pytest.raises(ValueError, match="int4 needs"):
        quantize_int4(torch.randn(32, 48), 32)


def test_fp16_weights_are_the_half_precision_values():
    weight = _weight(32, 64)
    q = quantize_fp16(weight)
    assert torch.equal(q.dequantize(), weight.half().float()) and q.nbytes == 32 * 64 * 2
    assert not torch.equal(q.dequantize(), weight)
