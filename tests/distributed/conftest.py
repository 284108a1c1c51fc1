"""Shared by the multi-rank tests: rank 0 (this process) runs single-threaded, as each worker rank does, so that two
or four ranks on a 2-core machine do not oversubscribe it."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
