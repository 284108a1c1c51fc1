"""The escape battery: what a hostile model (or a prompt injection it read) would try through the agent's tools.

Every attack runs through the tools the model calls (file tools, run_command), twice: with the namespace sandbox
that this machine offers, and with namespaces made unavailable (detection monkeypatched), where write and command
tools must be refused with a message that says why and how to opt out. Each attack ends in a clear error or a
killed process, and nothing outside the workspace changes (the `outside` tree and the home directory are
snapshotted before and compared after every test).
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from tsterm.agent import sandbox
from tsterm.agent.sandbox import Isolation, Limits, Workspace
from tsterm.agent.tools import Grep, ListDir, ReadFile, RunCommand, WriteFile

UNAVAILABLE = "user namespaces are disabled (made unavailable by the test)"
# Small limits, so that the bombs stay cheap on a shared machine; the mechanism is what is under test.
LIMITS = Limits(address_space_bytes=1 << 30, processes=32, file_size_bytes=1 << 20, tmp_bytes=8 << 20)
PY = os.path.realpath(sys.executable)  # the interpreter's installation is bound read-only into the sandbox


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root`: its type, size, mtime and content (files), not following links."""
    state = {}
    for directory, subdirs, names in os.walk(root):
        for name in subdirs + names:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            content = Path(path).read_bytes() if os.path.isfile(path) and not os.path.islink(path) else None
            state[os.path.relpath(path, root)] = (info.st_mode, info.st_size, info.st_mtime_ns, content)
    return state


@pytest.fixture(params=["namespaces", "unavailable"])
def mode(request, monkeypatch):
    if request.param == "unavailable":
        monkeypatch.setattr(sandbox, "detect_isolation", lambda: Isolation(None, UNAVAILABLE))
    else:
        assert sandbox.detect_isolation().mechanism is not None, sandbox.detect_isolation().reason
    return request.param


@pytest.fixture
def outside(tmp_path):
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("top secret\n")
    return path


@pytest.fixture
def ws(tmp_path, outside, mode):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("hello\n")
    before = _snapshot(outside)
    yield Workspace(root, limits=LIMITS)
    assert _snapshot(outside) == before, "something outside the workspace changed"


def _run(ws: Workspace, argv: list[str], timeout_s: float = 30.0):
    return RunCommand(ws, timeout_s=timeout_s).call({"argv": argv})


def _refused(result, what: str) -> bool:
    return result.error is not None and f"{what} refused" in result.error and UNAVAILABLE in result.error \
        and "sandbox: none" in result.error


def _confined(ws, result, *, mode: str, what: str, expect: str | None = None) -> None:
    """The command failed inside the sandbox (`expect` in its output), or was refused without one."""
    if mode == "unavailable":
        assert _refused(result, what), result
    else:
        assert result.error is not None and "top secret" not in result.content, result
        if expect is not None:
            assert expect in result.content, result.content


# ---- reading outside

def test_read_outside_through_dotdot_absolute_paths_and_proc_self_root(ws, outside, mode):
    secret = str(outside / "secret.txt")
    for path in ["../outside/secret.txt", secret, f"/proc/self/root{secret}", "~/.ssh/id_rsa"]:
        result = ReadFile(ws).call({"path": path})
        assert result.error is not None and "top secret" not in result.content
        assert "leaves the workspace" in result.error or "absolute" in result.error
    assert "leaves the workspace" in ListDir(ws).call({"path": ".."}).error
    assert "leaves the workspace" in Grep(ws).call({"pattern": "secret", "path": "../outside"}).error
    for argv in (["cat", secret], ["cat", f"/proc/self/root{secret}"], ["cat", f"/proc/1/root{secret}"],
                 ["cat", "../outside/secret.txt"]):
        _confined(ws, _run(ws, argv), mode=mode, what="running 'cat'", expect="No such file or directory")


