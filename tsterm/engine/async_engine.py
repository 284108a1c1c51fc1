"""Streaming front for the engine: an async iterator per request, shared by the TUI, the CLI and the server.

The engine runs its step loop on one background thread; other threads only post commands to it (add, abort, a call),
so the engine itself needs no locks. Outputs go back to each request's asyncio queue on its own event loop.

What a server needs from it:
- no request can end the engine thread: a delivery that fails (the consumer's loop is closed) drops and aborts that
  request only; a request the engine failed on (its output's `error`) fails its stream only, with an EngineStepError;
  and a step that fails as a whole (a bug outside the engine's own isolation) fails the requests in flight, not the
  thread;
- a cancelled or abandoned `generate` aborts its request, even while the add is queued or running on the engine
  thread: the abort is a command too, and commands run in the order they were posted;
- every wait has a timeout (`call_timeout` for a command, `output_timeout` between two outputs of a stream) that
  ends in an EngineTimeoutError;
- when the thread ends (`shutdown`, or an unexpected error) every pending stream and call fails with an
  EngineStoppedError that says why, and so does every later one.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from typing import Any

from tsterm.config import SamplingParams
from tsterm.engine.engine import Engine
from tsterm.engine.info import CALLS, EngineCalls, EngineInfo
from tsterm.engine.streams import ENDED, Stream, deliver, next_item, step_error
from tsterm.errors import EngineStoppedError, EngineTimeoutError, TstermError
from tsterm.outputs import RequestOutput
from tsterm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SHUT_DOWN = "the engine was shut down (AsyncEngine.shutdown): it takes no new requests and unfinished ones were aborted"


class _Command:
    """A function for the engine thread, and what to tell its waiter if it never runs (the thread stopped first)."""

    __slots__ = ("run", "fail", "cancelled")

    def __init__(self, run: Callable[[], None], fail: Callable[[BaseException], Any] | None = None):
        self.run, self.fail, self.cancelled = run, fail, False


class AsyncEngine(EngineCalls):
    def __init__(self, engine: Engine, call_timeout: float = 120.0, output_timeout: float | None = 600.0,
                 owns_engine: bool = False):
        """call_timeout: seconds to wait for the engine thread to take and answer a command (adding a request, stats),
        which may have to wait for the step in progress. output_timeout: seconds a stream waits for its next output
        (a queued request waits for room in the KV cache); None waits as long as the engine thread runs.
        owns_engine: `shutdown` ends the engine too (its executor: worker processes, device memory)."""
        self.engine, self.owns_engine = engine, owns_engine
        self.call_timeout, self.output_timeout = call_timeout, output_timeout
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams and _closed
        self._streams: dict[str, Stream] = {}  # live requests added by `generate` -> their consumers
        self._closed: EngineStoppedError | None = None  # set once: why the thread takes no more commands
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tsterm-engine", daemon=True)
        self._thread.start()

    # ---- the engine thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        reason = EngineStoppedError(SHUT_DOWN)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every waiter is told below
            log.warning("the engine thread stopped on an unexpected error", exc_info=True)
            reason = EngineStoppedError(f"the engine thread stopped on an unexpected error ({type(e).__name__}: {e}); "
                                        "unfinished requests were aborted, restart tsterm to continue")
            reason.__cause__ = e
        finally:
            self._close(reason)
            for request_id in list(self.engine.requests):  # nothing steps them any more: free their blocks
                self._quietly(self.engine.abort, request_id)

    def _loop(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished():
                self._execute(self._commands.get())  # idle: sleep until there is something to do
            while not self._stopping:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._execute(command)
            if self._stopping or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails every request in flight, not the thread
                log.debug("an engine step failed", exc_info=True)
                self._fail_requests(e)
                continue
            self._deliver(outputs)

    def _execute(self, command: _Command) -> None:
        if not command.cancelled:
            self._quietly(command.run)

    def _quietly(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the engine thread; an error is logged, never raised into the loop."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            log.warning("%s%r failed on the engine thread", getattr(fn, "__name__", fn), args, exc_info=True)
            return None

    def _add(self, stream: Stream, prompt: str | list[int], params: SamplingParams | None,
             request_id: str | None, options: dict[str, Any]) -> None:
        if stream.dropped:  # its consumer left before the add had its turn
            return
        try:
            rid = self.engine.add_request(prompt, params, request_id, **options)
        except Exception as e:  # noqa: BLE001 - a bad request fails its stream only
            stream.put(e)
            return
        stream.request_id = rid
        with self._lock:
            closed = self._closed
            if closed is None:
                self._streams[rid] = stream
        if closed is not None:  # shutdown gave up waiting for this thread and failed the streams it knew
            self._quietly(self.engine.abort, rid)
            stream.put(self._stopped_error())
        elif not stream.put(rid):
            self._drop(stream)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (one wake-up per consumer loop and step: streams.deliver)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput | Exception]]] = {}
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None:
                continue
            item: RequestOutput | Exception = out
            if out.error is not None:  # the engine failed on this request (and only on it)
                item = step_error(out.error, "this request was failed; the engine serves the others")
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for stream in deliver(by_loop):
            self._drop(stream)  # nobody is listening any more: free the request's blocks

    def _drop(self, stream: Stream) -> None:
        """The consumer has left (early exit, cancellation, its loop closed): abort its request if still running."""
        stream.dropped = True
        rid = stream.request_id
        with self._lock:  # only while the stream is registered is the request under that id still its own
            owned = rid is not None and self._streams.get(rid) is stream
            if owned:
                del self._streams[rid]
        if owned:
            self._quietly(self.engine.abort, rid)

    def _fail_requests(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id in list(self.engine.requests):
            self._quietly(self.engine.abort, request_id)
        if not isinstance(error, TstermError):  # consumers (the server's routes) handle tsterm's errors, by kind
            error = step_error(error, "the requests in it were aborted")
        for stream in streams.values():
            stream.put(error)
        if self.engine.has_unfinished():  # aborting did not clear them: stepping again would fail forever
            raise EngineStoppedError("the engine could not abort its requests after a failed step") from error

    # ---- any thread ------------------------------------------------------------------------------------------

    def _close(self, reason: EngineStoppedError) -> None:
        """Take no more commands; fail the queued ones and every registered stream (called once the thread ends,
        or by `shutdown` when the thread does not end in time)."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            streams, self._streams = list(self._streams.values()), {}
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command.fail is not None and not command.cancelled:
                command.fail(self._stopped_error())
        for stream in streams:
            stream.put(self._stopped_error())

    def _stopped_error(self) -> EngineStoppedError:
        """A fresh copy of the reason the thread stopped (one exception object raised in many tasks would share
        and grow one traceback)."""
        error = EngineStoppedError(str(self._closed))
        error.__cause__ = self._closed.__cause__
        return error

    def _post(self, command: _Command) -> None:
        with self._lock:
            if self._closed is not None:
                raise self._stopped_error()
            self._commands.put(command)

    def _post_quietly(self, command: _Command) -> None:
        try:
            self._post(command)
        except EngineStoppedError:
            pass  # the thread has stopped: every request was aborted already

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the engine thread and wait for its result (errors are re-raised here)."""
        if threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e
            finally:
                done.set()

        def fail(error: BaseException) -> None:
            box["error"] = error
            done.set()

        command = _Command(run, fail)
        self._post(command)
        limit = self.call_timeout if timeout is None else timeout
        if not done.wait(limit):
            command.cancelled = True
            raise EngineTimeoutError(f"the engine did not answer within {limit:g} s: its current step has run that "
                                     "long or is stuck (raise AsyncEngine.call_timeout for very slow steps)")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # ---- the API ---------------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per step that produced text; the last one has `finished=True`.

        cache_salt: prompts with different salts never share cached blocks (Engine.add_request).

        Leaving the iteration early (break, cancellation, an error) aborts the request and frees its blocks.
        `abort(request_id)` from elsewhere ends the iteration without a final output.
        """
        stream = Stream(asyncio.get_running_loop())
        options = {} if cache_salt is None else {"cache_salt": cache_salt}
        self._post(_Command(lambda: self._add(stream, prompt, params, request_id, options), stream.put))
        finished = False
        try:
            await next_item(stream, self.call_timeout)  # the request id, once the engine thread has added it
            while not finished:
                item = await next_item(stream, self.output_timeout)
                if item is ENDED:
                    return
                finished = item.finished
                yield item
        finally:
            if not finished:
                stream.dropped = True  # an add that has not run yet never will
                self._post_quietly(_Command(lambda: self._drop(stream)))  # runs after the add: commands run in order

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread, never blocks): its blocks are freed and its stream ends."""
        def run() -> None:
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.dropped = True
                stream.put(ENDED)
            self.engine.abort(request_id)
        self._post_quietly(_Command(run))

    def _engine_call(self, name: str, *args: Any) -> Any:
        """One of info.CALLS on the engine thread, waited for (EngineCalls' methods: stats, pin, dashboard, ...)."""
        return self._call(lambda: CALLS[name](self.engine, *args))

    @cached_property
    def info(self) -> EngineInfo:
        """The engine's identity and limits (fixed once it has started)."""
        return EngineInfo.of(self.engine)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step (and the engine, if this AsyncEngine owns it). Every stream
        still pending fails with EngineStoppedError, and so does every later call; unfinished requests are aborted."""
        self._stopping = True
        with self._lock:
            if self._closed is None:
                self._commands.put(_Command(lambda: None))  # wakes an idle thread
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():  # a step that does not return: fail the waiters now, the thread ends later
            self._close(EngineStoppedError(f"{SHUT_DOWN} (its last step was still running after {timeout:g} s)"))
        elif self.owns_engine:
            self.engine.shutdown()
