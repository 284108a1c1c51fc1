"""The KV cache's lower tiers under the device pool, as the KV manager sees them: a host tier (`kv_host`, bounded by
`kv_host_bytes`: host memory, pinned on a GPU; on the CPU a RAM cache under a smaller pool) and the disk store
(`kv_store`, `kv_disk`), either or both. A block copied out of the pool goes to both from one host buffer; the host
tier keeps the most recent ones (spilling to the store what the store lacks when it evicts), the store keeps them
across restarts; a read takes the host tier first, then the store. The rest of this note says "the store" for both.

Write-through: a full block is copied out when it is registered for the prefix cache (it is immutable from then on),
and a finished turn's partly filled last block when it is kept; the copy is queued for the store's writer thread, so
the engine's thread pays only the copy out of the pool (on a GPU, an asynchronous copy into pinned memory on a copy
stream). Write-through rather than write-on-evict because:
- a session must survive its engine: an engine killed or restarted never evicts what its pool holds, and the blocks
  of the sessions just used are exactly those still in the pool;
- copying a block out when `allocate` evicts it would put the copy (and a disk write) on the allocation path, in
  the middle of scheduling, and `BlockPool` evicts without telling anyone;
- an evicted block is already on disk, so eviction stays O(1) and no block's data is ever read after it was freed.
A block already stored (the same chain hash) is not written again.

Loads: a prompt whose next full blocks are not in the pool but are in the store gets them read, checked and copied
into fresh pool blocks, one batch a prompt (one copy into the pool for all its blocks), before its step runs; a block
that is missing, refused (checksum, fingerprint, header) or does not fit in the pool ends the run there, and the
rest is computed. Every byte either way is counted per tier (`ledger`: the copy audit's `kv_tier` phase, kinds
host_write / host_read / disk_write / disk_read, and the stats). With the MTP head, its one-layer pool travels with
the target's under the same block ids, and a step's blocks are copied out at the next schedule's start (the head
writes its KV of a step's positions after the step).

Several ranks (tensor / expert parallel): rank 0's tier decides for every rank, as the scheduler does; each save,
read and copy into the pool is sent to the workers (`RankTiers`: the distributed executor's control commands), and
each worker's own tier does it on its share of the pool, in its own store (`rank<R>` under the store's path, its
fingerprint naming its rank). A load keeps the leading blocks every rank read (a MIN all-reduce), the rest computed;
each store is bounded and evicts by itself, so a block gone from any rank's is a miss for all.

`model_fingerprint` names what makes a block's bytes what they are: the weights (their files' names, sizes and
mtimes), config.json and the tokenizer, the dtype, quantization, kernels, device type, the KV layout and block size,
and this rank's place in the tensor / expert parallel layout. The pool chains every hash from it, so a block of
another model (or dtype, quantization, ...) is never even looked up; its digest in each file's header is checked
on every read as well.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tsterm.engine.kv_host import HostKVCache
from tsterm.engine.kv_store import KVDiskStore, block_name, partial_name, snapshot_name
from tsterm.errors import ConfigError, DistributedError
from tsterm.model.arch import FULL_ATTENTION, LINEAR_ATTENTION
from tsterm.paths import default_cache_dir

# (kind, bytes): tier traffic, for the copy audit ("host_write", "host_read", "disk_write", "disk_read")
Ledger = Callable[[str, int], None]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# the kinds of a save or read sent to the other ranks (`read_words`, `tier_save`): a full block, a partial one, a
# hybrid's state snapshot
SAVE_FULL, SAVE_PARTIAL, SAVE_SNAPSHOT = 0, 1, 2
_WORD_BITS, _HASH_WORDS = 32, 4  # a 128-bit chain hash as int64 words of 32 bits each (the control protocol's words)


class RankTiers(Protocol):
    """Rank 0's link to the other ranks' tiers (`tsterm.distributed.executor.DistributedExecutor`): each call is sent
    to every worker, whose own `KVTier` over its shard of the pool does the same (`apply_saves`, `fetch_words`)."""

    def tier_save(self, words: list[int]) -> None:
        """Queue one save (`SAVE_FULL` / `SAVE_PARTIAL`, block id, hashes, token ids) for every worker; the queue is
        sent ahead of the next command, before anything can write the pool's blocks."""

    def tier_fetch(self, serial: int, reads: list[list[int]], have: int) -> int:
        """Every worker reads `reads` (`read_words`) as fetch `serial`; rank 0 read the first `have`: the number of
        leading blocks every rank read (the minimum), which every rank keeps."""

    def tier_load(self, loads: list[list[int]]) -> None:
        """Every worker copies fetch `serial`'s blocks into the pool blocks `ids`, each load `[serial, *ids]`."""

    def tier_flush(self) -> None:
        """Every worker's store has written its queue (returns once they all have)."""


