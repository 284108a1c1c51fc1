"""Decode with the workstation's front-ends in the engine's process: does the engine step lose time to the GIL while
the TUI repaints at 4 Hz and 32 API clients stream, against the same batch stepped alone? (Issue 39: whether the
engine core should run in a process of its own, as vLLM v1's does.)

    python benchmarks/engine_contention.py [--profile default|moe-demo] [--tokens 64] [--clients 32] [--rounds 5]
                                           [--threads N] [--timeout 300]

Six configurations, each once per round and in turn (so the machine's drift hits them alike), after one warm-up
round that is not counted; each reports its median round:

  bare 1       engine.step() in a tight loop on a thread of its own: the measured request alone.
  async 1      the measured request alone through AsyncEngine (the engine thread), read on an event loop of its own:
               the quiet engine of the issue.
  bare 33      the measured request and the 32 clients' requests (their exact prompt ids and sampling parameters,
               captured from the server in the warm-up), engine.step() in a tight loop: no TUI, no HTTP, no JSON,
               nothing else on any thread. The fair baseline of the loaded case.
  async 33     the same 33 requests through AsyncEngine, all read on one event loop of the benchmark's: what the
               engine thread's own hand-off costs, with no front-end.
  loaded 33    the real Textual app (tsterm.tui.TstermApp, headless, 160 columns: its dashboard open and polling the
               engine every `ui.stats_interval`, 0.25 s = 4 Hz in the shipped profiles) with its API server on a
               127.0.0.1 port, in this process, on this engine; 32 clients (the official `openai` client, in a child
               process, as real clients are) each stream a chat completion through HTTP (chat template, SSE, JSON),
               and the measured request streams through the app's AsyncEngine.
  process 33   the same app, server and clients with the engine core in a process of its own (EngineCoreProcess,
               as the TUI and `tsterm serve` run it by default): the core loads the profile's model, steps behind
               the same gate and records its steps there (`recorded_core`); the app, its server and the measured
               request's reader use the core's client. What moving the core out wins back (or costs: a message per
               step, and the same cores) against `loaded 33`.

Every request is greedy (the profile's sampling with temperature 0), runs `--tokens` tokens (ignore_eos) and has its
own prompt (nothing shared through the prefix cache between requests). In the AsyncEngine cases a gate holds the
engine's steps until every request of the batch is in the engine, so each batch starts whole, whatever order and
pace its requests arrive in: the decode steps of the 33-request cases are then the same steps (33 sequences, one new
token each, the same contexts), and only those are compared. The step is timed from outside: the benchmark wraps
the engine's `step` (and its scheduler's `schedule`, to see each batch's shape) on the engine instance.

What "loss" means. Per decode step of the full batch, on the engine thread:
  step      wall time of engine.step() (schedule, inputs, forward, sampling, detokenising, outputs);
  gap       from the end of one step to the start of the next: the AsyncEngine hand-off (one call_soon_threadsafe per
            output), the commands queued meanwhile (adds, the dashboard's stats polls), and waiting for the GIL;
  cycle     step + gap: the pace at which the engine produces tokens (the run's mean; its median beside it);
  ITL       the measured request's inter-token latency as its reader sees it (first token to last, per token);
  blocked   of a step's (or a gap's) wall time, what the engine thread spent neither on a CPU nor waiting for one
            (time.thread_time() and /proc/thread-self/schedstat's run-queue wait): waiting for the GIL, for its
            OpenMP workers at a barrier, or for I/O;
  run q     what it spent runnable but waiting for a core: the front-ends' CPU work competes for the cores even
            without the GIL, and a process of their own would not change that on the same machine.
With more than one torch thread, a worker that waits for a core keeps the engine thread waiting at the barrier,
which counts as blocked: `--threads 1` (the engine on one core, the front-ends free to use the other) makes blocked
time nearly all GIL; run it beside the default to see how much of the loss is the GIL and how much the cores.
Without --threads the thread governor sizes each step as users get it, and it counts the clients' process as a
neighbour: the `thr` column shows when the loaded case ran on fewer threads than the bare one (not a GIL effect).
The loss is the GIL-attributable slowdown of the engine's decode pace, the same 33-request batch with the front-ends
in the process against without: median cycle (loaded 33) / median cycle (bare 33) - 1; issue 39's threshold is 5%.
The cycle, not the step alone, because the engine thread can lose the GIL between steps as well as in them: each
output it hands to an event loop (call_soon_threadsafe writes to that loop's wake-up pipe, a system call that
releases the GIL), like each torch op in the step, is a point where a busy front-end thread may take the GIL and keep
it for up to a switch interval (sys.getswitchinterval(), 5 ms) before the engine thread has it back. The lines
under it split the loss: inside the step (step against step), between steps (gap), the engine's own hand-off with no
front-end (async 33 against bare 33: an engine-core process pays its own version of it, one message per step), and
what the front-ends add on top (loaded 33 against async 33: what a core process of its own would win back).
Detokenising stays on the engine thread in every case (it is part of Engine.step here).

Prints the CPU (model, AVX-512, AMX, the cores this process may use) with the figures. Everything listens on
127.0.0.1 only, every wait is bounded by --timeout, and the run stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tsterm.bench.machine import cpu_description

MEASURED_ID = "bench-measured"
TOPICS = ["Lighthouses", "Volcanoes", "Honeybees", "Glaciers", "Typewriters", "Kites", "Saltwater", "Owls",
          "Bicycles", "Lanterns", "Orchards", "Submarines", "Quartz", "Windmills", "Penguins", "Telescopes",
          "Marmalade", "Canyons", "Harbours", "Fireflies", "Zeppelins", "Meadows", "Anchors", "Dunes",
          "Origami", "Thunder", "Walnuts", "Igloos", "Yachts", "Xylophones", "Emeralds", "Nebulae"]
MEASURED_PROMPT = "Tell me about rivers: where they start, and where they end."
SIZE = (160, 50)  # the app's size: from 150 columns its dashboard opens by itself (ui.dashboard: auto)


def client_prompt(i: int) -> str:
    """Client i's message: a different first word for each, so no two prompts share a KV block."""
    return f"{TOPICS[i % len(TOPICS)]} ({i}), please: tell me about them."


