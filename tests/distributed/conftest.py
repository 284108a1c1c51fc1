"""Shared by the multi-rank tests: rank 0 (this process) runs single-threaded, as each worker rank does, so that two
or four ranks on a 2-core machine do not oversubscribe it."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def single_threaded(one_torch_thread):
    yield