def test_read_outside_through_symlinks(ws, outside, mode):
    os.symlink(outside / "secret.txt", ws.root / "leak.txt")
    os.symlink(outside, ws.root / "door")
    for path in ["leak.txt", "door/secret.txt"]:
        result = ReadFile(ws).call({"path": path})
        assert "leaves the workspace" in result.error and "top secret" not in result.content
        assert str(outside) not in result.error  # the refusal names no host path
    assert "top secret" not in Grep(ws).call({"pattern": "secret"}).content  # the walk never follows a link
    listing = ListDir(ws).call({}).content
    assert "link - leak.txt -> (outside the workspace)" in listing and str(outside) not in listing
    # inside the sandbox the links point at paths that do not exist there
    _confined(ws, _run(ws, ["cat", "leak.txt", "door/secret.txt"]), mode=mode, what="running 'cat'",
              expect="No such file or directory")


def test_the_home_directory_and_the_hosts_processes_are_not_visible(ws, mode):
    home = os.path.expanduser("~")
    result = _run(ws, ["sh", "-c", f"ls -a {home}; ls /proc; cat /proc/1/cmdline"])
    if mode == "unavailable":
        assert _refused(result, "running 'sh'")
        return
    pids = [line for line in result.content.split() if line.isdigit()]
    assert len(pids) <= 4, result.content  # the namespace's init, the shell, ls: not the host's processes
    assert "sandbox_init.py" in result.content  # PID 1 is the sandbox's init, not the host's
    home_entries = set(result.content.split("\n/proc")[0].split()) - {".", ".."}
    real_home = set(os.listdir(home))
    # at most the interpreter's installation when it lives in the home (pyenv); never the rest of the home
    assert not home_entries & (real_home - {".pyenv", ".local"}), home_entries


def test_a_new_hard_link_to_outside_cannot_be_made_and_bind_mounts_reach_nothing(ws, outside, mode):
    script = (f"import os\n"
              f"for make in (lambda: os.link({str(outside / 'secret.txt')!r}, 'hl'),\n"
              f"             lambda: os.symlink('/proc/1/root{outside}', 'sl') or open('sl/secret.txt').read()):\n"
              f"    try:\n"
              f"        print('made', make())\n"
              f"    except OSError as err:\n"
              f"        print('refused', err.strerror)\n")
    result = _run(ws, [PY, "-c", script])
    if mode == "unavailable":
        assert _refused(result, f"running {PY!r}")
    else:
        assert result.content.count("refused") == 2 and "top secret" not in result.content, result.content
    mounted = _run(ws, ["sh", "-c", f"mkdir -p mnt && mount --bind / mnt && cat mnt{outside}/secret.txt"])
    _confined(ws, mounted, mode=mode, what="running 'sh'")


# ---- writing outside

def test_write_outside_through_dotdot_absolute_paths_symlinks_and_hard_links(ws, outside, mode):
    os.symlink(outside / "secret.txt", ws.root / "leak.txt")
    os.symlink(outside, ws.root / "door")
    os.link(outside / "secret.txt", ws.root / "hard.txt")  # made by someone else, before the session
    for path in ["../outside/secret.txt", str(outside / "secret.txt"), "leak.txt", "door/new.txt", "hard.txt",
                 "/proc/self/root/tmp/x"]:
        result = WriteFile(ws).call({"path": path, "content": "pwned"})
        assert result.error is not None, path
        if mode == "unavailable":
            assert _refused(result, "write_file")
        else:
            assert any(text in result.error for text in ("leaves the workspace", "absolute", "2 hard links"))
    assert (outside / "secret.txt").read_text() == "top secret\n"
    for argv in (["sh", "-c", f"echo pwned > {outside}/new.txt"], ["touch", "/usr/pwned"],
                 ["sh", "-c", "echo pwned > /etc/passwd"], ["sh", "-c", "echo x > door/new.txt"]):
        _confined(ws, _run(ws, argv), mode=mode, what=f"running {argv[0]!r}")
    assert not os.path.exists("/usr/pwned")


