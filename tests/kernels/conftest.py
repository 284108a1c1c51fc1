"""Fixtures for kernel tests: `triton_ops` (the Triton kernels, interpreted on the CPU), `poison`, which makes
every torch.empty / torch.empty_like return NaN (floats) or huge values (ints), so a kernel that leaves part of
an output unwritten fails its comparison, and `native_spy`, which counts a C kernel's calls."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import cpu_native, dispatch

POISON_INT = 0x3FFF_FFFF


@pytest.fixture
def triton_ops() -> dispatch.KernelOps:
    """The Triton kernels (run by the interpreter on CPU tensors)."""
    return dispatch.load("triton")


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


class NativeSpy:
    """Counts the calls of one C kernel (of the library the ops load now) while passing them through."""

    def __init__(self, monkeypatch, name: str):
        native = cpu_native.load()
        assert native is not None, "the C kernels must build on the test machine (gcc, AVX2)"
        self.calls, fn = 0, getattr(native, name)

        def call(*args):
            self.calls += 1
            return fn(*args)
        monkeypatch.setattr(native, name, call)


@pytest.fixture
def native_spy(monkeypatch):
    """native_spy("prefill_attention").calls: how often the ops called that C kernel since."""
    return lambda name: NativeSpy(monkeypatch, name)
