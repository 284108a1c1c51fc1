"""How many threads a CPU step runs on: the cores this process may use, less what other processes keep busy.

Why: torch's and the C kernels' OpenMP threads (one libgomp) meet at a barrier between every op of a step, a few
hundred times per decoded token. When another process takes one of two cores, the thread that loses its core
stalls every barrier for a scheduler time slice: decode fell from ~0.05 s to 0.56-1.39 s a token (issue 31), while
one thread alone kept its pace. So before a step, at most every `interval_s`, the governor reads the CPU time the
cores of this process's affinity set spent busy since its last look (/proc/stat) and the CPU time this process
used (/proc/self/stat); the difference is what the others used, and the step runs on the cores they leave, never
fewer than one nor more than the process's own setting (OMP_NUM_THREADS, else one thread per physical core it may
use, torch's default; not torch's current count, which another engine's governor may have lowered).
When the others go quiet, the count rises again. The outputs do not change with it: the CPU kernels give the same
bits at any thread count (README "Same answer whatever the cache or the batch").
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

# A core counts as taken by others once they kept it this busy over the last interval: a busy loop reads ~1.0, the
# noise of an idle desktop a few hundredths.
TAKEN = 0.5


def _ticks_busy_per_cpu(stat_text: str, cpus: set[int]) -> int:
    """Busy jiffies (all but idle and iowait) summed over `cpus`, from /proc/stat."""
    busy = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        busy += sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy


def default_threads(cpus: set[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """OMP_NUM_THREADS when set, else the physical cores among `cpus` (hyper-threads of one core count once)."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
    except (KeyError, ValueError):
        pass
    cores = set()
    for cpu in cpus:
        try:
            topology = sys_cpu / f"cpu{cpu}" / "topology"
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def _ticks_of_process(stat_text: str) -> int:
    """utime + stime of /proc/<pid>/stat (fields 14 and 15; the name in parentheses may hold spaces)."""
    fields = stat_text.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


class CpuThreads:
    """Sets torch's (and so the C kernels') thread count before each CPU step to the cores others leave free."""

    def __init__(self, max_threads: int | None = None, interval_s: float = 0.2, proc: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] = torch.set_num_threads):
        self.cpus = os.sched_getaffinity(0)
        self.max_threads = max(1, min(max_threads or default_threads(self.cpus), len(self.cpus)))
        self.threads = self.max_threads
        self.interval_s, self.proc, self.clock, self.set_threads = interval_s, proc, clock, set_threads
        if torch.get_num_threads() != self.threads:  # from the process's setting, whatever an earlier engine left
            set_threads(self.threads)
        self._last: tuple[float, int, int] | None = None  # (time, busy ticks of the cpus, this process's ticks)
        self.changes = 0  # how often the count changed (stats, tests)

    def _read(self) -> tuple[int, int] | None:
        try:
            return (_ticks_busy_per_cpu((self.proc / "stat").read_text(), self.cpus),
                    _ticks_of_process((self.proc / "self" / "stat").read_text()))
        except (OSError, ValueError, IndexError):  # no /proc (not Linux) or a format we do not know: stay as we are
            return None

    def before_step(self) -> int:
        """The thread count for the next step (changed at most once per interval)."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.threads
        reading = self._read()
        if reading is None:
            return self.threads
        if self._last is not None:
            then, busy_then, own_then = self._last
            elapsed_ticks = (now - then) * os.sysconf("SC_CLK_TCK")
            others = max(0, (reading[0] - busy_then) - (reading[1] - own_then)) / max(elapsed_ticks, 1e-9)
            taken = int(others + (1 - TAKEN))  # cores the others keep busy, each counted from TAKEN of one
            threads = max(1, min(self.max_threads, len(self.cpus) - taken))
            if threads != self.threads:
                self.threads = threads
                self.changes += 1
                self.set_threads(threads)
        self._last = (now, *reading)
        return self.threads
