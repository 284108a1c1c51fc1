"""Rotary position embeddings, with the scaling types the supported checkpoints ship (default, linear, yarn, llama3)."""
from __future__ import annotations

import math

import torch
from tsterm_kernels import cpu_native

from tsterm.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [D/2] float32, attention_factor that scales cos and sin)."""
    base_inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    original_max = rope.original_max_position_embeddings or max_position_embeddings
    if rope.rope_type == "default":
        return base_inv, 1.0
    if rope.rope_type == "linear":
        return base_inv / rope.factor, 1.0
    if rope.rope_type == "llama3":
        low_wavelen = original_max / rope.low_freq_factor
        high_wavelen = original_max / rope.high_freq_factor
        wavelen = 2 * math.pi / base_inv
        scaled = torch.where(wavelen > low_wavelen, base_inv / rope.factor, base_inv)
        smooth = (original_max / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, original_max)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")  # ModelConfig validated it already


def _yarn(rope: RopeConfig, dim: int, original_max: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:  # DeepSeek's mscale / mscale_all_dim ratio, else the paper's default
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim) \
            if rope.mscale and rope.mscale_all_dim else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:  # (gpt-oss ships truncate: false: the ramp between the exact ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of each frequency kept as trained
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (1 when it is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position. Per step, `tables` looks up the step's rows once; every
    layer then rotates its q and k together with `rotate` (rotate-half layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, max_position_embeddings: int,
                 device: torch.device):
        inv_freq, scale = inverse_frequencies(rope, head_dim, max_position_embeddings)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        cos = freqs.cos() * scale
        self.cos = torch.cat((cos, cos), dim=-1).to(device)  # [P, D] float32: each pair's cos on both halves
        self.sin = (freqs.sin() * scale).to(device)  # [P, D/2] float32

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows: (cos [T, 1, D], sin [T, 1, D/2]) for positions [T]."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def rotate_(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`rotate`, in place where it can be: on the CPU, one C call (tsterm_kernels.cpu_native) rotates x [T, H, D]
    float32 itself when each token's heads are contiguous, and returns x; otherwise `rotate(x, tables)`, a new
    tensor (x is left as it was). Use the result. Tables narrower than D (partial rotary: `ModelConfig.rotary_dim`)
    rotate the leading dims of each head, in x itself, and pass the rest through."""
    cos, sin = tables
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (GLM-4.5, MiniMax-M2): the leading dims of each head, in place
        x[..., :cos.shape[-1]] = rotate(x[..., :cos.shape[-1]], tables)
        return x
    native = None
    if cpu_native.rows_contiguous_f32(x) and cos.is_contiguous() and sin.is_contiguous() \
            and cos.shape[-1] == x.shape[-1]:
        native = cpu_native.load()
    if native is None:
        return rotate(x, tables)
    native.rope(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], cos.data_ptr(), sin.data_ptr())
    return x


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] float32 (any strides) rotated by the step's `tables`; a new float32 tensor.

    Rotate-half: out = x * cos + [-x2, x1] * sin, written as one multiply and two in-place multiply-adds.
    """
    cos, sin = tables
    half = x.shape[-1] // 2
    out = x * cos  # [T, H, D]
    out[..., :half].addcmul_(x[..., half:], sin, value=-1.0)
    out[..., half:].addcmul_(x[..., :half], sin)
    return out
