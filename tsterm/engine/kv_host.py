"""The KV cache's host tier: a bounded, least-recently-used set of KV blocks in host memory (`kv_host_bytes`).

It sits between the device pool and the disk store (`kv_store`), holds the same things under the same names (a full
block by its chain hash, `<hash>.kvb`; a finished turn's partly filled last block, `.kvp`; a hybrid's state snapshot,
`.kvs`: `kv_store.block_name` and its siblings), so a name says the block's whole prefix and, through the chain's root,
the model fingerprint: a block of another model (or dtype, quantization, tensor-parallel rank, ...) has other names
and is never looked up. Each entry keeps the header the store would write, and a read checks the keys the caller
expects (the block's hash or parent, its token ids, dtype and shape) before a byte is served.

An entry is a host buffer the tier (`kv_tier`) copied out of the pool: on a GPU pinned memory, filled by an
asynchronous copy on a copy stream, with `ready` (its event's synchronize) to call before its bytes are first read; on
the CPU a plain copy (the device pool is host memory there: this tier is a larger RAM cache under a smaller pool).
The store's writer thread may hold the same buffer while it writes it (write-through): one copy out of the pool
serves both tiers.

Bounded by `max_bytes`: a `put` past it first evicts the least recently used entries; an evicted entry that the lower
tier does not hold yet is handed to `spill` (the store's `put`: written on its writer thread), so the host tier never
loses a block the disk tier could keep. A read or a repeated `put` makes an entry the most recent.

Only the engine's thread calls it (the KV manager's writes and reads); no lock. No torch: payloads are buffers.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tsterm.engine.kv_store import PARTIAL_SUFFIX, parse_partial

# spill(name, header, payload, ready) -> whether the lower tier took it (the store's `put`)
Spill = Callable[[str, dict[str, Any], Any, Callable[[], None] | None], bool]


@dataclass(slots=True)
class _Entry:
    header: dict[str, Any]
    payload: Any  # a buffer: its bytes are the block's
    ready: Callable[[], None] | None  # called before the payload's bytes are first read (a GPU copy's event)
    nbytes: int


class HostKVCache:
    """Blocks in host memory by name, at most `max_bytes` of payload, least recently used evicted first.

    Counters (monotonic): `written_blocks` / `written_bytes` (payloads taken in), `read_blocks` / `read_bytes`
    (served), `evicted_blocks`, `spilled_blocks` (evicted entries handed to the lower tier), `skipped_writes` (a
    payload larger than the whole tier), `refused` (a read whose header did not say what the caller expects: counted
    and dropped, never served)."""

    def __init__(self, max_bytes: int, spill: Spill | None = None):
        if max_bytes <= 0:
            raise ValueError(f"kv_host_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.spill = spill
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._partials: dict[int, set[tuple[int, str]]] = {}  # parent hash -> {(n, name)}
        self._bytes = 0
        self.written_blocks = self.written_bytes = self.read_blocks = self.read_bytes = 0
        self.evicted_blocks = self.spilled_blocks = self.skipped_writes = self.refused = 0

    # ---- lookups

    def contains(self, name: str) -> bool:
        return name in self._entries

    def partials(self, parent_hash: int) -> list[tuple[int, str]]:
        """(n, name) of the partial blocks held after the full block `parent_hash`, longest first."""
        return sorted(self._partials.get(parent_hash, ()), reverse=True)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Least recently used first."""
        return list(self._entries)

    # ---- writes

    def touch(self, name: str) -> bool:
        """Make an entry the most recently used; False when the tier does not hold it."""
        if name not in self._entries:
            return False
        self._entries.move_to_end(name)
        return True

    def put(self, name: str, header: dict[str, Any], payload: Any, ready: Callable[[], None] | None = None) -> bool:
        """Keep `payload` (a buffer, which the caller must not change afterwards) under `name` with `header`, evicting
        (and spilling) the least recently used entries until it fits. False when it was not kept: held already (then
        made the most recent), or larger than the whole tier (then spilled at once, if a lower tier is there)."""
        if self.touch(name):
            return False
        nbytes = memoryview(payload).nbytes
        if nbytes > self.max_bytes:
            self.skipped_writes += 1
            self._spill(name, _Entry(header, payload, ready, nbytes))
            return False
        while self._bytes + nbytes > self.max_bytes:
            self._evict()
        self._entries[name] = _Entry(header, payload, ready, nbytes)
        self._bytes += nbytes
        if name.endswith(PARTIAL_SUFFIX) and (parsed := parse_partial(name)) is not None:
            self._partials.setdefault(parsed[0], set()).add((parsed[1], name))
        self.written_blocks += 1
        self.written_bytes += nbytes
        return True

    def _evict(self) -> None:
        name, entry = self._entries.popitem(last=False)
        self._forget(name, entry)
        self.evicted_blocks += 1
        self._spill(name, entry)

    def _spill(self, name: str, entry: _Entry) -> None:
        if self.spill is not None and self.spill(name, entry.header, entry.payload, entry.ready):
            self.spilled_blocks += 1

    def _forget(self, name: str, entry: _Entry) -> None:
        self._bytes -= entry.nbytes
        if name.endswith(PARTIAL_SUFFIX) and (parsed := parse_partial(name)) is not None:
            siblings = self._partials.get(parsed[0], set())
            siblings.discard((parsed[1], name))
            if not siblings:
                self._partials.pop(parsed[0], None)

    def delete(self, names: list[str]) -> int:
        """Drop entries by name (not spilled); returns the bytes freed."""
        freed = 0
        for name in names:
            entry = self._entries.pop(name, None)
            if entry is not None:
                self._forget(name, entry)
                freed += entry.nbytes
        return freed

    # ---- reads

    def read(self, name: str, expect: dict[str, Any], into: memoryview) -> bool:
        """Fill `into` (exactly the payload's size) with the entry `name` when its header has every key/value of
        `expect`; False when the tier does not hold it, or refuses it (another size or header: dropped)."""
        entry = self._entries.get(name)
        if entry is None:
            return False
        if entry.nbytes != into.nbytes or any(entry.header.get(key) != value for key, value in expect.items()):
            self.refused += 1
            self.delete([name])
            return False
        if entry.ready is not None:
            entry.ready()  # (a GPU copy's event: long done by the time a later prompt asks, as a rule)
            entry.ready = None
        into[:] = memoryview(entry.payload).cast("B")
        self._entries.move_to_end(name)
        self.read_blocks += 1
        self.read_bytes += entry.nbytes
        return True

    def stats(self) -> dict[str, int]:
        return {"kv_host_bytes": self._bytes, "kv_host_max_bytes": self.max_bytes, "kv_host_blocks": len(self._entries),
                "kv_host_written_blocks": self.written_blocks, "kv_host_written_bytes": self.written_bytes,
                "kv_host_read_blocks": self.read_blocks, "kv_host_read_bytes": self.read_bytes,
                "kv_host_evicted_blocks": self.evicted_blocks, "kv_host_spilled_blocks": self.spilled_blocks,
                "kv_host_skipped_writes": self.skipped_writes, "kv_host_refused_blocks": self.refused}
