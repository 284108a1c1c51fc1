"""The tool sandbox: paths confined to a workspace root, file opens that never follow a link, and commands run in a
sandboxed child - Linux namespaces (user, mount, PID, IPC, UTS, network), a fresh root with only the system
directories (read-only) and the workspace (read-write), rlimits, a clean environment, and the whole PID namespace
killed when the command ends, times out or floods. The agent's tools (tools.py, toolset.py) are its only users;
sandbox_init.py is the launcher that runs in the child.

What it does not guard against: a kernel exploit; what the system directories hold (they are readable); the CPU
and memory a command uses up to its limits; a concurrent local attacker with write access to the workspace."""
from __future__ import annotations

import errno
import functools
import marshal
import os
import selectors
import signal
import subprocess
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tsterm.errors import TstermError

# What a child sees of the environment: this and nothing else from os.environ (no tokens, keys or proxies).
CLEAN_PATH = "/usr/bin:/bin"
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
SANDBOX_MODES = ("namespaces", "none")
_READ_CHUNK = 64 * 1024
_LAUNCHER = str(Path(__file__).with_name("sandbox_init.py"))
_LAUNCHER_GRACE_S = 10.0
# Bound read-only into every sandbox (when they exist); the interpreter's own prefixes are added (see below).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_ENTRIES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                "/etc/nsswitch.conf", "/etc/mime.types")
_ETC_NETWORK = ("/etc/resolv.conf", "/etc/ssl", "/etc/ca-certificates", "/etc/pki", "/etc/gai.conf")
_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


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


@dataclass(frozen=True, slots=True)
class Limits:
    """The rlimits a sandboxed command runs under (each process of it; `processes` for them all)."""

    cpu_s: int = 600  # also bounded by the command's timeout
    address_space_bytes: int = 8 << 30
    processes: int = 256
    open_files: int = 1024
    file_size_bytes: int = 1 << 30
    tmp_bytes: int = 256 << 20  # the private /tmp (a tmpfs, in memory)

    def rlimits(self, timeout_s: float) -> dict[str, int]:
        return {"cpu_s": min(self.cpu_s, int(timeout_s) + 1), "address_space_bytes": self.address_space_bytes,
                "processes": self.processes, "open_files": self.open_files,
                "file_size_bytes": self.file_size_bytes, "core_bytes": 0}


@dataclass(frozen=True, slots=True)
class Isolation:
    """What detect_isolation found: the mechanism in use (None: none available, `reason` says why)."""

    mechanism: str | None
    reason: str = ""
    cgroup_base: str | None = None  # where per-run pids cgroups go when RLIMIT_NPROC cannot bind (we are root)
    process_bound: str = ""


@functools.lru_cache(maxsize=1)
def detect_isolation() -> Isolation:
    """Probe once per process whether a command can be sandboxed here: run `true` through the launcher."""
    if sys.platform != "linux":
        return Isolation(None, f"Linux namespaces are needed and this is {sys.platform}")
    cgroup_base, bound = None, "processes bounded by RLIMIT_NPROC"
    if os.geteuid() == 0:  # the kernel exempts the host's root from RLIMIT_NPROC: a pids cgroup bounds them instead
        cgroup_base = _cgroup_base()
        trial = _make_cgroup(cgroup_base, 1) if cgroup_base else None
        if trial is None:
            cgroup_base = None
        else:
            _remove_dir(trial)
        bound = ("processes bounded by a pids cgroup" if cgroup_base else
                 "processes NOT bounded (running as root without a writable pids cgroup)")
    mechanism = "Linux namespaces (user, mount, pid, ipc, uts, net) via unshare(2), rlimits"
    probe = Isolation(mechanism, cgroup_base=cgroup_base, process_bound=bound)
    with tempfile.TemporaryDirectory(prefix="tsterm-sandbox-probe-") as root:
        workspace = Workspace(root, isolation=probe)
        try:
            result = workspace.run(["true"], timeout_s=30)
        except SandboxError as err:
            return Isolation(None, str(err))
    if result.exit_code != 0:
        return Isolation(None, f"a probe command in the sandbox failed: {result.error}: {result.output[-300:]}")
    return probe


