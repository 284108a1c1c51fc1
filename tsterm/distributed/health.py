"""Liveness of the worker ranks, apart from the collectives (an NCCL collective whose peer died never raises).

Each worker beats: a thread adds 1 to its store key `heartbeat/R` every `beat_interval(timeout)` seconds, over a
store connection of its own (the main one may be blocked in a long `get`). On rank 0, `WorkerWatch` (a thread) wakes
at once when a worker's process ends (the workers rank 0 started: their process sentinels), and every interval
reads the heartbeats: a worker whose count has not moved for `timeout_s` (stopped, hung, or on another machine and
gone) is declared dead. Either way the watch records the first dead rank and calls `on_failure` (the executor
aborts the groups, which ends an NCCL collective that waits on the dead rank; the engine's next look raises).
"""
from __future__ import annotations

import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_KEY = "heartbeat/{rank}"


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: several within the timeout, at most one a second."""
    return min(1.0, max(0.01, timeout_s / 8))


def open_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    """Another client connection to the ranks' store (tsterm's prefix)."""
    return dist.PrefixStore("tsterm/", dist.TCPStore(host, port, is_master=False, timeout=timeout))


class Heartbeat:
    """A worker's beat: a thread that counts up its store key until `stop`, the process's end, or until the store
    (rank 0's, or torchrun's) is gone."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        self.store = open_store(host, port, timedelta(seconds=max(timeout_s, 30.0)))
        self.key, self.interval = HEARTBEAT_KEY.format(rank=rank), beat_interval(timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"tsterm-heartbeat{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        try:
            while not self._stop.is_set():
                self.store.add(self.key, 1)
                self._stop.wait(self.interval)
        except (RuntimeError, OSError):  # the store went away with rank 0: nobody is left to tell
            pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class WorkerWatch:
    """Rank 0: notices a dead worker within `timeout_s` (a process that exits: at once)."""

    def __init__(self, store: dist.Store, ranks: list[int], sentinels: dict[int, int], timeout_s: float,
                 on_failure: Callable[[int, str], None]):
        """`store`: a connection of the watch's own; `sentinels`: rank -> process sentinel, for the workers this
        process started; `on_failure(rank, how)` runs once, on the watch's thread."""
        self.store, self.ranks, self.sentinels = store, ranks, sentinels
        self.timeout_s, self.interval = timeout_s, beat_interval(timeout_s)
        self.on_failure = on_failure
        self.dead: tuple[int, str] | None = None  # (rank, "exited" | "no heartbeat")
        self.failed = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tsterm-worker-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (before the workers are told to stop: their exits are not failures)."""
        self._stopping = True
        self._wake_w.send(None)
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def _heartbeats(self) -> dict[int, int]:
        return {rank: self.store.add(HEARTBEAT_KEY.format(rank=rank), 0) for rank in self.ranks}

    def _run(self) -> None:
        by_sentinel = {sentinel: rank for rank, sentinel in self.sentinels.items()}
        try:
            last = self._heartbeats()
        except (RuntimeError, OSError):
            last = {}
        seen = dict.fromkeys(self.ranks, time.monotonic())
        while not self._stopping:
            ready = multiprocessing.connection.wait([self._wake_r, *by_sentinel], timeout=self.interval)
            if self._stopping:
                return
            exited = sorted(by_sentinel[s] for s in ready if s in by_sentinel)
            if exited:
                return self._declare(exited[0], "exited")
            try:
                beats = self._heartbeats()
            except (RuntimeError, OSError):  # the store is gone (torchrun's agent): the collectives will tell
                return
            now = time.monotonic()
            for rank in self.ranks:
                if beats[rank] != last.get(rank):
                    last[rank], seen[rank] = beats[rank], now
                elif now - seen[rank] > self.timeout_s:
                    return self._declare(rank, "no heartbeat")

    def _declare(self, rank: int, how: str) -> None:
        self.dead = (rank, how)
        self.failed.set()
        self.on_failure(rank, how)

