"""What an engine front (AsyncEngine in this process, EngineCoreProcess for a core in its own) hands a consumer: one
asyncio queue per request on the consumer's own event loop, fed from the front's thread, and the wait for its next
item with a timeout that survives cancellation."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from tsterm.errors import EngineStepError, EngineTimeoutError

log = logging.getLogger(__name__)

ENDED = object()  # what `abort` puts on a stream: the iteration ends without a final output


class TimedOut:
    """Put on a stream by the timer of one wait for its next item."""

    __slots__ = ()


class Stream:
    """Where one request's outputs go: an asyncio queue on its consumer's loop, fed from the front's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_id: str | None = None  # set once the request is added
        self.dropped = False  # the consumer has left (set on either side): add nothing for it, deliver nothing
        # the engine has added this request: outputs under its id from before that belong to an earlier request of
        # the same id (EngineCoreProcess registers a stream before the core has taken the add)
        self.added = False

    def put(self, item: Any) -> bool:
        """Hand `item` to the consumer's loop (any thread); False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except Exception:  # noqa: BLE001 - RuntimeError('Event loop is closed') or anything else on the way
            log.debug("request %s: its consumer's event loop is gone", self.request_id, exc_info=True)
            return False
        return True


def put_each(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On a consumer's loop: hand a step's outputs to their queues, in order."""
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


def deliver(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]]) -> list[Stream]:
    """Hand a step's items to their streams: one wake-up per consumer loop and step, not one per output (32
    streaming clients on the server's loop were 32 `call_soon_threadsafe`s a step, each a system call and a GIL
    hand-off; benchmarks/engine_contention.py). Returns the streams whose loop is gone (to be dropped)."""
    gone: list[Stream] = []
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_each, [(stream.queue, item) for stream, item in items])
        except Exception:  # noqa: BLE001 - RuntimeError('Event loop is closed') or anything else on the way
            log.debug("%d request(s): their consumers' event loop is gone", len(items), exc_info=True)
            gone.extend(stream for stream, _ in items)
    return gone


def step_error(error: BaseException, what_happened: str) -> EngineStepError:
    """What a stream raises when the engine's step failed on its request: an EngineStepError caused by the error."""
    failure = EngineStepError(f"the engine's step failed ({type(error).__name__}: {error}); {what_happened}")
    failure.__cause__ = error
    return failure


async def next_item(stream: Stream, timeout: float | None) -> Any:
    """The stream's next item; an exception put on it is raised here, and EngineTimeoutError after `timeout` s.

    Not asyncio.wait_for: before Python 3.12 it swallows a cancellation that lands just as an output arrives, and a
    stream that streams every step would then ignore the cancel (an abort in the TUI) for good. Instead a timer puts
    this wait's own marker on the queue; a marker of an earlier wait is skipped."""
    marker = timer = None
    if timeout is not None and stream.queue.empty():
        marker = TimedOut()
        timer = stream.loop.call_later(timeout, stream.queue.put_nowait, marker)
    try:
        while isinstance(item := await stream.queue.get(), TimedOut):
            if item is marker:
                what = f"request {stream.request_id!r}" if stream.request_id else "adding the request"
                raise EngineTimeoutError(f"{what}: nothing from the engine within {timeout:g} s (its step is "
                                         "stuck, or the request waited that long for room in the KV cache)")
    finally:
        if timer is not None:
            timer.cancel()
    if isinstance(item, BaseException):
        raise item
    return item
