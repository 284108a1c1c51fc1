"""Streaming front for the engine: an async iterator per request, shared by the TUI, the CLI and the server.

The engine runs its step loop on one background thread; other threads only post commands (add, abort) to it,
so the engine itself needs no locks. Outputs go back to each request's asyncio queue on its own event loop.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from tsterm.config import SamplingParams
from tsterm.engine.engine import Engine
from tsterm.outputs import RequestOutput


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tsterm-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped:
            # Block for work when idle; otherwise drain commands between steps.
            if not self.engine.has_unfinished():
                self._commands.get()()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step fails every request in flight, never the thread silently
                    for rid in list(self._streams):
                        self.engine.abort(rid)
                        self._deliver(rid, e)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread and wait for its result (errors are re-raised here)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e
            done.set()

        self._commands.put(run)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per step that produced text; the last one has `finished=True`.

        Leaving the iteration early (break, cancellation) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id)
            self._streams[rid] = (loop, q)
            return rid

        rid = await loop.run_in_executor(None, self._call, add)
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
        self._commands.put(run)

    def stats(self) -> dict:
        return self._call(self.engine.stats)

    def expert_load(self) -> list[list[int]]:
        return self._call(self.engine.expert_load)

    def shutdown(self) -> None:
        def stop() -> None:
            self._stopped = True
        self._commands.put(stop)
        self._thread.join(timeout=10)
