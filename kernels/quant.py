"""Weight-only quantized linear layers: int8 per output channel, int4 per group of inputs, fp16.

A `QuantizedWeight` stands where a float weight [O, I] (or a stack of them, [E, O, I]) stood; the model's matmul
seam, `tsterm_kernels.reference.linear`, sends it here. Only the quantized bytes are kept: no float copy exists
after quantization, and every matmul reads the int8 / int4 data.

Formats:
- int8: `data` int8 [..., O, I], `scale` float32 [..., O]; W = data * scale[:, None] (symmetric, per row).
- int4: `data` uint8 [..., O, I/2] in the layout of torch's CPU int4 GEMM (`_convert_weight_to_int4pack_for_cpu`),
  `scale` float32 [..., I/G, O, 2] holding (scale, zero) per group of G inputs (O padded with zero rows to a
  multiple of 16, as torch packs them); W = (q - 8) * scale + zero with
  q in [0, 15] (asymmetric: zero = min + 8 * scale, which is GGUF Q4_1's block form for G = 32).
- fp16: each [O, I] matrix as fbgemm's packed half-precision GEMM matrix (`fbgemm_pack_gemm_matrix_fp16`; `packed`
  holds one opaque handle per matrix, the bytes live in fbgemm), run by `fbgemm_linear_fp16_weight`: the float32
  activations times the fp16 weights, accumulated in float32. Exact for weights that are bfloat16 values within
  fp16's range (most released checkpoints); otherwise each weight is rounded to 11 significant bits.

Kernels (benchmarks/quant_gemv.py, BENCHMARKS.md "Quantized weights"): int4 runs torch's
`_weight_int4pack_mm_for_cpu`; int8 runs `_weight_int8pack_mm`; fp16 fbgemm's AVX2 GEMM. All read only the
quantized bytes. On these AVX2 cores only fp16 is faster than float32 (1.6-4.9x per matmul); int8 / int4 save memory
(4x / 7x) but their torch kernels run 2-5x slower than float32. On other devices the weight is dequantized per
call (correct, not fast: no GPU kernel reads these formats yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 GEMM accepts
_INT4_ROW_MULTIPLE = 16  # ... and it packs output rows in sixteens


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized [..., O, I] weight. `kind` is "int8" or "int4"; see the module docstring for the layouts.

    Indexing the leading (expert) axis returns that expert's weight as views, so stacked experts quantize once and
    are read in place like their float stacks."""

    kind: str
    data: torch.Tensor  # int8 / int4 codes; fp16: empty (the bytes are in `packed`)
    scale: torch.Tensor  # int8 / int4 only
    group_size: int = 0  # int4 only
    in_features: int = 0
    dims: tuple[int, ...] = ()  # the float weight's shape [..., O, I]
    packed: tuple[torch.Tensor, ...] = ()  # fp16: fbgemm's handle of each [O, I] matrix

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.dims)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what the matmul returns

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return len(self.dims)

    @property
    def nbytes(self) -> int:
        if self.kind == "fp16":
            return 2 * torch.Size(self.dims).numel()
        return self.data.nbytes + self.scale.nbytes

    def __getitem__(self, index: int) -> "QuantizedWeight":
        assert len(self.dims) == 3, "only a stack of weights [E, O, I] is indexed"
        if self.kind == "fp16":
            return QuantizedWeight("fp16", self.data, self.scale, 0, self.in_features, self.dims[1:],
                                   (self.packed[index],))
        return QuantizedWeight(self.kind, self.data[index], self.scale[index], self.group_size, self.in_features,
                               self.dims[1:])

    def clone(self) -> "QuantizedWeight":
        if self.kind == "fp16":
            return quantize_fp16(self.dequantize())
        return QuantizedWeight(self.kind, self.data.clone(), self.scale.clone(), self.group_size, self.in_features,
                               self.dims)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these bytes stand for (tests, references; the matmuls never build it)."""
        if len(self.dims) == 3:
            return torch.stack([self[i].dequantize() for i in range(self.dims[0])])
        if self.kind == "int8":
            return self.data.float() * self.scale[:, None]
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.device)
        # exact: one 1 per row of the identity
        mm = _int4_mm if self.kind == "int4" else _fp16_mm
        return mm(eye, self).t().contiguous()


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-row int8 of a float weight [..., O, I]."""
    w = weight.float()
    scale = w.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # [..., O]
    data = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)  # [..., O, I]
    return QuantizedWeight("int8", data, scale.contiguous(), 0, weight.shape[-1], tuple(weight.shape))


