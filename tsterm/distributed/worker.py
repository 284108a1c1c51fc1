"""A worker rank: its shard of the model, driven by rank 0's commands until `STOP` (or until rank 0 is gone).

Started by `DistributedExecutor` as a spawned process, one per rank past 0. It reports through the store: `ready/R`
once it can build its groups, `blocks/R` with the KV blocks that fit on it, `error/R` with a one-line reason when
it fails, `heartbeat/R` counting up while it lives (`tsterm.distributed.health`), and `tables/R` when asked for its
block-table mirror, and `tier/opened/R` once it has opened its KV tier as rank 0 asked (empty, or why not). Any
failure ends the process; rank 0 notices (its process ends, its heartbeat stops, or a collective fails) and reports
it.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from tsterm.distributed import protocol
from tsterm.distributed.groups import IDLE_TIMEOUT, Groups, RankContext, connect_store
from tsterm.distributed.health import Heartbeat
from tsterm.distributed.tables import TableMirror
from tsterm.errors import ConfigError
from tsterm.engine.executor import ExecutorSpec
from tsterm.engine.kv_tier import SAVE_SNAPSHOT, Fetched, KVTier, open_rank_tier
from tsterm.engine.model_runner import ModelRunner
from tsterm.model.parallel import ParallelLayout


@dataclass(frozen=True)
class WorkerArgs:
    layout: ParallelLayout
    spec: ExecutorSpec  # the rank's own device; no progress callback
    store_host: str
    store_port: int
    timeout_s: float
    num_threads: int


def worker_main(args: WorkerArgs) -> None:
    torch.set_num_threads(args.num_threads)
    if args.spec.device.type == "cuda":
        torch.cuda.set_device(args.spec.device)  # NCCL binds a rank to the current device
    rank = args.layout.rank
    store = connect_store(args.store_host, args.store_port, args.layout.world_size, False, IDLE_TIMEOUT)
    try:
        Heartbeat(args.store_host, args.store_port, rank, args.timeout_s)  # beats until the process ends
        store.set(f"ready/{rank}", str(os.getpid()))
        groups = Groups(store, args.layout, args.spec.device, timedelta(seconds=args.timeout_s))

        def agree(num_blocks: int) -> int:
            store.set(f"blocks/{rank}", str(num_blocks))
            return int(store.get("blocks/agreed"))

        runner = ModelRunner(args.spec, RankContext(args.layout, groups, agree))

        def open_tier() -> KVTier | None:
            try:
                tier = open_rank_tier(json.loads(store.get("tier/open")), runner, rank)
            except ConfigError as e:  # (rank 0 raises it, naming the option; this rank goes on without a tier)
                store.set(f"tier/opened/{rank}", str(e))
                return None
            store.set(f"tier/opened/{rank}", "")
            return tier

        serve(runner, groups, want_logits=args.layout.ep_rank == 0,
              report=lambda tables: store.set(f"tables/{rank}", json.dumps(tables)), open_tier=open_tier)
        groups.close()
    except BaseException as e:  # noqa: BLE001 - any failure: say why where rank 0 reads it, then exit non-zero
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}".splitlines()[0][:500] if str(e) else type(e).__name__)
        except Exception:  # noqa: BLE001 - rank 0 (and its store) may be gone already
            pass
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)


def serve(runner: ModelRunner, groups: Groups, want_logits: bool, report, open_tier=None) -> None:
    """Run rank 0's commands. `want_logits`: this rank takes part in gathering the logits (rank 0's tp group);
    `report(tables)`: hand rank 0 the block-table mirror ({seq_id: block ids}); `open_tier()`: this rank's KV tier
    as rank 0 asked (None: refused, rank 0 was told why)."""
    mirror = TableMirror()
    tier: KVTier | None = None
    fetched: dict[int, Fetched] = {}  # serial -> the blocks of a fetch, until the load that copies them
    snapshots: dict[int, Fetched] = {}  # serial -> a hybrid's state snapshot, likewise
    try:
        while True:
            kind, words = protocol.receive(groups.control)
            if kind == protocol.Command.STEP:
                fetched.clear()  # (a fetch not loaded by now never will be)
                snapshots.clear()
                step, seq_ids, updates, freed = protocol.parse_step(words)
                step.block_tables = mirror.apply(seq_ids, updates, freed)
                runner.run_step(step, logits=want_logits)
            elif kind == protocol.Command.COPY_BLOCKS:
                runner.copy_blocks(protocol.pairs(words))
            elif kind == protocol.Command.COPY_STATES:
                runner.copy_states(protocol.pairs(words))
            elif kind == protocol.Command.REPORT_TABLES:
                report(mirror.tables)
            elif kind == protocol.Command.TIER_OPEN:
                tier = open_tier()
            elif kind == protocol.Command.TIER_SAVE:
                tier.apply_saves(protocol.unpack(words))
            elif kind == protocol.Command.TIER_FETCH:
                serial, *reads = protocol.unpack(words)
                got = tier.fetch_words(reads)  # (None: a state snapshot this rank does not have)
                n = protocol.all_reduce_min(groups.control, 0 if got is None else len(got))  # what every rank read
                if n and reads[0][0] == SAVE_SNAPSHOT:
                    snapshots[serial[0]] = got
                elif n:  # the leading n blocks
                    fetched[serial[0]] = Fetched(got.data[:n], got.rows[:n], serial[0])
            elif kind == protocol.Command.TIER_LOAD:
                for serial, *ids in protocol.unpack(words):
                    if serial in snapshots:  # (ids: the state slot)
                        tier.load_snapshot(ids[0], snapshots.pop(serial))
                    else:
                        tier.copy_in([(ids, fetched.pop(serial))])
            elif kind == protocol.Command.TIER_FLUSH:
                if tier is not None:
                    tier.flush()
                protocol.all_reduce_min(groups.control, 0)  # (rank 0 waits until every store has written)
            else:
                return
    finally:
        if tier is not None:
            tier.close()  # its queued writes finish before the process ends
