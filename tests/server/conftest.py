"""A real uvicorn server on a loopback port, serving the shipped agent-demo model on the CPU, shared by the tests
of this folder; `make_server` starts another app on the same engine (an API key, other limits)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tsterm import LLM
from tsterm.engine.async_engine import AsyncEngine
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
MODEL = "agent-demo"


@pytest.fixture(scope="session")
def llm():
    llm = LLM(str(AGENT_DEMO), device="cpu")
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="session")
def aengine(llm):
    aengine = AsyncEngine(llm.engine)
    yield aengine
    aengine.shutdown()


@pytest.fixture(scope="session")
def make_server(llm, aengine):
    servers = []

    def make(**options):
        server = BackgroundServer(create_app(build_state(llm, aengine, MODEL, **options))).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(make_server):
    return make_server()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_blocks_free(aengine, timeout: float = 10.0) -> dict:
    """The engine's stats once no block is referenced by a request (or the last stats at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = aengine.stats()
        if (stats["used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def http(method: str, url: str, body: bytes | str | dict | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> tuple[int, str]:
    """One raw HTTP request (stdlib only): (status, body text), error statuses included."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
