"""The machine a benchmark ran on, as the scripts under benchmarks/ print it next to their figures (the CPU differs
between machines of the same kind: name it with every number)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def cpu_description() -> str:
    """lscpu's model name (else /proc/cpuinfo's), whether AVX-512 and AMX are there, and this process's cores."""
    model, flags = None, set()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name:")), None)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    avx512 = "yes" if "avx512f" in flags else "no"
    amx = "yes (" + ", ".join(sorted(f for f in flags if f.startswith("amx"))) + ")" if "amx_tile" in flags else "no"
    return (f"{model or 'unknown CPU'}; AVX-512: {avx512}; AMX: {amx}; "
            f"{len(os.sched_getaffinity(0))} cores for this process")
