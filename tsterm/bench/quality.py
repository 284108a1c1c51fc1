"""Held-out perplexity of a transformers model with each weight quantization tsterm offers (benchmarks/quant_quality.py
and tests/model/test_quant_perplexity.py): every matrix tsterm quantizes is replaced by `quantize(w, mode)`
dequantized, so the figure is what the weights' quantization costs. A mode ending in "+a8" also rounds each input of
those matrices to int8 per block of 32 (max|x| / 127), as tsterm's CPU kernels do for int8 / int4 weights in every
matmul: what that rounding costs on top."""
from __future__ import annotations

import math

import torch
from tsterm_kernels.quant import int8_rows

from tsterm.model.quant import quantize


def quantizable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters tsterm quantizes (matrices; not the embedding nor the router), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if p.dim() >= 2 and not name.endswith(("embed_tokens.weight", "mlp.gate.weight"))}


@torch.no_grad()
def perplexity(model: torch.nn.Module, originals: dict[str, torch.Tensor], mode: str, windows: torch.Tensor) -> float:
    """Perplexity of `windows` [N, T] (next-token, within each window) with `originals` loaded as `mode` weights
    ("none": as they are; "+a8" appended: their inputs rounded to int8 blocks too)."""
    mode, _, activations = mode.partition("+")
    for name, param in model.named_parameters():
        if name in originals:
            weight = originals[name] if mode == "none" else quantize(originals[name], mode)
            param.copy_(weight.dequantize() if hasattr(weight, "dequantize") else weight)  # unquantizable: as is
    owners = {name.rsplit(".", 1)[0] for name in originals}
    hooks = [module.register_forward_pre_hook(_round_to_int8_blocks) for name, module in model.named_modules()
             if activations == "a8" and name in owners]
    try:
        logits = model(windows).logits  # [N, T, V]
    finally:
        for hook in hooks:
            hook.remove()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    return math.exp(nll.item())


def _round_to_int8_blocks(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the input x [..., I] as the C kernels see it, int8 codes per block of 32 times max|x| / 127."""
    codes, scale = int8_rows(args[0])
    return ((codes * scale[..., None]).reshape(args[0].shape).to(args[0].dtype), *args[1:])
