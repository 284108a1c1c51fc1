"""The KV cache's lower tier: the disk store (`kv_store`) under the device pool, as the KV manager sees it.

Write-through: a full block is copied out when it is registered for the prefix cache (it is immutable from then on),
and a finished turn's partly filled last block when it is kept; the copy is queued for the store's writer thread, so
the engine's thread pays only the copy out of the pool (on a GPU, an asynchronous copy into pinned memory on a copy
stream). Write-through rather than write-on-evict because:
- a session must survive its engine: an engine killed or restarted never evicts what its pool holds, and the blocks
  of the sessions just used are exactly those still in the pool;
- on the CPU the pool is host memory: there is no host tier to stage an evicted block in, and writing it out when
  `allocate` evicts it would put a disk write on the allocation path, in the middle of scheduling;
- an evicted block is already on disk, so eviction stays O(1) and no block's data is ever read after it was freed.
A block already stored (the same chain hash) is not written again.

Loads: a prompt whose next full blocks are not in the pool but are in the store gets them read, checked and copied
into fresh pool blocks, one batch a prompt (one copy into the pool for all its blocks), before its step runs; a block
that is missing, refused (checksum, fingerprint, header) or does not fit in the pool ends the run there, and the
rest is computed. Every byte either way is counted (`ledger`: the copy audit's `kv_tier` phase, and the stats).

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
from typing import Any

import torch

from tsterm.engine.kv_store import KVDiskStore, block_name, partial_name, snapshot_name
from tsterm.errors import ConfigError
from tsterm.model.arch import FULL_ATTENTION, LINEAR_ATTENTION
from tsterm.paths import default_cache_dir

# (kind, bytes): tier traffic, for the copy audit ("disk_write", "disk_read", "host_read")
Ledger = Callable[[str, int], None]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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


class DiskTier:
    """The device pool's blocks (`kv`: the paged pool `[L, 2, num_blocks, B, Hkv, D]`) to and from `store`.

    `root_hash`: the pool's (`BlockPool.root_hash`), the parent of a first partial block. Counters: `hit_blocks`
    (served from disk), `host_hit_blocks` (from the writer's queue), `load_seconds` / `loads` (the time prompts
    waited for their blocks: reads, checks and the copy into the pool), `saved_blocks`."""

    def __init__(self, store: KVDiskStore, kv: torch.Tensor, root_hash: int, ledger: Ledger | None = None,
                 states: Any = None):
        """states: a hybrid model's recurrent-state pool (`RecurrentStatePool`: `conv` and `recurrent`, one slot per
        index of their dim 1), whose snapshots at block boundaries are stored with their blocks; None otherwise."""
        self.store = store
        self.states = states
        self._state_parts = [] if states is None else [states.conv, states.recurrent]
        self.snapshot_nbytes = sum(t[:, 0].numel() * t.element_size() for t in self._state_parts)
        self._snapshot_meta = {"state": [[str(t.dtype).removeprefix("torch."), [t.shape[0], *t.shape[2:]]]
                                         for t in self._state_parts]}
        self.saved_snapshots = self.hit_snapshots = 0
        self.kv = kv
        self.root_hash = root_hash
        self.ledger = ledger
        self.block_shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.block_nbytes = kv[:, :, 0].numel() * kv.element_size()
        self.dtype = kv.dtype
        self._meta = {"dtype": str(kv.dtype).removeprefix("torch."), "shape": list(self.block_shape)}
        self.cuda = kv.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self.hit_blocks = self.host_hit_blocks = self.saved_blocks = 0
        self.load_seconds = 0.0
        self.loads = 0

    # ---- names and lookups

    def full_read(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> TierRead | None:
        """The read of the full block hashed `block_hash`, or None when the store does not hold it."""
        name = block_name(block_hash)
        if not self.store.contains(name):
            return None
        return TierRead(name, {"kind": "full", "hash": f"{block_hash:032x}", "tokens": list(token_ids),
                               **self._meta})

    def partial_read(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[TierRead, int] | None:
        """(read, n): the stored partial block after `parent_hash` (None: the root) holding the most of `token_ids`'
        first tokens, n of them; None when none does."""
        parent = self.root_hash if parent_hash is None else parent_hash
        for n, name in self.store.partials(parent):
            if n <= len(token_ids) and name == partial_name(parent, token_ids[:n]):
                return TierRead(name, {"kind": "partial", "parent": f"{parent:032x}",
                                       "tokens": list(token_ids[:n]), **self._meta}), n
        return None

    # ---- write-through

    def save_block(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Queue the registered block `block_id` for the store, unless it is there already."""
        name = block_name(block_hash)
        if self.store.touch(name):  # (stored already: now the most recently used)
            return
        parent = None if parent_hash is None else f"{parent_hash:032x}"
        self._save(block_id, name, {"kind": "full", "hash": f"{block_hash:032x}", "parent": parent,
                                    "tokens": list(token_ids), **self._meta})

    def save_partial(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Queue a finished turn's partly filled last block (the KV of `token_ids` after `parent_hash`)."""
        parent = self.root_hash if parent_hash is None else parent_hash
        name = partial_name(parent, token_ids)
        if self.store.contains(name):
            return
        self._save(block_id, name, {"kind": "partial", "parent": f"{parent:032x}", "tokens": list(token_ids),
                                    **self._meta})

    def _save(self, block_id: int, name: str, header: dict[str, Any]) -> None:
        source = self.kv[:, :, block_id]
        ready = None
        if self.cuda:
            # into pinned memory on a copy stream, after the work that wrote the block; the step stream waits for the
            # copy before anything that may reuse the block (the host does not wait); the writer waits for its event
            host = torch.empty(self.block_shape, dtype=self.dtype, pin_memory=True)
            current = torch.cuda.current_stream(self.kv.device)
            self._copy_stream.wait_stream(current)
            with torch.cuda.stream(self._copy_stream):
                host.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            current.wait_event(event)
            ready = event.synchronize
        else:
            host = source.clone(memory_format=torch.contiguous_format)
        if self.store.put(name, header, _bytes_of(host), ready=ready):
            self.saved_blocks += 1
            if self.ledger is not None:
                self.ledger("disk_write", self.block_nbytes)

    # ---- a hybrid's state snapshots (the recurrent state after a full block: where a cached prefix resumes)

    def save_snapshot(self, slot: int, block_hash: int) -> None:
        """Queue the state in `slot` (kept with the block hashed `block_hash`) for the store, unless it is there."""
        name = snapshot_name(block_hash)
        if self.store.touch(name):
            return
        host = torch.empty(self.snapshot_nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        ready = None
        if self.cuda:  # (as `_save`: on the copy stream, after the step that wrote the slot; the next one waits)
            current = torch.cuda.current_stream(self.kv.device)
            self._copy_stream.wait_stream(current)
            with torch.cuda.stream(self._copy_stream):
                self._copy_state(host, slot, out=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            current.wait_event(event)
            ready = event.synchronize
        else:
            self._copy_state(host, slot, out=True)
        header = {"kind": "snapshot", "hash": f"{block_hash:032x}", **self._snapshot_meta}
        if self.store.put(name, header, _bytes_of(host), ready=ready):
            self.saved_snapshots += 1
            if self.ledger is not None:
                self.ledger("disk_write", self.snapshot_nbytes)

    def has_snapshot(self, block_hash: int) -> bool:
        return self.states is not None and self.store.contains(snapshot_name(block_hash))

    def fetch_snapshot(self, block_hash: int) -> torch.Tensor | None:
        """The stored state after the block hashed `block_hash`, read and checked into a host buffer; None when
        missing or refused."""
        start = time.perf_counter()
        staging = torch.empty(self.snapshot_nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        expect = {"kind": "snapshot", "hash": f"{block_hash:032x}", **self._snapshot_meta}
        source = self.store.read(snapshot_name(block_hash), expect, _bytes_of(staging))
        self.load_seconds += time.perf_counter() - start
        if source is None:
            return None
        self.hit_snapshots += 1
        if self.ledger is not None:
            self.ledger("host_read" if source == "pending" else "disk_read", self.snapshot_nbytes)
        return staging

    def load_snapshot(self, slot: int, data: torch.Tensor) -> None:
        """Copy a fetched snapshot into the state slot `slot` (on a GPU, ahead of the step on its stream)."""
        self._copy_state(data, slot, out=False)

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

    def fetch(self, reads: list[TierRead]) -> torch.Tensor:
        """Read and check `reads` in order into one host tensor `[n, L, 2, B, Hkv, D]`, stopping at the first that
        is missing or refused: n <= len(reads) blocks, the leading ones."""
        start = time.perf_counter()
        staging = torch.empty((len(reads), *self.block_shape), dtype=self.dtype, pin_memory=self.cuda)
        n = 0
        for read in reads:
            source = self.store.read(read.name, read.expect, _bytes_of(staging[n]))
            if source is None:
                break
            n += 1
            if source == "pending":
                self.host_hit_blocks += 1
            else:
                self.hit_blocks += 1
            if self.ledger is not None:
                self.ledger("host_read" if source == "pending" else "disk_read", self.block_nbytes)
        self.load_seconds += time.perf_counter() - start
        return staging[:n]

    def copy_in(self, loads: list[tuple[list[int], torch.Tensor]]) -> None:
        """Copy fetched blocks into the pool: each (block ids, `fetch`'s tensor of as many blocks) one batched copy (on
        a GPU, ahead of the step on its stream)."""
        start = time.perf_counter()
        for block_ids, data in loads:
            index = torch.tensor(block_ids, dtype=torch.long).to(self.kv.device, non_blocking=True)
            self.kv.index_copy_(2, index, data.to(self.kv.device, non_blocking=True).movedim(0, 2))
        self.load_seconds += time.perf_counter() - start
        self.loads += 1

    # ---- the rest

    def stats(self) -> dict[str, int | float]:
        out = {**self.store.stats(), "kv_disk_hit_blocks": self.hit_blocks, "kv_disk_loads": self.loads,
               "kv_disk_load_seconds": self.load_seconds, "kv_disk_saved_blocks": self.saved_blocks}
        if self.states is not None:
            out["kv_disk_saved_snapshots"] = self.saved_snapshots
            out["kv_disk_hit_snapshots"] = self.hit_snapshots
        return out

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self.store.flush()

    def close(self) -> None:
        self.store.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a flat writable buffer over its memory."""
    return memoryview(t.view(torch.uint8).numpy().reshape(-1))


def open_disk_tier(options: dict[str, Any], fingerprint: str, executor: Any, root_hash: int, *, block_size: int,
                   model: str, num_state_slots: int, ledger: Ledger | None = None) -> DiskTier:
    """The disk tier an engine's `kv_disk` option asks for, over `executor`'s paged KV pool (and a hybrid model's
    recurrent-state pool: its snapshots at block boundaries are stored with their blocks). Refused (ConfigError,
    naming `kv_disk`) for an executor whose pools are not in this process (several ranks) and with the MTP head."""
    if getattr(executor, "mtp", None) is not None:
        raise ConfigError("kv_disk: the MTP draft head keeps KV of its own that the disk tier does not store yet; "
                          "use another speculative_method, or remove kv_disk")
    cache = getattr(executor, "cache", None)
    pools = getattr(cache, "pools", None)
    kv_pool = pools.get(FULL_ATTENTION) if isinstance(pools, dict) else None
    kv = getattr(kv_pool, "kv", None)
    if not isinstance(kv, torch.Tensor):
        raise ConfigError("kv_disk: the disk tier needs the one-process executor's KV pool; with tensor or expert "
                          "parallel ranks each rank would have to store its own share (not done yet): remove kv_disk "
                          "or run on one rank")
    states = pools.get(LINEAR_ATTENTION) if num_state_slots else None
    if num_state_slots and not isinstance(getattr(states, "recurrent", None), torch.Tensor):
        raise ConfigError("kv_disk: the disk tier needs the one-process executor's recurrent-state pool for this "
                          "hybrid model; remove kv_disk or run on one rank")
    path = Path(options["path"]).expanduser() if options.get("path") else default_cache_dir() / "kv"
    try:
        store = KVDiskStore(path, options["max_bytes"], fingerprint, model=model, block_size=block_size)
    except OSError as e:
        raise ConfigError(f"kv_disk.path: cannot use {str(path)!r} as the KV store: {e.strerror or e}") from None
    return DiskTier(store, kv, root_hash, ledger, states=states)
