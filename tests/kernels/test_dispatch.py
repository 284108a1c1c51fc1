"""The kernel dispatch: one binding of every op, switched by name, Triton imported lazily."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tsterm_kernels import dispatch, reference


def test_use_rebinds_every_op():
    from tsterm_kernels import triton_ops

    dispatch.use("triton")
    assert dispatch.ops.name == "triton"
    for op in dispatch.OP_NAMES:
        assert getattr(dispatch.ops, op) is getattr(triton_ops, op)
    dispatch.use("torch")
    assert dispatch.ops.name == "torch"
    for op in dispatch.OP_NAMES:
        assert getattr(dispatch.ops, op) is getattr(reference, op)


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown kernel implementation 'cuda'"):
        dispatch.use("cuda")
    assert dispatch.ops.name == "torch"


def test_importing_the_package_does_not_import_triton():
    code = "import sys, tsterm_kernels.dispatch, tsterm_kernels.reference; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