# ---- timing the engine's steps from outside -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    start: float  # perf_counter at the call
    end: float
    cpu_start: float  # the engine thread's time.thread_time() at the call
    cpu_end: float
    runq_start: float  # the time it has spent runnable but waiting for a core (schedstat; NaN where there is none)
    runq_end: float
    seqs: int  # sequences in the batch
    tokens: int  # tokens the batch computed
    decoding: int  # sequences in it that had sampled a token before (not a prompt's last chunk)
    threads: int  # torch's thread count after the step (the governor sets it per step)


class StepRecorder:
    """Wraps one engine's `step` and its scheduler's `schedule` (instance attributes, removed by `remove`) for one
    configuration: each step's wall and thread-CPU times, its batch shape and thread count, and when each token of the
    measured request came out of the engine. The engine thread's CPU time is time.thread_time(), its run-queue wait
    /proc/thread-self/schedstat's second field (opened on that thread; no run-queue split where the kernel has no
    schedstat): the rest of a step's wall time the thread was blocked (the GIL, its OpenMP workers, I/O), not
    waiting for a core. With `gate`, no step runs until that many requests are in the engine
    (the engine thread goes back to its commands meanwhile); past `gate_timeout` seconds the gate opens anyway and
    `short` says how many were missing. `threads`: run every step on that many threads (the governor off)."""

    def __init__(self, engine: Any, gate: int = 0, gate_timeout: float = 300.0, threads: int | None = None):
        self.engine, self.gate, self.threads = engine, gate, threads
        self.gate_deadline = time.monotonic() + gate_timeout
        self.steps: list[StepRecord] = []
        self.measured: list[tuple[float, int]] = []  # (step end, tokens the measured request has by then)
        self.opened_at: float | None = None if gate else time.perf_counter()
        self.short = 0
        self._shape: tuple[int, int, int] | None = None
        self._saved: dict[tuple[Any, str], Any] = {}
        self._governor = None
        self._schedstat: dict[int, int] = {}  # thread id -> its schedstat file (-1: none)

    def install(self) -> StepRecorder:
        self._wrap(self.engine, "step", self._step)
        self._wrap(self.engine.scheduler, "schedule", self._schedule)
        if self.threads is not None and hasattr(self.engine.executor, "cpu_threads"):
            self._governor, self.engine.executor.cpu_threads = self.engine.executor.cpu_threads, None
        return self

    def remove(self) -> None:
        for (obj, name), previous in self._saved.items():
            delattr(obj, f"_bench_{name}")
            if previous is None:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        self._saved.clear()
        for fd in self._schedstat.values():
            if fd >= 0:
                os.close(fd)
        self._schedstat.clear()
        if self._governor is not None:
            self.engine.executor.cpu_threads, self._governor = self._governor, None

    def _wrap(self, obj: Any, name: str, wrapper: Callable[[], Any]) -> None:
        self._saved[(obj, name)] = vars(obj).get(name)
        setattr(obj, f"_bench_{name}", getattr(obj, name))
        setattr(obj, name, wrapper)

    def _clocks(self) -> tuple[float, float]:
        """(CPU time, run-queue wait) of the calling thread, in seconds (the wait NaN without schedstat)."""
        ident = threading.get_ident()
        fd = self._schedstat.get(ident)
        if fd is None:
            try:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                fd = -1
            self._schedstat[ident] = fd
        runq = math.nan
        if fd >= 0:
            with contextlib.suppress(OSError, ValueError, IndexError):
                runq = int(os.pread(fd, 128, 0).split()[1]) / 1e9
        # CPU time from the clock, not schedstat's first field: for a running thread that one lags by up to a tick
        return time.thread_time(), runq

    def _schedule(self) -> Any:
        batch = self.engine.scheduler._bench_schedule()
        self._shape = None if batch is None else (len(batch.seqs), batch.num_tokens,
                                                  sum(1 for seq in batch.seqs if seq.num_output_tokens))
        return batch

    def _step(self) -> list:
        if self.opened_at is None:
            waiting = len(self.engine.requests)
            if waiting < self.gate and time.monotonic() < self.gate_deadline:
                time.sleep(0.002)  # not a wait for anything: the AsyncEngine loop takes its next command
                return []
            self.short, self.opened_at = max(0, self.gate - waiting), time.perf_counter()
        if self.threads is not None:
            import torch

            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
        self._shape = None
        (cpu0, runq0), t0 = self._clocks(), time.perf_counter()
        outputs = self.engine._bench_step()
        t1, (cpu1, runq1) = time.perf_counter(), self._clocks()
        if self._shape is not None:
            import torch

            self.steps.append(StepRecord(t0, t1, cpu0, cpu1, runq0, runq1, *self._shape,
                                         threads=torch.get_num_threads()))
        for out in outputs:
            if out.request_id == MEASURED_ID and out.outputs:
                self.measured.append((t1, len(out.outputs[0].token_ids)))
        return outputs


