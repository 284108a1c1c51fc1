"""`tsterm serve` as a process: the model loads, a line on stderr says where it listens (the profile's `server:`
port and model name), the API answers, the key (from the environment) is required and never printed; the
workstation's `--serve` flags."""
from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import threading

import pytest

from tests.server.conftest import AGENT_DEMO, http
from tsterm.cli import main

SAFETY = 300  # seconds: only a broken shutdown waits this long


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tsterm_serve_process(tmp_path):
    """The real path: the engine core runs in a process of its own, which ends when the server stops."""
    port, key = _free_port(), "env-key-1234567"
    code = "import sys; from tsterm.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "TSTERM_API_KEY": key}
    profile = tmp_path / "served.yaml"
    profile.write_text(f"model: {AGENT_DEMO}\ndevice: cpu\nserver:\n  port: {port}\n  model_name: agent_demo\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--profile", str(profile)], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, listening = [], threading.Event()

    def read_stderr() -> None:  # "tsterm serve: ... on URL" comes once the model is loaded and the port listens
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("tsterm serve: "):
                listening.set()
        listening.set()  # EOF: it ended
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        listening.wait()
        assert proc.poll() is None, "".join(lines)
        status, body = http("GET", f"http://127.0.0.1:{port}/health")
        assert status == 200 and json.loads(body)["model"] == "agent_demo"
        request = {"model": "agent_demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert http("POST", url, request)[0] == 401
        assert http("POST", url, request, headers={"Authorization": f"Bearer {key}"})[0] == 200
        core = int(re.search(r"engine core: process (\d+)", "".join(lines)).group(1))
        assert core != proc.pid
        core_exited = os.pidfd_open(core)  # readable once the core process has exited
    finally:
        proc.terminate()  # uvicorn's graceful stop; then the engine core is shut down
        proc.wait()
        reader.join()
    assert select.select([core_exited], [], [], SAFETY)[0], "the engine core outlived tsterm serve"
    os.close(core_exited)
    log = "".join(lines)
    assert f"agent_demo on http://127.0.0.1:{port}/v1" in log and "API key required" in log
    assert key not in log


def test_workstation_serve_flags_need_serve_and_a_key_off_loopback(capsys):
    for argv in (["--port", "9000"], ["--api-key", "k", "--host", "0.0.0.0"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "only apply with --serve" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--serve", "--port", "70000"])
    assert exit_.value.code == 2 and "--port must be in 0..65535" in capsys.readouterr().err


def test_serve_takes_the_parallel_and_speculative_flags():
    from tsterm.cli import build_parser
    from tsterm.launch import overrides_from_args

    args = build_parser().parse_args(["serve", "--profile", "agent-demo", "--tensor-parallel-size", "2",
                                      "--expert-parallel-size", "2", "--quantization", "int8", "--speculative", "suffix",
                                      "--num-speculative-tokens", "6"])
    assert overrides_from_args(args) | {"dtype": None, "device": None} == {
        "dtype": None, "device": None, "tensor_parallel_size": 2, "expert_parallel_size": 2, "quantization": "int8",
        "speculative_method": "suffix", "num_speculative_tokens": 6}


def test_serve_checks_cors_and_host_names_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TSTERM_API_KEY", raising=False)
    profile = tmp_path / "open.yaml"  # a model that is not there: the settings' error must come first
    profile.write_text(f"model: {tmp_path / 'missing'}\nserver:\n  cors_origins: ['*']\n")
    assert main(["serve", "--profile", str(profile), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert 'server.cors_origins has "*"' in err and "missing" not in err, err
