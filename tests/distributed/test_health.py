"""The worker watch on its own, with no process handles (torchrun's ranks): a rank whose heartbeat stops is declared
dead by its heartbeat alone, while a rank that keeps beating is not."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tsterm.distributed.health import Heartbeat, WorkerWatch, open_store

GUARD_S = 120.0


def test_a_rank_whose_heartbeat_stops_is_declared_dead():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = open_store("127.0.0.1", master.port, timedelta(seconds=30))
    timeout_s = 2.0
    beating = Heartbeat("127.0.0.1", master.port, 2, timeout_s)  # rank 2 beats all along
    store.add("heartbeat/1", 1)  # rank 1 beat once, then stopped
    verdicts = []
    watch = WorkerWatch(open_store("127.0.0.1", master.port, timedelta(seconds=30)), [1, 2], {}, timeout_s,
                        lambda rank, how: verdicts.append((rank, how)))
    try:
        assert watch.failed.wait(GUARD_S)
        assert watch.dead == (1, "no heartbeat") and verdicts == [(1, "no heartbeat")]
        assert store.add("heartbeat/2", 0) > 1  # rank 2 kept beating meanwhile
    finally:
        watch.stop()
        beating.stop()
