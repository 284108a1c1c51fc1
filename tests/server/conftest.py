"""A real uvicorn server on a loopback port, serving the shipped agent-demo model on the CPU, shared by the tests
of this folder; `make_server` starts another app on the same engine (an API key, other limits)."""
from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import openai
import pytest

from tsterm import LLM
from tsterm.engine.async_engine import AsyncEngine
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
MODEL = "agent-demo"


class Served:
    """Outermost ASGI app: counts the HTTP requests the server has finished, by path, with all of their bookkeeping
    (the metrics middleware's count, the release of a request's place in the queue); `wait` blocks until enough
    have. What a test waits for after a response: the server's own accounting of it ends just after the client
    has it."""

    def __init__(self, app):
        self.app, self.finished, self.changed = app, Counter(), threading.Condition()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                with self.changed:
                    self.finished[scope["path"]] += 1
                    self.changed.notify_all()

    def wait(self, path: str, n: int) -> None:
        """Until `n` requests to `path` have finished, counted since the server started."""
        with self.changed:
            self.changed.wait_for(lambda: self.finished[path] >= n)


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
        state = build_state(aengine, MODEL, **options)
        served = Served(create_app(state))
        server = BackgroundServer(served).start()
        server.state, server.served = state, served
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


def wait_blocks_free(aengine) -> dict:
    """The engine's stats once no request is running or waiting in it: its blocks are then free, unless one leaked.

    `stats()` runs on the engine thread between two steps, so each read waits for the next step (a client that left
    is noticed and its request aborted meanwhile); an idle engine answers at once with what is left."""
    while True:
        stats = aengine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats


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