def quantize_fp16(weight: torch.Tensor) -> QuantizedWeight:
    """A float weight [..., O, I] as fbgemm's packed fp16 matrices (one per [O, I])."""
    mats = weight.float().reshape(-1, *weight.shape[-2:])
    packed = tuple(torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(m.contiguous()) for m in mats)
    empty = torch.empty(0, device=weight.device)
    return QuantizedWeight("fp16", empty, empty, 0, weight.shape[-1], tuple(weight.shape), packed)


def int4_supported(shape: torch.Size | tuple[int, ...], group_size: int) -> bool:
    """Whether a weight of this [..., O, I] shape quantizes to int4 in groups of `group_size` (any O: the rows are
    padded to torch's multiple of 16 with zeros, which the matmul's output drops)."""
    return group_size in INT4_GROUP_SIZES and shape[-1] % group_size == 0


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` inputs (min/max), of a float weight [..., O, I]."""
    if not int4_supported(weight.shape, group_size):
        raise ValueError(f"int4 needs I % group_size == 0 with group_size in {INT4_GROUP_SIZES}; got shape "
                         f"{tuple(weight.shape)}, group_size {group_size}")
    if weight.dim() == 3:
        parts = [quantize_int4(w, group_size) for w in weight]
        return QuantizedWeight("int4", torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                               group_size, weight.shape[-1], tuple(weight.shape))
    out_f, in_f = weight.shape
    w = weight.float().view(out_f, in_f // group_size, group_size)  # [O, I/G, G]
    low, high = w.amin(-1), w.amax(-1)  # [O, I/G]
    scale = ((high - low) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(out_f, in_f)
    return pack_int4(q, scale, low + 8 * scale, group_size)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> QuantizedWeight:
    """int4 weight from codes q [O, I] in [0, 15] and per-group scale, zero [O, I/G]: W = (q - 8) * scale + zero."""
    out_f = q.shape[0]
    pad = -out_f % _INT4_ROW_MULTIPLE  # zero rows (code 8, scale 0, zero 0) up to torch's multiple of 16
    q = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
    scale, zero = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (scale, zero))
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)  # [O + pad, I/2]
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()  # [I/G, O + pad, 2]
    return QuantizedWeight("int4", data, scales_and_zeros, group_size, q.shape[1], (out_f, q.shape[1]))


def _int4_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.data, w.group_size, w.scale)  # [M, O + pad]
    out_f = w.dims[-2]
    return y if y.shape[1] == out_f else y[:, :out_f].contiguous()


def _fp16_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.ops.aten.fbgemm_linear_fp16_weight(x, w.packed[0], None)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ W.T (+ bias) -> [M, O] float32, reading only the quantized bytes of `weight` [O, I] on the CPU."""
    if x.device.type != "cpu":  # no device kernel reads these formats yet
        y = torch.nn.functional.linear(x, weight.dequantize().to(x.dtype))
    elif weight.kind == "fp16":
        y = _fp16_mm(x.float(), weight)
    elif weight.kind == "int8":
        y = torch._weight_int8pack_mm(x.float(), weight.data, weight.scale)
    else:
        y = _int4_mm(x.float().contiguous(), weight)
    y = y.to(x.dtype)
    return y if bias is None else y + bias
