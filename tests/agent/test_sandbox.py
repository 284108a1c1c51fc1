"""The sandbox: paths that leave the workspace are refused; commands that hang, flood, crash or snoop are contained."""
from __future__ import annotations

import os
import resource
import select
import time
from pathlib import Path

import pytest

from tsterm.agent.sandbox import SandboxError, Workspace


@pytest.fixture
def outside(tmp_path):
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("top secret\n")
    return path


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("hello\n")
    return Workspace(root)


def _exits(pid: int, within_s: float) -> bool:
    """Whether process `pid` ends within `within_s` (a pidfd turns readable as it ends); a hang guard, not a pace."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within_s)[0])
    finally:
        os.close(fd)


# ---- paths

def test_paths_inside_resolve_to_real_paths(ws):
    assert ws.resolve("sub/a.txt") == ws.root / "sub" / "a.txt"
    assert ws.resolve(".") == ws.root
    assert ws.resolve("sub/../sub/a.txt", strict=True) == ws.root / "sub" / "a.txt"
    assert ws.resolve("new/file.txt") == ws.root / "new" / "file.txt"  # not strict: may not exist yet
    os.symlink("sub/a.txt", ws.root / "inner_link")
    assert ws.resolve("inner_link") == ws.root / "sub" / "a.txt"  # a symlink that stays inside is fine


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "sub/../../outside", "sub/../../ws/../outside"])
def test_dotdot_escapes_are_refused(ws, outside, path):
    with pytest.raises(SandboxError, match="leaves the workspace") as err:
        ws.resolve(path)
    assert repr(path) in str(err.value)


def test_absolute_and_home_paths_are_refused(ws, outside):
    for path in [str(outside / "secret.txt"), str(ws.root / "sub" / "a.txt"), "/etc/passwd", "~/x"]:
        with pytest.raises(SandboxError, match="absolute"):
            ws.resolve(path)


def test_nul_bytes_are_refused(ws):
    with pytest.raises(SandboxError, match="NUL"):
        ws.resolve("sub/a.txt\x00.png")


def test_symlink_to_a_file_outside_is_refused(ws, outside):
    os.symlink(outside / "secret.txt", ws.root / "leak.txt")
    with pytest.raises(SandboxError, match="'leak.txt' leaves the workspace"):
        ws.resolve("leak.txt")


def test_symlink_to_a_directory_outside_is_refused_and_so_is_everything_through_it(ws, outside):
    os.symlink(outside, ws.root / "sub" / "door")
    for path in ["sub/door", "sub/door/secret.txt", "sub/door/new.txt"]:
        with pytest.raises(SandboxError, match="leaves the workspace"):
            ws.resolve(path)


def test_dotdot_after_a_symlinked_dir_follows_the_link_and_is_refused(ws, outside, tmp_path):
    # 'deep' points to outside/deeper, so 'deep/../secret.txt' is outside/secret.txt for the kernel, even though
    # the text alone ('deep/..') would stay in the root.
    (outside / "deeper").mkdir()
    os.symlink(outside / "deeper", ws.root / "deep")
    with pytest.raises(SandboxError, match="leaves the workspace"):
        ws.resolve("deep/../secret.txt")


def test_symlink_loops_are_refused(ws):
    os.symlink("loop_b", ws.root / "loop_a")
    os.symlink("loop_a", ws.root / "loop_b")
    os.symlink("self", ws.root / "self")
    for path in ["loop_a", "self", "self/x"]:
        with pytest.raises(SandboxError, match="cannot be resolved|leaves|loop"):
            ws.resolve(path)


def test_a_workspace_root_must_be_a_directory(tmp_path):
    with pytest.raises(SandboxError, match="not a directory"):
        Workspace(tmp_path / "missing")


# ---- commands (each in both modes: the namespace sandbox, and `sandbox: none`'s plain subprocess)

@pytest.fixture(params=["namespaces", "none"])
def cmd_ws(request, tmp_path):
    root = tmp_path / "cmd_ws"
    (root / "sub").mkdir(parents=True)
    return Workspace(root, sandbox=request.param)


def test_a_command_runs_without_a_shell_in_its_working_directory(cmd_ws):
    ws = cmd_ws
    result = ws.run(["echo", "$HOME", ";", "ls"], timeout_s=5)
    assert (result.exit_code, result.output, result.error) == (0, "$HOME ; ls\n", None)
    assert ws.run(["pwd"], timeout_s=5, cwd="sub").output == f"{ws.root / 'sub'}\n"
    with pytest.raises(SandboxError, match="leaves the workspace"):
        ws.run(["pwd"], timeout_s=5, cwd="..")
    with pytest.raises(SandboxError, match="cannot run 'no-such-program'"):
        ws.run(["no-such-program"], timeout_s=5)


def test_the_child_sees_a_clean_environment(cmd_ws, monkeypatch):
    monkeypatch.setenv("TSTERM_TEST_SECRET", "hunter2")
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent.so")
    result = cmd_ws.run(["env"], timeout_s=5)
    env = dict(line.split("=", 1) for line in result.output.splitlines())
    assert "hunter2" not in result.output
    assert env == {"PATH": "/usr/bin:/bin", "HOME": str(cmd_ws.root), "LANG": "C.UTF-8"}


def test_stdin_is_closed(cmd_ws):
    # Give this process a stdin that never ends (as a terminal would be): an inheriting `cat` would hang on it.
    read_end, write_end = os.pipe()
    saved_stdin = os.dup(0)
    os.dup2(read_end, 0)
    try:
        result = cmd_ws.run(["cat"], timeout_s=1.0)
    finally:
        os.dup2(saved_stdin, 0)
        for fd in (saved_stdin, read_end, write_end):
            os.close(fd)
    assert (result.exit_code, result.output, result.timed_out) == (0, "", False)


def test_a_hanging_plain_command_is_killed_with_its_whole_process_group(tmp_path):
    # (the namespace sandbox's version, setsid and double forks included: test_sandbox_escapes.py)
    ws = Workspace(tmp_path, sandbox="none")
    pidfile = ws.root / "pids"
    start = time.monotonic()
    result = ws.run(["sh", "-c", f"sleep 100 & echo $! > {pidfile}; sleep 100"], timeout_s=1.0)
    assert time.monotonic() - start < 3
    assert result.timed_out and "timed out" in result.error
    grandchild = int(pidfile.read_text())
    # SIGKILL is sent at once; the process ends when it next runs: wait for that, not for `sleep 100` to end
    assert _exits(grandchild, within_s=60), "the backgrounded grandchild outlived the timeout"


def test_a_background_child_holding_the_pipe_does_not_keep_the_run_alive(cmd_ws):
    # The shell exits at once but its child keeps stdout open. Plain: the run ends at the timeout, not in 100 s.
    # In the sandbox the command's exit ends its PID namespace, the child with it: the run ends at once.
    result = cmd_ws.run(["sh", "-c", "sleep 100 &"], timeout_s=1.0)
    if cmd_ws.sandbox == "none":
        assert result.timed_out and result.duration_s < 3
    else:
        assert (result.exit_code, result.timed_out, result.error) == (0, False, None)


def test_a_flood_is_capped_and_killed_without_filling_memory(cmd_ws):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = cmd_ws.run(["yes"], timeout_s=10, max_output_bytes=100_000)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert result.truncated and not result.timed_out and "exceeded 100000 bytes" in result.error
    assert len(result.output) == 100_000 and result.output.startswith("y\ny\n")
    assert result.duration_s < 5 and grown_kib < 50_000  # `yes` writes GB/s: unread, it would be gigabytes


def test_output_under_the_cap_is_whole(cmd_ws):
    result = cmd_ws.run(["sh", "-c", "echo out; echo err >&2"], timeout_s=5, max_output_bytes=100)
    assert (result.output, result.truncated) == ("out\nerr\n", False)


def test_crashes_and_failures_are_results_not_exceptions(cmd_ws):
    failed = cmd_ws.run(["sh", "-c", "echo oops; exit 3"], timeout_s=5)
    assert (failed.exit_code, failed.output, failed.error) == (3, "oops\n", "exited with status 3")
    crashed = cmd_ws.run(["sh", "-c", "kill -SEGV $$"], timeout_s=5)
    assert crashed.exit_code == -11 and crashed.error == "killed by SIGSEGV"


# ---- where namespaces are forbidden

FORBIDDEN = """
import json, sys
from tsterm.agent.sandbox import detect_isolation
from tsterm.agent.toolset import build_toolset
from tsterm.profiles import AgentSettings
with build_toolset(AgentSettings(allow_write=True, allow_commands=True), sys.argv[1]) as toolset:
    tools = {tool.name: tool for tool in toolset.tools}
    print(json.dumps({"sandbox": toolset.sandbox, "reason": detect_isolation().reason,
                      "write": tools["write_file"].call({"path": "a.txt", "content": "x"}).error,
                      "run": tools["run_command"].call({"argv": ["true"]}).error,
                      "read": tools["read_file"].call({"path": "notes.txt"}).content}))
"""


def test_a_kernel_that_forbids_user_namespaces_refuses_write_and_command_tools(tmp_path):
    # A real refusal, not a mock: this test's process runs in a user namespace (util-linux's unshare) whose
    # user.max_user_namespaces is 0, so the sandbox's own unshare(2) fails there, as in a locked-down container.
    import json
    import subprocess
    import sys

    (tmp_path / "notes.txt").write_text("still readable\n")
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1" "$2"'
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, sys.executable, FORBIDDEN,
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert "user.max_user_namespaces" in seen["reason"]
    assert seen["sandbox"] == f"sandbox: unavailable ({seen['reason']}) - write and command tools are refused"
    for error, what in [(seen["write"], "write_file"), (seen["run"], "running 'true'")]:
        assert error.startswith(f"{what} refused: the sandbox is unavailable") and "sandbox: none" in error
    assert seen["read"] == "still readable\n" and not (tmp_path / "a.txt").exists()
