"""How cpu_select times the candidates of a shape class: on one thread (a kernel on several threads waits at its
barriers for a thread that lost its core to another process), by the thread's CPU clock, interleaved rounds, each
candidate's fastest call. A fake clock advanced by the calls themselves stands for the CPU time they take."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, cpu_select
from tsterm_kernels.cpu_select import CpuInfo, ShapeClass

ZEN4 = CpuInfo("x86_64", "AMD Ryzen 9 7950X", frozenset({"avx", "avx2", "fma", "f16c", "avx512f"}))
GEMM = ShapeClass("gemm", (576, 576))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Calls:
    """Candidates whose calls take scripted seconds on a fake clock; each call's name and thread count recorded."""

    def __init__(self, seconds: dict[str, list[float]]):
        self.seconds = {name: list(times) for name, times in seconds.items()}
        self.now, self.log = 0.0, []

    def clock(self) -> float:
        return self.now

    def runs(self) -> dict:
        def run(name):
            def call():
                self.log.append((name, torch.get_num_threads()))
                self.now += self.seconds[name].pop(0)
            return call
        return {name: run(name) for name in self.seconds}


def test_measure_keeps_each_candidates_fastest_call_of_interleaved_rounds_on_one_thread(two_threads):
    # warm calls first (not counted: their 0.001 s would otherwise be the minimum), then rounds in turn
    calls = Calls({"c-avx512": [0.001, 3.0, 1.0, 2.0, 9.0], "c-avx2": [0.001, 2.5, 4.0, 1.5, 9.0]})
    best = cpu_select.measure(calls.runs(), seconds_per_candidate=4.0, clock=calls.clock)
    assert best == {"c-avx512": 1.0, "c-avx2": 1.5}
    # 3 rounds (at least 3; 14 s spent > 4 s x 2 candidates after them), each candidate once a round, in turn
    assert [name for name, _ in calls.log] == ["c-avx512", "c-avx2"] * 4
    assert {threads for _, threads in calls.log} == {1}  # every call on one thread
    assert torch.get_num_threads() == 2  # restored


def test_measure_goes_on_until_each_candidate_had_its_time_or_the_rounds_run_out(two_threads):
    calls = Calls({"a": [0.0] + [0.5] * 10, "b": [0.0] + [0.25] * 10})
    # 0.75 s a round: past 2 x 2 s after the 6th round
    assert cpu_select.measure(calls.runs(), 2.0, clock=calls.clock) == {"a": 0.5, "b": 0.25}
    assert len(calls.log) == 2 * (1 + 6)
    calls = Calls({"a": [0.0] * 6})
    assert cpu_select.measure(calls.runs(), 1.0, max_rounds=5, clock=calls.clock) == {"a": 0.0}
    assert len(calls.log) == 1 + 5


def test_choose_runs_the_timer_on_one_thread_and_restores_the_count(two_threads):
    seen = []

    def timer(shape, candidates):
        seen.append(torch.get_num_threads())
        return {"c-avx512": 1.0, "c-avx2": 2.0, "torch": 0.5}

    candidates = cpu_select.available(ZEN4, {"native": cpu_native.ISA_AVX512, "avx2": 0})
    choice = cpu_select.choose(GEMM, candidates, timer)
    assert choice.candidate == "c-avx512" and seen == [1] and torch.get_num_threads() == 2

    def failing(shape, candidates):
        raise RuntimeError("the kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        cpu_select.choose(GEMM, candidates, failing)
    assert torch.get_num_threads() == 2  # restored on a failure too