# ---- what one run of one configuration gives -----------------------------------------------------------------------


def per_token(times: list[tuple[float, int]]) -> float | None:
    """Seconds per token from the first output to the last: (t_last - t_first) / (tokens_last - tokens_first)."""
    if len(times) < 2 or times[-1][1] <= times[0][1]:
        return None
    return (times[-1][0] - times[0][0]) / (times[-1][1] - times[0][1])


@dataclass
class Run:
    """One configuration's run: its decode steps of the full batch and what the measured request's reader saw."""

    config: str
    batch: int
    steps: list[StepRecord]
    engine_itl: float | None  # seconds per token of the measured request, at the engine (step ends)
    stream_itl: float | None  # ... as its reader saw it (None for the bare loops: the loop is the reader)
    extra: dict[str, Any] = field(default_factory=dict)

    def is_decode(self, step: StepRecord) -> bool:
        """A step that decodes one token for each of the batch's sequences: no prompt in it (a prompt served
        whole from the prefix cache but its last token has the same shape, hence `decoding`)."""
        return step.seqs == step.tokens == step.decoding == self.batch

    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if self.is_decode(s)]

    def pairs(self) -> list[tuple[StepRecord, StepRecord]]:
        """Consecutive decode steps (the gap and the cycle are measured between them)."""
        return [(a, b) for a, b in zip(self.steps, self.steps[1:]) if self.is_decode(a) and self.is_decode(b)]

    def figures(self) -> dict[str, float]:
        """Over consecutive decode steps of the full batch (seconds): the mean step and gap after it, each split into
        the time the engine thread was blocked and the time it waited for a core, their sum the cycle (means add
        up, and the mean is the pace: a repaint that hits one step in forty moves the mean, not the median), and
        the cycle's median; the measured request's ITL; the median thread count; how many decode steps there
        were. Without schedstat, `blocked` holds all the off-CPU time and there is no `runq`."""
        pairs = self.pairs()
        if not pairs:
            raise RuntimeError(f"{self.config}: no two steps in a row decoded the whole batch of {self.batch} (it "
                               "never formed: too little KV cache room, or requests that never arrived)")
        mean = statistics.fmean
        has_runq = not any(math.isnan(a.runq_start) or math.isnan(b.runq_start) for a, b in pairs)

        def split(t0: float, t1: float, cpu0: float, cpu1: float, runq0: float, runq1: float) -> tuple[float, float]:
            runq = runq1 - runq0 if has_runq else 0.0
            return max(0.0, (t1 - t0) - (cpu1 - cpu0) - runq), runq

        steps = [split(a.start, a.end, a.cpu_start, a.cpu_end, a.runq_start, a.runq_end) for a, _ in pairs]
        gaps = [split(a.end, b.start, a.cpu_end, b.cpu_start, a.runq_end, b.runq_start) for a, b in pairs]
        out = {"step": mean(a.end - a.start for a, _ in pairs), "blocked": mean(b for b, _ in steps),
               "gap": mean(b.start - a.end for a, b in pairs), "gap_blocked": mean(b for b, _ in gaps),
               "cycle": mean(b.start - a.start for a, b in pairs),
               "cycle_p50": statistics.median(b.start - a.start for a, b in pairs),
               "threads": statistics.median(a.threads for a, _ in pairs), "steps": len(self.decode_steps())}
        if has_runq:
            out["runq"], out["gap_runq"] = mean(r for _, r in steps), mean(r for _, r in gaps)
        itl = self.stream_itl if self.stream_itl is not None else self.engine_itl
        if itl is not None:
            out["itl"] = itl
        return out


