"""Fixtures for kernel tests: the op implementation is restored to "torch" after every test, and `poison` makes
every torch.empty / torch.empty_like return NaN (floats) or huge values (ints), so a kernel that leaves part of
an output unwritten fails its comparison."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import dispatch

POISON_INT = 0x3FFF_FFFF


@pytest.fixture(autouse=True)
def restore_torch_ops():
    yield
    dispatch.use("torch")


@pytest.fixture
def triton_ops():
    """`dispatch.ops` bound to the Triton kernels for the test (run by the interpreter on CPU tensors)."""
    dispatch.use("triton")
    return dispatch.ops


def poison_(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(min(POISON_INT, torch.iinfo(t.dtype).max))
    return t


@pytest.fixture
def poison(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison_(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison_(empty_like(*args, **kwargs)))
