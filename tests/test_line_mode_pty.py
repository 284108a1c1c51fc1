"""`tsterm chat --plain` on a real terminal (a pty): the `>>> ` prompt, ctrl+c stops the reply and not the chat,
keys typed during a reply do not land in it, ctrl+d leaves with exit 0, and the chat is in the TUI's store."""
from __future__ import annotations

import json
import os
import pty
import select
import sys
import time
from pathlib import Path

AGENT_DEMO = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "agent_demo"
HANG_S = 600.0  # a hang guard only: every read wakes as soon as the child writes


class Terminal:
    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.output = b""

    def read_until(self, marker: bytes, start: int = 0) -> bytes:
        """Read the child's output until `marker` is in it past `start` (or the child closed the terminal)."""
        return self._read_while(lambda: marker not in self.output[start:], f"no {marker!r}", start)

    def read_past(self, size: int) -> bytes:
        """Read until the output is longer than `size` bytes: the child wrote something new."""
        return self._read_while(lambda: len(self.output) <= size, f"nothing past byte {size}", size)

    def _read_while(self, waiting, what: str, start: int) -> bytes:
        deadline = time.monotonic() + HANG_S
        while waiting():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{what} in {self.output[start:]!r} after {HANG_S:g} s"
            if not self._read(remaining):  # wakes as soon as the child writes
                break
        return self.output[start:]

    def _read(self, timeout: float) -> bool:
        """Take what the child wrote within `timeout`; False once it closed the terminal."""
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                self.output += os.read(self.fd, 4096)
            except OSError:
                return False
        return True

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self) -> int:
        """The child's exit code, reading what it still writes (the terminal closes as it exits)."""
        deadline = time.monotonic() + HANG_S
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"still running after {HANG_S:g} s; output {self.output!r}"
            if not self._read(remaining):  # closed: it is exiting
                return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def test_ctrl_c_stops_the_reply_not_the_chat(tmp_path):
    profile = tmp_path / "long.yaml"  # replies that never end on their own: only ctrl+c stops them
    profile.write_text(f"model: {AGENT_DEMO}\ndevice: cpu\nsampling:\n  temperature: 0\n  max_tokens: 100000\n"
                       "  ignore_eos: true\n")
    env = {**os.environ, "TSTERM_DATA_DIR": str(tmp_path / "data"), "TERM": "dumb"}
    term = Terminal(["-c", "import sys; from tsterm.cli import main; sys.exit(main(sys.argv[1:]))", "chat", "--plain",
                     "--profile", str(profile)], env)
    term.read_until(b">>> ")
    at = len(term.output)
    term.send(b"What is 6 * 7?\r")
    echoed = at + len(term.read_until(b"\n", start=at))  # the line is echoed, then the reply streams
    term.read_past(echoed)  # its first bytes: the reply is under way
    term.send(b"xyzzy")  # typed while the reply streams: neither echoed into it nor kept
    term.read_past(len(term.output))  # the reply streams on past them
    term.send(b"\x03")  # ctrl+c
    after = term.read_until(b">>> ", start=at)
    assert b"(stopped)" in after and b"xyzzy" not in after
    at = len(term.output)
    term.send(b"/help\r")
    assert b"/bye" in term.read_until(b">>> ", start=at)
    term.send(b"\x04")  # ctrl+d at the prompt: leave
    assert term.wait() == 0
    [saved] = list((tmp_path / "data" / "sessions").glob("*.json"))
    session = json.loads(saved.read_text())
    assert [m["content"] for m in session["messages"] if m["role"] == "user"] == ["What is 6 * 7?"]
    assert session["turns"][0]["finish_reason"] == "abort" and session["turns"][0]["generated_tokens"] > 0
