"""`tsterm serve` as a process: the model loads, a line on stderr says where it listens, the API answers, the key
(from the environment) is required and never printed."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from tests.server.conftest import AGENT_DEMO, http


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tsterm_serve_process(tmp_path):
    port, key = _free_port(), "env-key-1234567"
    code = "import sys; from tsterm.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "TSTERM_API_KEY": key}
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", str(AGENT_DEMO), "--device", "cpu",
                             "--port", str(port)], env=env, stderr=stderr, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = http("GET", f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                time.sleep(0.1)
        assert status == 200 and json.loads(body)["model"] == "agent_demo"
        request = {"model": "agent_demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert http("POST", url, request)[0] == 401
        assert http("POST", url, request, headers={"Authorization": f"Bearer {key}"})[0] == 200
    finally:
        proc.terminate()
        proc.wait(30)
    log = (tmp_path / "stderr").read_text()
    assert f"agent_demo on http://127.0.0.1:{port}/v1" in log and "API key required" in log
    assert key not in log