def test_writing_inside_still_works(ws, mode):
    result = WriteFile(ws).call({"path": "sub/new.txt", "content": "fine"})
    ran = _run(ws, ["sh", "-c", "echo made > made.txt; cat sub/new.txt"])
    if mode == "unavailable":
        assert _refused(result, "write_file") and _refused(ran, "running 'sh'")
        assert not (ws.root / "sub").exists()
    else:
        assert result.ok and ran.ok and ran.content == "fine"
        assert (ws.root / "made.txt").read_text() == "made\n"


# ---- network

def test_no_network_not_even_the_hosts_loopback(ws, mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    script = ("import socket\n"
              "for address in [('127.0.0.1', %d), ('example.com', 80)]:\n"
              "    try:\n"
              "        socket.create_connection(address, timeout=10).close()\n"
              "        print('connected', address)\n"
              "    except OSError as err:\n"
              "        print('no network', address, type(err).__name__)\n" % port)
    try:
        result = _run(ws, [PY, "-c", script])
        if mode == "unavailable":
            assert _refused(result, f"running {PY!r}")
        else:
            assert result.ok and "connected" not in result.content and result.content.count("no network") == 2
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody reached the host's listener
    finally:
        listener.close()


# ---- resources

def test_a_fork_bomb_is_bounded_by_the_process_limit(ws, mode):
    script = ("import os, time\n"
              "n = 0\n"
              "try:\n"
              "    while True:\n"
              "        if os.fork() == 0:\n"
              "            time.sleep(1000)\n"
              "        n += 1\n"
              "except OSError as err:\n"
              "    print('bounded after', n, err.errno)\n")
    result = _run(ws, [PY, "-c", script])
    if mode == "unavailable":
        assert _refused(result, f"running {PY!r}")
        return
    assert result.ok, result
    words = result.content.split()
    assert words[:2] == ["bounded", "after"] and int(words[2]) < LIMITS.processes and int(words[3]) == errno.EAGAIN


def test_a_memory_bomb_fails_at_the_address_space_limit(ws, mode):
    result = _run(ws, [PY, "-c", "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))"])
    if mode == "unavailable":
        assert _refused(result, f"running {PY!r}")
    else:
        assert result.error == f"{PY}: exited with status 1" and "MemoryError" in result.content


def test_a_huge_file_is_stopped_at_the_file_size_limit(ws, mode):
    sparse = _run(ws, [PY, "-c", "f = open('huge', 'wb'); f.seek(10 << 30); f.write(b'x'); f.close()"])
    stream = _run(ws, ["sh", "-c", "head -c 10G /dev/zero > stream"])
    if mode == "unavailable":
        assert _refused(sparse, f"running {PY!r}") and _refused(stream, "running 'sh'")
        return
    # Python ignores SIGXFSZ and sees EFBIG; `head` is killed by it (the shell says so, exit 128 + 25)
    assert "File too large" in sparse.content and sparse.error == f"{PY}: exited with status 1", sparse
    assert "File size limit exceeded" in stream.content and stream.error == "sh: exited with status 153", stream
    assert os.path.getsize(ws.root / "stream") <= LIMITS.file_size_bytes
    assert not (ws.root / "huge").exists() or os.path.getsize(ws.root / "huge") <= LIMITS.file_size_bytes


def test_cpu_time_and_open_files_are_limited(ws, mode):
    ws.limits = Limits(cpu_s=1, open_files=64)
    spin = _run(ws, [PY, "-c", "while True: pass"])
    files = _run(ws, [PY, "-c", "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('.', 0))\n"
                                "except OSError as err:\n    print(len(fds), err.strerror)"])
    if mode == "unavailable":
        assert _refused(spin, f"running {PY!r}") and _refused(files, f"running {PY!r}")
        return
    assert spin.error == f"{PY}: killed by SIGXCPU"
    count, why = files.content.split(" ", 1)
    assert int(count) < 64 and why.strip() == "Too many open files"


def test_network_true_in_the_profile_shares_the_hosts_network(tmp_path, mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ws = Workspace(tmp_path, network=True)
    script = f"import socket; socket.create_connection(('127.0.0.1', {listener.getsockname()[1]})).close()"
    try:
        result = _run(ws, [PY, "-c", script])
        if mode == "unavailable":
            assert _refused(result, f"running {PY!r}")
        else:
            assert result.ok and "network on" in ws.describe()
            listener.accept()[0].close()  # it reached us
    finally:
        listener.close()


def test_setsid_and_double_forks_die_with_the_namespace_at_the_timeout(ws, mode):
    # Two escapees hold the write end of a FIFO: one setsid(), one double-forked and setsid(). The test keeps the
    # read end; once the run returns, reading it must give their greeting and then end of file - all writers gone,
    # so both processes are dead (an event the kernel reports, not a wait). The shell waits for both greetings
    # (on `go`) before it sleeps into the timeout.
    os.mkfifo(ws.root / "hold")
    os.mkfifo(ws.root / "go")
    reader = os.open(ws.root / "hold", os.O_RDONLY | os.O_NONBLOCK)
    marker = f"{os.getpid() % 9000 + 1000}.{threading.get_ident() % 99991}"
    script = (f"setsid sh -c 'echo a > go; echo a; exec sleep {marker}' > hold & "
              f"(setsid sh -c 'echo b > go; echo b; exec sleep {marker}' > hold &); "
              f"exec 3<>go; head -n 2 <&3 > /dev/null; exec sleep {marker}")  # 3<>: go never sees EOF
    try:
        result = _run(ws, ["sh", "-c", script], timeout_s=5)
        if mode == "unavailable":
            assert _refused(result, "running 'sh'")
            return
        assert "timed out" in result.error, result
        held = os.read(reader, 100)
        assert sorted(held.split()) == [b"a", b"b"], held
        assert os.read(reader, 100) == b"", "a process holding the FIFO outlived the timeout"
    finally:
        os.close(reader)
    survivors = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, marker)]
    assert survivors == []


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def test_secrets_in_the_parents_environment_are_not_visible(ws, mode, monkeypatch):
    monkeypatch.setenv("TSTERM_API_KEY", "tsk-5f3a9c")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-7e21b8")
    result = _run(ws, ["sh", "-c", "env; cat /proc/*/environ /proc/*/cmdline 2>/dev/null | tr '\\0' '\\n'"])
    if mode == "unavailable":
        assert _refused(result, "running 'sh'")
    else:
        assert result.ok and "PATH=/usr/bin:/bin" in result.content
        assert "tsk-5f3a9c" not in result.content and "sk-7e21b8" not in result.content
        assert "API_KEY" not in result.content


