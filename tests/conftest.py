"""Session-wide test setup. TRITON_INTERPRET must be set before anything imports triton: Triton kernels are then
defined as interpreted functions and run on CPU tensors (tests/kernels)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402 - after TRITON_INTERPRET, like everything that may import triton
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def own_data_dir(tmp_path_factory, monkeypatch):
    """No test writes the user's saved sessions: TSTERM_DATA_DIR is a fresh directory for each test (one that needs
    its own sets it again)."""
    monkeypatch.setenv("TSTERM_DATA_DIR", str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): tiny models
    are op-overhead bound, one thread is faster than two, and multi-rank tests do not oversubscribe 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    # Here, not in tests/tui/conftest.py: an option must be known before pytest reads the sub-folders' conftests
    # (`pytest --snapshot-update` from the root would otherwise be an unrecognised argument).
    parser.addoption("--snapshot-update", action="store_true", dest="snapshot_update",
                     help="rewrite the TUI snapshots in tests/tui/snapshots/ instead of comparing with them")