def model_fingerprint(model_dir: Path, *, dtype: torch.dtype, quantization: str, kernels: str, device_type: str,
                      block_size: int, kv_layout: dict[str, Any], tensor_parallel_size: int = 1,
                      expert_parallel_size: int = 1, rank: int = 0, deterministic: bool = True) -> str:
    """What a KV block's bytes depend on besides its tokens, as one string (the root of every chain hash)."""
    model_dir = Path(model_dir)
    weights = []
    for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            st = path.stat()
            weights.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    files = {}
    for name in _IDENTITY_FILES:
        path = model_dir / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    return json.dumps({"weights": weights, "files": files, "dtype": str(dtype), "quantization": quantization,
                       "kernels": kernels, "device": device_type, "block_size": block_size, "kv": kv_layout,
                       "tp": tensor_parallel_size, "ep": expert_parallel_size, "rank": rank,
                       "deterministic": deterministic}, sort_keys=True)


def rank_fingerprint(fingerprint: str, rank: int) -> str:
    """`model_fingerprint` of rank `rank` of the layout `fingerprint` (rank 0's) names: its store's, never rank 0's."""
    fields = json.loads(fingerprint)
    fields["rank"] = rank
    return json.dumps(fields, sort_keys=True)


def _int_words(value: int) -> list[int]:
    return [(value >> (_WORD_BITS * i)) & ((1 << _WORD_BITS) - 1) for i in range(_HASH_WORDS)]


def _words_int(words: Sequence[int]) -> int:
    return sum(int(w) << (_WORD_BITS * i) for i, w in enumerate(words[:_HASH_WORDS]))


def read_words(read: TierRead) -> list[int]:
    """A read as the int64 words sent to the other ranks: [kind, 4 words of its hash (a full block) or its parent's (a
    partial one), its token ids]; each rank checks the block against its own layout (`KVTier.read_of`)."""
    full = read.expect["kind"] == "full"
    key = int(read.expect["hash" if full else "parent"], 16)
    return [SAVE_FULL if full else SAVE_PARTIAL, *_int_words(key), *read.expect["tokens"]]


def engine_fingerprint(config: Any, model_dir: Path, model_config: Any, dtype: torch.dtype, device: torch.device,
                       executor: Any) -> str:
    """`model_fingerprint` of an engine (rank 0 of its layout) with `config` (EngineConfig) over `executor`."""
    layout = {"layers": model_config.num_hidden_layers, "kv_heads": model_config.num_key_value_heads,
              "head_dim": model_config.head_dim, "bytes_per_block": executor.kv_bytes_per_block,
              "model_type": model_config.model_type}
    return model_fingerprint(model_dir, dtype=dtype, quantization=config.quantization, kernels=executor.kernels,
                             device_type=device.type, block_size=config.block_size, kv_layout=layout,
                             tensor_parallel_size=config.tensor_parallel_size,
                             expert_parallel_size=config.expert_parallel_size, deterministic=config.deterministic)


@dataclass(frozen=True, slots=True)
class TierRead:
    """One block a prompt wants from the tier: its file `name` and what its header must say (`expect`)."""

    name: str
    expect: dict[str, Any]


@dataclass(slots=True)
class Fetched:
    """Blocks read from the tiers for one prompt: `data` `[n, block bytes]` (uint8, pinned on a GPU), and for each
    row the tier that served it ("host": host memory, the host tier or the disk writer's queue; "disk": a file) and
    the prompt tokens it holds."""

    data: torch.Tensor
    rows: list[tuple[str, int]]
    serial: int = -1  # with several ranks: which fetch of the workers' this is (`copy_in` names it to them)

    def __len__(self) -> int:
        return len(self.rows)


