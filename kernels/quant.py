"""Weight-only quantized linear layers: int8 and int4 in blocks of 32 inputs (GGUF Q8_0 / Q4_1's form), fp16, and
fp8 in blocks of 128 x 128 (fine-grained FP8 checkpoints' form).

A `QuantizedWeight` stands where a float weight [O, I] (or a stack of them, [E, O, I]) stood; the model's matmul
seam, `tsterm_kernels.torch_ops.linear`, sends it here. Only the quantized bytes are kept: no float copy exists
after quantization, and every matmul of few rows reads the int8 / int4 data.

Formats (I a multiple of 32; fp16 scales, as GGUF stores them):
- int8: `data` int8 [..., O, I], `scale` fp16 [..., O, I/32]: W = code * d. GGUF Q8_0 blocks are these bytes.
- int4: `data` uint8 [..., O, I/2], `scale` fp16 [..., O, I/32, 2] holding (d, m): W = code * d + m, code in [0, 15];
  byte j of a block's 16 holds input j in its low nibble and input j + 16 in its high one. GGUF Q4_1 blocks are
  these bytes; Q4_0's are too, with m = -8 d.
- fp16: each [O, I] matrix as fbgemm's packed half-precision GEMM matrix (`fbgemm_pack_gemm_matrix_fp16`; `packed`
  holds one opaque handle per matrix, the bytes live in fbgemm), run by `fbgemm_linear_fp16_weight`: the float32
  activations times the fp16 weights, accumulated in float32. Exact for weights that are bfloat16 values within
  fp16's range (most released checkpoints); otherwise each weight is rounded to 11 significant bits.
- fp8: `data` float8_e4m3fn [..., O, I], `scale` float32 [..., ceil(O/128), ceil(I/128)]: W = value * the scale of
  its 128 x 128 block (a partial block at the right and bottom edges), the `weight_scale_inv` of Qwen's and
  DeepSeek's block-scaled FP8 checkpoints. Any O and I.
- mxfp4 (OCP Microscaling MXFP4, gpt-oss's experts): `data` uint8 [..., O, I/2] (a checkpoint's `_blocks`
  [..., O, I/32, 16], viewed), `scale` uint8 [..., O, I/32] (`_scales`, E8M0): W = e2m1(code) * 2^(scale - 127), the
  e2m1 codes 0..7 meaning 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives; byte j of a block's 16 holds input 2j
  in its low nibble and input 2j + 1 in its high one (scale 255 is NaN, as the spec has it). 4.25 bits a weight.
  `QuantizedWeight.mxfp4(blocks, scales)` builds one from those two tensors as they are (views: a mapped
  checkpoint's bytes are read in place); `mxfp4_interleave` converts GGUF's MXFP4 nibble order (byte j: inputs j and
  j + 16) to this one.

Kernels (benchmarks/quant_gemv.py, BENCHMARKS.md "Quantized weights"): int8 and int4 run tsterm's C kernels
(`tsterm_kernels.cpu_native`, csrc/gemv.c) for any number of rows of x: each row is quantized to int8 per block of 32
and the integer products summed, as llama.cpp does for these formats (tests/kernels/oracles.py's `int8_rows_matmul`
is that arithmetic in float64), so a row's result is the same bits in a decode, a prefill or a batch of any size (the engine's invariance
promise; the int8 rounding of x costs +0.6% held-out perplexity on the default model, a tenth of int4's weight
rounding, BENCHMARKS.md). A weight marked `prefill_gemm` (an engine's `deterministic: false`) sends more than
NATIVE_MAX_ROWS rows to csrc/gemm.c's float32 GEMM instead, which dequantizes each 16-row panel of the weight as it
packs it: the bits of that GEMM on the dequantized weight, which is never written out. fp16 runs fbgemm's AVX2 GEMM. mxfp4 runs csrc/mxfp4.c for any number of rows: x stays float32 and each weight is decoded exactly
(a 16-entry table times the block's power of two), the products summed in one fixed order per (row, output) (16
lanes along the inputs, then a fixed tree), so a row's result is the same bits alone, in a batch or in a prefill,
in the AVX-512 and the AVX2 build alike. fp8 has no CPU kernel: its weight is dequantized per call (correct, not fast;
tsterm.model.quant refuses `quantization: fp8` on the CPU). Without the C kernels (no compiler, not x86), int8 /
int4 / mxfp4 run torch's GEMM on the float32 weight, dequantized at its first matmul and kept (`dequantized_float`: a float
model's memory beside the blocks, `float_nbytes`; dequantizing the whole matrix at every call made each decoded token
cost a float model's dequantization). On a CUDA device int8, int4, fp8 and mxfp4 run the Triton kernel `tsterm_kernels.triton_quant_linear`, which
dequantizes the weight in registers; fp16 (fbgemm's packing) exists on the CPU only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tsterm_kernels import cpu_native

BLOCK = 32  # inputs per int8 / int4 block
FP8_BLOCK = 128  # outputs and inputs per fp8 block (one scale each)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
NATIVE_MAX_ROWS = 16  # more rows than this may take the float GEMM (a weight marked `prefill_gemm`)
NATIVE_KINDS = ("int8", "int4")  # the kinds the C int8-row kernels read (csrc/gemv.c, gemm.c)
Q_GEMM_KINDS = {"int8": 1, "int4": 2}  # csrc/tsterm.h's TSTERM_Q8, TSTERM_Q4
TRITON_KINDS = ("int8", "int4", "fp8", "mxfp4")  # the kinds the Triton kernel reads
FALLBACK_KINDS = ("int8", "int4", "mxfp4")  # without the C kernels: a float32 copy made once per matrix and kept
MX_BLOCK = 32  # inputs per mxfp4 block (one E8M0 scale each)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized [..., O, I] weight. `kind` is "int8", "int4", "fp8", "mxfp4" or "fp16"; see the module docstring
    for layouts.

    Indexing the leading (expert) axis returns that expert's weight as views, so stacked experts quantize once and
    are read in place like their float stacks."""

    kind: str
    data: torch.Tensor  # int8 / int4 / mxfp4 codes, fp8 values; fp16: empty (the bytes are in `packed`)
    scale: torch.Tensor  # int8 / int4 / fp8 / mxfp4 only
    dims: tuple[int, ...] = ()  # the float weight's shape [..., O, I]
    packed: tuple[torch.Tensor, ...] = ()  # fp16: fbgemm's handle of each [O, I] matrix
    # int8 / int4 on the CPU: a prefill of more than NATIVE_MAX_ROWS rows may run the float32 GEMM (an engine's
    # `deterministic: false`, `allow_prefill_gemm`); else every row is rounded to int8, however many come together
    prefill_gemm: bool = False
    # int8 / int4 / mxfp4 without the C kernels (no compiler, not x86): the float32 weight torch multiplies by, dequantized
    # on its first matmul and kept (one slot per matrix: a stack's experts, indexed, share their stack's slots)
    float_slots: list | None = field(default=None, compare=False, repr=False)
    slot: int = field(default=0, compare=False, repr=False)

    def __post_init__(self):
        if self.float_slots is None and self.kind in FALLBACK_KINDS:
            object.__setattr__(self, "float_slots", [None] * (self.dims[0] if len(self.dims) == 3 else 1))

    @classmethod
    def blocks(cls, kind: str, data: torch.Tensor, scale: torch.Tensor) -> "QuantizedWeight":
        """An int8 / int4 weight from its codes and fp16 scales in the module's layout (GGUF blocks repacked)."""
        *lead, out_f, code_cols = data.shape
        in_f = code_cols * (2 if kind == "int4" else 1)
        want = {"int8": (torch.int8, (*lead, out_f, in_f // BLOCK)),
                "int4": (torch.uint8, (*lead, out_f, in_f // BLOCK, 2))}
        if kind not in want:
            raise ValueError(f"quantized weight kind must be int8 or int4, got {kind!r} (fp8: QuantizedWeight.fp8)")
        dtype, scale_shape = want[kind]
        if data.dtype != dtype or in_f % BLOCK or scale.dtype != torch.float16 or tuple(scale.shape) != scale_shape:
            raise ValueError(f"{kind} weight needs {dtype} codes with inputs a multiple of {BLOCK} and float16 "
                             f"scales of shape {scale_shape}; got {data.dtype} {tuple(data.shape)} codes, "
                             f"{scale.dtype} {tuple(scale.shape)} scales")
        return cls(kind, data.contiguous(), scale.contiguous(), (*lead, out_f, in_f))

    @classmethod
    def fp8(cls, data: torch.Tensor, scale: torch.Tensor) -> "QuantizedWeight":
        """An fp8 weight from its float8_e4m3fn values [..., O, I] and the float32 scales of its 128 x 128 blocks
        [..., ceil(O/128), ceil(I/128)] (a checkpoint's `weight_scale_inv`: W = value * scale)."""
        if data.dim() < 2 or data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 weight needs float8_e4m3fn values of shape [..., O, I]; got {data.dtype} "
                             f"{tuple(data.shape)}")
        *lead, out_f, in_f = data.shape
        scale_shape = (*lead, -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))
        if scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape:
            raise ValueError(f"fp8 weight of shape {tuple(data.shape)} needs float32 scales of shape {scale_shape} "
                             f"(one per {FP8_BLOCK} x {FP8_BLOCK} block); got {scale.dtype} {tuple(scale.shape)}")
        if scale.device != data.device:
            raise ValueError(f"fp8 values on {data.device} and scales on {scale.device}: put both on one device")
        return cls("fp8", data.contiguous(), scale.contiguous(), tuple(data.shape))

    @classmethod
    def mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "QuantizedWeight":
        """An mxfp4 weight [..., O, I] from a checkpoint's two tensors as they are: `blocks` uint8 [..., O, I/32, 16]
        (or already viewed as [..., O, I/2]) and `scales` uint8 (or float8_e8m0fnu) [..., O, I/32], one E8M0 scale
        per block of 32 inputs (layout: the module docstring). Contiguous tensors are kept as they are, views of a
        mapped file included (nothing is copied); others are made contiguous once."""
        if blocks.dtype != torch.uint8 or blocks.dim() < 2:
            raise ValueError(f"mxfp4 blocks must be uint8 [..., O, I/32, 16] or [..., O, I/2]; got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
        if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
            scales = scales.view(torch.uint8)
        if scales.dtype != torch.uint8:
            raise ValueError(f"mxfp4 scales must be uint8 (E8M0) [..., O, I/32]; got {scales.dtype}")
        if blocks.dim() == scales.dim() + 1:  # [..., O, I/32, 16]
            if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
                raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} need 16 bytes per block and scales of shape "
                                 f"{tuple(blocks.shape[:-1])}; got scales {tuple(scales.shape)}")
            blocks = blocks.contiguous().view(*blocks.shape[:-2], blocks.shape[-2] * 16)
        elif blocks.dim() != scales.dim() or blocks.shape[:-1] != scales.shape[:-1] \
                or blocks.shape[-1] != 16 * scales.shape[-1]:
            raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                             f"blocks [..., O, I/2] need scales [..., O, I/32]")
        if blocks.device != scales.device:
            raise ValueError(f"mxfp4 blocks on {blocks.device} and scales on {scales.device}: put both on one device")
        *lead, out_f, half = blocks.shape
        return cls("mxfp4", blocks.contiguous(), scales.contiguous(), (*lead, out_f, 2 * half))

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
            return QuantizedWeight("fp16", self.data, self.scale, self.dims[1:], (self.packed[index],))
        return QuantizedWeight(self.kind, self.data[index], self.scale[index], self.dims[1:],
                               prefill_gemm=self.prefill_gemm, float_slots=self.float_slots, slot=index)

    def clone(self) -> "QuantizedWeight":
        if self.kind == "fp16":
            return quantize_fp16(self.dequantize())
        return QuantizedWeight(self.kind, self.data.clone(), self.scale.clone(), self.dims,
                               prefill_gemm=self.prefill_gemm)

    @property
    def float_nbytes(self) -> int:
        """Bytes of the float32 copies the torch fallback keeps (`dequantized_float`), of this matrix or stack."""
        return sum(t.nbytes for t in self.float_slots or () if t is not None)

    def dequantized_float(self) -> torch.Tensor:
        """dequantize(), made once per matrix and kept: what the torch fallback of an int8 / int4 matmul (no C
        kernels) multiplies by, instead of dequantizing the whole weight at every call."""
        if self.float_slots is None or len(self.dims) != 2:
            return self.dequantize()
        cached = self.float_slots[self.slot]
        if cached is None or cached.device != self.device:
            cached = self.float_slots[self.slot] = self.dequantize()
        return cached

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these bytes stand for (tests, references, a prefill's GEMM)."""
        if self.kind == "fp16":
            if len(self.dims) == 3:
                return torch.stack([self[i].dequantize() for i in range(self.dims[0])])
            eye = torch.eye(self.dims[-1], dtype=torch.float32, device=self.device)
            return _fp16_mm(eye, self).t().contiguous()  # exact: one 1 per row of the identity
        *lead, out_f, in_f = self.dims
        if self.kind == "fp8":
            scale = self.scale.repeat_interleave(FP8_BLOCK, -2)[..., :out_f, :]  # [..., O, I/128]: each row's
            return self.data.float() * scale.repeat_interleave(FP8_BLOCK, -1)[..., :in_f]
        if self.kind == "int8":
            codes = self.data.view(*lead, out_f, in_f // BLOCK, BLOCK).float()
            return (codes * self.scale.float()[..., None]).view(self.dims)
        if self.kind == "mxfp4":
            return mxfp4_dequantize(self.data, self.scale)
        d, m = self.scale.float().unbind(-1)  # [..., O, I/32] each
        return (int4_codes(self.data).float() * d[..., None] + m[..., None]).view(self.dims)


def int4_codes(data: torch.Tensor) -> torch.Tensor:
    """int4 bytes [..., O, I/2] -> codes [..., O, I/32, 32] (uint8, 0..15) in input order."""
    blocks = data.view(*data.shape[:-1], data.shape[-1] // 16, 16)
    return torch.cat((blocks & 15, blocks >> 4), dim=-1)


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (uint8) -> float32: 2^(s - 127) (2^-127 for 0, a subnormal; 255 is NaN)."""
    bits = scales.to(torch.int32) << 23  # the biased exponent in place: 2^(s - 127) for s >= 1
    values = torch.where(scales == 0, torch.tensor(2.0 ** -127, device=scales.device), bits.view(torch.float32))
    return torch.where(scales == 255, torch.tensor(float("nan"), device=scales.device), values)


def mxfp4_dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """mxfp4 bytes [..., O, I/2] and E8M0 scales [..., O, I/32] -> the float32 weight [..., O, I]."""
    *lead, out_f, half = data.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    pairs = torch.stack((table[(data & 15).long()], table[(data >> 4).long()]), dim=-1)  # [..., O, I/2, 2]
    values = pairs.view(*lead, out_f, half // 16, MX_BLOCK) * e8m0_values(scale)[..., None]
    return values.view(*lead, out_f, 2 * half)


def mxfp4_interleave(split: torch.Tensor) -> torch.Tensor:
    """Blocks of 16 bytes [..., 16] in GGUF's MXFP4 nibble order (byte j: input j low, input j + 16 high) -> this
    module's (byte j: input 2j low, input 2j + 1 high), as a new tensor. (The E8M0 scale bytes need no change.)"""
    codes = torch.cat((split & 15, split >> 4), dim=-1)  # [..., 32]: inputs in order
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_mxfp4(weight: torch.Tensor) -> QuantizedWeight:
    """A float weight [..., O, I] (I a multiple of 32) as mxfp4, as the OCP MX spec quantizes: each block's scale is
    2^(floor(log2(max |w|)) - 2) (e2m1's largest exponent is 2; a zero block gets 2^-127), its values w / scale
    rounded to the nearest e2m1 value (ties to the even code), saturating at +-6."""
    w = _blocks_of(weight)  # [..., O, I/32, 32]
    amax = w.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = (w / torch.exp2(exp)[..., None]).clamp(-6.0, 6.0)
    grid = torch.tensor(E2M1_VALUES[:8])
    distance = (scaled.abs()[..., None] - grid).abs()  # [..., 32, 8]
    nearest = distance.amin(-1, keepdim=True)
    ties = distance == nearest
    even = ties & (torch.arange(8) % 2 == 0)  # between two values: the even code (e2m1's RNE)
    magnitude = torch.where(even.any(-1), even.int().argmax(-1), ties.int().argmax(-1))
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() * 8).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., O, I/32, 16]
    return QuantizedWeight.mxfp4(blocks, (exp + 127).to(torch.uint8))


def quantize_supported(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a weight of this [..., O, I] shape quantizes to int8 / int4 (whole blocks of 32 inputs)."""
    return shape[-1] % BLOCK == 0


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    if not quantize_supported(weight.shape):
        raise ValueError(f"int8 / int4 quantize blocks of {BLOCK} inputs; got shape {tuple(weight.shape)}")
    return weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // BLOCK, BLOCK)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per block of 32 inputs (GGUF Q8_0) of a float weight [..., O, I]."""
    w = _blocks_of(weight)  # [..., O, I/32, 32]
    d = (w.abs().amax(-1) / 127.0).half()  # the stored scale; codes are rounded against it
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    codes = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes.view(weight.shape), d, tuple(weight.shape))


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 per block of 32 inputs (min/max; GGUF Q4_1) of a float weight [..., O, I]."""
    w = _blocks_of(weight)  # [..., O, I/32, 32]
    low, high = w.amin(-1), w.amax(-1)
    d, m = ((high - low) / 15.0).half(), low.half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    codes = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    data = codes[..., :16] | (codes[..., 16:] << 4)  # [..., O, I/32, 16]
    return QuantizedWeight("int4", data.reshape(*weight.shape[:-1], weight.shape[-1] // 2),
                           torch.stack((d, m), dim=-1).contiguous(), tuple(weight.shape))


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """float8_e4m3fn per 128 x 128 block of a float weight [..., O, I]: scale = the block's max |w| / 448, values
    w / scale rounded by torch's float8_e4m3fn conversion (an all-zero block gets scale 0)."""
    *lead, out_f, in_f = weight.shape
    rows, cols = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    w = weight.float()
    padded = F.pad(w, (0, cols * FP8_BLOCK - in_f, 0, rows * FP8_BLOCK - out_f))  # zeros: no effect on a max
    amax = padded.abs().view(*lead, rows, FP8_BLOCK, cols, FP8_BLOCK).amax(dim=(-3, -1))  # [..., O/128, I/128]
    scale = amax / FP8_MAX
    per_weight = scale.repeat_interleave(FP8_BLOCK, -2)[..., :out_f, :].repeat_interleave(FP8_BLOCK, -1)[..., :in_f]
    divisor = torch.where(per_weight > 0, per_weight, torch.ones((), device=weight.device))
    values = (w / divisor).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight.fp8(values, scale)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., I] as the C kernels round it for an int8 / int4 weight: per block of 32, dx = max|x| / 127 and codes
    round-half-even(x / dx). -> (codes [..., I/32, 32] float32, dx [..., I/32])."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros(()))
    return torch.round(xb * inv[..., None]), dx


def quantize_fp16(weight: torch.Tensor) -> QuantizedWeight:
    """A float weight [..., O, I] as fbgemm's packed fp16 matrices (one per [O, I])."""
    mats = weight.float().reshape(-1, *weight.shape[-2:])
    packed = tuple(torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(m.contiguous()) for m in mats)
    empty = torch.empty(0, device=weight.device)
    return QuantizedWeight("fp16", empty, empty, tuple(weight.shape), packed)


def _fp16_mm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.ops.aten.fbgemm_linear_fp16_weight(x, w.packed[0], None)


def runs_on_triton(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether `quantized_linear` runs the Triton kernel (CUDA inputs; tests patch this to run it interpreted)."""
    return x.is_cuda and weight.kind in TRITON_KINDS


def dequantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel's torch twin: F.linear of float32 x and the dequantized weight (+ bias), in x's dtype."""
    return F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float()).to(x.dtype)


def allow_prefill_gemm(weight: QuantizedWeight) -> QuantizedWeight:
    """The same bytes, marked so that a prefill of many rows may take the float32 GEMM (`deterministic: false`)."""
    return dataclasses.replace(weight, prefill_gemm=True) if weight.kind in NATIVE_KINDS else weight


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ W.T (+ bias) -> [M, O] in x's dtype, for W a `QuantizedWeight` [O, I] (see the module docstring).

    int8 / int4 on the CPU run the int8-row kernels for any number of rows, so a row's result is the same bits alone
    or in a batch, in a decode or a prefill; a weight marked `prefill_gemm` sends more than NATIVE_MAX_ROWS rows to
    the float32 GEMM instead (faster prefill on some CPUs, but a prompt's logits then depend on how it was split)."""
    if runs_on_triton(x, weight):
        from tsterm_kernels.triton_quant_linear import quant_linear  # imports triton: lazily
        return quant_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    rows = x.shape[0]
    if weight.kind == "mxfp4" and x.is_cpu:
        native = cpu_native.load()
        if native is None:  # no C kernels: torch's GEMM on the float32 weight, dequantized once and kept
            y = F.linear(x.float(), weight.dequantized_float())
        else:  # csrc/mxfp4.c for any number of rows: a row's bits do not depend on the rows beside it
            y = mxfp4_matmul(native, x, weight)
        if y.dtype is not x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias
    native = cpu_native.load() if weight.kind in NATIVE_KINDS and x.is_cpu else None
    if native is not None and (rows <= NATIVE_MAX_ROWS or not weight.prefill_gemm):
        # Every matmul of a decode, and of a prefill unless told otherwise: x's rows quantized to int8, so a row's
        # result does not depend on how many rows came with it (kept lean: a call here costs ~8 us beyond the C code)
        xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.float().contiguous()
        out_f, in_f = weight.dims[-2], weight.dims[-1]
        y = torch.empty((rows, out_f), dtype=torch.float32)
        fn = native.q4_matmul if weight.kind == "int4" else native.q8_matmul
        if fn(xf.data_ptr(), rows, in_f, weight.data.data_ptr(), weight.scale.data_ptr(), out_f, y.data_ptr()):
            raise MemoryError("out of memory for the quantized matmul's scratch")
    elif weight.kind == "fp16" and x.is_cpu:
        y = _fp16_mm(x.float(), weight)
    elif (weight.kind in NATIVE_KINDS and x.is_cpu and len(weight.dims) == 2 and x.dim() == 2
          and (native := cpu_native.load()) is not None):
        # a prefill: csrc/gemm.c's float32 GEMM, its panels dequantized from the blocks as it packs them
        xf = x if x.dtype is torch.float32 and x.stride(1) == 1 else x.float().contiguous()
        out_f, in_f = weight.dims
        y = torch.empty((rows, out_f), dtype=torch.float32)
        native.q_gemm(xf.data_ptr(), xf.stride(0), rows, in_f, Q_GEMM_KINDS[weight.kind], weight.data.data_ptr(),
                      weight.scale.data_ptr(), out_f, y.data_ptr())
    elif x.is_cpu and weight.kind in NATIVE_KINDS and native is None:
        # no C kernels (no compiler, not x86): torch's GEMM on the float32 weight, dequantized once and kept
        y = F.linear(x.float(), weight.dequantized_float())
    else:
        y = F.linear(x.float(), dequantize(weight, cpu_native.load() if x.is_cpu else None))
    if y.dtype is not x.dtype:
        y = y.to(x.dtype)
    return y if bias is None else y + bias


def mxfp4_matmul(native: "cpu_native.NativeKernels", x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, I] @ W.T -> a new float32 [M, O] by csrc/mxfp4.c, for an mxfp4 W [O, I] on the CPU."""
    if len(weight.dims) != 2:
        raise ValueError(f"an mxfp4 matmul takes one [O, I] weight (index a stack of experts first), got {weight.dims}")
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.float().contiguous()
    out_f, in_f = weight.dims
    y = torch.empty((xf.shape[0], out_f), dtype=torch.float32)
    if native.mxfp4_matmul(xf.data_ptr(), xf.shape[0], in_f, weight.data.data_ptr(), weight.scale.data_ptr(), out_f,
                           y.data_ptr()):
        raise MemoryError("out of memory for the mxfp4 matmul's scratch")
    return y


def dequantize(weight: QuantizedWeight, native: "cpu_native.NativeKernels | None" = None) -> torch.Tensor:
    """weight.dequantize(), by the C kernels when given (a prefill's GEMM needs it once per call)."""
    if native is None or weight.kind not in NATIVE_KINDS or len(weight.dims) != 2:
        return weight.dequantize()
    out = torch.empty(weight.dims, dtype=torch.float32)
    fn = native.q4_dequantize if weight.kind == "int4" else native.q8_dequantize
    fn(weight.data.data_ptr(), weight.scale.data_ptr(), weight.dims[0], weight.dims[1], out.data_ptr())
    return out
