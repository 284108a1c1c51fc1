"""GGML quantized blocks -> `tsterm_kernels.quant`'s layout (blocks of 32 inputs): the repacking that lets a GGUF
import keep its linear weights quantized (`tsterm.convert.gguf`).

A linear weight stored as one of `NATIVE_TYPES` becomes `Blocks`: int8 codes [..., O, I] with one float16 scale d per
32 inputs (W = code * d), or int4 codes packed two per byte [..., O, I/2] with (d, m) per 32 (W = code * d + m).

Per GGML type (`NATIVE_TYPES`):
- Q8_0, Q4_0, Q4_1: the blocks' bytes as they are (Q4_0's m is -8 d, exact in float16): the file's exact values.
- Q4_K (super-blocks of 256: float16 d, dmin, 6-bit scale sc and min m per sub-block of 32, 4-bit codes): each
  sub-block is an int4 block with d' = d sc, m' = -dmin m, computed exactly in float32 and rounded to float16 (the
  only rounding: a weight moves by at most 2^-11 (15 |d sc| + |dmin m|)); the codes are re-nibbled, integer moves.
- Q5_K, Q6_K (5 / 6-bit codes; Q6_K has a scale per 16): no int4 form holds them, so each block of 32 of their
  exact dequantized values is re-quantized to int8 (`tsterm_kernels.quant.quantize_int8`): lossy, by at most half
  an int8 step, 1/8 of the format's own step for weights that straddle zero (see `requantize_int8`).
A K-quant tensor whose float16 d', m' or d would not be finite (no real model) is dequantized instead.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True)
class NativeType:
    """How a GGML type's blocks become tsterm's (see the module docstring)."""
    inputs: int  # inputs per GGML block (32; the K-quants' super-blocks: 256)
    nbytes: int  # bytes per GGML block
    kind: str  # the tsterm kind it becomes: "int8" / "int4"
    requantized: bool = False  # re-quantized from its dequantized values (lossy), not repacked


QK_K = 256  # inputs per K-quant super-block
NATIVE_TYPES = {  # GGML types kept as blocks
    "Q8_0": NativeType(BLOCK, 34, "int8"), "Q4_0": NativeType(BLOCK, 18, "int4"), "Q4_1": NativeType(BLOCK, 20, "int4"),
    "Q4_K": NativeType(QK_K, 144, "int4"),
    "Q5_K": NativeType(QK_K, 176, "int8", requantized=True), "Q6_K": NativeType(QK_K, 210, "int8", requantized=True),
}


@dataclass(frozen=True)
class Blocks:
    """A quantized weight in tsterm's block layout (`tsterm_kernels.quant`): kind "int8" or "int4"."""
    ggml_type: str  # the GGML type it came from ("A+B": gate/up experts of two types fused)
    kind: str
    codes: np.ndarray  # int8 [..., O, I] / uint8 [..., O, I/2]
    scales: np.ndarray  # float16 [..., O, I/32] / [..., O, I/32, 2]
    requantized: bool = False  # (some of) its blocks were re-quantized from floats: Q5_K / Q6_K -> int8

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Blocks":
        """The same weight with its output rows rearranged by `fn` (applied to codes and scales alike: exact)."""
        return Blocks(self.ggml_type, self.kind, fn(torch.from_numpy(self.codes)).numpy(),
                      fn(torch.from_numpy(self.scales)).numpy(), self.requantized)


