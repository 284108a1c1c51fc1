"""Engines for an engine core process to build (tests/engine/test_core_process.py): module-level functions, so that
`functools.partial(fn, ...)` pickles into the child, which imports this module by the sys.path the front sends."""
from __future__ import annotations

import os

from tsterm.launch import build_engine

OPTIONS = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 128}


def tiny(model_dir: str, progress):
    return build_engine(model_dir, OPTIONS, progress)


def failing_step(model_dir: str, fail_at: int, progress):
    """An engine whose step number `fail_at` (1-based) raises RuntimeError("kernel exploded")."""
    engine = tiny(model_dir, progress)
    step, calls = engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("kernel exploded")
        return step()

    engine.step = failing
    return engine


def dying_load(code: int, progress):
    """The core process ends while it loads, as one killed by the kernel's OOM killer would."""
    progress(0, 1, "weights")
    os._exit(code)


def gated_step(model_dir: str, fifo: str, gate_at: int, progress):
    """An engine whose step number `gate_at` (1-based) first waits for a byte on the named pipe `fifo`: the test
    decides when it ends (an event across the process boundary, not a delay)."""
    engine = tiny(model_dir, progress)
    step, calls = engine.step, []

    def gated():
        calls.append(1)
        if len(calls) == gate_at:
            with open(fifo, "rb") as gate:
                gate.read(1)
        return step()

    engine.step = gated
    return engine
