"""benchmarks/engine_contention.py's logic, never its timings (the figures are the benchmark's to report): only the
decode steps of the whole batch are compared; the gate holds every step until the batch is whole and the recorder
leaves the engine as it found it; the bare loop and the AsyncEngine decode the same steps; and a tiny run of the
whole script (the app, its API server, clients in a child process) stops by itself and prints its summary."""
from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engine_contention import (MEASURED_ID, Request, Run, StepRecord, StepRecorder, config_names, per_token,
                                          run_async, run_bare, same_requests)
from tsterm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 6


def record(start: float, length: float, seqs: int, tokens: int, cpu: tuple[float, float],
           runq: tuple[float, float] = (0.01, 0.01), decoding: int | None = None) -> StepRecord:
    return StepRecord(start, start + length, *cpu, *runq, seqs, tokens, seqs if decoding is None else decoding, 2)


def test_only_the_decode_steps_of_the_whole_batch_count():
    steps = [record(0.0, 0.5, 3, 90, (0.0, 0.5), (0.0, 0.0), decoding=0),  # the prompts' prefill
             record(0.5, 0.05, 3, 3, (0.5, 0.55), (0.0, 0.0), decoding=0),  # their last tokens (the rest: cached)
             record(0.6, 0.10, 3, 3, (0.6, 0.66), (0.0, 0.01)),  # 0.04 s off the CPU: 0.01 of it in the run queue
             record(0.72, 0.12, 3, 3, (0.68, 0.80)),
             record(0.86, 0.14, 3, 3, (0.81, 0.95)),  # the gap before it: 0.01 s blocked
             record(1.3, 0.05, 2, 2, (1.0, 1.05))]  # one request finished early: another batch
    figures = Run("x", 3, steps, None, None).figures()
    # two pairs of decode steps in a row, (0.6, 0.72) and (0.72, 0.86): means over their first steps and gaps
    assert figures["steps"] == 3 and figures["step"] == pytest.approx(0.11)
    assert figures["blocked"] == pytest.approx(0.015) and figures["runq"] == pytest.approx(0.005)
    assert figures["gap"] == pytest.approx(0.02) and figures["gap_blocked"] == pytest.approx(0.005)
    assert figures["gap_runq"] == pytest.approx(0)
    assert figures["cycle"] == pytest.approx(0.13) == figures["step"] + figures["gap"]
    assert figures["cycle_p50"] == pytest.approx(0.13) and figures["threads"] == 2 and "itl" not in figures
    assert Run("x", 3, steps, 0.2, 0.25).figures()["itl"] == 0.25  # the reader's, when there is one
    no_schedstat = [dataclasses.replace(r, runq_start=math.nan, runq_end=math.nan) for r in steps]
    lumped = Run("x", 3, no_schedstat, None, None).figures()  # all the off-CPU time, the run queue's too
    assert "runq" not in lumped and lumped["blocked"] == pytest.approx(0.02)
    assert Run("x", 3, steps, 0.2, None).figures()["itl"] == 0.2
    assert per_token([(1.0, 1), (1.5, 2), (3.0, 5)]) == pytest.approx(0.5) and per_token([(1.0, 1)]) is None
    with pytest.raises(RuntimeError, match="never formed"):
        Run("x", 4, steps, None, None).figures()
    with pytest.raises(RuntimeError, match="never formed"):  # one decode step: no cycle to measure
        Run("x", 3, steps[:3], None, None).figures()
    assert config_names(32) == ("bare 1", "async 1", "bare 33", "async 33", "loaded 33", "process 33")


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    return LLM("moe-demo", device="cpu", dtype="float32")


def requests(llm, n: int) -> list[Request]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    ids = [llm.engine.tokenizer.encode(f"{word}, said the king, and went") for word in ("Hark", "Lo", "Fie")]
    return [Request(tuple(ids[i]), params, MEASURED_ID if i == 0 else f"other-{i}") for i in range(n)]


def test_the_gate_holds_steps_until_the_batch_is_whole_and_the_engine_is_left_as_found(llm):
    engine = llm.engine
    first, second = requests(llm, 2)
    recorder = StepRecorder(engine, gate=2).install()
    try:
        engine.add_request(list(first.prompt_ids), first.params, first.request_id)
        assert engine.step() == [] and engine.step() == [] and recorder.steps == []  # held: one of two is in
        engine.add_request(list(second.prompt_ids), second.params, second.request_id)
        while engine.has_unfinished():
            engine.step()
    finally:
        recorder.remove()
    wrapped = {"step", "schedule", "_bench_step", "_bench_schedule"}
    assert not wrapped & {*vars(engine), *vars(engine.scheduler)}  # the class's own methods again, nothing left
    assert recorder.short == 0 and {s.seqs for s in recorder.steps} == {2}
    assert len(Run("x", 2, recorder.steps, None, None).decode_steps()) == TOKENS - 1
    assert [n for _, n in recorder.measured] == list(range(1, TOKENS + 1))  # every token of the measured request


def test_the_bare_loop_and_the_async_engine_decode_the_same_steps(llm):
    batch = requests(llm, 3)
    bare = run_bare(llm.engine, "bare 3", batch, timeout=120, threads=None)
    through = run_async(llm.engine, "async 3", batch, timeout=120, threads=None)
    assert not llm.engine.requests and "step" not in vars(llm.engine)
    for run in (bare, through):
        assert [(s.seqs, s.tokens) for s in run.decode_steps()] == [(3, 3)] * (TOKENS - 1)
        assert run.engine_itl is not None
    assert bare.stream_itl is None and through.stream_itl is not None  # the reader's own view of the stream
    renamed = [Request(r.prompt_ids, r.params, f"again-{i}") for i, r in enumerate(batch)]
    assert same_requests(batch, renamed[::-1]) and not same_requests(batch, renamed[:2])


def test_a_tiny_run_of_the_script_stops_by_itself_with_its_summary():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_contention.py"), "--profile", "moe-demo",
                           "--tokens", "4", "--clients", "2", "--rounds", "1", "--timeout", "120"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^CPU: .+; AVX-512: (yes|no); AMX: (yes|no).*; \d+ cores", out, re.M)
    rows = {m[1]: m for m in re.finditer(r"^(bare 1|async 1|bare 3|async 3|loaded 3|process 3) +(\d+) +(\d+) ", out,
                                         re.M)}
    assert sorted(rows) == sorted(config_names(2))
    assert {row[1]: int(row[2]) for row in rows.values()} == {"bare 1": 1, "async 1": 1, "bare 3": 3, "async 3": 3,
                                                              "loaded 3": 3, "process 3": 3}
    assert {int(row[3]) for row in rows.values()} == {3}  # every configuration decoded the same 3 steps
    assert "loaded: dashboard open" in out and re.search(r"^loss = cycle\(loaded 3\) / cycle\(bare 3\) - 1 = ", out,
                                                           re.M)
    # the engine core in its own process (the TUI's default), recorded inside the core
    assert re.search(r"^engine core in its own process: cycle\(process 3\) / cycle\(bare 3\) - 1 = ", out, re.M)
