"""The tool sandbox: paths confined to a workspace root, and subprocesses without a shell, with a timeout, an
output cap and a clean environment. Pure Python; the agent's tools (tools.py) are its only users."""
from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tsterm.errors import TstermError

# What a child sees of the environment: this and nothing else from os.environ (no tokens, keys or proxies).
CLEAN_PATH = "/usr/bin:/bin"
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
_READ_CHUNK = 64 * 1024


class SandboxError(TstermError, ValueError):
    """A path or command the sandbox refuses: the message names the path/argv and why."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """One finished subprocess. `output` is stdout and stderr interleaved, decoded as UTF-8 (bad bytes replaced)."""

    exit_code: int  # negative: killed by that signal (the sandbox's own SIGKILL on timeout or flood included)
    output: str
    truncated: bool  # output went past max_output_bytes: the rest was dropped and the process group killed
    duration_s: float
    timed_out: bool

    @property
    def error(self) -> str | None:
        """Why this run is a failure, in words; None when it exited 0 within its limits."""
        if self.timed_out:
            return f"timed out after {self.duration_s:.1f} s; the command and its children were killed"
        if self.truncated:
            return f"output exceeded {len(self.output.encode())} bytes; it was cut there and the command was killed"
        if self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:
                name = f"signal {-self.exit_code}"
            return f"killed by {name}"
        if self.exit_code != 0:
            return f"exited with status {self.exit_code}"
        return None


class Workspace:
    """A directory the agent's tools may read, write and run commands in, and nothing outside it.

    `resolve` is the only way a tool turns a user-given path into a real one. A symlink could be swapped between
    `resolve` and the open that follows; the sandbox guards against the model's paths, not against a concurrent
    local attacker with write access to the workspace.
    """

    def __init__(self, root: str | os.PathLike):
        path = Path(root)
        if not path.is_dir():
            raise SandboxError(f"workspace root {str(path)!r} is not a directory")
        self.root = path.resolve(strict=True)

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def resolve(self, path: str | os.PathLike, *, strict: bool = False) -> Path:
        """The real path (symlinks resolved) that a workspace-relative `path` names; refuse anything outside.

        strict=True also requires it to exist. Raises SandboxError naming `path`.
        """
        text = os.fspath(path)
        if not isinstance(text, str):
            raise SandboxError(f"path {text!r} must be text, not bytes")
        if "\x00" in text:
            raise SandboxError(f"path {text!r} contains a NUL byte")
        if os.path.isabs(text) or text.startswith("~"):
            raise SandboxError(f"path {text!r} is absolute; give a path relative to the workspace root")
        try:
            real = (self.root / text).resolve(strict=strict)
        except FileNotFoundError:
            raise SandboxError(f"path {text!r} does not exist in the workspace") from None
        except (RuntimeError, OSError) as err:  # RuntimeError: a symlink loop (Python < 3.13); ELOOP; ENAMETOOLONG
            raise SandboxError(f"path {text!r} cannot be resolved: {err}") from None
        if real != self.root and not real.is_relative_to(self.root):
            raise SandboxError(f"path {text!r} leaves the workspace (it resolves to {str(real)!r})")
        if not strict and _has_symlink_loop(real):
            raise SandboxError(f"path {text!r} cannot be resolved: a symlink loop")
        return real

    def relative(self, real: Path) -> str:
        """How a tool shows a resolved path to the model: relative to the root, '.' for the root."""
        return real.relative_to(self.root).as_posix() or "."

    def environment(self) -> dict[str, str]:
        return {"PATH": CLEAN_PATH, "HOME": str(self.root), "LANG": "C.UTF-8"}

    def run(self, argv: list[str], *, timeout_s: float, cwd: str = ".",
            max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> RunResult:
        """Run `argv` (no shell) in workspace-relative `cwd` and wait at most `timeout_s` for it.

        The child gets stdin from /dev/null, the clean environment and its own session, so a timeout or a flood
        kills its whole process group, grandchildren included. Output is read incrementally and at most
        max_output_bytes of it is kept. Raises SandboxError for a bad argv/cwd or a program that cannot start;
        everything the program itself does (exit status, signal, hang, flood) comes back in the RunResult.
        """
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise SandboxError(f"a command must be a non-empty list of strings, got {argv!r}")
        if any("\x00" in arg for arg in argv):
            raise SandboxError(f"command {argv!r} contains a NUL byte")
        workdir = self.resolve(cwd, strict=True)
        if not workdir.is_dir():
            raise SandboxError(f"working directory {cwd!r} is not a directory")
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=self.environment(), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True)
        except OSError as err:  # not found, not executable
            raise SandboxError(f"cannot run {argv[0]!r}: {err.strerror or err}") from None
        deadline = start + timeout_s
        try:
            kept, truncated, timed_out = _read_capped(proc, deadline, max_output_bytes)
            if not (truncated or timed_out):
                timed_out = not _wait_unreaped(proc.pid, deadline)  # EOF, but the program may still run
        finally:
            # The leader is not reaped yet, so its pid (= the group id) cannot have been reused: killing the group
            # hits only what this run started, including background children that outlived the leader.
            _kill_group(proc.pid)
            proc.stdout.close()
            exit_code = proc.wait()
        return RunResult(exit_code=exit_code, output=kept.decode("utf-8", errors="replace"), truncated=truncated,
                         duration_s=time.monotonic() - start, timed_out=timed_out)


def _has_symlink_loop(real: Path) -> bool:
    # resolve(strict=False) gives up silently on a loop in Python >= 3.13 and leaves the link in the result.
    try:
        real.stat()
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def _read_capped(proc: subprocess.Popen, deadline: float, max_bytes: int) -> tuple[bytes, bool, bool]:
    """Read the child's output until EOF, the deadline, or past max_bytes; never hold more than max_bytes+chunk."""
    kept = bytearray()
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept), False, True
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                return bytes(kept), False, False
            room = max_bytes - len(kept)
            kept += chunk[:room]
            if len(chunk) > room:
                return bytes(kept), True, False


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until `pid` exits or the deadline passes, leaving it a zombie (WNOWAIT). True if it exited."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
