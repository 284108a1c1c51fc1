"""Quantize-on-load: the decoder's linear weights as weight-only fp16 / int8 / int4 / fp8 ones (EngineConfig.quantization).

What is quantized: every matrix the decoder multiplies through `tsterm_kernels.torch_ops.linear` - fused q/k/v
(and the hybrids' q/k/v/gate and linear-attention projections), o_proj / out_proj, the experts' and dense MLPs'
`w13` / `w2` stacks (per expert), the shared expert, and the LM head. What stays in the float dtype: the
embedding (a row lookup), norms, biases, the router and the shared expert's gate (a few KB that decide routing),
the convolution and the linear-attention decay parameters.

int8 and int4 quantize blocks of 32 inputs (GGUF Q8_0 / Q4_1's forms, `tsterm_kernels.quant`); a matrix whose inputs
are not a multiple of 32 stays float (a row-local rule: fused and separate projections get the same format).
fp8 quantizes blocks of 128 x 128 (any shape; a partial block at the edges), as fine-grained FP8 checkpoints do.

Quantized as they load: the loader stores each weight into a `QuantizeOnLoad` dict, which quantizes a linear weight
as it is stored, so its float form (the fused q/k/v, a layer's stacked experts, on the device already) is dropped
before the next one is read: the float model never exists whole, and the load's peak is the quantized model plus
one float matrix (and the parts it was fused from). `quantize_weights` does the same to a dict loaded whole.

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


def check_mode(mode: str, device: torch.device) -> None:
    """A ConfigError unless `mode` is a quantization with a kernel on `device`."""
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return
    on_cpu = device.type == "cpu"
    if on_cpu and mode not in CPU_QUANTIZATIONS:
        raise ConfigError(f"quantization: {mode} has no CPU kernel (device is {device}): its weights would be "
                          f"dequantized at every matmul; on the CPU use quantization: int8 or int4 (or fp16), "
                          f"{mode} on a GPU")
    if not on_cpu and mode not in GPU_QUANTIZATIONS:
        raise ConfigError(f"quantization: {mode} runs on the CPU only (fbgemm's packed matrices; device is "
                          f"{device}); on a GPU use quantization: int8, int4 or fp8")


class QuantizeOnLoad(dict):
    """The loader's name -> weight dict, quantizing each linear weight (`is_linear_weight`) to `mode` as it is stored
    (see the module doc); other weights are stored as they are. `finish()` after the last weight.

    A tied LM head stored as the embedding itself gets its own quantized copy (the embedding stays float for its
    lookup); an FP8 checkpoint's matrix kept as fp8 stays so under `mode` fp8, and is re-quantized under another.
    Under mode none, weights that come quantized are stored as they come: gpt-oss's MXFP4 experts as "mxfp4"
    QuantizedWeights (the loader keeps them; under another mode it dequantizes them at load instead)."""

    def __init__(self, mode: str, device: torch.device, dtype: torch.dtype):
        super().__init__()
        check_mode(mode, device)
        self.mode, self.device, self.dtype = mode, device, dtype

    def __setitem__(self, name: str, weight: torch.Tensor | QuantizedWeight) -> None:
        if self.mode != "none" and is_linear_weight(name):
            weight = self._quantized(weight)  # the caller's float tensor is dropped when the caller lets it go
        super().__setitem__(name, weight)

    def _quantized(self, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        if isinstance(weight, QuantizedWeight):  # an FP8 checkpoint's matrix kept as fp8 (tsterm.model.loader)
            if weight.kind == self.mode:
                return weight
            weight = weight.dequantize().to(self.dtype)  # float where it stays float
        return quantize(weight, self.mode)

    def finish(self) -> dict[str, torch.Tensor]:
        """The weights as a plain dict. On the CPU, the float tensors left (embedding, norms, router, biases) are views
        of the checkpoint's file mapping, which keeps every page read at load resident, the quantized matrices'
        float pages too: owning copies let the mapping go. (On a GPU the weights were copied off the mapping.)"""
        weights = dict(self)
        if self.mode != "none" and self.device.type == "cpu":
            copies: dict[int, torch.Tensor] = {}  # a tensor stored under two names stays one tensor
            for name, weight in weights.items():
                if not isinstance(weight, QuantizedWeight):
                    weights[name] = copies.setdefault(id(weight), weight.clone())
            _return_freed_memory()
        return weights


def quantize_weights(weights: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Replace the linear weights of a model loaded whole (in `weights`, in place) by their `mode` form; returns it.
    (The loaders quantize as they load instead: `QuantizeOnLoad`.)"""
    check_mode(mode, weights["embed"].device)
    if mode == "none":
        return weights
    sink = QuantizeOnLoad(mode, weights["embed"].device, weights["embed"].dtype)
    for name in list(weights):
        sink[name] = weights.pop(name)  # each float matrix released as its quantized form is made
    weights.update(sink.finish())
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