class KVTier:
    """The device pool's blocks to and from the lower tiers: a host tier (`host`, `kv_host.HostKVCache`) and a disk
    store (`store`, `kv_store.KVDiskStore`), either or both.

    `kv`: the paged pool `[L, 2, num_blocks, B, Hkv, D]`, or several pools under the same block ids (the MTP head's
    one-layer pool after the target's): a block's bytes are each pool's block, one after the other. `root_hash`: the
    pool's (`BlockPool.root_hash`), the parent of a first partial block.

    A block copied out of the pool goes to both tiers from one host buffer (the disk's write is write-through: a
    session survives a restart or a crash whatever the host tier held); the host tier, when over its budget, spills
    what the store does not hold. A read takes the host tier first, then the store.

    Counters: `hit_blocks` (served from disk files), `host_hit_blocks` (from host memory: the host tier or the disk
    writer's queue), `load_seconds` / `loads` (the time prompts waited for their blocks: reads, checks and the copy
    into the pool), `saved_blocks` (copied out of the pool)."""

    def __init__(self, store: KVDiskStore | None, kv: torch.Tensor | Sequence[torch.Tensor], root_hash: int,
                 ledger: Ledger | None = None, states: Any = None, host: HostKVCache | None = None,
                 defer_after_step: bool = False, ranks: RankTiers | None = None):
        """states: a hybrid model's recurrent-state pool (`RecurrentStatePool`: `conv` and `recurrent`, one slot per
        index of their dim 1), whose snapshots at block boundaries are stored with their blocks; None otherwise.
        defer_after_step: a block saved after a step (`step_done` to `before_schedule`) is copied out at the next
        schedule's start instead of at once: the MTP head writes its KV of a step's positions after the step
        (`MtpDraftSource.after_step`), and no step or load writes a pool block before the next schedule.
        ranks: rank 0's link to the other ranks' tiers (`RankTiers`, the distributed executor), None on one rank or
        on a worker: each save, read and copy into the pool decided here is sent to every rank, which does the same
        on its own shard of the pool, in its own store."""
        if store is None and host is None:
            raise ValueError("a KV tier needs a host tier, a disk store or both")
        self.store = store
        self.host = host
        if host is not None and store is not None:
            host.spill = self._spill
        self.parts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        self.kv = self.parts[0]
        self.states = states
        self._state_parts = [] if states is None else [states.conv, states.recurrent]
        self.snapshot_nbytes = sum(t[:, 0].numel() * t.element_size() for t in self._state_parts)
        self._snapshot_meta = {"state": [[str(t.dtype).removeprefix("torch."), [t.shape[0], *t.shape[2:]]]
                                         for t in self._state_parts]}
        self.saved_snapshots = self.hit_snapshots = 0
        self.root_hash = root_hash
        self.ledger = ledger
        self._part_shapes = [(p.shape[0], p.shape[1], *p.shape[3:]) for p in self.parts]
        self._part_nbytes = [p[:, :, 0].numel() * p.element_size() for p in self.parts]
        self.block_nbytes = sum(self._part_nbytes)
        offset = 0
        for part, nbytes in zip(self.parts, self._part_nbytes):  # (each part's bytes must view as its dtype)
            assert offset % part.element_size() == 0 and self.block_nbytes % part.element_size() == 0
            offset += nbytes
        described = [[str(p.dtype).removeprefix("torch."), list(s)] for p, s in zip(self.parts, self._part_shapes)]
        # (one pool: the header of every store written before several existed; the MTP head's: one pair per pool)
        self._meta = ({"dtype": described[0][0], "shape": described[0][1]} if len(described) == 1
                      else {"parts": described})
        self.cuda = self.kv.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.kv.device) if self.cuda else None
        self.hit_blocks = self.host_hit_blocks = self.saved_blocks = 0
        self.hit_tokens = {"host": 0, "disk": 0}  # prompt tokens copied into the pool from each (`copy_in`)
        self.load_seconds = 0.0
        self.loads = 0
        self.defer_after_step = defer_after_step
        self._after_step = False
        self._deferred: list[Callable[[], None]] = []
        self.ranks = ranks
        self._serial = 0  # fetches the workers were asked for (`Fetched.serial`)

    # ---- the deferred copies (the MTP head's KV: see __init__)

    def step_done(self) -> None:
        """A step ran (its blocks are being registered): until `before_schedule`, saves wait (with the MTP head)."""
        self._after_step = self.defer_after_step

    def before_schedule(self) -> None:
        """The next schedule starts: the saves since the last step are copied out now, before any step or load."""
        self._after_step = False
        deferred, self._deferred = self._deferred, []
        for save in deferred:
            save()

    # ---- names and lookups

    def contains(self, name: str) -> bool:
        return (self.host is not None and self.host.contains(name)) or \
            (self.store is not None and self.store.contains(name))

    def full_read(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> TierRead | None:
        """The read of the full block hashed `block_hash`, or None when no tier holds it."""
        name = block_name(block_hash)
        if not self.contains(name):
            return None
        return TierRead(name, {"kind": "full", "hash": f"{block_hash:032x}", "tokens": list(token_ids),
                               **self._meta})

    def partial_read(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[TierRead, int] | None:
        """(read, n): the stored partial block after `parent_hash` (None: the root) holding the most of `token_ids`'
        first tokens, n of them; None when none does."""
        parent = self.root_hash if parent_hash is None else parent_hash
        found = set(self.host.partials(parent)) if self.host is not None else set()
        if self.store is not None:
            found.update(self.store.partials(parent))
        for n, name in sorted(found, reverse=True):
            if n <= len(token_ids) and name == partial_name(parent, token_ids[:n]):
                return TierRead(name, {"kind": "partial", "parent": f"{parent:032x}",
                                       "tokens": list(token_ids[:n]), **self._meta}), n
        return None

    # ---- writes: copied out of the pool once, kept by the host tier and queued for the store

    def _held(self, name: str) -> bool:
        """Whether the tier right under the pool holds `name` already (made the most recent in each tier that does);
        a block only the store holds is copied out again into the host tier, where a later read costs no file."""
        in_host = self.host is not None and self.host.touch(name)
        in_store = self.store is not None and self.store.touch(name)
        return in_host or (self.host is None and in_store)

    def save_block(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Copy the registered block `block_id` out to the tiers, unless they hold it already."""
        name = block_name(block_hash)
        if self._after_step:
            self._deferred.append(lambda: self.save_block(block_id, block_hash, parent_hash, token_ids))
            return
        if self.ranks is not None:  # (whatever this rank holds: another rank's store may have lost it)
            self.ranks.tier_save([SAVE_FULL, block_id, *_int_words(block_hash), parent_hash is not None,
                                  *_int_words(parent_hash or 0), *token_ids])
        if self._held(name):
            return
        parent = None if parent_hash is None else f"{parent_hash:032x}"
        header = {"kind": "full", "hash": f"{block_hash:032x}", "parent": parent, "tokens": list(token_ids),
                  **self._meta}
        if self._keep(name, header, *self._copy_out(self.block_nbytes, lambda flat: self._copy_block(flat, block_id))):
            self.saved_blocks += 1

    def save_partial(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Copy a finished turn's partly filled last block (the KV of `token_ids` after `parent_hash`) out."""
        parent = self.root_hash if parent_hash is None else parent_hash
        name = partial_name(parent, token_ids)
        if self._after_step:
            self._deferred.append(lambda: self.save_partial(block_id, parent_hash, token_ids))
            return
        if self.ranks is not None:
            self.ranks.tier_save([SAVE_PARTIAL, block_id, *_int_words(parent), *token_ids])
        if self._held(name):
            return
        header = {"kind": "partial", "parent": f"{parent:032x}", "tokens": list(token_ids), **self._meta}
        if self._keep(name, header, *self._copy_out(self.block_nbytes, lambda flat: self._copy_block(flat, block_id))):
            self.saved_blocks += 1

    def _copy_out(self, nbytes: int, fill: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, Any]:
        """A host buffer of `nbytes` that `fill` copies pool data into: (buffer, the callable that waits for it, or
        None). On a GPU the buffer is pinned and filled on the copy stream after the work that wrote the data; the
        step stream waits for the copy before anything that may overwrite the block (the host does not wait); a
        reader of the buffer (the host tier's read, the store's writer) calls the event's synchronize first."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        if not self.cuda:
            fill(host)
            return host, None
        current = torch.cuda.current_stream(self.kv.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            fill(host)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        current.wait_event(event)
        return host, event.synchronize

    def _keep(self, name: str, header: dict[str, Any], host: torch.Tensor, ready: Any) -> bool:
        """Hand a copied-out buffer to the store (first: the host tier's spill then finds it queued) and the host
        tier; whether either took it. Each tier's bytes are counted in the ledger as its traffic."""
        payload, nbytes, kept = _bytes_of(host), host.numel(), False
        if self.store is not None and self.store.put(name, header, payload, ready=ready):
            kept = True
            if self.ledger is not None:
                self.ledger("disk_write", nbytes)
        if self.host is not None and self.host.put(name, header, payload, ready=ready):
            kept = True
            if self.ledger is not None:
                self.ledger("host_write", nbytes)
        return kept

    def _spill(self, name: str, header: dict[str, Any], payload: Any, ready: Any) -> bool:
        """The host tier's eviction of a block the store does not hold: written to disk (counted as disk traffic)."""
        if not self.store.put(name, header, payload, ready=ready):
            return False
        if self.ledger is not None:
            self.ledger("disk_write", memoryview(payload).nbytes)
        return True

    def _copy_block(self, flat: torch.Tensor, block_id: int) -> None:
        """Block `block_id` of each pool into its bytes of `flat`, one pool after the other."""
        offset = 0
        for part, nbytes, shape in zip(self.parts, self._part_nbytes, self._part_shapes):
            flat[offset:offset + nbytes].view(part.dtype).view(shape).copy_(part[:, :, block_id], non_blocking=True)
            offset += nbytes

    # ---- a hybrid's state snapshots (the recurrent state after a full block: where a cached prefix resumes)

    def save_snapshot(self, slot: int, block_hash: int) -> None:
        """Copy the state in `slot` (kept with the block hashed `block_hash`) out to the tiers, unless they hold it."""
        name = snapshot_name(block_hash)
        if self.ranks is not None:
            self.ranks.tier_save([SAVE_SNAPSHOT, slot, *_int_words(block_hash)])
        if self._held(name):
            return
        header = {"kind": "snapshot", "hash": f"{block_hash:032x}", **self._snapshot_meta}
        if self._keep(name, header, *self._copy_out(self.snapshot_nbytes,
                                                    lambda flat: self._copy_state(flat, slot, out=True))):
            self.saved_snapshots += 1

    def has_snapshot(self, block_hash: int) -> bool:
        return self.states is not None and self.contains(snapshot_name(block_hash))

    def fetch_snapshot(self, block_hash: int) -> Fetched | None:
        """The stored state after the block hashed `block_hash`, read and checked into a host buffer (`data`, one
        row; with several ranks: read by every rank); None when missing or refused (on any rank)."""
        start = time.perf_counter()
        staging = torch.empty(self.snapshot_nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        expect = {"kind": "snapshot", "hash": f"{block_hash:032x}", **self._snapshot_meta}
        source = self._read(snapshot_name(block_hash), expect, _bytes_of(staging), self.snapshot_nbytes)
        serial = -1
        if self.ranks is not None and source is not None:
            serial, self._serial = self._serial, self._serial + 1
            if not self.ranks.tier_fetch(serial, [[SAVE_SNAPSHOT, *_int_words(block_hash)]], 1):
                source = None
        self.load_seconds += time.perf_counter() - start
        if source is None:
            return None
        self.hit_snapshots += 1
        return Fetched(staging, [(source, 0)], serial)

    def load_snapshot(self, slot: int, fetched: Fetched) -> None:
        """Copy a fetched snapshot into the state slot `slot` (on a GPU, ahead of the step on its stream)."""
        if self.ranks is not None:
            self.ranks.tier_load([[fetched.serial, slot]])
        self._copy_state(fetched.data, slot, out=False)

    def _copy_state(self, flat: torch.Tensor, slot: int, out: bool) -> None:
        """Between the flat bytes `flat` and state slot `slot` of each state tensor, in order (out: slot -> flat)."""
        offset = 0
        for part in self._state_parts:
            nbytes = part[:, 0].numel() * part.element_size()
            view = flat[offset:offset + nbytes].view(part.dtype).view(part.shape[0], *part.shape[2:])
            if out:
                view.copy_(part[:, slot], non_blocking=True)
            else:
                part[:, slot].copy_(view.to(part.device, non_blocking=True))
            offset += nbytes

    # ---- loads

    def _read(self, name: str, expect: dict[str, Any], into: memoryview, nbytes: int) -> str | None:
        """Fill `into` from the host tier, else the store: "host" (host memory: the host tier, or the store's write
        queue), "disk", or None (missing or refused). Counted in the ledger as the serving tier's traffic."""
        source = None
        if self.host is not None and self.host.read(name, expect, into):
            source = "host"
        elif self.store is not None:
            found = self.store.read(name, expect, into)
            source = None if found is None else "host" if found == "pending" else "disk"
        if source is not None and self.ledger is not None:
            self.ledger(f"{source}_read", nbytes)
        return source

    def fetch(self, reads: list[TierRead]) -> Fetched:
        """Read and check `reads` in order into one host buffer `[n, block bytes]`, stopping at the first that is
        missing or refused: n <= len(reads) blocks, the leading ones."""
        start = time.perf_counter()
        staging = torch.empty((len(reads), self.block_nbytes), dtype=torch.uint8, pin_memory=self.cuda)
        rows: list[tuple[str, int]] = []
        for read in reads:
            source = self._read(read.name, read.expect, _bytes_of(staging[len(rows)]), self.block_nbytes)
            if source is None:
                break
            rows.append((source, len(read.expect["tokens"])))
        serial = -1
        if self.ranks is not None and rows:  # a load is only what every rank read: the leading blocks all have
            serial, self._serial = self._serial, self._serial + 1
            del rows[self.ranks.tier_fetch(serial, [read_words(read) for read in reads[:len(rows)]], len(rows)):]
        for source, _ in rows:
            if source == "host":
                self.host_hit_blocks += 1
            else:
                self.hit_blocks += 1
        self.load_seconds += time.perf_counter() - start
        return Fetched(staging[:len(rows)], rows, serial)

    def copy_in(self, loads: list[tuple[list[int], Fetched]]) -> dict[str, int]:
        """Copy fetched blocks into the pool: each (block ids, `fetch`'s blocks, as many) one batched copy per pool
        (on a GPU, ahead of the step on its stream). Returns the prompt tokens they hold by serving tier."""
        start = time.perf_counter()
        tokens = {"host": 0, "disk": 0}
        if self.ranks is not None:
            self.ranks.tier_load([[fetched.serial, *block_ids] for block_ids, fetched in loads if block_ids])
        for block_ids, fetched in loads:
            device = self.kv.device
            index = torch.tensor(block_ids, dtype=torch.long).to(device, non_blocking=True)
            data = fetched.data.to(device, non_blocking=True)
            offset = 0
            for part, nbytes, shape in zip(self.parts, self._part_nbytes, self._part_shapes):
                rows = data[:, offset:offset + nbytes].view(part.dtype).view(len(block_ids), *shape)
                part.index_copy_(2, index, rows.movedim(0, 2))
                offset += nbytes
            for source, n in fetched.rows:
                tokens[source] += n
        for source, n in tokens.items():
            self.hit_tokens[source] += n
        self.load_seconds += time.perf_counter() - start
        self.loads += 1
        return tokens

    # ---- a worker rank: what rank 0 decided, on this rank's shard of the pool and its own store

    def read_of(self, words: Sequence[int]) -> TierRead:
        """The read rank 0 sent as `read_words`, with what this rank's headers must say."""
        kind, key, tokens = words[0], _words_int(words[1:1 + _HASH_WORDS]), list(words[1 + _HASH_WORDS:])
        if kind == SAVE_FULL:
            return TierRead(block_name(key), {"kind": "full", "hash": f"{key:032x}", "tokens": tokens, **self._meta})
        return TierRead(partial_name(key, tokens), {"kind": "partial", "parent": f"{key:032x}", "tokens": tokens,
                                                    **self._meta})

    def fetch_words(self, reads: list[list[int]]) -> Fetched | None:
        """A worker's part of rank 0's fetch: its blocks (`fetch`), or a hybrid's state snapshot (`fetch_snapshot`:
        one read of kind `SAVE_SNAPSHOT`, None when missing or refused)."""
        if reads and reads[0][0] == SAVE_SNAPSHOT:
            return self.fetch_snapshot(_words_int(reads[0][1:1 + _HASH_WORDS]))
        return self.fetch([self.read_of(read) for read in reads])

    def apply_saves(self, saves: list[list[int]]) -> None:
        """Rank 0's saves (`RankTiers.tier_save`), in order: each block (or a hybrid's state snapshot) copied out of
        this rank's pool to its tiers."""
        for words in saves:
            kind, block_id = words[0], words[1]
            if kind == SAVE_SNAPSHOT:  # (block_id: the state slot)
                self.save_snapshot(block_id, _words_int(words[2:2 + _HASH_WORDS]))
            elif kind == SAVE_FULL:
                block_hash = _words_int(words[2:2 + _HASH_WORDS])
                rest = words[2 + _HASH_WORDS:]
                parent = _words_int(rest[1:1 + _HASH_WORDS]) if rest[0] else None
                self.save_block(block_id, block_hash, parent, rest[1 + _HASH_WORDS:])
            else:
                self.save_partial(block_id, _words_int(words[2:2 + _HASH_WORDS]), words[2 + _HASH_WORDS:])

    # ---- the rest

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"kv_tier_loads": self.loads, "kv_tier_load_seconds": self.load_seconds,
                                       "kv_tier_saved_blocks": self.saved_blocks,
                                       "kv_host_hit_blocks": self.host_hit_blocks}
        if self.store is not None:
            out.update(self.store.stats())
            out["kv_disk_hit_blocks"] = self.hit_blocks
        if self.host is not None:
            out.update(self.host.stats())
        if self.states is not None:
            out["kv_tier_saved_snapshots"] = self.saved_snapshots
            out["kv_tier_hit_snapshots"] = self.hit_snapshots
        return out

    def flush(self) -> None:
        """Wait until every queued block is on disk (every rank's)."""
        self.before_schedule()
        if self.store is not None:
            self.store.flush()
        if self.ranks is not None:
            self.ranks.tier_flush()

    def close_local(self) -> None:
        """`close` for this rank alone."""
        self.before_schedule()
        if self.store is not None:
            self.store.close()

    def close(self) -> None:
        """Finish the store's queued writes (every rank's); the host tier's blocks go with the process (the store
        holds them too)."""
        self.close_local()
        if self.ranks is not None:
            try:
                self.ranks.tier_flush()
            except DistributedError:  # (the ranks failed: the executor holds the error; each file is whole or absent)
                pass


DiskTier = KVTier  # (its name while the disk store was the only tier)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a flat writable buffer over its memory."""
    return memoryview(t.view(torch.uint8).numpy().reshape(-1))


def open_tiers(options: dict[str, Any] | None, fingerprint: str, executor: Any, root_hash: int, *, block_size: int,
               model: str, num_state_slots: int, ledger: Ledger | None = None, host_bytes: int = 0,
               rank: int = 0) -> KVTier:
    """The tiers an engine's `kv_disk` option (`options`; None: no disk store) and `kv_host_bytes` (`host_bytes`; 0:
    no host tier) ask for, over `executor`'s paged KV pool (the MTP head's too: one more pool under the same block
    ids) and a hybrid model's recurrent-state pool (its snapshots at block boundaries are kept with their blocks).

    Several ranks (an executor with `open_rank_tiers`, the distributed one): this tier is rank 0's, over its share of
    the pool, and every worker opens its own over its share (`open_rank_tiers`), in the store's subdirectory
    `rank<R>` under a fingerprint naming its rank, each bounded by `max_bytes`; rank 0 decides what is saved and
    read for all (`RankTiers`), a hybrid model's state snapshots too (each rank's share of the state). The copy
    ledger counts every rank's bytes (rank 0's times the world size: each rank's share of a block is as large); the
    stores' counters (`stats`) are rank 0's. (The MTP head runs on one rank only: `EngineConfig` refuses it with
    ranks.) `rank`: a worker's, opening its own tier (`fingerprint` already its own)."""
    what = "kv_disk" if options is not None else "kv_host_bytes"
    ranks = executor if callable(getattr(executor, "open_rank_tiers", None)) else None
    runner = getattr(executor, "runner", None) if ranks is not None else executor  # (rank 0's share, with ranks)
    pools = getattr(getattr(runner, "cache", None), "pools", None)
    kv_pool = pools.get(FULL_ATTENTION) if isinstance(pools, dict) else None
    kv = getattr(kv_pool, "kv", None)
    if not isinstance(kv, torch.Tensor):
        raise ConfigError(f"{what}: the KV tiers need the executor's KV pool (each rank's share of it) in this "
                          f"process; this executor has none: remove {what}")
    mtp = getattr(runner, "mtp", None)
    parts = [kv]
    if mtp is not None:  # the MTP head's KV: its first num_blocks blocks are the pool's, under the same ids
        parts.append(mtp.kv_pool.kv)
    states = pools.get(LINEAR_ATTENTION) if num_state_slots else None
    if num_state_slots and not isinstance(getattr(states, "recurrent", None), torch.Tensor):
        raise ConfigError(f"{what}: the KV tiers need the executor's recurrent-state pool (each rank's share of it) "
                          f"in this process for this hybrid model; this executor has none: remove {what}")
    store = None
    if options is not None:
        path = Path(options["path"]).expanduser() if options.get("path") else default_cache_dir() / "kv"
        path = path / f"rank{rank}" if rank else path  # (each rank's blocks have the same names: rank 0's chain's)
        try:
            store = KVDiskStore(path, options["max_bytes"], fingerprint, model=model, block_size=block_size)
        except OSError as e:
            raise ConfigError(f"kv_disk.path: cannot use {str(path)!r} as the KV store: {e.strerror or e}") from None
    host = HostKVCache(host_bytes) if host_bytes else None
    if ranks is not None and ledger is not None:  # every rank moves its share, as large as rank 0's: the copy
        world, counted = executor.layout.world_size, ledger  # ledger counts what all of them moved
        ledger = lambda kind, nbytes: counted(kind, nbytes * world)  # noqa: E731
    tier = KVTier(store, parts, root_hash, ledger, states=states, host=host, defer_after_step=mtp is not None,
                  ranks=ranks)
    if ranks is not None:
        try:
            ranks.open_rank_tiers({"options": options, "fingerprint": fingerprint, "root_hash": f"{root_hash:x}",
                                   "block_size": block_size, "model": model, "host_bytes": host_bytes,
                                   "num_state_slots": num_state_slots})
        except BaseException:
            tier.close_local()
            raise
    return tier


def open_rank_tier(request: dict[str, Any], runner: Any, rank: int) -> KVTier:
    """A worker's tier, as rank 0's `open_tiers` asked (`request`): over `runner`'s share of the pool, in its own
    store (`rank<R>` under the store's path), under the fingerprint of its rank."""
    return open_tiers(request["options"], rank_fingerprint(request["fingerprint"], rank), runner,
                      int(request["root_hash"], 16), block_size=request["block_size"], model=request["model"],
                      num_state_slots=request["num_state_slots"], host_bytes=request["host_bytes"], rank=rank)


def open_disk_tier(options: dict[str, Any], fingerprint: str, executor: Any, root_hash: int, *, block_size: int,
                   model: str, num_state_slots: int, ledger: Ledger | None = None) -> KVTier:
    """`open_tiers` with a disk store and no host tier."""
    return open_tiers(options, fingerprint, executor, root_hash, block_size=block_size, model=model,
                      num_state_slots=num_state_slots, ledger=ledger)