class Workspace:
    """A directory the agent's tools may read, write and run commands in, and nothing outside it.

    `resolve` is the only way a tool turns a user-given path into a real one, and `open_fd` the way it opens one:
    from the root, a component at a time, never following a link, so a link swapped in after `resolve` makes the
    open fail rather than lead out. `run` runs a command in the sandbox (see describe()). `sandbox` is the profile's
    agent.sandbox: "namespaces" (the default: write and command tools are refused where namespaces are
    unavailable) or "none" (commands run as plain subprocesses); `network` lets sandboxed commands use the host's
    network; `limits` are their rlimits. `isolation` overrides detection (the probe itself uses it).
    """

    def __init__(self, root: str | os.PathLike, *, sandbox: str = "namespaces", network: bool = False,
                 limits: Limits | None = None, isolation: Isolation | None = None):
        path = Path(root)
        if not path.is_dir():
            raise SandboxError(f"workspace root {str(path)!r} is not a directory")
        if sandbox not in SANDBOX_MODES:
            raise SandboxError(f"sandbox must be one of {list(SANDBOX_MODES)}, got {sandbox!r}")
        self.root = path.resolve(strict=True)
        self.sandbox, self.network, self.limits = sandbox, network, limits or Limits()
        self._isolation = isolation  # None: detect_isolation() decides, when first needed

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
            # where it leads is not said: the model learns no path of the host from a refusal
            raise SandboxError(f"path {text!r} leaves the workspace")
        if not strict and _has_symlink_loop(real):
            raise SandboxError(f"path {text!r} cannot be resolved: a symlink loop")
        return real

    def relative(self, real: Path) -> str:
        """How a tool shows a resolved path to the model: relative to the root, '.' for the root."""
        return real.relative_to(self.root).as_posix() or "."

    def environment(self) -> dict[str, str]:
        return {"PATH": CLEAN_PATH, "HOME": str(self.root), "LANG": "C.UTF-8"}

    # ---- confinement

    @property
    def isolation(self) -> Isolation:
        """How this workspace's commands are confined: detected once per process (see detect_isolation)."""
        if self.sandbox == "none":
            return Isolation(None, "agent.sandbox is 'none': commands run as plain subprocesses, unconfined")
        return self._isolation if self._isolation is not None else detect_isolation()

    def describe(self) -> str:
        """One line for the user: which sandbox is in use, or why write and command tools are refused."""
        isolation = self.isolation
        if isolation.mechanism is None:
            if self.sandbox == "none":
                return "sandbox: none (agent.sandbox: none) - commands run unconfined, as you"
            return f"sandbox: unavailable ({isolation.reason}) - write and command tools are refused"
        network = "network on" if self.network else "network off"
        return f"sandbox: {isolation.mechanism}; {network}; {isolation.process_bound}"

    def require_confinement(self, what: str) -> None:
        """Raise SandboxError naming `what` unless commands can be confined here or the profile opted out."""
        if self.sandbox == "none":
            return
        isolation = self.isolation
        if isolation.mechanism is None:
            raise SandboxError(f"{what} refused: the sandbox is unavailable ({isolation.reason}); set "
                               "'sandbox: none' in the profile's agent section to allow it unconfined")

    # ---- files, opened without following links

    def open_fd(self, real: Path, flags: int, mode: int = 0o644, *, make_parents: bool = False) -> int:
        """Open the resolved path `real` walking from the root one component at a time with O_NOFOLLOW, so a link
        that appeared after `resolve` cannot lead anywhere: it fails instead. Returns a file descriptor."""
        parts = real.relative_to(self.root).parts
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for index, part in enumerate(parts):
                last = index == len(parts) - 1
                if not last and make_parents:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    if last:
                        next_fd = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
                    else:
                        next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                          dir_fd=fd)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link_at(part, fd):
                        shown = "/".join(parts[:index + 1])
                        raise SandboxError(f"path {shown!r} became a symbolic link while it was opened") from None
                    raise
                os.close(fd)
                fd = next_fd
            if not parts:  # the root itself
                next_fd = os.open(".", flags | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = next_fd
            return fd
        except BaseException:
            os.close(fd)
            raise

    # ---- commands

    def run(self, argv: list[str], *, timeout_s: float, cwd: str = ".",
            max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> RunResult:
        """Run `argv` (no shell) in workspace-relative `cwd` and wait at most `timeout_s` for it.

        In the sandbox (see describe()) the program runs in its own namespaces: it sees the system directories
        read-only, the workspace read-write and nothing else; no network unless allowed; rlimits; the clean
        environment; stdin from /dev/null. When it exits, at the timeout or when its output floods, the whole PID
        namespace is killed (background, setsid and double-forked children included) before run() returns.
        With `sandbox: none` it runs as a plain subprocess in its own session, and the same events kill its process
        group. Output is read incrementally and at most max_output_bytes of it is kept. Raises SandboxError for a
        bad argv/cwd, a program that cannot start or an unavailable sandbox; everything the program itself does
        (exit status, signal, hang, flood) comes back in the RunResult.
        """
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise SandboxError(f"a command must be a non-empty list of strings, got {argv!r}")
        if any("\x00" in arg for arg in argv):
            raise SandboxError(f"command {argv!r} contains a NUL byte")
        workdir = self.resolve(cwd, strict=True)
        if not workdir.is_dir():
            raise SandboxError(f"working directory {cwd!r} is not a directory")
        self.require_confinement(f"running {argv[0]!r}")
        if self.sandbox == "none":
            return self._run_plain(argv, workdir, timeout_s, max_output_bytes)
        return self._run_confined(argv, workdir, timeout_s, max_output_bytes)

    def confined_command(self, argv: list[str], workdir: Path, env: dict[str, str]) -> tuple[list[str], object]:
        """The command line that runs `argv` in the sandbox with the stdio it is given, for a long-running program
        (an MCP server): no timeout but the CPU limit; killing the launcher's process group, or SIGTERM to the
        launcher, kills the namespace. Returns it and a cleanup to call once the launcher has exited."""
        launcher, newroot, cgroup = self._launcher(argv, workdir, env, float(self.limits.cpu_s), None)

        def cleanup() -> None:
            _remove_dir(newroot)
            if cgroup is not None:
                _remove_dir(cgroup)

        return launcher, cleanup

    def _launcher(self, argv: list[str], workdir: Path, env: dict[str, str], timeout_s: float,
                  status_fd: int | None) -> tuple[list[str], str, str | None]:
        """sandbox_init.py's command line for one run, the empty directory its new root is mounted on and its pids
        cgroup (None unless we are root): both are to be removed once the launcher has exited."""
        newroot = tempfile.mkdtemp(prefix="tsterm-sandbox-")
        cgroup_base = self.isolation.cgroup_base
        cgroup = _make_cgroup(cgroup_base, self.limits.processes) if cgroup_base else None
        config = {"status_fd": status_fd, "parent": os.getpid(), "cgroup": cgroup, "network": self.network,
                  "newroot": newroot, "workspace": str(self.root), "cwd": str(workdir), "argv": list(argv),
                  "env": dict(env), "limits": self.limits.rlimits(timeout_s), "tmp_bytes": self.limits.tmp_bytes,
                  "read_only": _read_only_paths(self.network, self.root), "etc": _etc_files(self.network)}
        return [sys.executable, "-I", "-S", _LAUNCHER, marshal.dumps(config).hex()], newroot, cgroup

    def _run_plain(self, argv: list[str], workdir: Path, timeout_s: float, max_output_bytes: int) -> RunResult:
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

    def _run_confined(self, argv: list[str], workdir: Path, timeout_s: float, max_output_bytes: int) -> RunResult:
        start = time.monotonic()
        deadline = start + timeout_s
        status_read, status_write = os.pipe()
        try:
            launcher, newroot, cgroup = self._launcher(argv, workdir, self.environment(), timeout_s, status_write)
        except BaseException:
            os.close(status_read)
            os.close(status_write)
            raise
        try:
            try:
                proc = subprocess.Popen(launcher, env=self.environment(), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                        close_fds=True, pass_fds=(status_write,))
            finally:
                os.close(status_write)
            try:
                kept, truncated, timed_out = _read_capped(proc, deadline, max_output_bytes)
                if not (truncated or timed_out):
                    timed_out = not _wait_unreaped(proc.pid, deadline)
            finally:
                # SIGTERM: the launcher SIGKILLs the namespace's init and exits once it is reaped, which is after
                # the kernel has killed everything else in the namespace. It is not reaped yet: the pid is ours.
                if proc.poll() is None:
                    _signal(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=_LAUNCHER_GRACE_S)
                except subprocess.TimeoutExpired:  # a launcher that never got as far as its handler
                    _kill_group(proc.pid)
                    proc.wait()
                proc.stdout.close()
            status = _read_all(status_read)
        finally:
            os.close(status_read)
            _remove_dir(newroot)
            if cgroup is not None:
                _remove_dir(cgroup)
        lines = status.splitlines()
        errors = [line[6:] for line in lines if line.startswith("error ")]
        if errors:
            raise SandboxError(errors[0])
        exits = [int(line[5:]) for line in lines if line.startswith("exit ")]
        output = kept.decode("utf-8", errors="replace")
        if exits:
            exit_code = os.waitstatus_to_exitcode(exits[0])
        elif timed_out or truncated:
            exit_code = -signal.SIGKILL
        else:
            raise SandboxError(f"the sandbox launcher failed (status {proc.returncode}): {output[-500:]}")
        return RunResult(exit_code=exit_code, output=output, truncated=truncated,
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
    try:
        pidfd = os.pidfd_open(pid)  # readable once the process has exited: no polling
    except (AttributeError, OSError):  # before Linux 5.3, or not Linux
        pidfd = None
    if pidfd is not None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(pidfd, selectors.EVENT_READ)
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    if selector.select(remaining):
                        return True
        finally:
            os.close(pidfd)
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


def _is_link_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read_all(fd: int) -> str:
    """What the launcher and its init wrote on the status pipe; they have exited, so it is all there."""
    os.set_blocking(fd, False)
    data = bytearray()
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", errors="replace")


def _remove_dir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _cgroup_base() -> str | None:
    """A pids-cgroup directory we may make per-run cgroups in: cgroup v1's pids hierarchy, or v2's root with the
    pids controller enabled for its children. None if there is none we may write."""
    for base in _CGROUP_ROOTS:
        if not (os.path.isdir(base) and os.access(base, os.W_OK)):
            continue
        if base.endswith("/pids") and os.path.exists(os.path.join(base, "cgroup.procs")):
            return base
        try:
            with open(os.path.join(base, "cgroup.subtree_control")) as file:
                if "pids" in file.read().split():
                    return base
        except OSError:
            continue
    return None


def _make_cgroup(base: str, processes: int) -> str | None:
    """A fresh pids cgroup under `base` holding at most `processes` tasks; None if it cannot be made."""
    try:
        path = tempfile.mkdtemp(prefix="tsterm-sandbox-", dir=base)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "pids.max"), "w") as file:
            file.write(str(processes))
    except OSError:
        _remove_dir(path)
        return None
    return path


def _read_only_paths(network: bool, root: Path) -> list[str]:
    """The host paths a sandbox sees read-only: system directories, a few /etc entries, and this interpreter's
    installation (so `python` and tools installed with it run), unless they are inside the workspace."""
    paths = [*_SYSTEM_DIRS, *_ETC_ENTRIES, *(_ETC_NETWORK if network else ())]
    for prefix in {sys.base_prefix, sys.prefix}:
        real = os.path.realpath(prefix)
        if not any(real == d or real.startswith(d + "/") for d in _SYSTEM_DIRS) \
                and not Path(real).is_relative_to(root) and real != "/":
            paths.append(real)
    return paths


def _etc_files(network: bool) -> dict[str, str]:
    """Files the sandbox's /etc gets in place of the host's: one user (root, mapped to the real user), no others."""
    files = {"passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n",
             "group": "root:x:0:\nnogroup:x:65534:\n", "hostname": "sandbox\n"}
    if not network:
        files["hosts"] = "127.0.0.1 localhost sandbox\n::1 localhost\n"
    return files
