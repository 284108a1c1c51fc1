"""Per-command overhead of the agent's tool sandbox: one short command run sandboxed (Linux namespaces, a fresh root,
rlimits; tsterm/agent/sandbox.py) and as a plain subprocess (`agent.sandbox: none`), in the same run.

    python benchmarks/sandbox_overhead.py [--runs 50] [--rounds 3] [--command "python3 -c pass"]

Each round runs the command --runs times each way, alternating, so the machine's drift hits both alike; every
configuration reports the median per-command wall time of its median round, and the ratio. Both ways go through
Workspace.run (a clean environment, output capture, the process-group or namespace kill at the end), so the
difference is what the sandbox adds: the launcher's interpreter start, unshare(2), the mounts and pivot_root, the
namespace's init and, as root, the per-run pids cgroup. Prints the CPU model and the mechanism first.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import time

from tsterm.agent.sandbox import Workspace, detect_isolation

from tsterm.bench.machine import cpu_description


def per_command_s(workspace: Workspace, argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = workspace.run(argv, timeout_s=30)
        times.append(time.perf_counter() - start)
        if result.error is not None:
            raise SystemExit(f"{argv} failed ({workspace.sandbox}): {result.error}: {result.output[-300:]}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="commands per configuration per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--command", default="true", help="the command to run, split like a shell (default: true)")
    args = parser.parse_args()
    args.command = shlex.split(args.command)
    isolation = detect_isolation()
    print(f"CPU: {cpu_description()}")
    if isolation.mechanism is None:
        raise SystemExit(f"no sandbox here: {isolation.reason}")
    with tempfile.TemporaryDirectory(prefix="tsterm-sandbox-bench-") as root:
        sandboxed, plain = Workspace(root), Workspace(root, sandbox="none")
        print(sandboxed.describe())
        per_command_s(sandboxed, args.command, 3)  # warm the page cache for both
        per_command_s(plain, args.command, 3)
        rounds: dict[str, list[float]] = {"sandboxed": [], "plain": []}
        for _ in range(args.rounds):
            rounds["sandboxed"].append(per_command_s(sandboxed, args.command, args.runs))
            rounds["plain"].append(per_command_s(plain, args.command, args.runs))
    box, bare = statistics.median(rounds["sandboxed"]), statistics.median(rounds["plain"])
    print(f"command: {' '.join(args.command)}; {args.rounds} rounds x {args.runs} runs each way")
    print(f"{'configuration':<12} {'per command (ms)':>17}")
    print(f"{'plain':<12} {bare * 1e3:>17.2f}")
    print(f"{'sandboxed':<12} {box * 1e3:>17.2f}")
    print(f"overhead: +{(box - bare) * 1e3:.2f} ms per command, {box / bare:.1f}x")


if __name__ == "__main__":
    main()
