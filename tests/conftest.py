"""Session-wide test setup. TRITON_INTERPRET must be set before anything imports triton: Triton kernels are then
defined as interpreted functions and run on CPU tensors (tests/kernels)."""
import os

os.environ["TRITON_INTERPRET"] = "1"
