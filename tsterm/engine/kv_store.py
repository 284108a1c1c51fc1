"""The disk tier of the KV cache: blocks in files, named by their chain hash, refused unless whole and of this model.

A block leaves the engine's pool as bytes (`tsterm.engine.kv_tier` copies it out) and lands here as one file:

    MAGIC (8 bytes) | header length (u32) | header (JSON) | payload | CRC-32 of header + payload (u32)

named `<chain hash>.kvb` (a full block: the same 128-bit chain hash the prefix cache keys it by, so a hash names the
block's whole prefix, the model's fingerprint as its root) or `<parent hash>-<n>-<key>.kvp` (a finished turn's partly
filled last block: its n token ids after the full block `parent`, `partial_key`). The header holds the model
fingerprint's digest, the block's hash, parent and token ids, and the payload's dtype and shape; a read checks each
of them and the checksum before a byte of the payload is served, and refuses (and deletes) the block otherwise, so
the caller computes it instead: a foreign model's block, a torn or corrupted file, never a wrong one.

Writes go through a temporary file in the same directory, renamed into place once written: a crash before the
rename leaves a `.tmp` file that no read ever opens (the next store over the directory deletes it); a file renamed
but not flushed before a power loss fails its checksum. Writes run on the store's writer thread, off the engine's:
`put` queues the payload and returns; until it is written the payload is served from memory (`read`), which makes
the queue a small host tier of its own.

The store is bounded (`max_bytes`): before each write it deletes the least recently used files until the new one
fits; a read or a repeated `put` makes a file most recent (its mtime, so that the order survives a restart). Several
models may share one directory: their chain hashes differ (each chain starts at its model's fingerprint), and
`models/<digest>.json` records each fingerprint, for `tsterm sessions` to find a session's blocks without a model.

No torch here: the tier (`kv_tier`) hands payloads over as buffers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"TSKVBLK1"
FULL_SUFFIX, PARTIAL_SUFFIX, SNAPSHOT_SUFFIX = ".kvb", ".kvp", ".kvs"  # (a hybrid's state at a full block's end)
_PREFIX = struct.Struct("<8sI")  # magic, header length
_CRC = struct.Struct("<I")
_MAX_HEADER = 1 << 20
_PARTIAL_PERSON = b"tsterm-partial"  # blake2b personalisation of a partial block's key: apart from chain hashes
DEFAULT_MAX_PENDING_BYTES = 256 << 20  # payloads queued for the writer; past it a write is dropped, not waited for


def fingerprint_digest(fingerprint: str) -> str:
    """The 32 hex digits a block's header and the store's manifest name the model fingerprint by."""
    return hashlib.sha256(fingerprint.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def block_name(block_hash: int) -> str:
    return f"{block_hash:032x}{FULL_SUFFIX}"


def snapshot_name(block_hash: int) -> str:
    """A hybrid model's recurrent state after the full block hashed `block_hash` (kept with it to resume from)."""
    return f"{block_hash:032x}{SNAPSHOT_SUFFIX}"


def partial_key(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The key of a partly filled block holding the KV of `token_ids` after the full block hashed `parent_hash`."""
    h = hashlib.blake2b(digest_size=16, person=_PARTIAL_PERSON)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return int.from_bytes(h.digest(), "little")


def partial_name(parent_hash: int, token_ids: Sequence[int]) -> str:
    return f"{parent_hash:032x}-{len(token_ids)}-{partial_key(parent_hash, token_ids):032x}{PARTIAL_SUFFIX}"


def parse_partial(name: str) -> tuple[int, int] | None:
    """(parent hash, n) of a partial block's file name; None if it is not one."""
    parts = name[:-len(PARTIAL_SUFFIX)].split("-")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1])
    except ValueError:
        return None


