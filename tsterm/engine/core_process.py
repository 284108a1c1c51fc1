"""The engine core in a process of its own, and the front-end's client of it.

Why: in one process the front-ends' Python (the TUI's repaint, the server's JSON, detokenised streams to 32
clients, Jinja) holds the GIL while the engine thread wants to schedule and launch kernels. Measured in
benchmarks/engine_contention.py (BENCHMARKS.md "Engine core in or out of process"): +4.5-6.2% on the default
model's CPU step, +37% on a 3 ms step (a GPU decode step is that short). In its own process the core's loop
(`run_core`) never waits for the front-ends' GIL.

The child builds the engine (from a picklable `build(progress)`, so the weights load there and only there), says
it is ready with its EngineInfo, then loops: take the front's messages (add, abort, a call from info.CALLS,
shutdown), step while there is work, send each step's outputs as deltas (wire.py). Messages travel over one
duplex pipe (multiprocessing.connection: pickle over a socket pair), in order in both directions.

`EngineCoreProcess` is the front's side, with AsyncEngine's API (generate, abort, stats, pin, dashboard, ...,
shutdown) and its promises: a request's failure fails its stream only; a cancelled or abandoned `generate` aborts
its request; every wait has a timeout; when the core stops (shutdown, a crash, a kill) every pending stream and
call fails with an EngineStoppedError that says why, and so does every later one.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tsterm.config import SamplingParams
from tsterm.engine.info import CALLS, EngineCalls, EngineInfo
from tsterm.engine.streams import ENDED, Stream, deliver, next_item, step_error
from tsterm.engine.wire import OutputDecoder, OutputEncoder, portable
from tsterm.errors import EngineStoppedError, EngineTimeoutError, RequestError, TstermError
from tsterm.outputs import RequestOutput

if TYPE_CHECKING:
    from tsterm.engine.engine import Engine
    from tsterm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
Build = Callable[[ProgressFn], "Engine"]  # picklable: sent to the core process, which runs it to load the engine
SHUT_DOWN = ("the engine was shut down (EngineCoreProcess.shutdown): it takes no new requests and unfinished ones "
             "were aborted")


# ---- the core's side (the child process) ---------------------------------------------------------------------

def run_core(conn: Connection, build: Build) -> None:
    """The core's work: build the engine, then serve the front over `conn` until told to stop or the front is gone
    (its end of the pipe closed: the front exited or was killed)."""
    def progress(done: int, total: int, what: str) -> None:
        conn.send(("progress", done, total, what))

    try:
        engine = build(progress)
    except BaseException as e:  # noqa: BLE001 - the front raises it (a ModelLoadError names the file)
        conn.send(("failed", portable(e)))
        return
    try:
        conn.send(("ready", EngineInfo.of(engine)))
        _Core(engine, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the front is gone: nobody to tell
    except BaseException as e:  # noqa: BLE001 - the front fails every waiter with it
        log.warning("the engine core stopped on an unexpected error", exc_info=True)
        try:
            conn.send(("stopped", portable(e)))
        except OSError:
            pass
    finally:
        engine.shutdown()  # a multi-rank engine's workers end with the core


def main(argv: list[str]) -> None:
    """`python -m tsterm.engine.core_process FD`: the core process. FD is its end of a socket pair; the front sends
    its sys.path first (so that `build` unpickles as it pickled), then `build`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle: it shuts the core down
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    conn = Connection(int(argv[0]))
    try:
        sys.path[:] = conn.recv()
        build = conn.recv()
    except (EOFError, OSError):
        return  # the front gave up before the core started
    run_core(conn, build)


