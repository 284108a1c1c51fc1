"""Held-out perplexity of a transformers model with each weight quantization tsterm offers (benchmarks/quant_quality.py
and tests/model/test_quant_perplexity.py): every matrix tsterm quantizes is replaced by `quantize(w, mode)`
dequantized, so the figure is what the weights' quantization costs (tsterm's C kernels also round activations to
int8 in decode; that is not in it)."""
from __future__ import annotations

import math

import torch

from tsterm.model.quant import quantize


def quantizable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters tsterm quantizes (matrices; not the embedding nor the router), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if p.dim() >= 2 and not name.endswith(("embed_tokens.weight", "mlp.gate.weight"))}


@torch.no_grad()
def perplexity(model: torch.nn.Module, originals: dict[str, torch.Tensor], mode: str, windows: torch.Tensor) -> float:
    """Perplexity of `windows` [N, T] (next-token, within each window) with `originals` loaded as `mode` weights
    ("none": as they are)."""
    for name, param in model.named_parameters():
        if name in originals:
            weight = originals[name] if mode == "none" else quantize(originals[name], mode)
            param.copy_(weight.dequantize() if hasattr(weight, "dequantize") else weight)  # unquantizable: as is
    logits = model(windows).logits  # [N, T, V]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    return math.exp(nll.item())
