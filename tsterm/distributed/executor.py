"""The rank-0 executor: the engine's process is rank 0 and starts one worker process per other rank.

The engine's scheduler, block pool and prefix cache stay here and decide for every rank: each rank keeps its
heads' KV under the same block ids. Each engine call becomes one broadcast command (the step's host lists with
only what changed in the block tables, `tsterm.distributed.tables`; or the copy-on-write pairs); then every rank
runs its shard of the step, and rank 0 returns the gathered logits. The KV tiers (`kv_disk`, `kv_host_bytes`) work the
same way: rank 0's tier decides which blocks are saved and read, and each rank moves its own share to and from its own
store (`open_rank_tiers` and the `tier_*` calls: `tsterm.engine.kv_tier.RankTiers`).

Under torchrun (`python -m tsterm.distributed.torchrun`, see there) the workers are torchrun's processes, on this machine or
others: the executor attaches to them through torchrun's store instead of starting any.

Faults: a `WorkerWatch` thread (`tsterm.distributed.health`) sees a worker's process end at once, and a worker whose
heartbeat stops (stopped, hung, or a torchrun rank that is gone) within `distributed_timeout_s`; it aborts the
groups, which ends an NCCL collective waiting on that rank (an NCCL wait never raises by itself). On the CPU a
gloo collective with a dead peer fails at once, and one with a hung peer times out after `distributed_timeout_s`.
Either way the executor stops every worker and raises `DistributedError` naming the rank (a failure found while
the engine was idle, at its next call), and every later call raises it again: nothing waits forever. Starting
(imports, weight loading) is bounded by `max(distributed_timeout_s, START_TIMEOUT_S)`, and a worker that dies
while starting is reported at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from tsterm.distributed import protocol
from tsterm.distributed.groups import Groups, RankContext, connect_store
from tsterm.distributed.health import WorkerWatch, beat_interval, open_store
from tsterm.distributed.tables import TableSender
from tsterm.distributed.worker import WorkerArgs, worker_main
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.executor import Executor, ExecutorSpec
from tsterm.engine.model_runner import ModelRunner
from tsterm.errors import ConfigError, DistributedError
from tsterm.model.parallel import ParallelLayout

START_TIMEOUT_S = 600.0  # importing torch and reading a large shard can take minutes
# set by `tsterm.distributed.torchrun` on rank 0: attach to torchrun's ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
TORCHRUN_ENV = "TSTERM_TORCHRUN"
POLL_S = 0.02


def _stop_processes(processes: list[multiprocessing.Process]) -> None:
    """Kill the workers still running (also what a garbage-collected executor left) and reap them."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)


def _release(processes: list[multiprocessing.Process], held: list) -> None:
    """What a garbage-collected executor left: its workers, its watch and its process groups."""
    _stop_processes(processes)
    for thing in held:
        with contextlib.suppress(RuntimeError, OSError):
            thing.stop() if isinstance(thing, WorkerWatch) else thing.close()


