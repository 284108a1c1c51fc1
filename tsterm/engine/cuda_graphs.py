"""CUDA graphs of decode steps: one per (batch bucket, context tier), captured on first use, replayed after.

What a replay relies on (see torch.cuda.graph):
- Static addresses. Each graph owns its input buffers, laid out for its batch size and block-table width, and
  keeps its output (the logits) alive. A step writes the staging buffer, uploads into the graph's buffers on the
  current stream, then replays on that stream.
- The same kernels for any inputs of the graph's shape. The Triton ops make every host-side choice (tile sizes,
  grid sizes, the number of KV splits) from shapes and host lists only; at capture these describe the bucket:
  `batch_size` rows of one token each, contexts up to `max_context` (= table width x block size), which fixes the
  split count. The context length of each row is read on the device, so one graph serves any context within
  its bound. The torch twins read host lists per sequence, so graphs are used with the Triton ops only.
- Padding. Rows past the real batch hold token 0 at position 0, KV slot -1 (store_kv skips it) and context
  length 0 (attention reads no key and writes zeros); their logits rows are never returned, and their (token,
  expert) pairs weigh 0 in the expert-load count (the step's `pair_weights`, passed to the model's step context).
- Capture hygiene. Warm-up runs (Triton compiles, cuBLAS workspaces) and the capture use one dedicated side
  stream; every graph captures into one shared memory pool. Sharing is safe because replays never overlap (one
  stream) and no graph reads another's memory: inputs live in each graph's own buffers, outputs stay referenced.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.step_inputs import HostStep, StepLayout, step_inputs

if TYPE_CHECKING:
    from tsterm.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
MIN_GRAPH_CONTEXT = 1024  # tokens: the smallest context tier (shorter contexts use its graph)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: BATCH_BUCKETS below the cap, and the cap itself (at most the largest bucket)."""
    cap = min(max_num_seqs, BATCH_BUCKETS[-1])
    return tuple(sorted({b for b in BATCH_BUCKETS if b < cap} | {cap}))


class DecodeGraph:
    """A padded decode step of `batch_size` rows over contexts of at most `table_width` blocks.

    `run_eager` executes exactly what `capture` records (same inputs, same host decisions), without a graph: the
    CPU tests use it to check padding against the unpadded step.
    """

    def __init__(self, runner: ModelRunner, batch_size: int, table_width: int):
        self.runner, self.batch_size, self.table_width = runner, batch_size, table_width
        self.max_context = table_width * runner.block_size
        self.top_k = runner.cfg.num_experts_per_tok
        self.layout = StepLayout(batch_size, batch_size, table_width, 0, batch_size * self.top_k)
        device = runner.device
        self.i64 = torch.zeros(self.layout.i64_size, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(self.layout.i32_size, dtype=torch.int32, device=device)
        # Host lists as the kernels' launchers see them at capture: one token per row, every context at the bound.
        shape = HostStep(query_start_loc=list(range(batch_size + 1)), seq_lens=[self.max_context] * batch_size,
                         block_tables=[[] for _ in range(batch_size)])
        self.inputs = step_inputs(self.layout, self.i64, self.i32, shape, runner.block_size)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [batch_size, V] float32, the graph's output

    def _upload(self, step: HostStep, num_real: int) -> None:
        step.pad_decode(self.batch_size)
        step.sample_rows = []  # every row's logits are computed; the first num_real are returned
        pair_weights = [1] * (num_real * self.top_k) + [0] * ((self.batch_size - num_real) * self.top_k)
        staging = self.runner.staging
        staging.write(self.layout, step, pair_weights)
        staging.upload(self.layout, self.i64, self.i32)

    def forward(self) -> torch.Tensor:
        """The captured work: the padded forward and the logits of every row, [batch_size, V] float32."""
        model = self.runner.model
        with model.step_context(self.inputs.meta, self.inputs.pair_weights, self.inputs.state_slots):
            hidden = model.forward(self.inputs.input_ids, self.inputs.positions)  # [B, H]
            return model.logits(hidden)  # [B, V]

    def run_eager(self, batch: ScheduledBatch) -> torch.Tensor:
        self._upload(self.runner.host_step(batch), len(batch.seqs))
        return self.forward()[:len(batch.seqs)]

    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        self._upload(HostStep(), 0)  # all padding: the warm-up writes no KV and reads none
        current = torch.cuda.current_stream(self.runner.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            logits = self.forward()
        self.graph, self.logits = graph, logits

    def replay(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, V] of the batch's S sequences: a view of the graph's output, valid until its next replay."""
        self._upload(self.runner.host_step(batch), len(batch.seqs))
        self.graph.replay()
        return self.logits[:len(batch.seqs)]


class DecodeGraphs:
    """The runner's captured decode graphs, by (batch bucket, table width)."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int):
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        self.min_width = min(-(-MIN_GRAPH_CONTEXT // runner.block_size), runner.max_blocks_per_seq)
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.failed: set[tuple[int, int]] = set()  # shapes whose capture failed: eager from then on
        self.pool: tuple | None = None  # one memory pool and one capture stream for every graph, made at first use
        self.stream: torch.cuda.Stream | None = None

    def shape_for(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(batch size, table width) of the graph that can run `batch`, or None: run it eagerly."""
        num_seqs = len(batch.seqs)
        if num_seqs > self.buckets[-1] or any(n != 1 for n in batch.num_new) or not all(batch.sample_mask()):
            return None
        blocks = max(-(-(seq.num_computed_tokens + 1) // self.runner.block_size) for seq in batch.seqs)
        width = max(self.min_width, 1 << (blocks - 1).bit_length())  # the next power of two, at least the minimum
        width = min(width, self.runner.max_blocks_per_seq)
        if blocks > width:
            return None
        return next(b for b in self.buckets if b >= num_seqs), width

    def for_batch(self, batch: ScheduledBatch) -> DecodeGraph | None:
        """The graph that runs `batch`, captured now on the first step of its shape; None: run it eagerly (not a
        pure decode step, too large, or a shape whose capture failed)."""
        shape = self.shape_for(batch)
        return None if shape is None else self.get(*shape)

    def get(self, batch_size: int, table_width: int) -> DecodeGraph | None:
        """The captured graph of this shape, captured now if it is the first step of that shape.

        A capture that fails is logged once and remembered: that shape decodes eagerly from then on (correct, only
        slower), and is never captured again."""
        key = (batch_size, table_width)
        graph = self.graphs.get(key)
        if graph is None and key not in self.failed:
            graph = DecodeGraph(self.runner, batch_size, table_width)
            try:
                if self.pool is None:
                    self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.runner.device)
                graph.capture(self.pool, self.stream)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager decoding
                self.failed.add(key)
                log.warning("CUDA graph capture of a decode step of %d sequences (contexts up to %d tokens) failed: "
                            "%s: %s; steps of this shape run eagerly (engine option cuda_graphs=False turns graphs "
                            "off)", batch_size, graph.max_context, type(e).__name__, e)
                return None
            self.graphs[key] = graph
        return graph
