"""The kernel dispatch: an object per implementation, Triton imported lazily, nothing bound process-wide."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tsterm_kernels import dispatch, torch_ops


def test_load_binds_every_op_of_one_implementation():
    from tsterm_kernels import triton_ops

    triton, torch_impl = dispatch.load("triton"), dispatch.load("torch")
    assert (triton.name, torch_impl.name) == ("triton", "torch")
    for op in dispatch.OP_NAMES:
        assert getattr(triton, op) is getattr(triton_ops, op)
        assert getattr(torch_impl, op) is getattr(torch_ops, op)


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown kernel implementation 'cuda'"):
        dispatch.load("cuda")


def test_importing_the_package_does_not_import_triton():
    code = "import sys, tsterm_kernels.dispatch, tsterm_kernels.torch_ops; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
