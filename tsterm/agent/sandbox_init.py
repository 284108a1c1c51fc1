"""The sandbox's launcher, run by sandbox.py as `python -I -S sandbox_init.py CONFIG` for every command (CONFIG: a
dict in marshal's format, as hex; the same interpreter writes and reads it).

Standard library only (it runs without site-packages), and only modules that load fast: it runs once per command.
It joins the run's pids cgroup (when given), makes new user, mount, PID, IPC, UTS and (network off) network
namespaces with unshare(2) and maps our uid to root in them, then forks the namespace's init (PID 1). The init
builds a fresh root on a tmpfs - the system directories bound read-only, a private /tmp, /dev and /proc, the
workspace bound read-write, nothing else of the host (the user's home included) - pivots into it, and forks the
command with rlimits, a clean environment and default signal dispositions. The init reaps everything and exits
when the command exits; the kernel then kills whatever else is left in the namespace, so backgrounded, setsid()-ed
and double-forked children die with it.

SIGTERM to this launcher means "kill the namespace now": it SIGKILLs the init and exits once the init is reaped,
which happens only after every process of the namespace is gone. Its parent's death SIGKILLs it (PR_SET_PDEATHSIG),
and its death SIGKILLs the init the same way.

The init tells the parent what happened on the status pipe (config "status_fd"; None: errors go to stderr), one
line each:
`exit <wait status>` when the command ended, `error <text>` when the sandbox could not be set up or the program
could not be started.
"""
import ctypes
import errno
import fcntl
import marshal
import os
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217,
                  "armv7l": 218, "armv8l": 218, "i686": 217, "i386": 217}
# statvfs flags -> the mount flags a bind remount must keep (the kernel locks them on mounts from another user ns)
LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
DEVICES = ("null", "zero", "full", "random", "urandom")
LIMITS = {"cpu_s": resource.RLIMIT_CPU, "address_space_bytes": resource.RLIMIT_AS,
          "processes": resource.RLIMIT_NPROC, "open_files": resource.RLIMIT_NOFILE,
          "file_size_bytes": resource.RLIMIT_FSIZE, "core_bytes": resource.RLIMIT_CORE}

UNSHARE_HINTS = {
    errno.EPERM: " (unprivileged user namespaces are disabled here: kernel.unprivileged_userns_clone, "
                 "kernel.apparmor_restrict_unprivileged_userns, or a container's seccomp policy)",
    errno.ENOSPC: " (no user namespace may be made here: user.max_user_namespaces is reached or 0)",
    errno.EINVAL: " (this kernel lacks the namespaces the sandbox needs)",
    errno.EUSERS: " (user namespaces are nested too deeply)",
}

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda text: None if text is None else text.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source or ''} on {target}")


def write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def report(fd: int | None, kind: str, text: str) -> None:
    """A line on the status pipe; without one (a long-running server's launcher: config status_fd None), an error
    goes to stderr, where whoever started it reads why it did not start."""
    if fd is not None:
        os.write(fd, f"{kind} {text}\n".encode())
    elif kind == "error":
        os.write(2, f"sandbox: {text}\n".encode())


def touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def bind(source: str, target: str, *, read_only: bool) -> None:
    """Bind `source` at `target` (made here: a directory or an empty file), read-only if asked."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        touch(target)
    try:
        mount(source, target, None, MS_BIND)
    except SetupError:  # a mount with locked submounts may be bound only with them
        mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        flags = os.statvfs(source).f_flag
        keep = sum(ms for st, ms in LOCKED_FLAGS if flags & st)
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)


def build_root(cfg: dict) -> None:
    new = cfg["newroot"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    os.makedirs(new + "/proc")
    try:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        pass  # a container that masks parts of the host's /proc forbids a new one: commands get no /proc
    os.makedirs(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, f"{new}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    os.makedirs(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    for path in cfg["read_only"]:
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin: the same link
            os.symlink(os.readlink(path), new + path)
        elif os.path.exists(path):
            bind(os.path.realpath(path), new + path, read_only=True)
    os.makedirs(new + "/etc", exist_ok=True)
    for name, text in cfg["etc"].items():
        with open(f"{new}/etc/{name}", "w") as file:
            file.write(text)
    workspace = cfg["workspace"]
    bind(workspace, new + workspace, read_only=False)
    os.chdir(new)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {os.uname().machine}")
    check(libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")  # the old root now lies under the new
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    check(libc.sethostname(b"sandbox", 7), "sethostname")
    if not cfg["network"]:
        loopback_up()


def loopback_up() -> None:
    """The new network namespace's `lo` is down: bring it up, so programs may talk to themselves on 127.0.0.1."""
    AF_INET, SOCK_DGRAM, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 2, 2, 0x8913, 0x8914, 0x1
    sock = libc.socket(AF_INET, SOCK_DGRAM, 0)  # the socket module would cost a few ms per command to import
    if sock < 0:
        raise SetupError(f"socket: {os.strerror(ctypes.get_errno())}")
    try:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
    finally:
        os.close(sock)


def run_command(cfg: dict, status: int | None) -> None:
    """In the command's child: limits, defaults, exec. Never returns."""
    try:
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; exec keeps what is ignored
        for name, value in cfg["limits"].items():
            # CPU: SIGXCPU at the limit, SIGKILL a second later for a program that ignores it
            resource.setrlimit(LIMITS[name], (value, value + 1 if name == "cpu_s" else value))
        os.chdir(cfg["cwd"])
        argv = cfg["argv"]
        try:
            os.execvpe(argv[0], argv, cfg["env"])
        except OSError as err:
            report(status, "error", f"cannot run {argv[0]!r}: {err.strerror or err}")
    except BaseException as err:  # noqa: BLE001 - whatever it is, the parent hears of it
        report(status, "error", f"cannot start the command in the sandbox: {type(err).__name__}: {err}")
    os._exit(127)


def init(cfg: dict, status: int | None) -> None:
    """PID 1 of the new namespace. Never returns."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        build_root(cfg)
    except (SetupError, OSError) as err:
        report(status, "error", f"cannot set up the sandbox: {err}")
        os._exit(125)
    command = os.fork()
    if command == 0:
        run_command(cfg, status)
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == command:
            report(status, "exit", str(wait_status))
            os._exit(0)  # the kernel kills the rest of the namespace


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    status = cfg["status_fd"]
    if status is not None:
        os.set_inheritable(status, False)  # the command's exec closes it
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        if os.getppid() != cfg["parent"]:
            os._exit(125)  # the parent died before the line above
        if cfg["cgroup"]:
            write(cfg["cgroup"] + "/cgroup.procs", str(os.getpid()))
        uid, gid = os.getuid(), os.getgid()
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if not cfg["network"]:
            flags |= CLONE_NEWNET
        if libc.unshare(ctypes.c_int(flags)) != 0:
            err = ctypes.get_errno()
            raise SetupError(f"unshare: {os.strerror(err)}{UNSHARE_HINTS.get(err, '')}")
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"0 {uid} 1")
        write("/proc/self/gid_map", f"0 {gid} 1")
    except (SetupError, OSError) as err:
        report(status, "error", f"cannot create the sandbox's namespaces: {err}")
        os._exit(125)
    child: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: child and os.kill(child[0], signal.SIGKILL))
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        init(cfg, status)
    child.append(pid)
    _, wait_status = os.waitpid(pid, 0)  # retried after the SIGTERM handler (PEP 475)
    os._exit(0 if os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 0 else 1)


if __name__ == "__main__":
    main()
