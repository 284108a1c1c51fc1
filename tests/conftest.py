"""Session-wide test setup. TRITON_INTERPRET must be set before anything imports triton: Triton kernels are then
defined as interpreted functions and run on CPU tensors (tests/kernels)."""
import os

os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    # Here, not in tests/tui/conftest.py: an option must be known before pytest reads the sub-folders' conftests
    # (`pytest --snapshot-update` from the root would otherwise be an unrecognised argument).
    parser.addoption("--snapshot-update", action="store_true", dest="snapshot_update",
                     help="rewrite the TUI snapshots in tests/tui/snapshots/ instead of comparing with them")
