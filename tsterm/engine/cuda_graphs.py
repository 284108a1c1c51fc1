"""CUDA graphs of decode steps: one per (batch bucket, context tier), captured at start-up, replayed after.

Start-up (`DecodeGraphs.capture_all`, called by the runner once its cache exists): every shape of `capture_plan` is
captured, the largest batch and the widest tier first (later, smaller captures reuse the pool's memory), with a
progress message per graph; the captures' warm-up runs compile the Triton kernels' decode variants, so no request
pays for a capture or a compile. A shape whose capture failed then (or that start-up did not capture) is tried once
more on its first step; a failure is final (eager steps for that shape).

What a replay relies on (see torch.cuda.graph):
- Static addresses. Each graph owns its input buffers, laid out for its batch size and block-table width; its
  logits are copied, inside the graph, into rows of one output buffer that every graph shares (`DecodeGraphs.out`,
  allocated outside the pool): the graphs keep no output of their own alive, and a step's logits are consumed
  before the next replay (the Executor contract). A step writes the staging buffer, uploads into the graph's
  buffers on the current stream, then replays on that stream.
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
  stream) and no graph reads another's memory: inputs live in each graph's own buffers, and a graph's logits leave
  the pool within its own replay (copied into the shared output buffer, which is not in the pool).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.step_inputs import HostStep, StepLayout, step_inputs

if TYPE_CHECKING:
    from tsterm.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
LARGE_BUCKET_STEP = 16  # past the last of BATCH_BUCKETS, a bucket every this many sequences
MIN_GRAPH_CONTEXT = 1024  # tokens: the smallest context tier (shorter contexts use its graph)
# what the captures take whatever the model: the capture stream's own cuBLAS and cuBLASLt workspaces, the first
# segments of the graphs' pool (the caching allocator maps memory in segments of 2 MiB for small blocks, 20 MiB for
# large ones), the compiled kernels' code
GRAPH_BASE_BYTES = 128 << 20


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: BATCH_BUCKETS below the cap, then every LARGE_BUCKET_STEP sequences, and the cap
    itself, so that every decode batch up to `max_num_seqs` has a graph (padded to the next bucket)."""
    large = range(BATCH_BUCKETS[-1] + LARGE_BUCKET_STEP, max_num_seqs, LARGE_BUCKET_STEP)
    return tuple(sorted({b for b in (*BATCH_BUCKETS, *large) if b < max_num_seqs} | {max_num_seqs}))


