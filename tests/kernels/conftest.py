"""Fixtures for kernel tests: `triton_ops` (the Triton kernels, interpreted on the CPU), `poison`, which makes
every torch.empty / torch.empty_like return NaN (floats) or huge values (ints), so a kernel that leaves part of
an output unwritten fails its comparison, and `native_spy`, which counts a C kernel's calls."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import cpu_native, cpu_select, dispatch

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
    """Counts the calls of one C kernel (of every build the ops may load now: the native one and, on a CPU with
    AVX-512, the AVX2 one) while passing them through."""

    def __init__(self, monkeypatch, name: str):
        native = cpu_native.load()
        assert native is not None, "the C kernels must build on the test machine (gcc, AVX2)"
        self.calls = 0
        for build in {id(b): b for b in (native, cpu_native.load_variant("avx2")) if b is not None}.values():
            self._wrap(monkeypatch, build, name)

    def _wrap(self, monkeypatch, build, name):
        fn = getattr(build, name)

        def call(*args):
            self.calls += 1
            return fn(*args)
        monkeypatch.setattr(build, name, call)


def isa_candidates() -> list[str]:
    """The C builds this CPU runs (cpu_select's candidate names), from what it reports: every kernel test that takes
    `cpu_isa` runs once per build."""
    cpu = cpu_select.CpuInfo.detect()
    return (["c-avx512"] if cpu.avx512 else []) + (["c-avx2"] if cpu.avx2 else [])


@pytest.fixture(params=isa_candidates())
def cpu_isa(request, monkeypatch) -> str:
    """The ops' float32 shape classes forced onto one C build (TSTERM_CPU_KERNELS), one test run per build."""
    monkeypatch.setenv(cpu_select.ENV, request.param)
    return request.param


@pytest.fixture
def native_spy(monkeypatch):
    """native_spy("prefill_attention").calls: how often the ops called that C kernel since."""
    return lambda name: NativeSpy(monkeypatch, name)
