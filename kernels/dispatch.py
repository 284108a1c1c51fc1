"""Chooses one implementation per op, as an object each engine holds: `load("torch")` or `load("triton")`.

There is no process-wide binding: the engine's executor loads a `KernelOps` and hands it to its model, so two
engines in one process (the TUI switching profiles, the TUI and a server, one engine per rank) can run different
implementations side by side, and a load that fails leaves every other engine as it was.

The top-level `kernels/` directory installs as the package `tsterm_kernels`: the PyPI name `kernels` belongs
to another project that transformers probes for. The directory has no `__init__.py` on purpose, so that a
process started in the repository root sees `kernels` only as an empty namespace package, which transformers
treats as "not installed".
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

OP_NAMES = ("rms_norm", "store_kv", "paged_attention", "moe_route", "fused_moe", "causal_conv1d_update",
            "recurrent_gated_delta_rule", "causal_conv1d", "chunk_gated_delta_rule", "decode_stack")

# name -> module providing every op in OP_NAMES. Imported on first `load` (Python caches the module), so that
# importing this package never imports triton (nor needs a GPU).
IMPLEMENTATIONS = {"torch": "tsterm_kernels.torch_ops", "triton": "tsterm_kernels.triton_ops"}
# ops that only some implementations have: op -> {implementation: module}; elsewhere the field is None and the model
# composes the op from the ones above (MLA's absorbed attention: the paged attention over the latent pool)
OPTIONAL_OPS = {"mla_attention": {"triton": "tsterm_kernels.triton_mla"}}


@dataclass(frozen=True, slots=True)
class KernelOps:
    """One implementation of every op in OP_NAMES; each has the signature of its torch version in `torch_ops`."""

    name: str
    rms_norm: Callable
    store_kv: Callable
    paged_attention: Callable
    moe_route: Callable
    fused_moe: Callable
    causal_conv1d_update: Callable  # Gated DeltaNet decode (torch versions in `torch_gated_delta`)
    recurrent_gated_delta_rule: Callable
    causal_conv1d: Callable  # Gated DeltaNet prefill: every prompt chunk of a step in one call
    chunk_gated_delta_rule: Callable
    decode_stack: Callable  # a model's layers -> one callable for its decode steps, or None (see torch_ops)
    mla_attention: Callable | None = None  # MLA's absorbed attention over the latent pool (triton_mla); torch: None


def load(name: str) -> KernelOps:
    """The ops of implementation `name` ("torch": `torch_ops`, the CPU path with its C kernels; "triton": the
    Triton kernels)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown kernel implementation {name!r} (have: {', '.join(IMPLEMENTATIONS)})")
    module = importlib.import_module(IMPLEMENTATIONS[name])
    optional = {op: getattr(importlib.import_module(where[name]), op)
                for op, where in OPTIONAL_OPS.items() if name in where}
    return KernelOps(name, **{op: getattr(module, op) for op in OP_NAMES}, **optional)
