"""The CPU thread governor (`tsterm.engine.cpu_threads`): a step runs on the cores other processes leave free.

Unit tests drive it with a fake /proc and clock; the last test runs a real busy process beside a real engine and
waits (by steps, not by time) until the governor has stepped down, with the outputs unchanged."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tsterm.engine.cpu_threads import CpuThreads

HZ = os.sysconf("SC_CLK_TCK")


class FakeProc:
    """/proc/stat (per-cpu jiffies) and /proc/self/stat (this process's utime, stime) that a test advances."""

    def __init__(self, root, cpus):
        self.root, self.cpus = root, sorted(cpus)
        (root / "self").mkdir()
        self.busy = {c: 0 for c in self.cpus}
        self.idle = {c: 0 for c in self.cpus}
        self.own = 0
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for c in self.cpus:  # user nice system idle iowait irq softirq steal guest guest_nice
            lines.append(f"cpu{c} {self.busy[c]} 0 0 {self.idle[c]} 0 0 0 0 0 0")
        (self.root / "stat").write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")
        (self.root / "self" / "stat").write_text(f"42 (python (x)) R 1 1 1 0 -1 0 0 0 0 0 {self.own} 0 0 0 20 0 2\n")

    def advance(self, seconds, own_cores, other_cores):
        """`seconds` pass; this process keeps `own_cores` busy, others `other_cores` (spread over the cpus)."""
        total = own_cores + other_cores
        for i, c in enumerate(self.cpus):
            share = min(1.0, max(0.0, total - i))
            self.busy[c] += int(share * seconds * HZ)
            self.idle[c] += int((1 - share) * seconds * HZ)
        self.own += int(own_cores * seconds * HZ)
        self.write()


@pytest.fixture
def governed(tmp_path):
    now = [0.0]
    calls = []
    gov = CpuThreads(max_threads=2, interval_s=0.2, proc=tmp_path, clock=lambda: now[0], set_threads=calls.append)
    gov.cpus = {0, 1}  # as if this process may run on two cores, whatever the test machine has
    gov.max_threads = gov.threads = 2
    calls.clear()  # the constructor's own setting (torch's count may be what an earlier engine left)
    return gov, FakeProc(tmp_path, gov.cpus), now, calls


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(governed):
    gov, proc, now, calls = governed
    assert gov.before_step() == 2  # the first look only reads
    for own, other, want in [(2.0, 0.0, 2), (1.3, 0.7, 1), (1.0, 1.0, 1), (1.0, 0.02, 2), (1.95, 0.05, 2)]:
        now[0] += 1.0
        proc.advance(1.0, own, other)
        assert gov.before_step() == want, (own, other)
    assert calls == [1, 2]  # set only when the count changes
    assert gov.changes == 2


def test_it_looks_at_most_once_per_interval(governed):
    gov, proc, now, calls = governed
    gov.before_step()
    now[0] += 0.05
    proc.advance(0.05, 1.0, 1.0)
    assert gov.before_step() == 2 and calls == []  # too soon: no read, no change
    now[0] += 0.3
    proc.advance(0.3, 1.0, 1.0)
    assert gov.before_step() == 1


def test_never_more_than_it_started_with_nor_less_than_one(governed):
    gov, proc, now, calls = governed
    gov.max_threads = gov.threads = 1  # OMP_NUM_THREADS=1: the user's cap stands on an idle machine
    gov.before_step()
    now[0] += 1.0
    proc.advance(1.0, 1.0, 0.0)
    assert gov.before_step() == 1
    gov.max_threads = 2
    now[0] += 1.0
    proc.advance(1.0, 0.0, 2.0)  # others keep both cores busy: still one thread
    assert gov.before_step() == 1


def test_its_ceiling_is_the_processs_setting_not_what_an_earlier_engine_left(tmp_path, monkeypatch):
    """A governor lowers torch's (process-wide) count; the next engine's ceiling must not inherit that."""
    sys_cpu = tmp_path / "sys"
    for cpu, core in ((0, 0), (1, 0), (2, 1), (3, 1)):  # two cores with two hyper-threads each
        (sys_cpu / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (sys_cpu / f"cpu{cpu}" / "topology" / "physical_package_id").write_text("0\n")
        (sys_cpu / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{core}\n")
    from tsterm.engine.cpu_threads import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads({0, 1, 2, 3}, sys_cpu) == 2
    assert default_threads({0, 1}, sys_cpu) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads({0, 1, 2, 3}, sys_cpu) == 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as an earlier engine's governor may have left it
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        gov = CpuThreads(proc=tmp_path / "missing")
        assert gov.max_threads == min(2, len(os.sched_getaffinity(0))) == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_without_proc_it_keeps_its_count(tmp_path):
    calls = []
    gov = CpuThreads(max_threads=2, proc=tmp_path / "missing", set_threads=calls.append)
    calls.clear()
    assert gov.before_step() == gov.threads == gov.max_threads
    assert calls == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to step down from")
def test_an_engine_beside_a_busy_process_steps_down_with_the_same_outputs(tmp_path_factory):
    from tests.helpers.checkpoints import make_checkpoint
    from tsterm.config import SamplingParams
    from tsterm.llm import LLM

    path, _ = make_checkpoint(tmp_path_factory.mktemp("threads") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, max_position_embeddings=512))
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    governor = llm.engine.executor.cpu_threads
    governor.interval_s = 0.0  # look before every step
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = [[5, 6, 7, 8, 9] * 4]
    quiet = llm.generate(prompt, params)[0].outputs[0]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(200):  # steps until the governor has seen the busy core (the first read only primes it)
            llm.generate([[11, 12]], SamplingParams(temperature=0, max_tokens=1))
            if governor.threads == governor.max_threads - 1:
                break
        assert governor.threads == governor.max_threads - 1
        assert llm.stats()["cpu_threads"] == governor.threads
        loaded = llm.generate(prompt, params)[0].outputs[0]
    finally:
        busy.kill()
        busy.wait()
    assert (loaded.token_ids, loaded.logprobs) == (quiet.token_ids, quiet.logprobs)
