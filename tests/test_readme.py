"""The README as a tested contract: every fenced block it marks as runnable runs, and prints what the README shows.

A marker is an HTML comment on the line before the opening fence (GitHub does not render it):

- `<!-- readme-test: shell -->` on a ```bash block: each command (a line that does not start with `#`; a trailing
  `\\` continues it) runs with bash, in order, in one scratch directory, and must exit 0. `tsterm` is this
  environment's (its bin directory leads PATH, and `.venv` in the scratch directory links to the environment, so
  `.venv/bin/tsterm` works as the Quickstart writes it). The `# ` lines right under a command are its stdout, line
  for line. Where the output varies, lines `N ~ REGEX` in the marker say that command N's stdout has a line
  matching REGEX. `port=P` in the marker: P in the block is a free port instead. A command that ends with `&` runs
  in the background until the block ends (a server; the next command's connection waits in its listen queue).
- `<!-- readme-test: python -->` on a ```python block: it runs as a script in the scratch directory; the next
  fenced block is its stdout, exactly.

Sessions and profiles go to the scratch directory (TSTERM_DATA_DIR, XDG_CONFIG_HOME); models come from the user
cache, where the default model is imported once (tests/chat/conftest.py). A CLI run costs ~5-10 s on 2 cores.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"^<!-- readme-test: (?P<spec>.*?)-->\n```(?P<lang>\w*)\n(?P<body>.*?)^```\n", re.M | re.S)
FENCE = re.compile(r"^```\w*\n(?P<body>.*?)^```\n", re.M | re.S)
TIMEOUT_S = 300


@dataclass
class Block:
    line: int  # of the opening fence in README.md
    kind: str  # shell | python
    body: str
    expected: str | None = None  # python: the stdout the README shows
    patterns: dict[int, list[str]] = field(default_factory=dict)  # shell: command number -> regexes
    port: int | None = None

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def marked_blocks(text: str) -> list[Block]:
    blocks = []
    for match in MARKER.finditer(text):
        first, *rest = match["spec"].strip().splitlines() or [""]
        kind, *options = first.split()
        block = Block(text[:match.start("body")].count("\n"), kind, match["body"])
        for option in options:
            key, _, value = option.partition("=")
            assert key == "port" and value.isdigit(), f"{block}: unknown marker option {option!r}"
            block.port = int(value)
        for line in rest:
            number, sep, pattern = line.strip().partition(" ~ ")
            assert sep and number.isdigit(), f"{block}: a marker line is `N ~ REGEX`, got {line!r}"
            block.patterns.setdefault(int(number), []).append(pattern)
        if kind == "python":
            output = FENCE.search(text, match.end())
            assert output, f"{block}: a python block needs the fenced block of its output after it"
            block.expected = output["body"]
        else:
            assert kind == "shell", f"{block}: unknown kind {kind!r} (shell or python)"
        blocks.append(block)
    return blocks


def commands(body: str) -> list[tuple[str, list[str]]]:
    """(command, the stdout lines the README shows under it) in order. A command goes on over the next lines while
    it ends with `\\` or a quote is open (a JSON body across lines)."""
    parsed: list[tuple[str, list[str]]] = []
    pending = ""
    for line in body.splitlines():
        if pending or not line.startswith("#"):
            pending += line + "\n"
            if not line.endswith("\\") and _complete(pending):
                parsed.append((pending.strip(), []))
                pending = ""
        elif parsed and (line.startswith("# ") or line == "#"):
            parsed[-1][1].append(line[2:])
    assert not pending, f"an unfinished command: {pending!r}"
    return parsed


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # no closing quotation
        return False
    return True


BACKGROUND = re.compile(r"\s&\s*(#.*)?$")


BLOCKS = marked_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_marks_its_runnable_blocks():
    """The Quickstart answer, the Python API, the agent and bench commands and the server are all checked."""
    shown = "\n".join(block.body for block in BLOCKS)
    for needle in ("tsterm run --profile default", "LLM.from_profile", "tsterm bench --profile agent-demo",
                   "tsterm serve --profile agent-demo", "curl"):
        assert needle in shown, f"no marked README block runs {needle!r}"


@pytest.fixture
def scratch(tmp_path) -> dict[str, str]:
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TSTERM_DATA_DIR": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # the suite's setting, not a user's
    return env


def wait_listening(port: int, process: subprocess.Popen, log: Path) -> None:
    """Until the background command listens on `port` (a server binds before it loads its model), or exits."""
    while process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            time.sleep(0.05)  # a poll interval: the server binds within its first seconds
    raise AssertionError(f"the background command exited {process.returncode}: {log.read_text()[-3000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_a_marked_readme_block_prints_what_the_readme_shows(block, scratch, tmp_path):
    if block.kind == "python":
        script = tmp_path / "block.py"
        script.write_text(block.body, encoding="utf-8")
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=scratch, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, f"{block}: exit {done.returncode}\n{done.stderr[-3000:]}"
        assert done.stdout == block.expected, f"{block}: prints\n{done.stdout}\nbut the README shows\n{block.expected}"
        return
    port = None if block.port is None else free_port()
    body = block.body if port is None else re.sub(rf"\b{block.port}\b", str(port), block.body)
    background: list[subprocess.Popen] = []
    try:
        for number, (command, shown) in enumerate(commands(body), start=1):
            if (ampersand := BACKGROUND.search(command)) is not None:
                log = tmp_path / f"background-{number}.err"
                with log.open("w") as stderr:
                    process = subprocess.Popen(["bash", "-c", "exec " + command[:ampersand.start()]], cwd=tmp_path,
                                               env=scratch, stdout=subprocess.DEVNULL, stderr=stderr)
                background.append(process)
                if port is not None:
                    wait_listening(port, process, log)
                continue
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=scratch, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
            where = f"{block} command {number}: {command.split()[:3]}"
            assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr[-3000:]}"
            lines = done.stdout.splitlines()
            if shown and number not in block.patterns:  # patterns: the shown lines are abridged
                assert lines == shown, f"{where}: prints\n{done.stdout}\nbut the README shows\n" + "\n".join(shown)
            for pattern in block.patterns.get(number, []):
                assert any(re.search(pattern, line) for line in lines), \
                    f"{where}: no line matches {pattern!r} in\n{done.stdout}"
    finally:
        for process in background:  # ours: ended by its own handle
            process.terminate()
            process.wait(timeout=60)