def test_a_redos_pattern_returns_and_the_process_keeps_serving(ws, mode):
    # '(a+)+$' on 'aaa...b' takes exponential time in a backtracking engine (Python's re would not return in
    # this test's lifetime, holding the GIL); grep's RE2 is linear. While it runs on a worker thread, this thread
    # must still get the GIL: another tool call finishes here.
    (ws.root / "evil.txt").write_text("a" * 50_000 + "b\n")
    results = {}
    worker = threading.Thread(target=lambda: results.update(grep=Grep(ws).call({"pattern": r"(a+)+$"})))
    worker.start()
    assert ReadFile(ws).call({"path": "notes.txt"}).content == "hello\n"
    worker.join()
    assert "no match" in results["grep"].content and results["grep"].ok
    backreference = Grep(ws).call({"pattern": r"(a*)*\1$"})
    assert "bad pattern" in backreference.error and "RE2" in backreference.error


# ---- opting out

def test_sandbox_none_runs_unconfined_when_the_profile_says_so(tmp_path, mode):
    ws = Workspace(tmp_path, sandbox="none")
    assert ws.describe().startswith("sandbox: none")
    assert WriteFile(ws).call({"path": "a.txt", "content": "x"}).ok
    assert _run(ws, ["cat", "a.txt"]).content == "x"


def test_the_description_says_which_mechanism_is_in_use(ws, mode):
    if mode == "unavailable":
        assert ws.describe() == f"sandbox: unavailable ({UNAVAILABLE}) - write and command tools are refused"
    else:
        assert ws.describe().startswith("sandbox: Linux namespaces") and "network off" in ws.describe()