def context_widths(block_size: int, max_blocks_per_seq: int) -> tuple[int, ...]:
    """The context tiers, in blocks of a block table: MIN_GRAPH_CONTEXT's blocks, doubling, up to the longest table
    (the last tier stops there)."""
    width = min(-(-MIN_GRAPH_CONTEXT // block_size), max_blocks_per_seq)
    widths = [width]
    while widths[-1] < max_blocks_per_seq:
        widths.append(min(2 * widths[-1], max_blocks_per_seq))
    return tuple(widths)


def capture_plan(buckets: tuple[int, ...], widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (batch size, table width) shapes start-up captures, in order: the widest tier and the largest batch first,
    so that each later capture finds the memory it needs already in the graphs' pool."""
    return [(size, width) for width in sorted(widths, reverse=True) for size in sorted(buckets, reverse=True)]


def capture_message(index: int, total: int, batch_size: int, max_context: int) -> str:
    """The progress line of the `index`-th capture (from 1) of `total`."""
    rows = "1 sequence" if batch_size == 1 else f"{batch_size} sequences"
    return f"capturing CUDA graphs {index}/{total}: decode of {rows}, contexts up to {max_context} tokens"


def graph_memory_estimate(plan: list[tuple[int, int]], vocab_size: int, step_bytes: int, step_tokens: int) -> int:
    """Bytes to hold for the graphs of `plan` when sizing the cache before they exist: GRAPH_BASE_BYTES, the shared
    output buffer (the largest batch's float32 logits), every graph's input buffers, and the working memory of the
    largest decode step, scaled from the profile step's (`step_bytes` over `step_tokens` tokens) with its own logits
    counted in full. (The runner measures what the captures took and logs both.)"""
    if not plan:
        return 0
    largest = max(size for size, _ in plan)
    inputs = sum(StepLayout(size, size, width, 0, size).i64_size * 8 + StepLayout(size, size, width, 0).i32_size * 4
                 for size, width in plan)
    working = step_bytes * largest // max(step_tokens, 1) + largest * vocab_size * 4
    return GRAPH_BASE_BYTES + largest * vocab_size * 4 + inputs + min(working, step_bytes)


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
        self.logits: torch.Tensor | None = None  # [batch_size, V] float32: the graph's rows of the shared output

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

    def capture(self, pool: tuple, stream: torch.cuda.Stream, out: torch.Tensor) -> None:
        """Warm up (Triton compiles this shape's variants) and record the step; its logits land in `out`'s first
        `batch_size` rows (the buffer every graph shares)."""
        self._upload(HostStep(), 0)  # all padding: the warm-up writes no KV and reads none
        current = torch.cuda.current_stream(self.runner.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        rows = out[:self.batch_size]
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            rows.copy_(self.forward())  # the forward's own logits are freed after capture, back to the pool
        self.graph, self.logits = graph, rows

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
        self.widths = context_widths(runner.block_size, runner.max_blocks_per_seq)
        self.min_width = self.widths[0]
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.failed: set[tuple[int, int]] = set()  # shapes whose capture failed: eager from then on
        # one memory pool, one capture stream and one output buffer for every graph, made at the first capture
        self.pool: tuple | None = None
        self.stream: torch.cuda.Stream | None = None
        self.out: torch.Tensor | None = None  # [largest bucket, V] float32
        self.captured_at_start = 0  # graphs `capture_all` captured

    def plan(self) -> list[tuple[int, int]]:
        """Every shape a decode step can take, in capture order (`capture_plan`)."""
        return capture_plan(self.buckets, self.widths)

    def capture_all(self, progress: Callable[[int, int, str], None] | None = None) -> int:
        """Capture every shape of the plan now (start-up), each announced as `progress(0, 0, message)` (a status line:
        the loading screen shows it as it is). Returns the number captured; a failed shape is logged and decodes
        eagerly (see `get`)."""
        plan = self.plan()
        for i, (batch_size, width) in enumerate(plan, 1):
            if progress is not None:
                progress(0, 0, capture_message(i, len(plan), batch_size, width * self.runner.block_size))
            self.get(batch_size, width)
        self.captured_at_start = len(self.graphs)
        return self.captured_at_start

    def shape_for(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(batch size, table width) of the graph that can run `batch`, or None: run it eagerly."""
        num_seqs = len(batch.seqs)
        if num_seqs > self.buckets[-1] or any(n != 1 for n in batch.num_new) or not all(batch.sample_mask()):
            return None
        blocks = max(-(-(seq.num_computed_tokens + 1) // self.runner.block_size) for seq in batch.seqs)
        width = next((w for w in self.widths if w >= blocks), None)
        if width is None:
            return None
        return next(b for b in self.buckets if b >= num_seqs), width

    def for_batch(self, batch: ScheduledBatch) -> DecodeGraph | None:
        """The graph that runs `batch` (captured at start-up; a shape start-up missed is captured now, on its first
        step); None: run it eagerly (not a pure decode step, too large, or a shape whose capture failed)."""
        shape = self.shape_for(batch)
        return None if shape is None else self.get(*shape)

    def get(self, batch_size: int, table_width: int) -> DecodeGraph | None:
        """The captured graph of this shape, captured now if it was not yet.

        A capture that fails is logged once and remembered: that shape decodes eagerly from then on (correct, only
        slower), and is never captured again."""
        key = (batch_size, table_width)
        graph = self.graphs.get(key)
        if graph is None and key not in self.failed:
            graph = DecodeGraph(self.runner, batch_size, table_width)
            try:
                if self.pool is None:
                    self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.runner.device)
                if self.out is None:
                    self.out = torch.empty((self.buckets[-1], self.runner.cfg.vocab_size), dtype=torch.float32,
                                           device=self.runner.device)
                graph.capture(self.pool, self.stream, self.out)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager decoding
                self.failed.add(key)
                log.warning("CUDA graph capture of a decode step of %d sequences (contexts up to %d tokens) failed: "
                            "%s: %s; steps of this shape run eagerly (engine option cuda_graphs=False turns graphs "
                            "off)", batch_size, graph.max_context, type(e).__name__, e)
                return None
            self.graphs[key] = graph
        return graph
