"""A model's float32 shape classes on the CPU and the kernel each runs (`tsterm_kernels.cpu_select`), chosen when an
engine starts: measured on this machine the first time a class is seen, read back from the kernel cache after.

The classes are what the model multiplies: each float32 linear weight [O, I] (q/k/v, o_proj, the hybrids'
projections, a dense MLP's two matrices, the router, the shared expert's gate, the LM head), each float32 stack of
routed or shared experts, and each full-attention layer's heads. Quantized weights (int8 / int4 blocks) are not
chosen for: their kernels are the int8-row ones, whatever the CPU. A model run in bfloat16 has "bf16" classes instead:
each bfloat16 linear weight [O, I], an expert stack's two matrices among them (csrc/bf16.c's AMX or AVX512-BF16 code,
or torch's bfloat16 matmul), and each full-attention layer's heads over its bfloat16 pool ("bf16-attention").
"""
from __future__ import annotations

import logging

import torch
from tsterm_kernels import cpu_select, torch_ops
from tsterm_kernels.cpu_select import Choice, ShapeClass

log = logging.getLogger(__name__)

_LINEARS = ("qkv", "qkvg", "o_proj", "in_proj", "out_proj", "router", "shared_gate")  # layer attributes `linear` takes


def _float32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32


def _bf16_classes(w) -> list[ShapeClass]:
    """A bfloat16 CPU weight's linears: a matrix [O, I], or a stack's [E, O, I] (each expert's matrix)."""
    if not (isinstance(w, torch.Tensor) and w.is_cpu and w.dtype is torch.bfloat16 and w.dim() in (2, 3)):
        return []
    return [ShapeClass("bf16", tuple(w.shape[-2:]))]


def shape_classes(model) -> list[ShapeClass]:
    """Every float32 (and bfloat16) shape class of a `DecoderModel`'s CPU ops, in model order, each once."""
    classes = []
    for _, mixer, _, mlp in model.layers:
        for part in (mixer, mlp):
            for name in _LINEARS:
                classes += _bf16_classes(getattr(part, name, None))
        for name in ("w13", "w2", "shared_w13", "shared_w2"):
            classes += _bf16_classes(getattr(mlp, name, None))
    classes += _bf16_classes(model.lm_head)
    for _, mixer, _, mlp in model.layers:
        for part in (mixer, mlp):
            for name in _LINEARS:
                w = getattr(part, name, None)
                if _float32(w) and w.dim() == 2:
                    classes.append(ShapeClass("gemm", tuple(w.shape)))
        cache = getattr(mixer, "k_cache", None)
        if _float32(cache) and hasattr(mixer, "num_heads"):
            classes.append(ShapeClass("attention", (mixer.num_heads, mixer.num_kv_heads, mixer.head_dim)))
        elif (isinstance(cache, torch.Tensor) and cache.is_cpu and cache.dtype is torch.bfloat16
              and hasattr(mixer, "num_heads")):  # a bfloat16 pool: AMX's arithmetic or the widened float32 one
            classes.append(ShapeClass("bf16-attention", (mixer.num_heads, mixer.num_kv_heads, mixer.head_dim)))
        if mlp.router is None:  # a dense MLP: the one expert's two matrices through `linear`
            classes += [ShapeClass("gemm", tuple(w.shape)) for w in mlp.dense if _float32(w)]
        elif _float32(mlp.w13):
            classes.append(ShapeClass("experts", (*mlp.w13.shape, mlp.top_k)))
        if _float32(getattr(mlp, "shared_w13", None)):
            classes.append(ShapeClass("experts", (*mlp.shared_w13.shape, 1)))
    if _float32(model.lm_head) and model.lm_head.dim() == 2:
        classes.append(ShapeClass("gemm", tuple(model.lm_head.shape)))
    return list(dict.fromkeys(classes))


def choose(model) -> dict[str, Choice]:
    """Each of the model's shape classes' kernel on this machine (measured now where the kernel cache has none: a
    few hundred milliseconds), logged in one line with the CPU."""
    plan = torch_ops.cpu_kernel_plan(shape_classes(model))
    cpu = torch_ops.cpu_machine()
    log.info("CPU kernels on %s: %s", cpu.describe(), cpu_select.describe(plan))
    return plan