class _Core:
    def __init__(self, engine: Engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self.encoder = OutputEncoder()
        self.stopping = False

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while not self.stopping:
            if not engine.has_unfinished():
                self.handle(conn.recv())  # idle: sleep until the front has something
            while not self.stopping and conn.poll():
                self.handle(conn.recv())
            if self.stopping or not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails every request in flight, not the core
                log.debug("an engine step failed", exc_info=True)
                self.fail_requests(e)
                continue
            if outputs:
                conn.send(("outputs", self.encoder.encode(outputs)))
        for request_id in list(engine.requests):
            engine.abort(request_id)

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, options = message
            try:
                self.engine.add_request(prompt, params, request_id, **options)
            except Exception as e:  # noqa: BLE001 - a bad request fails its stream only
                self.conn.send(("rejected", request_id, portable(e)))
            else:
                self.conn.send(("added", request_id))
        elif kind == "abort":
            request_id = message[1]
            self.engine.abort(request_id)
            self.encoder.forget(request_id)
            self.conn.send(("ended", request_id))
        elif kind == "call":
            _, call_id, name, args = message
            try:
                value = CALLS[name](self.engine, *args)
            except Exception as e:  # noqa: BLE001 - raised on the caller's side
                self.conn.send(("error", call_id, portable(e)))
            else:
                self.conn.send(("result", call_id, value))
        elif kind == "shutdown":
            self.stopping = True
        else:
            raise ValueError(f"unknown message {kind!r} from the front")

    def fail_requests(self, error: Exception) -> None:
        request_ids = list(self.engine.requests)
        for request_id in request_ids:
            self.engine.abort(request_id)
            self.encoder.forget(request_id)
        self.conn.send(("failed_step", request_ids, portable(error)))
        if self.engine.has_unfinished():  # aborting did not clear them: stepping again would fail forever
            raise EngineStoppedError("the engine could not abort its requests after a failed step") from error


# ---- the front's side ----------------------------------------------------------------------------------------

class _Call:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def _stop_at_exit(ref: weakref.ReferenceType) -> None:
    client = ref()
    if client is not None:
        client.shutdown()


class EngineCoreProcess(EngineCalls):
    def __init__(self, build: Build, progress: ProgressFn | None = None, call_timeout: float = 120.0,
                 output_timeout: float | None = 600.0, log_path: str | None = None):
        """Start the core process and wait until its engine is loaded (blocking; `progress` sees the load as the
        child reports it). A failed load raises its error here (a ModelLoadError, a ConfigError); a child that dies
        while loading, an EngineStoppedError with its exit code. The timeouts are AsyncEngine's; `log_path`: where
        the core's output goes (None: this process's stderr)."""
        self.call_timeout, self.output_timeout = call_timeout, output_timeout
        # A fresh interpreter (`python -m`): no fork of the front's threads, and unlike multiprocessing's spawn it
        # never re-imports the front's __main__. Not a daemon: the core may start worker processes of its own.
        ours, theirs = socket.socketpair()
        if log_path is not None:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        output = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child holds it
        try:
            self._process = subprocess.Popen([sys.executable, "-m", "tsterm.engine.core_process", str(theirs.fileno())],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=output,
                                             stderr=output)
        finally:
            theirs.close()
            if output is not None:
                output.close()
        self._conn = Connection(ours.detach())
        self._conn.send(list(sys.path))
        self._conn.send(build)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _streams, _calls and _closed
        self._streams: dict[str, Stream] = {}  # request id -> its consumer, from `generate` to its last output
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._closed: EngineStoppedError | None = None
        self._decoder = OutputDecoder()
        self.info: EngineInfo = self._wait_ready(progress, log_path)
        self._tokenizer: Tokenizer | None = None
        # at exit: a core still running is shut down (its engine's workers too), not left to notice the closed pipe
        self._at_exit = functools.partial(_stop_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        self._reader = threading.Thread(target=self._read, name="tsterm-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, progress: ProgressFn | None, log_path: str | None) -> EngineInfo:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                where = f"see {log_path}" if log_path else "see its messages above"
                raise EngineStoppedError(f"the engine process exited while loading (exit code "
                                         f"{self._process.wait()}): {where}") from None
            kind = message[0]
            if kind == "progress":
                if progress is not None:
                    progress(*message[1:])
            elif kind == "ready":
                return message[1]
            else:  # "failed"
                self._process.wait()
                raise message[1]

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, loaded in this process from the model directory (the core has its own)."""
        if self._tokenizer is None:
            from tsterm.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.info.model)
        return self._tokenizer

    # ---- the reader thread: every message from the core, in order ---------------------------------------------

    def _read(self) -> None:
        reason = EngineStoppedError(SHUT_DOWN)
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "stopped":
                    reason = EngineStoppedError(
                        f"the engine process stopped on an unexpected error ({type(message[1]).__name__}: "
                        f"{message[1]}); unfinished requests were aborted, restart tsterm to continue")
                    reason.__cause__ = message[1]
                    break
                self._dispatch(message)
        except (EOFError, OSError):
            if self._closed is None:  # not our own shutdown: the core died (killed, out of memory, a crash)
                try:
                    code = self._process.wait(5.0)
                except subprocess.TimeoutExpired:
                    code = None
                reason = EngineStoppedError(f"the engine process exited unexpectedly (exit code {code}); unfinished "
                                            "requests were aborted, restart tsterm to continue")
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave waiters hanging
            log.warning("the engine core's reader stopped on an unexpected error", exc_info=True)
            reason = EngineStoppedError(f"tsterm lost the engine process's messages ({type(e).__name__}: {e})")
        self._close(reason)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self._deliver(message[1])
        elif kind == "added":
            with self._lock:
                stream = self._streams.get(message[1])
                if stream is not None:
                    stream.added = True
            if stream is not None and not stream.put(message[1]):
                self._drop(stream)
        elif kind == "rejected":
            with self._lock:
                stream = self._streams.pop(message[1], None)
            if stream is not None:
                stream.put(message[2])
        elif kind == "ended":
            self._decoder.forget(message[1])
        elif kind == "failed_step":
            _, request_ids, error = message
            if not isinstance(error, TstermError):  # consumers (the server's routes) handle tsterm's errors
                error = step_error(error, "the requests in it were aborted")
            for request_id in request_ids:
                self._decoder.forget(request_id)
                with self._lock:
                    stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(error)
        elif kind in ("result", "error"):
            with self._lock:
                call = self._calls.pop(message[1], None)
            if call is not None:
                if kind == "result":
                    call.value = message[2]
                else:
                    call.error = message[2]
                call.done.set()

    def _deliver(self, encoded: list[tuple]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput | Exception]]] = {}
        for item in encoded:
            out = self._decoder.decode(item)
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and not stream.added:  # an earlier request of the same id, aborted
                    stream = None
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None or stream.dropped:
                continue
            value: RequestOutput | Exception = out
            if out.error is not None:  # the engine failed on this request (and only on it)
                value = step_error(out.error, "this request was failed; the engine serves the others")
            by_loop.setdefault(stream.loop, []).append((stream, value))
        for stream in deliver(by_loop):
            self._drop(stream)

    # ---- any thread --------------------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._lock:
            if self._closed is not None:
                raise self._stopped_error()
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # the pipe is gone: the reader says why, if it has not yet
            raise EngineStoppedError(f"the engine process is gone ({type(e).__name__}: {e})") from None

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except EngineStoppedError:
            pass  # the core has stopped: every request was aborted already

    def _drop(self, stream: Stream) -> None:
        """The consumer has left: abort its request if it is still its own."""
        stream.dropped = True
        rid = stream.request_id
        with self._lock:
            owned = rid is not None and self._streams.get(rid) is stream
            if owned:
                del self._streams[rid]
        if owned:
            self._send_quietly(("abort", rid))

    def _close(self, reason: EngineStoppedError) -> None:
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for stream in streams:
            stream.put(self._stopped_error())
        for call in calls:
            call.error = self._stopped_error()
            call.done.set()

    def _stopped_error(self) -> EngineStoppedError:
        error = EngineStoppedError(str(self._closed))
        error.__cause__ = self._closed.__cause__
        return error

    def _engine_call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """One of info.CALLS in the core, between two of its steps (EngineCalls' methods)."""
        call, call_id = _Call(), next(self._call_ids)
        with self._lock:
            if self._closed is not None:
                raise self._stopped_error()
            self._calls[call_id] = call
        try:
            self._send(("call", call_id, name, args))
        except EngineStoppedError:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        limit = self.call_timeout if timeout is None else timeout
        if not call.done.wait(limit):
            with self._lock:
                self._calls.pop(call_id, None)
            raise EngineTimeoutError(f"the engine did not answer within {limit:g} s: its current step has run that "
                                     "long or is stuck (raise call_timeout for very slow steps)")
        if call.error is not None:
            raise call.error
        return call.value

    # ---- the API (AsyncEngine's) -------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: a RequestOutput per step that produced text, the last with `finished=True`;
        leaving early aborts the request; `abort(request_id)` ends the iteration without a final output."""
        stream = Stream(asyncio.get_running_loop())
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        with self._lock:
            if self._closed is not None:
                raise self._stopped_error()
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in use", param="request_id")
            self._streams[rid] = stream
        stream.request_id = rid
        options = {} if cache_salt is None else {"cache_salt": cache_salt}
        finished = False
        try:
            self._send(("add", rid, prompt, params, options))
            await next_item(stream, self.call_timeout)  # the request id, once the core has added it
            while not finished:
                item = await next_item(stream, self.output_timeout)
                if item is ENDED:
                    return
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._drop(stream)  # the abort reaches the core after the add: messages keep their order

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread, never blocks): its blocks are freed and its stream ends."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.dropped = True
            stream.put(ENDED)
        self._send_quietly(("abort", request_id))

    @property
    def pid(self) -> int | None:
        """The core process's id."""
        return self._process.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core after its current step: unfinished requests are aborted, its engine (and any workers)
        shut down, the process ends. Every pending stream and later call fails with EngineStoppedError."""
        atexit.unregister(self._at_exit)
        self._send_quietly(("shutdown",))
        self._close(EngineStoppedError(SHUT_DOWN))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:  # a step that does not return
            log.warning("the engine process did not stop within %g s: terminating it", timeout)
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)  # it has read the end of the pipe: the process is gone
        self._conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