def to_blocks(raw: np.ndarray, ggml_type: str, qtype: Any, in_f: int) -> Blocks | None:
    """GGML blocks `raw` [..., O, I / inputs per block, bytes per block] of a `NATIVE_TYPES` type (`qtype`: its
    GGMLQuantizationType) -> Blocks; None where the result's float16 scales would not be finite (no real model:
    the caller imports floats instead). Q8_0 / Q4_x: pure byte moves; Q4_K: its codes moved, its scales multiplied
    out and rounded to float16; Q5_K / Q6_K: re-quantized to int8 from the exact dequantized values."""
    native = NATIVE_TYPES[ggml_type]
    *lead, out_f, _, _ = raw.shape
    if native.requantized:
        scales, codes = requantize_int8(raw, qtype, in_f)
    elif ggml_type == "Q4_K":
        scales, codes = q4_k_scales(raw), q4_k_codes(raw)
    elif ggml_type == "Q8_0":  # {float16 d; int8 qs[32]}
        scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]  # [..., O, I/32]
        codes = np.ascontiguousarray(raw[..., 2:]).view(np.int8)
    elif ggml_type == "Q4_1":  # {float16 d, m; uint8 qs[16]}: W = q d + m
        scales = np.ascontiguousarray(raw[..., :4]).view(np.float16)  # [..., O, I/32, 2] = (d, m)
        codes = raw[..., -16:]
    else:  # Q4_0 {float16 d; uint8 qs[16]}: W = (q - 8) d = q d + (-8 d), -8 d exact in float16
        d = np.ascontiguousarray(raw[..., :2]).view(np.float16)  # [..., O, I/32, 1]
        with np.errstate(over="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m[np.isfinite(d)]).all():  # |d| > 8188: -8 d overflows float16 (no real model)
            return None
        scales, codes = np.concatenate([d, m], axis=-1), raw[..., -16:]
    if native.inputs == QK_K and not np.isfinite(scales).all():  # a scale beyond float16 (no real model)
        return None
    int4 = native.kind == "int4"
    scales = scales.reshape(*lead, out_f, in_f // BLOCK, *((2,) if int4 else ()))
    codes = np.ascontiguousarray(codes).reshape(*lead, out_f, in_f // 2 if int4 else in_f)
    return Blocks(ggml_type, native.kind, codes, scales, native.requantized)


def q4_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [..., S, 144] {float16 d, dmin; uint8 scales[12]; uint8 qs[128]} -> the int4 (d', m')
    [..., S, 8, 2] of their 8 sub-blocks of 32: W = q (d sc) - (dmin m) = q d' + m'. d sc and dmin m are exact in
    float32 (an 11-bit significand times a 6-bit integer); rounding them to float16 is the only change to the
    weights: each d', m' moves by at most 2^-11 of itself (2^-25 absolute below float16's normal range), so a weight
    by at most 2^-11 (15 |d sc| + |dmin m|) (+ 2^-21 absolute when those are subnormal). Non-finite ones (d sc >
    65504: no real model) are left to the caller."""
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16).astype(np.float32)  # [..., S, 1]
    dmin = np.ascontiguousarray(raw[..., 2:4]).view(np.float16).astype(np.float32)
    # 12 bytes of 6-bit (scale, min) pairs: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    # sub-blocks 4-7 in bytes 8-11 (scale: low nibble, min: high nibble) with their top 2 bits in the top 2 bits of
    # bytes 0-3 (scales) and 4-7 (mins)
    low, high, rest = raw[..., 4:8], raw[..., 8:12], raw[..., 12:16]
    sc = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)  # [..., S, 8]
    mn = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.stack([(d * sc).astype(np.float16), (-(dmin * mn)).astype(np.float16)], axis=-1)


def q4_k_codes(raw: np.ndarray) -> np.ndarray:
    """Q4_K's 128 code bytes [..., S, 128] -> tsterm int4 bytes [..., S, 128] (integer moves only). The file's
    byte 32 g + i holds input i of sub-block 2 g in its low nibble and input i of sub-block 2 g + 1 in its high one;
    tsterm's byte j of a sub-block holds its input j (low nibble) and j + 16 (high)."""
    qs = raw[..., -128:].reshape(*raw.shape[:-1], 4, 32)  # [..., S, g, i]
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, 32)  # [..., S, sub-block, input]
    return codes[..., :16] | (codes[..., 16:] << 4)  # [..., S, 8, 16]


REQUANTIZE_CHUNK = 1 << 22  # weights dequantized at a time (16 MiB of float32) by requantize_int8


def requantize_int8(raw: np.ndarray, qtype: Any, in_f: int) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K / Q6_K blocks [..., O, I/256, bytes] -> int8 (scales [..., O, I/32], codes [..., O, I]): the `gguf`
    package's exact dequantization, re-quantized per block of 32 by `tsterm_kernels.quant.quantize_int8` (d =
    max|w| / 127 rounded to float16, codes round(w / d)): each weight moves by at most d / 2 (half an int8 step).
    Against the format's own step s (Q5_K: d sc of the sub-block, codes 0..31; Q6_K: the larger d sc of the
    block's two halves of 16, codes -32..31), max|w| <= 32 s where the block's values straddle zero (as trained
    weights' do), so at most 0.126 s; a Q5_K block far off zero relative to its spread (max|w| = dmin m >> 31 s)
    moves by up to dmin m / 254. Measured on quantized normal weights (tests/model/test_gguf_kquants.py): max
    0.10 s / 0.12 s, RMS 0.04 s / 0.07 s (Q5_K / Q6_K), which adds 1% / 3% to the format's own RMS rounding error
    (0.29 s). A few rows at a time, so the floats never exceed a chunk."""
    from gguf import dequantize
    from tsterm_kernels.quant import quantize_int8

    rows = raw.reshape(-1, raw.shape[-2] * raw.shape[-1])
    scales = np.empty((rows.shape[0], in_f // BLOCK), np.float16)
    codes = np.empty((rows.shape[0], in_f), np.int8)
    step = max(1, REQUANTIZE_CHUNK // in_f)
    for start in range(0, rows.shape[0], step):
        part = quantize_int8(torch.from_numpy(dequantize(rows[start:start + step], qtype)))
        scales[start:start + step], codes[start:start + step] = part.scale.numpy(), part.data.numpy()
    return scales, codes