class KVDiskStore:
    """A bounded directory of KV blocks for one model (`fingerprint`), shared by any number of models.

    Counters (monotonic): `written_blocks` / `written_bytes` (payload bytes written), `read_blocks` / `read_bytes`
    (served from disk), `pending_hits` (served from the writer's queue), `refused` (by reason: `checksum`,
    `fingerprint`, `mismatch`), `evicted_blocks`, `write_errors`, `dropped_writes` (the queue was over
    `max_pending_bytes`), `skipped_writes` (a block larger than the whole store).

    `rename` is the call that publishes a written file (os.replace); the crash tests replace it to stop between the
    write and the rename."""

    def __init__(self, path: str | Path, max_bytes: int, fingerprint: str, *, model: str = "",
                 block_size: int = 0, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 rename: Callable[[str, str], None] = os.replace):
        if max_bytes <= 0:
            raise ValueError(f"kv_disk max_bytes must be positive, got {max_bytes}")
        self.path = Path(path).expanduser()
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.digest = fingerprint_digest(fingerprint)
        self.max_pending_bytes = max_pending_bytes
        self._rename = rename
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes on disk, least recently used first
        self._partials: dict[int, set[tuple[int, str]]] = {}  # parent hash -> {(n, name)}
        self._bytes = 0
        self._pending: dict[str, Any] = {}  # name -> (header bytes, payload buffer), queued for the writer
        self._pending_bytes = 0
        self.written_blocks = self.written_bytes = self.read_blocks = self.read_bytes = self.pending_hits = 0
        self.evicted_blocks = self.write_errors = self.dropped_writes = self.skipped_writes = 0
        self.refused: dict[str, int] = {"checksum": 0, "fingerprint": 0, "mismatch": 0}
        self._scan()
        self._write_manifest(model, block_size)
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="tsterm-kv-writer", daemon=True)
        self._writer.start()
        # at the interpreter's exit too (an engine never shut down: `tsterm run`, a script), the queued writes finish
        self._stop = weakref.finalize(self, _stop_writer, self._queue, self._writer)

    # ---- the directory

    def _scan(self) -> None:
        """Index the blocks on disk, least recently used first; delete what a crash left half written."""
        entries = []
        for entry in os.scandir(self.path):
            name = entry.name
            if ".tmp" in name and name.startswith("."):
                if not _writer_alive(name):
                    Path(entry.path).unlink(missing_ok=True)
                continue
            if not name.endswith((FULL_SUFFIX, PARTIAL_SUFFIX, SNAPSHOT_SUFFIX)) or not entry.is_file():
                continue
            st = entry.stat()
            entries.append((st.st_mtime_ns, name, st.st_size))
        for _, name, size in sorted(entries):
            self._add(name, size)

    def _add(self, name: str, size: int) -> None:  # (under the lock, or before the writer starts)
        old = self._files.pop(name, None)
        self._bytes += size - (old or 0)
        self._files[name] = size
        if name.endswith(PARTIAL_SUFFIX):
            parsed = parse_partial(name)
            if parsed is not None:
                self._partials.setdefault(parsed[0], set()).add((parsed[1], name))

    def _drop(self, name: str) -> None:  # (under the lock)
        size = self._files.pop(name, None)
        if size is None:
            return
        self._bytes -= size
        if name.endswith(PARTIAL_SUFFIX):
            parsed = parse_partial(name)
            if parsed is not None:
                siblings = self._partials.get(parsed[0], set())
                siblings.discard((parsed[1], name))
                if not siblings:
                    self._partials.pop(parsed[0], None)

    def _write_manifest(self, model: str, block_size: int) -> None:
        """`models/<digest>.json`: the fingerprint behind a digest (the chain's root), for tools that read the store
        without the model (`tsterm sessions`)."""
        target = self.path / "models" / f"{self.digest}.json"
        text = json.dumps({"fingerprint": self.fingerprint, "block_size": block_size, "model": model})
        try:
            if target.is_file() and target.read_text(encoding="utf-8") == text:
                return
            target.parent.mkdir(exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        except OSError as e:
            log.warning("kv_disk: could not write the store's model manifest %s: %s", target, e)

    # ---- lookups (the engine's thread)

    def contains(self, name: str) -> bool:
        with self._lock:
            return name in self._files or name in self._pending

    def partials(self, parent_hash: int) -> list[tuple[int, str]]:
        """(n, name) of the partial blocks stored after the full block `parent_hash`, longest first."""
        with self._lock:
            found = set(self._partials.get(parent_hash, ()))
            found.update((p[1], name) for name in self._pending if name.endswith(PARTIAL_SUFFIX)
                         and (p := parse_partial(name)) is not None and p[0] == parent_hash)
        return sorted(found, reverse=True)

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._files)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._files)

    # ---- writes

    def touch(self, name: str) -> bool:
        """Make a stored (or queued) block the most recently used; False when the store does not hold it."""
        with self._lock:
            if name in self._pending:
                return True
            if name not in self._files:
                return False
            self._files.move_to_end(name)
        try:
            os.utime(self.path / name)
        except OSError:
            pass
        return True

    def put(self, name: str, header: dict[str, Any], payload: Any, ready: Callable[[], None] | None = None) -> bool:
        """Queue `payload` (a buffer: its bytes are the block's) under `name` with `header`; False when it was not
        queued (already stored or queued, or the queue is over `max_pending_bytes`). The caller must not change the
        payload's memory afterwards; `ready`, when given, is called before its bytes are first read (a GPU copy's
        event)."""
        nbytes = memoryview(payload).nbytes
        head = json.dumps({**header, "fingerprint": self.digest, "nbytes": nbytes}).encode()
        size = _PREFIX.size + len(head) + nbytes + _CRC.size
        with self._lock:
            if self._closed or name in self._pending:
                return False
            if name in self._files:
                self._files.move_to_end(name)
                return False
            if size > self.max_bytes:
                self.skipped_writes += 1
                return False
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped_writes += 1
                return False
            self._pending[name] = (head, payload, ready)
            self._pending_bytes += nbytes
        self._queue.put(name)
        return True

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop()

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            try:
                if name is None:
                    return
                with self._lock:
                    head, payload, ready = self._pending[name]
                try:
                    if ready is not None:
                        ready()
                    self._write(name, head, payload)
                except OSError as e:
                    self.write_errors += 1
                    log.warning("kv_disk: writing %s failed: %s", name, e)
                with self._lock:
                    self._pending.pop(name, None)
                    self._pending_bytes -= memoryview(payload).nbytes
            except BaseException:  # noqa: BLE001 - the writer thread must outlive any one block
                log.exception("kv_disk: the writer failed on %s", name)
            finally:
                self._queue.task_done()

    def _write(self, name: str, head: bytes, payload: Any) -> None:
        view = memoryview(payload).cast("B")
        size = _PREFIX.size + len(head) + view.nbytes + _CRC.size
        self._make_room(size)
        crc = zlib.crc32(view, zlib.crc32(head))  # (zlib releases the GIL on large buffers)
        tmp = self.path / f".{name}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, len(head)))
                f.write(head)
                f.write(view)
                f.write(_CRC.pack(crc))
            self._rename(str(tmp), str(self.path / name))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._add(name, size)
            self.written_blocks += 1
            self.written_bytes += view.nbytes

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until `size` more bytes fit under max_bytes."""
        while True:
            with self._lock:
                if self._bytes + size <= self.max_bytes or not self._files:
                    return
                name = next(iter(self._files))
                self._drop(name)
                self.evicted_blocks += 1
            (self.path / name).unlink(missing_ok=True)

    # ---- reads (the engine's thread)

    def read(self, name: str, expect: dict[str, Any], into: memoryview) -> str | None:
        """Fill `into` (exactly the payload's size) with the block `name`, after checking its checksum, its model
        fingerprint and that its header has every key/value of `expect`. Returns where it came from ("pending": the
        writer's queue, "disk"), or None: missing, or refused (then counted by reason and deleted)."""
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            head, payload, ready = pending
            if ready is not None:
                ready()
            view = memoryview(payload).cast("B")
            if view.nbytes != into.nbytes or not _header_matches(json.loads(head), expect):
                return None
            into[:] = view
            with self._lock:
                self.pending_hits += 1
            return "pending"
        path = self.path / name
        try:
            with open(path, "rb") as f:
                prefix = f.read(_PREFIX.size)
                if len(prefix) != _PREFIX.size:
                    return self._refuse(name, "checksum")
                magic, head_len = _PREFIX.unpack(prefix)
                if magic != MAGIC or head_len > _MAX_HEADER:
                    return self._refuse(name, "checksum")
                head = f.read(head_len)
                try:
                    header = json.loads(head)
                except ValueError:
                    return self._refuse(name, "checksum")
                if not isinstance(header, dict) or len(head) != head_len:
                    return self._refuse(name, "checksum")
                if header.get("fingerprint") != self.digest:  # (refused whether the rest is whole or not)
                    return self._refuse(name, "fingerprint")
                if header.get("nbytes") != into.nbytes:
                    return self._refuse(name, "mismatch")
                if f.readinto(into) != into.nbytes:
                    return self._refuse(name, "checksum")
                tail = f.read(_CRC.size + 1)
        except FileNotFoundError:
            with self._lock:
                self._drop(name)  # (deleted under us: `tsterm sessions drop`, another store's eviction)
            return None
        if len(tail) != _CRC.size or _CRC.unpack(tail)[0] != zlib.crc32(into, zlib.crc32(head)):
            return self._refuse(name, "checksum")
        if not _header_matches(header, expect):
            return self._refuse(name, "mismatch")
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
            self.read_blocks += 1
            self.read_bytes += into.nbytes
        try:
            os.utime(path)  # most recently used, across restarts too
        except OSError:
            pass
        return "disk"

    def _refuse(self, name: str, reason: str) -> None:
        log.warning("kv_disk: block %s refused (%s); it is computed instead", name, reason)
        with self._lock:
            self.refused[reason] += 1
            self._drop(name)
        (self.path / name).unlink(missing_ok=True)
        return None

    def delete(self, names: list[str]) -> int:
        """Delete stored blocks by name; returns the bytes freed."""
        freed = 0
        for name in names:
            with self._lock:
                freed += self._files.get(name, 0)
                self._drop(name)
            (self.path / name).unlink(missing_ok=True)
        return freed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"kv_disk_bytes": self._bytes, "kv_disk_blocks": len(self._files),
                    "kv_disk_max_bytes": self.max_bytes,
                    "kv_disk_written_blocks": self.written_blocks, "kv_disk_written_bytes": self.written_bytes,
                    "kv_disk_read_blocks": self.read_blocks, "kv_disk_read_bytes": self.read_bytes,
                    "kv_disk_queue_hit_blocks": self.pending_hits, "kv_disk_pending_bytes": self._pending_bytes,
                    "kv_disk_refused_blocks": sum(self.refused.values()),
                    "kv_disk_refused_checksum": self.refused["checksum"],
                    "kv_disk_refused_fingerprint": self.refused["fingerprint"],
                    "kv_disk_refused_mismatch": self.refused["mismatch"],
                    "kv_disk_evicted_blocks": self.evicted_blocks, "kv_disk_write_errors": self.write_errors,
                    "kv_disk_dropped_writes": self.dropped_writes}


def _stop_writer(writes: queue.Queue, writer: threading.Thread) -> None:
    writes.put(None)
    writer.join()


def _header_matches(header: dict[str, Any], expect: dict[str, Any]) -> bool:
    return all(header.get(key) == value for key, value in expect.items())


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that writes the temporary file `tmp_name` (`.<name>.tmp-<pid>-<thread>`) still runs."""
    try:
        pid = int(tmp_name.rsplit(".tmp-", 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # (this process's writer has not started: a leftover of an earlier process with this pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- a session's blocks, without the model (`tsterm sessions`)

def store_models(path: str | Path) -> list[dict[str, Any]]:
    """The models whose blocks a store directory holds (their manifests: fingerprint, block_size, model)."""
    folder = Path(path).expanduser() / "models"
    found = []
    for manifest in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("fingerprint"), str) and \
                isinstance(data.get("block_size"), int) and data["block_size"] > 0:
            found.append(data)
    return found


def session_block_names(fingerprint: str, block_size: int, token_ids: Sequence[int]) -> list[str]:
    """The names of the blocks a finished turn with `token_ids` (prompt + reply) leaves in the store under the model
    `fingerprint`: its full blocks' and the partly filled last one's (the last token's KV is never computed). A hybrid
    model's state snapshots are named by `snapshot_name` of a full block's hash."""
    from tsterm.engine.block_pool import BlockPool  # (no torch either)

    pool = BlockPool(1, block_size, fingerprint=fingerprint)
    computed = max(len(token_ids) - 1, 0)
    names, parent = [], None
    for i in range(computed // block_size):
        parent = pool.hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        names.append(block_name(parent))
    tail = list(token_ids[computed // block_size * block_size:computed])
    if tail:
        names.append(partial_name(pool.root_hash if parent is None else parent, tail))
    return names
