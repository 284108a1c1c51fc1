"""A CPU stand-in for a CUDA graph (tests of the graph path without a GPU): its capture runs the step once as the
real capture would record it, and its replay re-runs that forward into the same logits tensor."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tsterm.engine.cuda_graphs import DecodeGraph
from tsterm.engine.step_inputs import HostStep


def capture_on_cpu(captures: list[tuple[int, int]] | None = None):
    """A replacement for `DecodeGraph.capture` (monkeypatch it in); each capture's (batch size, table width) is
    appended to `captures` when given."""
    def capture(self: DecodeGraph, pool, stream, out) -> None:
        if captures is not None:
            captures.append((self.batch_size, self.table_width))
        self._upload(HostStep(), 0)
        self.logits = self.forward()

        def replay() -> None:
            with torch.inference_mode():
                self.logits.copy_(self.forward())

        self.graph = SimpleNamespace(replay=replay)

    return capture
