"""Chooses one implementation per op, once. `use("torch")` forces the reference twins (tests, CPU).

The top-level `kernels/` directory installs as the package `tsterm_kernels`: the PyPI name `kernels` belongs
to another project that transformers probes for. The directory has no `__init__.py` on purpose, so that a
process started in the repository root sees `kernels` only as an empty namespace package, which transformers
treats as "not installed".
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

from tsterm_kernels import reference

OP_NAMES = ("rms_norm", "store_kv", "paged_attention", "moe_route", "fused_moe")

# name -> module providing every op in OP_NAMES, or its import path: imported on first `use`, so that importing
# this package never imports triton (nor needs a GPU).
_IMPLEMENTATIONS: dict[str, object] = {"torch": reference, "triton": "tsterm_kernels.triton_ops"}

ops = SimpleNamespace()


def use(name: str) -> None:
    """Bind every op in `ops` to implementation `name`."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown kernel implementation {name!r} (have: {', '.join(_IMPLEMENTATIONS)})")
    impl = _IMPLEMENTATIONS[name]
    if isinstance(impl, str):
        impl = _IMPLEMENTATIONS[name] = importlib.import_module(impl)
    for op in OP_NAMES:
        setattr(ops, op, getattr(impl, op))
    ops.name = name


use("torch")
