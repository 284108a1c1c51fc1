"""Helpers for driving the TUI under Pilot."""
from __future__ import annotations

import asyncio
import time


async def wait_until(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    """Let the app run until `predicate()` is truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def engine_stats(app) -> dict:
    return await asyncio.to_thread(app.host.async_engine.stats)