class DistributedExecutor(Executor):
    """Tensor x expert parallel over `config.tensor_parallel_size x config.expert_parallel_size` ranks."""

    def __init__(self, spec: ExecutorSpec):
        config = spec.config
        self.layout = layout = ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size, rank=0)
        layout.check(spec.model_config, str(spec.model_dir))
        world = layout.world_size
        first = spec.device.index or 0
        if spec.device.type == "cuda" and torch.cuda.device_count() < first + world:
            raise ConfigError(f"{world} ranks from {spec.device} need CUDA devices {first}..{first + world - 1}; this "
                              f"machine has {torch.cuda.device_count()}")
        self.timeout_s = config.distributed_timeout_s
        self._failure: DistributedError | None = None
        self._closed = False
        self.tables = TableSender()
        self._tier_saves: list[list[int]] = []  # the KV tier's saves for the workers, sent ahead of the next command
        self.control_bytes = 0  # sent to each worker on the control group, since start
        self.last_step_bytes = 0  # of those, by the last step
        timeout = timedelta(seconds=self.timeout_s)
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)  # rank 0 too: NCCL and the current stream follow the current device
        if os.environ.get(TORCHRUN_ENV) == "1":  # torchrun started every rank: use its rendezvous store
            if int(os.environ["WORLD_SIZE"]) != world or int(os.environ["RANK"]) != 0:
                raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks (this one rank "
                                  f"{os.environ['RANK']}) but tensor_parallel_size x expert_parallel_size is {world}")
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store_host, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            self.store = connect_store(store_host, store_port, world, not agent_store, timeout)
            self.processes: list[multiprocessing.Process] = []
        else:
            master = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
            store_host, store_port = "127.0.0.1", master.port
            self.store = dist.PrefixStore("tsterm/", master)
            self.processes = self._spawn(spec, master.port)
        held: list = []  # what the finalizer releases besides the processes
        self._finalizer = weakref.finalize(self, _release, self.processes, held)
        try:
            self._wait_for("ready", max(self.timeout_s, START_TIMEOUT_S), "start")
            self.groups = Groups(self.store, layout, spec.device, timedelta(seconds=self.timeout_s))
            held.append(self.groups)
            self.runner = ModelRunner(spec, RankContext(layout, self.groups, self._agree_min))
            groups = self.groups  # (the watch's thread must not hold the executor: its finalizer would never run)
            self.watch = WorkerWatch(open_store(store_host, store_port, timeout), list(range(1, world)),
                                     {rank: p.sentinel for rank, p in enumerate(self.processes, 1)}, self.timeout_s,
                                     lambda rank, how: groups.abort())
            held.insert(0, self.watch)
        except BaseException:
            _release(self.processes, held)
            raise
        # torchrun's workers outlive a command that never shuts its engine down: stop them when this process exits
        self._stop_at_exit = weakref.finalize(self, _send_stop, self.groups.control) if not self.processes else None
        self.num_blocks, self.max_model_len = self.runner.num_blocks, self.runner.max_model_len
        self.kv_bytes_per_block = self.runner.kv_bytes_per_block * world  # every rank holds as many KV heads
        self.kernels = self.runner.kernels
        self.num_state_slots = self.runner.num_state_slots
        self.state_bytes = self.runner.state_bytes * world  # every rank holds its share of each slot

    def _spawn(self, spec: ExecutorSpec, store_port: int) -> list[multiprocessing.Process]:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or CUDA state
        threads = max(1, (os.cpu_count() or 1) // self.layout.world_size)
        processes = []
        with _real_stderr():
            for rank in range(1, self.layout.world_size):
                # CUDA: rank r on the r-th device after rank 0's
                device = (torch.device("cuda", (spec.device.index or 0) + rank) if spec.device.type == "cuda"
                          else spec.device)
                args = WorkerArgs(dataclasses.replace(self.layout, rank=rank),
                                  dataclasses.replace(spec, device=device, progress=None),
                                  "127.0.0.1", store_port, self.timeout_s, threads)
                process = context.Process(target=worker_main, args=(args,), name=f"tsterm-rank{rank}", daemon=True)
                process.start()
                processes.append(process)
        return processes

    # ---------------------------------------------------------------------------------------------------------
    # start

    def _wait_for(self, key: str, limit_s: float, what: str) -> list[int]:
        """Each worker's `key/R` value, polling the store; a worker that exits first is reported at once."""
        deadline = time.monotonic() + limit_s
        values: dict[int, int] = {}
        workers = self.layout.world_size - 1
        while len(values) < workers:
            for rank in range(1, self.layout.world_size):
                if rank not in values and self.store.check([f"{key}/{rank}"]):
                    values[rank] = int(self.store.get(f"{key}/{rank}"))
            dead = [rank for rank, p in enumerate(self.processes, 1) if p.exitcode is not None and rank not in values]
            if dead:
                raise self._error(f"while starting ({what})")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.layout.world_size)) - set(values))
                raise DistributedError(f"worker rank(s) {missing} did not {what} within {limit_s:g} s")
            if len(values) < workers:
                time.sleep(POLL_S)
        return [values[rank] for rank in sorted(values)]

    def _agree_min(self, num_blocks: int) -> int:
        agreed = min([num_blocks, *self._wait_for("blocks", max(self.timeout_s, START_TIMEOUT_S), "load its weights")])
        self.store.set("blocks/agreed", str(agreed))
        return agreed

    # ---------------------------------------------------------------------------------------------------------
    # steps

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self._check_usable()
        step = self.runner.host_step(batch)
        seq_ids, updates, freed = self.tables.updates(batch.seqs, step.block_tables)
        try:
            self._send_tier_saves()
            self.last_step_bytes = protocol.send(self.groups.control, protocol.Command.STEP,
                                                 protocol.step_payload(step, seq_ids, updates, freed))
            self.control_bytes += self.last_step_bytes
            logits = self.runner.run_step(step)
            if logits.is_cuda:  # an NCCL wait does not block the host: wait here, where a dead peer is noticed
                torch.cuda.current_stream(logits.device).synchronize()  # (the watch's abort ends the wait)
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection, or the timeout passed
            raise self._fail(e) from None
        except BaseException:  # rank 0 itself stopped mid-step (an interrupt): the ranks are out of step for good
            self._abandon()
            raise
        if self.watch.failed.is_set():  # the step ended because the watch aborted the groups: its logits are void
            raise self._fail(None)
        return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._broadcast(protocol.Command.COPY_BLOCKS, pairs)
        self.runner.copy_blocks(pairs)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        self._broadcast(protocol.Command.COPY_STATES, pairs)
        self.runner.copy_states(pairs)

    def _broadcast(self, command: protocol.Command, payload: list[tuple[int, int]]) -> None:
        """Send every worker a command that rank 0 then runs on its own shard too."""
        self._command(command, protocol.flatten(payload))

    def _command(self, command: protocol.Command, words: list[int], reduce: int | None = None) -> int | None:
        """Send every worker a command (after the KV tier's queued saves); with `reduce`, then the least of it and
        the workers' answers (`protocol.all_reduce_min`)."""
        self._check_usable()
        try:
            self._send_tier_saves()
            self.control_bytes += protocol.send(self.groups.control, command, words)
            return None if reduce is None else protocol.all_reduce_min(self.groups.control, reduce)
        except RuntimeError as e:
            raise self._fail(e) from None
        except BaseException:
            self._abandon()
            raise

    def _send_tier_saves(self) -> None:
        """The KV tier's saves since the last command, before any command that could write the pool's blocks."""
        if self._tier_saves:
            saves, self._tier_saves = self._tier_saves, []
            self.control_bytes += protocol.send(self.groups.control, protocol.Command.TIER_SAVE,
                                                protocol.pack(*saves))

    # ---------------------------------------------------------------------------------------------------------
    # the KV tiers (`tsterm.engine.kv_tier.RankTiers`): rank 0 decides, each rank moves its share of every block

    def open_rank_tiers(self, request: dict) -> None:
        """Every worker opens its own KV tier as `request` says (`kv_tier.open_rank_tier`); ConfigError with the
        first worker's reason when one cannot."""
        workers = range(1, self.layout.world_size)
        for rank in workers:
            self.store.delete_key(f"tier/opened/{rank}")
        self.store.set("tier/open", json.dumps(request))
        self._command(protocol.Command.TIER_OPEN, [])
        keys = [f"tier/opened/{rank}" for rank in workers]
        self.store.wait(keys, timedelta(seconds=max(self.timeout_s, START_TIMEOUT_S)))
        for rank, key in zip(workers, keys):
            reason = self.store.get(key).decode()
            if reason:
                raise ConfigError(f"{reason} (worker rank {rank})")

    def tier_save(self, words: list[int]) -> None:
        self._tier_saves.append(words)

    def tier_fetch(self, serial: int, reads: list[list[int]], have: int) -> int:
        return self._command(protocol.Command.TIER_FETCH, protocol.pack([serial], *reads), reduce=have)

    def tier_load(self, loads: list[list[int]]) -> None:
        if loads:
            self._command(protocol.Command.TIER_LOAD, protocol.pack(*loads))

    def tier_flush(self) -> None:
        """Every worker's store has written its queue; nothing to wait for once the ranks have failed or stopped."""
        if self._failure is None and not self._closed and not self.watch.failed.is_set():
            self._command(protocol.Command.TIER_FLUSH, [], reduce=0)

    def expert_load(self) -> list[list[int]]:
        return self.runner.expert_load()  # routing is replicated: rank 0 counts every expert's tokens

    def rank_expert_load(self) -> list[int]:
        """Tokens routed to each rank's experts since start, over every MoE layer (a rank of an ep group holds a
        column share of each of its group's experts: its group's count)."""
        load = self.runner.expert_load()
        if not load:
            return []
        per_expert = [sum(column) for column in zip(*load)]  # [E]
        return [sum(per_expert[slice(first, first + count)])
                for first, count in (dataclasses.replace(self.layout, rank=rank).experts(len(per_expert))
                                     for rank in range(self.layout.world_size))]

    def counters(self) -> dict[str, int]:
        counters = dict(self.runner.counters())
        for name in ("cow_bytes", "state_copy_bytes", "state_snapshot_bytes"):  # each rank copies its share
            counters[name] *= self.layout.world_size
        counters["ranks"] = self.layout.world_size
        counters["control_bytes"] = self.control_bytes
        return counters

    def block_tables(self) -> dict[int, list[int]]:
        """Rank 0's record of the block tables the workers hold, {seq_id: block ids}."""
        return self.tables.tables()

    def worker_block_tables(self) -> list[dict[int, list[int]]]:
        """Each worker's block-table mirror, as it reports it through the store (a consistency check between
        steps; equal to `block_tables()` while the ranks are in step)."""
        workers = range(1, self.layout.world_size)
        for rank in workers:
            self.store.delete_key(f"tables/{rank}")
        self._broadcast(protocol.Command.REPORT_TABLES, [])
        keys = [f"tables/{rank}" for rank in workers]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        return [{int(seq_id): table for seq_id, table in json.loads(self.store.get(key)).items()} for key in keys]

    def rank_memory(self) -> list[dict[str, int]]:
        """Each rank's resident bytes, rank 0 (the engine's whole process) first: `anon` (copied shards, the KV
        pool, activations) and `file` (the pages of the mapped weight files it has read). {} without /proc."""
        return [_resident(pid) for pid in (os.getpid(), *(p.pid for p in self.processes))]

    def rank_stats(self) -> list[dict[str, int]]:
        load = self.rank_expert_load() or [0] * self.layout.world_size
        return [{"rank": rank, "expert_tokens": tokens, **memory}
                for rank, (tokens, memory) in enumerate(zip(load, self.rank_memory()))]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stop_at_exit is not None:
            self._stop_at_exit.detach()
        self.watch.stop()  # before the workers are told to stop: their exits are no failure
        if self._failure is None and not self.watch.failed.is_set():
            with contextlib.suppress(RuntimeError):  # (the KV tier's last saves, if its engine did not close it)
                self._send_tier_saves()
            _send_stop(self.groups.control)
            deadline = time.monotonic() + self.timeout_s
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        else:
            self.groups.abort()
        _stop_processes(self.processes)
        self.groups.close()
        self._finalizer.detach()

    # ---------------------------------------------------------------------------------------------------------
    # faults

    def _check_usable(self) -> None:
        if self._failure is None and self.watch.failed.is_set():  # a worker died while the engine was idle
            self._fail(None, when="between steps")
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise DistributedError("the distributed executor was shut down")

    def _fail(self, cause: Exception | None, when: str = "during a step") -> DistributedError:
        """After a failed collective or the watch's verdict: name the rank, stop every worker, and stay failed."""
        # a worker that is exiting, or whose heartbeat just stopped, is named by the watch: wait for its verdict
        # (at once for an exit; for a hang, shortly after the collective's own timeout)
        self.watch.failed.wait(3 * beat_interval(self.timeout_s) + 0.5)
        self._failure = self._error(when, cause)
        self.groups.abort()
        _stop_processes(self.processes)
        return self._failure

    def _abandon(self) -> None:
        self._failure = DistributedError("distributed engine stopped: rank 0 was interrupted in the middle of a step, "
                                         "so the ranks are out of step; start the engine again")
        _stop_processes(self.processes)
        self.groups.abort()

    def _reason(self, rank: int) -> str | None:
        """What worker `rank` wrote before failing, if anything (the store may be gone with rank 0's agent)."""
        try:
            return self.store.get(f"error/{rank}").decode() if self.store.check([f"error/{rank}"]) else None
        except RuntimeError:
            return None

    def _error(self, when: str, cause: Exception | None = None) -> DistributedError:
        reasons = []
        watch = getattr(self, "watch", None)  # none yet while starting
        dead, how = watch.dead if watch is not None and watch.dead is not None else (None, None)
        for rank, process in enumerate(self.processes, 1):
            if multiprocessing.connection.wait([process.sentinel], timeout=0):
                process.join(timeout=1.0)  # it has ended: reap it for its exit code
            reason = self._reason(rank)
            if process.exitcode is not None or reason:
                code = process.exitcode
                how = ("failed" if code is None else f"was killed by signal {-code}" if code < 0
                       else f"exited with code {code}")
                reasons.append(f"worker rank {rank} (pid {process.pid}) {how}" + (f": {reason}" if reason else ""))
            elif _stopped(process.pid):
                reasons.append(f"worker rank {rank} (pid {process.pid}) is stopped and did not answer within "
                               f"{self.timeout_s:g} s")
            elif rank == dead:
                reasons.append(f"worker rank {rank} (pid {process.pid}) sent no heartbeat for {self.timeout_s:g} s "
                               "(hung?)")
        if not self.processes:  # torchrun's workers: what they wrote before failing, or the heartbeat they missed
            reasons = [f"worker rank {rank}: {self._reason(rank)}" for rank in range(1, self.layout.world_size)
                       if self._reason(rank)]
            if not reasons and how == "no heartbeat":
                reasons = [f"worker rank {dead} sent no heartbeat for {self.timeout_s:g} s (gone or hung)"]
        if not reasons:
            alive = [rank for rank, p in enumerate(self.processes, 1) if p.is_alive()] or \
                list(range(1, self.layout.world_size))
            reasons.append(f"no answer from worker rank(s) {alive} within {self.timeout_s:g} s (hung?)")
        detail = f" ({str(cause).splitlines()[0][:200]})" if cause is not None and str(cause) else ""
        return DistributedError(f"distributed engine failed {when}: {'; '.join(reasons)}{detail}; the engine has "
                                "stopped, start it again")


def _send_stop(control: dist.ProcessGroup) -> None:
    try:
        protocol.send(control, protocol.Command.STOP)
    except RuntimeError:
        pass


@contextlib.contextmanager
def _real_stderr():
    """Spawning hands the child the parent's stderr descriptor (multiprocessing's resource tracker does): under the
    TUI, sys.stderr is Textual's capture with no descriptor (fileno -1), so the OS-level stderr is lent meanwhile."""
    try:
        valid = sys.stderr is not None and sys.stderr.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        valid = False
    if valid or sys.__stderr__ is None:
        yield
        return
    captured, sys.stderr = sys.stderr, sys.__stderr__
    try:
        yield
    finally:
        sys.stderr = captured


def _resident(pid: int) -> dict[str, int]:
    fields = {"RssAnon:": "anon", "RssFile:": "file"}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            words = [line.split() for line in f]
    except OSError:
        return {}
    return {fields[w[0]]: int(w[1]) * 1024 for w in words if len(w) > 1 and w[0] in fields}


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): its state in /proc, where there is one."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