# ---- running things on threads of their own, with a bound -----------------------------------------------------------


def on_own_thread(fn: Callable[[], Any], timeout: float, name: str) -> Any:
    """Run `fn` on a new thread that ends with it and return its result (or raise its error). Torch's OpenMP pool
    belongs to the thread that starts a parallel region, for that thread's life: a thread per configuration (as the
    AsyncEngine's own) leaves no pool behind next to the next one's (tsterm/tui/engine_host.py)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{name}: not done within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    params: Any  # SamplingParams
    request_id: str


def run_bare(engine: Any, config: str, requests: list[Request], timeout: float, threads: int | None) -> Run:
    recorder = StepRecorder(engine, threads=threads).install()

    def loop() -> None:
        deadline = time.monotonic() + timeout
        for r in requests:
            engine.add_request(list(r.prompt_ids), r.params, r.request_id)
        while engine.has_unfinished():
            if time.monotonic() > deadline:
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                raise TimeoutError(f"{config}: not done within {timeout:g} s")
            engine.step()

    try:
        on_own_thread(loop, timeout + 30, f"bench-{config.replace(' ', '-')}")
    finally:
        recorder.remove()
    return Run(config, len(requests), recorder.steps, per_token(recorder.measured), None)


def read_streams(aengine: Any, requests: list[Request], timeout: float) -> list[tuple[float, int]]:
    """Stream every request through `aengine` on an event loop of its own (a thread); returns when and how many
    tokens the measured request's reader had at each of its outputs."""
    from time import perf_counter

    seen: list[tuple[float, int]] = []

    async def one(r: Request) -> None:
        async for out in aengine.generate(list(r.prompt_ids), r.params, request_id=r.request_id):
            if r.request_id == MEASURED_ID:
                seen.append((perf_counter(), len(out.outputs[0].token_ids)))

    async def every() -> None:
        await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout)

    on_own_thread(lambda: asyncio.run(every()), timeout + 30, "bench-reader")
    return seen


def run_async(engine: Any, config: str, requests: list[Request], timeout: float, threads: int | None) -> Run:
    from tsterm.engine.async_engine import AsyncEngine

    recorder = StepRecorder(engine, gate=len(requests), gate_timeout=timeout, threads=threads).install()
    aengine = AsyncEngine(engine, output_timeout=timeout)
    try:
        seen = read_streams(aengine, requests, timeout)
    finally:
        aengine.shutdown()
        recorder.remove()
    return Run(config, len(requests), recorder.steps, per_token(recorder.measured), per_token(seen))


# ---- the loaded case: the app, its server, and clients in a child process -------------------------------------------


