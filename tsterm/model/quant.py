"""Quantize-on-load: the decoder's linear weights as weight-only fp16 / int8 / int4 / fp8 ones (EngineConfig.quantization).

What is quantized: every matrix the decoder multiplies through `tsterm_kernels.reference.linear` - fused q/k/v
(and the hybrids' q/k/v/gate and linear-attention projections), o_proj / out_proj, the experts' and dense MLPs'
`w13` / `w2` stacks (per expert), the shared expert, and the LM head. What stays in the float dtype: the
embedding (a row lookup), norms, biases, the router and the shared expert's gate (a few KB that decide routing),
the convolution and the linear-attention decay parameters.

int8 and int4 quantize blocks of 32 inputs (GGUF Q8_0 / Q4_1's forms, `tsterm_kernels.quant`); a matrix whose inputs
are not a multiple of 32 stays float (a row-local rule: fused and separate projections get the same format). Each float matrix is dropped as
soon as its quantized form exists, so the float copies made at load (fused q/k/v, stacked experts) go one by one.
fp8 quantizes blocks of 128 x 128 (any shape; a partial block at the edges), as fine-grained FP8 checkpoints do.

Devices. On the CPU: fp16, int8 and int4 (fbgemm's GEMM and tsterm's C kernels); fp8 is refused there, since no CPU
kernel reads it (every matmul would dequantize the whole matrix): use int8 or int4. On a GPU: int8, int4 and fp8
(the Triton kernels `tsterm_kernels.triton_quant_linear` and, for the expert stacks a MoE layer hands to
`ops.fused_moe`, `tsterm_kernels.triton_fused_moe`); fp16 is refused (fbgemm packs for the CPU only).
"""
from __future__ import annotations

import ctypes

import torch
from tsterm_kernels.quant import (QuantizedWeight, allow_prefill_gemm, quantize_fp8, quantize_fp16, quantize_int4,
                                  quantize_int8, quantize_supported)

from tsterm.errors import ConfigError

QUANTIZATIONS = ("none", "fp16", "int8", "int4", "fp8")
CPU_QUANTIZATIONS = ("fp16", "int8", "int4")
GPU_QUANTIZATIONS = ("int8", "int4", "fp8")
# canonical weight names (tsterm.model.loader / hybrid_loader) of the matrices `linear` multiplies by
LINEAR_NAMES = ("qkv", "qkvg", "o_proj", "in_proj", "out_proj", "w13", "w2", "shared_w13", "shared_w2")


def is_linear_weight(name: str) -> bool:
    return name == "lm_head" or name.rsplit(".", 1)[-1] in LINEAR_NAMES


def quantize(weight: torch.Tensor, mode: str) -> QuantizedWeight | torch.Tensor:
    """One [..., O, I] weight as `mode` ("fp16", "int8", "int4" or "fp8"); an int8 / int4 weight whose inputs are
    not whole blocks of 32 is returned as it is."""
    if mode == "fp16":
        return quantize_fp16(weight)
    if mode == "fp8":
        return quantize_fp8(weight)
    if not quantize_supported(weight.shape):
        return weight
    return quantize_int4(weight) if mode == "int4" else quantize_int8(weight)


def quantize_weights(weights: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Replace the linear weights of a loaded model (in `weights`, in place) by their `mode` form; returns it."""
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return weights
    device = weights["embed"].device
    on_cpu = device.type == "cpu"
    if on_cpu and mode not in CPU_QUANTIZATIONS:
        raise ConfigError(f"quantization: {mode} has no CPU kernel (device is {device}): its weights would be "
                          f"dequantized at every matmul; on the CPU use quantization: int8 or int4 (or fp16), "
                          f"{mode} on a GPU")
    if not on_cpu and mode not in GPU_QUANTIZATIONS:
        raise ConfigError(f"quantization: {mode} runs on the CPU only (fbgemm's packed matrices; device is "
                          f"{device}); on a GPU use quantization: int8, int4 or fp8")
    tied = weights["lm_head"] is weights["embed"]
    for name in [n for n in weights if is_linear_weight(n)]:
        if isinstance(weights[name], QuantizedWeight):  # an FP8 checkpoint's matrix kept as fp8 (tsterm.model.loader)
            if weights[name].kind == mode:
                continue
            weights[name] = weights[name].dequantize().to(weights["embed"].dtype)  # float where it stays float
        if name == "lm_head" and tied:  # the embedding stays float for its lookup; the head gets its own copy
            weights[name] = quantize(weights["embed"], mode)
            continue
        weights[name] = quantize(weights[name], mode)  # the float tensor is released here
    # The float tensors left (embedding, norms, router, biases) are views of the checkpoint's file mapping, which keeps
    # every page read at load resident, the quantized matrices' float pages too: owning copies lets the mapping go.
    # (On a GPU the weights were copied off the mapping at load already.)
    if on_cpu:
        for name, weight in weights.items():
            if not isinstance(weight, QuantizedWeight):
                weights[name] = weight.clone()
        _return_freed_memory()
    return weights


def _return_freed_memory() -> None:
    """Give the float copies made at load (fused q/k/v, stacked experts), now freed, back to the OS: glibc keeps
    freed blocks of that size in its heap (measured on SmolLM2: RSS stays at the float model's without this)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, or the allocator returns memory itself
        pass


def weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes the model's weights hold (a tied head counted once; a mapped file's pages count as they are read)."""
    seen, total = set(), 0
    for weight in weights.values():
        if id(weight) not in seen:
            seen.add(id(weight))
            total += weight.nbytes if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()
    return total


def allow_prefill_gemms(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`deterministic: false`: mark every int8 / int4 weight (in place) so that a prefill of many rows may run the
    float32 GEMM (`tsterm_kernels.quant.allow_prefill_gemm`); returns `weights`."""
    for name, weight in weights.items():
        if isinstance(weight, QuantizedWeight):
            weights[name] = allow_prefill_gemm(weight)
    return weights