def client_worker() -> None:
    """The child process's side: `--client-worker` reads its orders (JSON) on stdin, streams one chat completion per
    prompt concurrently through the official `openai` client, and prints what each saw (JSON) on stdout."""
    import openai

    spec = json.loads(sys.stdin.read())

    async def one(client: openai.AsyncOpenAI, content: str) -> dict[str, Any]:
        chunks: list[float] = []
        stream = await client.chat.completions.create(
            model=spec["model"], messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=spec["tokens"], stream=True, extra_body={"ignore_eos": True})
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    chunks.append(time.perf_counter())
                finish = choice.finish_reason or finish
        return {"chunks": len(chunks), "finish": finish,
                "itl": (chunks[-1] - chunks[0]) / (len(chunks) - 1) if len(chunks) > 1 else None}

    async def every() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=spec["url"], api_key=spec["api_key"] or "unused", max_retries=0,
                                    timeout=spec["timeout"])
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in spec["prompts"]),
                                                         return_exceptions=True), spec["timeout"])

    try:
        results = asyncio.run(every())
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
        results = [e]
    print(json.dumps([r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"} for r in results]))


def recorded_core(model_dir: str, options: dict[str, Any], gate: int, timeout: float, threads: int | None,
                  records: str, progress: Callable[..., None]) -> Any:
    """What the engine core process of the `process` configuration builds (pickled there by name: this module is
    imported as `engine_contention` from the sys.path the front sends): the profile's engine with a StepRecorder
    gated on the batch, whose records are written to `records` (pickle) when the core shuts the engine down."""
    import pickle

    from tsterm.launch import build_engine

    engine = build_engine(model_dir, options, progress)
    recorder = StepRecorder(engine, gate=gate, gate_timeout=timeout, threads=threads).install()
    shutdown = engine.shutdown

    def write_then_shut_down() -> None:
        with open(records, "wb") as f:
            pickle.dump({"steps": [dataclasses.astuple(r) for r in recorder.steps], "measured": recorder.measured,
                         "short": recorder.short}, f)
        shutdown()
    engine.shutdown = write_then_shut_down
    return engine


async def run_loaded(llm: Any, profile: str, measured: Request, clients: int, tokens: int, timeout: float,
                     threads: int | None, in_process: bool = True) -> tuple[Run, list[Request]]:
    """The app with its server on this engine, the clients in a child process, the measured request through the
    app's AsyncEngine. Returns the run and the requests the server added for the clients (their prompt ids and
    sampling parameters as the server made them). `in_process` False: the app's engine core runs in a process of
    its own (EngineCoreProcess, loading the profile's model there), recorded there (`recorded_core`); no requests
    are captured then (the same server renders the same prompts)."""
    import pickle

    from tsterm.tui import TstermApp
    from tsterm.tui.widgets.dashboard import Dashboard

    engine = llm.engine
    added: list[Request] = []
    add_request = engine.add_request

    def capture(prompt: Any, params: Any = None, request_id: str | None = None, **kw: Any) -> str:
        rid = add_request(prompt, params, request_id, **kw)
        added.append(Request(tuple(engine.requests[rid].prompt_token_ids), params, rid))
        return rid

    data_dir = Path(tempfile.mkdtemp(prefix="tsterm-contention-"))
    old_data_dir = os.environ.get("TSTERM_DATA_DIR")
    os.environ["TSTERM_DATA_DIR"] = str(data_dir)  # the app's sessions, history, ...: nothing in the user's own
    records = data_dir / "core-records.pickle"
    if in_process:
        recorder = StepRecorder(engine, gate=clients + 1, gate_timeout=timeout, threads=threads).install()
        engine.add_request = capture
        factory: Callable[..., Any] = lambda: llm  # noqa: E731
    else:
        import engine_contention  # this file by its module name, so that the core unpickles `recorded_core`

        from tsterm.engine.core_process import EngineCoreProcess
        from tsterm.launch import engine_options
        from tsterm.profiles import load_profile

        model_dir, options = engine_options(load_profile(profile))
        build = functools.partial(engine_contention.recorded_core, model_dir, options, clients + 1, timeout, threads,
                                  str(records))
        factory = lambda progress: EngineCoreProcess(build, progress, output_timeout=timeout)  # noqa: E731
    deadline = time.monotonic() + timeout
    proc = None
    try:
        app = TstermApp(profile, engine_factory=factory, sessions_dir=data_dir / "sessions",
                        serve={"host": "127.0.0.1", "port": 0})
        async with app.run_test(size=SIZE) as pilot:
            while not (app.api_server is not None and app.screen.query(Dashboard)):
                if time.monotonic() > deadline or app.loading is not None and app.loading.error:
                    raise RuntimeError(f"loaded: the app or its API server did not start "
                                       f"({app.loading.error if app.loading is not None else 'timed out'})")
                await pilot.pause(0.05)
            dashboard, server = app.screen.query_one(Dashboard), app.api_server
            polls: list[float] = []  # when the dashboard took each poll of the engine's counters
            update_stats = dashboard.update_stats

            def counted(*args: Any, **kwargs: Any) -> Any:
                polls.append(time.perf_counter())
                return update_stats(*args, **kwargs)
            dashboard.update_stats = counted
            orders = {"url": server.url, "model": server.model_name, "api_key": server.options.api_key,
                      "tokens": tokens, "timeout": timeout, "prompts": [client_prompt(i) for i in range(clients)]}
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client-worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            talk = asyncio.ensure_future(asyncio.to_thread(proc.communicate, json.dumps(orders), timeout + 30))
            seen = await asyncio.to_thread(read_streams, app.host.async_engine, [measured], timeout)
            stdout, stderr = await talk
            dashboard_open = dashboard.display and dashboard.region.width > 0
            interval = app.host.ui.stats_interval
        # the app has exited: an engine core of its own has shut down and written its records
        if not in_process:
            with open(records, "rb") as f:
                written = pickle.load(f)
            recorder = SimpleNamespace(steps=[StepRecord(*r) for r in written["steps"]],
                                       measured=written["measured"], short=written["short"])
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if in_process:
            recorder.remove()
        if "add_request" in vars(engine):
            del engine.add_request
        if old_data_dir is None:
            os.environ.pop("TSTERM_DATA_DIR", None)
        else:
            os.environ["TSTERM_DATA_DIR"] = old_data_dir
        shutil.rmtree(data_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"loaded: the client process failed ({proc.returncode}): {stderr.strip()[-2000:]}")
    results = json.loads(stdout)
    errors = [r["error"] for r in results if "error" in r]
    if errors or len(results) != clients:
        raise RuntimeError(f"loaded: {len(errors)} of {clients} clients failed: {errors[:3]}")
    if recorder.short:
        raise RuntimeError(f"loaded: {recorder.short} of {clients + 1} requests had not arrived after {timeout:g} s")
    name = f"{'loaded' if in_process else 'process'} {clients + 1}"
    run = Run(name, clients + 1, recorder.steps, per_token(recorder.measured), per_token(seen))
    decode = run.decode_steps()
    window = (decode[0].start, decode[-1].end) if decode else (0.0, 0.0)
    in_window = [t for t in polls if window[0] <= t <= window[1]]
    extra = {"dashboard_open": dashboard_open, "stats_interval": interval,
             "dashboard_hz": len(in_window) / (window[1] - window[0]) if window[1] > window[0] else None,
             "client_itl": statistics.median(r["itl"] for r in results if r["itl"] is not None)
             if any(r["itl"] is not None for r in results) else None,
             "client_chunks": statistics.median(r["chunks"] for r in results)}
    run.extra = extra
    return run, [r for r in added if r.request_id != MEASURED_ID]


# ---- the whole measurement ----------------------------------------------------------------------------------------


def same_requests(a: list[Request], b: list[Request]) -> bool:
    """The same prompts and sampling parameters (request ids aside), in any order."""
    def key(r: Request) -> str:
        return repr((r.prompt_ids, dataclasses.asdict(r.params)))
    return sorted(map(key, a)) == sorted(map(key, b))


def config_names(clients: int) -> tuple[str, ...]:
    n = clients + 1
    return ("bare 1", "async 1", f"bare {n}", f"async {n}", f"loaded {n}", f"process {n}")


def measure(args: argparse.Namespace) -> dict[str, list[Run]]:
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile(args.profile)
    llm = on_own_thread(lambda: load_llm(profile), args.timeout, "bench-load")
    engine = llm.engine
    try:
        tokenizer = engine.tokenizer
        params = dataclasses.replace(profile.sampling_params(), temperature=0.0, max_tokens=args.tokens,
                                     ignore_eos=True, n=1, logprobs=None)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": MEASURED_PROMPT}],
                                               add_generation_prompt=True, tokenize=True)
        measured = Request(tuple(prompt), params, MEASURED_ID)
        names = config_names(args.clients)
        captured: list[Request] | None = None
        runs: dict[str, list[Run]] = {name: [] for name in names}
        for round_ in range(args.rounds + 1):  # round 0: the warm-up, not counted (and the clients' capture)
            for name in (names[-2], *names[:-2], names[-1]) if round_ == 0 else names:
                if name.startswith("process"):
                    run, _ = asyncio.run(run_loaded(llm, args.profile, measured, args.clients, args.tokens,
                                                    args.timeout, args.threads, in_process=False))
                elif name.startswith("loaded"):
                    run, added = asyncio.run(run_loaded(llm, args.profile, measured, args.clients, args.tokens,
                                                        args.timeout, args.threads))
                    if captured is None:
                        captured = added
                        if any(r.params != params for r in captured):
                            raise RuntimeError("the server sampled the clients' requests with other parameters than "
                                               f"the measured request's: {captured[0].params} vs {params}")
                    elif not same_requests(added, captured):
                        raise RuntimeError("the clients' requests differ from the warm-up's: the batches would not "
                                           "be the same")
                else:
                    batch = [measured] if name.endswith(" 1") else [measured] + [
                        Request(r.prompt_ids, r.params, f"bench-{i}") for i, r in enumerate(captured)]
                    runner = run_bare if name.startswith("bare") else run_async
                    run = runner(engine, name, batch, args.timeout, args.threads)
                if engine.has_unfinished() or engine.requests:
                    raise RuntimeError(f"{name}: requests left in the engine after the run")
                figures = run.figures()
                print(f"  round {round_}{' (warm-up)' if round_ == 0 else ''} {name:<10} "
                      + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in figures.items()
                                  if k not in ("threads", "steps"))
                      + f"  ({figures['steps']} decode steps, {figures['threads']:g} threads)", flush=True)
                if round_ > 0:
                    runs[name].append(run)
        return runs
    finally:
        engine.shutdown()


def report(runs: dict[str, list[Run]], args: argparse.Namespace, cpu: str) -> None:
    names = list(runs)
    bare1, async1, bare_n, async_n, loaded, process = names
    med: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        figures = [r.figures() for r in rs]
        med[name] = {k: statistics.median(f[k] for f in figures) for k in figures[0]
                     if all(k in f for f in figures)}
    print()
    print(f"CPU: {cpu}")
    print(f"profile {args.profile}: {args.clients} streaming API clients + the measured request, {args.tokens} tokens "
          f"each, greedy; per decode step of the full batch, the run's mean (ms), median of {args.rounds} round(s) "
          "after a warm-up")
    print("  step = blocked (the GIL, OpenMP workers, I/O) + run queue (waiting for a core) + on the CPU; the same "
          "for the gap after it; cycle = step + gap")
    columns = [("step", "step"), ("blocked", "blocked"), ("runq", "run q"), ("gap", "gap"),
               ("gap_blocked", "blocked"), ("gap_runq", "run q"), ("cycle", "cycle"), ("cycle_p50", "cycle p50"),
               ("itl", "ITL")]
    print(f"{'config':<11}{'batch':>6}{'steps':>6}{'thr':>4}" + "".join(f"{label:>10}" for _, label in columns)
          + "   cycle by round")
    for name in names:
        m, rs = med[name], runs[name]
        cells = "".join(f"{m[k] * 1e3:10.2f}" if k in m else f"{'-':>10}" for k, _ in columns)
        rounds = " ".join(f"{r.figures().get('cycle', float('nan')) * 1e3:.1f}" for r in rs)
        print(f"{name:<11}{rs[0].batch:>6}{m['steps']:>6.0f}{m['threads']:>4.0f}{cells}   {rounds}")

    def ratio(a: str, b: str, key: str, key_b: str | None = None) -> float:
        return med[a][key] / med[b][key_b or key]

    loaded_run = runs[loaded][-1].extra
    hz = statistics.median(r.extra["dashboard_hz"] for r in runs[loaded] if r.extra["dashboard_hz"] is not None) \
        if any(r.extra["dashboard_hz"] is not None for r in runs[loaded]) else float("nan")
    itls = [r.extra["client_itl"] for r in runs[loaded] if r.extra["client_itl"] is not None]
    client_itl = statistics.median(itls) if itls else float("nan")
    print(f"loaded: dashboard {'open' if loaded_run['dashboard_open'] else 'CLOSED'}, polling every "
          f"{loaded_run['stats_interval']:g} s; it refreshed {hz:.1f} times/s while the batch decoded; the HTTP "
          f"clients saw {client_itl * 1e3:.2f} ms per SSE chunk (median client)")
    loss = ratio(loaded, bare_n, "cycle") - 1
    verdict = "over" if loss > 0.05 else "within"
    print(f"loss = cycle({loaded}) / cycle({bare_n}) - 1 = {loss * 100:+.1f}%: {verdict} issue 39's 5%")
    print(f"  inside the step: step({loaded}) / step({bare_n}) - 1 = {(ratio(loaded, bare_n, 'step') - 1) * 100:+.1f}%"
          f"; between steps: gap {med[loaded]['gap'] * 1e3:.2f} ms against {med[bare_n]['gap'] * 1e3:.2f} ms")

    def waits(name: str) -> str:
        m = med[name]
        blocked = (m["blocked"] + m["gap_blocked"]) * 1e3
        if "runq" not in m:
            return f"{blocked:.2f} ms off the CPU (no schedstat here to split the GIL from the cores)"
        return f"{blocked:.2f} ms blocked, {(m['runq'] + m['gap_runq']) * 1e3:.2f} ms waiting for a core"
    print(f"  the engine thread per cycle: {waits(loaded)} loaded; {waits(bare_n)} bare. A process of its own "
          "would take the front-ends off the GIL, not off the cores")
    def blocked(name: str) -> float:
        return med[name]["blocked"] + med[name]["gap_blocked"]
    added = blocked(loaded) - blocked(bare_n)
    print(f"  blocked time the front-ends add per cycle: {added * 1e3:+.2f} ms = "
          f"{added / med[bare_n]['cycle'] * 100:+.1f}% of the bare cycle (the GIL's part of the loss; nearly all of "
          "blocked is the GIL with one torch thread)")
    if "runq" in med[bare_n]:
        busy = (med[bare_n]["runq"] + med[bare_n]["gap_runq"]) / med[bare_n]["cycle"]
        if busy > 0.1:
            print(f"  NOTE: even bare, the engine thread waited for a core {busy * 100:.0f}% of its cycle: other "
                  "processes were using the cores, and the loss above is mostly their noise; rerun on a quiet machine")
    print(f"  the engine's own hand-off, no front-end: cycle({async_n}) / cycle({bare_n}) - 1 = "
          f"{(ratio(async_n, bare_n, 'cycle') - 1) * 100:+.1f}%; the front-ends over it: cycle({loaded}) / "
          f"cycle({async_n}) - 1 = {(ratio(loaded, async_n, 'cycle') - 1) * 100:+.1f}%")
    print(f"  what the measured stream sees: ITL({loaded}) / ITL({bare_n}) = {ratio(loaded, bare_n, 'itl'):.3f}, "
          f"ITL({async_n}) / ITL({bare_n}) = {ratio(async_n, bare_n, 'itl'):.3f}")
    process_loss = ratio(process, bare_n, "cycle") - 1
    print(f"engine core in its own process: cycle({process}) / cycle({bare_n}) - 1 = {process_loss * 100:+.1f}% "
          f"(in the front's process: {loss * 100:+.1f}%); blocked time over bare per cycle "
          f"{(blocked(process) - blocked(bare_n)) * 1e3:+.2f} ms = "
          f"{(blocked(process) - blocked(bare_n)) / med[bare_n]['cycle'] * 100:+.1f}%; what the measured stream "
          f"sees: ITL({process}) / ITL({bare_n}) = {ratio(process, bare_n, 'itl'):.3f}, ITL({process}) / "
          f"ITL({loaded}) = {ratio(process, loaded, 'itl'):.3f}")
    print(f"quiet engine (batch 1): ITL({async1}) / ITL({bare1}) = {ratio(async1, bare1, 'itl'):.3f}; the loaded "
          f"stream against the quiet one: ITL({loaded}) / ITL({async1}) = {ratio(loaded, async1, 'itl'):.2f} "
          f"(batch {runs[loaded][0].batch} against 1: not a measure of contention)")


def main() -> None:
    if sys.argv[1:] == ["--client-worker"]:
        client_worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="default", help="a shipped profile or a path (default: default; "
                        "moe-demo for a quick run)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--clients", type=int, default=32, help="streaming API clients beside the measured request")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (one warm-up round runs first)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every step (default: the "
                        "thread governor, as users get)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one configuration may take")
    args = parser.parse_args()
    if not 1 <= args.clients <= len(TOPICS) * 4 or args.tokens < 3 or args.rounds < 1:
        parser.error("--clients 1..128, --tokens >= 3, --rounds >= 1")
    cpu = cpu_description()
    print(f"CPU: {cpu}", flush=True)
    runs = measure(args)
    report(runs, args, cpu)


if __name__ == "__main__":
    main()
