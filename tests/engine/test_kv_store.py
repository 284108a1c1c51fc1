"""The disk store of KV blocks on its own (no model): its bound under any workload, and what a crash or a torn,
corrupted or foreign file leaves readable (nothing wrong, ever)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsterm.engine.kv_store import FULL_SUFFIX, KVDiskStore, block_name

HEADER = {"kind": "full", "tokens": [1, 2, 3, 4]}


def payload(seed: int, size: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(size))


def files_on_disk(path: Path) -> dict[str, int]:
    """The store's files and sizes now (the writer thread may delete one between the listing and its stat)."""
    sizes = {}
    for p in path.iterdir():
        try:
            if p.is_file():
                sizes[p.name] = p.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


def read(store: KVDiskStore, name: str, size: int, expect=None) -> bytes | None:
    into = bytearray(size)
    return bytes(into) if store.read(name, expect or {}, memoryview(into)) else None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "read", "flush"]), st.integers(0, 40),
                              st.integers(1, 600)), max_size=60),
       max_bytes=st.integers(400, 4000))
def test_the_store_stays_under_its_bound_and_serves_only_what_it_was_given(tmp_path_factory, ops, max_bytes):
    path = tmp_path_factory.mktemp("bound")
    store = KVDiskStore(path, max_bytes, "model-a", max_pending_bytes=1 << 20)
    given_payloads: dict[str, bytes] = {}
    try:
        for op, key, size in ops:
            name = block_name(key)
            if op == "put":
                data = given_payloads.setdefault(name, payload(key, size))
                store.put(name, HEADER, data)
            elif op == "read" and name in given_payloads:
                got = read(store, name, len(given_payloads[name]))
                assert got is None or got == given_payloads[name]  # missing (evicted) or exactly what was put
            else:
                store.flush()
            on_disk = files_on_disk(path)
            blocks = {name: size for name, size in on_disk.items() if name.endswith(FULL_SUFFIX)}
            assert sum(blocks.values()) <= max_bytes  # the bound holds at every moment, not only after a flush
        store.flush()
        blocks = {name: size for name, size in files_on_disk(path).items() if name.endswith(FULL_SUFFIX)}
        assert store.size_bytes == sum(blocks.values()) <= max_bytes
        assert set(blocks) == set(store.names())
        assert not [name for name in files_on_disk(path) if ".tmp" in name]
    finally:
        store.close()
    reopened = KVDiskStore(path, max_bytes, "model-a")  # a restart indexes exactly what is there
    try:
        assert reopened.size_bytes == store.size_bytes and set(reopened.names()) == set(store.names())
        for name in reopened.names():
            assert read(reopened, name, len(given_payloads[name])) == given_payloads[name]
    finally:
        reopened.close()


def test_least_recently_used_goes_first_and_a_read_makes_a_block_recent(tmp_path):
    store = KVDiskStore(tmp_path, 10_000, "m")
    for key in range(3):
        store.put(block_name(key), HEADER, payload(key, 100))
    store.flush()
    one = store.size_bytes // 3
    store.close()
    store = KVDiskStore(tmp_path, 3 * one + one // 2, "m")  # room for three and a half
    assert read(store, block_name(0), 100) == payload(0, 100)  # 0 is now the most recent
    store.put(block_name(3), HEADER, payload(3, 100))
    store.flush()
    assert set(store.names()) == {block_name(0), block_name(2), block_name(3)}
    store.close()


def test_a_foreign_fingerprint_a_wrong_header_and_a_flipped_bit_are_refused(tmp_path):
    other = KVDiskStore(tmp_path, 1 << 20, "model-b")
    other.put(block_name(1), HEADER, payload(1, 64))
    other.close()
    store = KVDiskStore(tmp_path, 1 << 20, "model-a")
    assert read(store, block_name(1), 64) is None  # another model's block
    assert store.refused["fingerprint"] == 1 and not (tmp_path / block_name(1)).exists()
    store.put(block_name(2), HEADER, payload(2, 64))
    store.put(block_name(3), HEADER, payload(3, 64))
    store.flush()
    assert read(store, block_name(2), 64, {"tokens": [9, 9, 9, 9]}) is None  # not the tokens asked for
    assert store.refused["mismatch"] == 1
    path = tmp_path / block_name(3)
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    assert read(store, block_name(3), 64) is None and store.refused["checksum"] == 1
    store.close()


def test_a_block_renamed_before_it_was_whole_fails_its_checksum(tmp_path):
    """A power loss after the rename but before the data reached the disk: the file is there, cut short."""
    store = KVDiskStore(tmp_path, 1 << 20, "m")
    store.put(block_name(5), HEADER, payload(5, 4096))
    store.flush()
    path = tmp_path / block_name(5)
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 3000, 30, 5):
        store.close()
        path.write_bytes(whole[:cut])
        store = KVDiskStore(tmp_path, 1 << 20, "m")
        assert read(store, block_name(5), 4096) is None and store.refused["checksum"] == 1
        assert not path.exists()
    store.close()


WRITER = textwrap.dedent("""
    import sys, threading
    from tsterm.engine.kv_store import KVDiskStore, block_name

    def stop_before_rename(tmp, final):  # the writer is killed here: the block is written, not yet renamed
        print("written", tmp, flush=True)
        threading.Event().wait()

    store = KVDiskStore(sys.argv[1], 1 << 20, "m")
    store.put(block_name(1), {"kind": "full"}, bytes(range(256)) * 16)
    store.flush()
    store._rename = stop_before_rename
    store.put(block_name(2), {"kind": "full"}, bytes(range(256)) * 16)
    threading.Event().wait()
""")


def test_a_writer_killed_between_write_and_rename_leaves_no_readable_block(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        line = child.stdout.readline()  # waits for the writer to reach the rename
        assert line.startswith("written "), line
        tmp = Path(line.split()[1])
        assert tmp.exists() and tmp.stat().st_size > 4096  # the whole block, under its temporary name
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    store = KVDiskStore(tmp_path, 1 << 20, "m")
    try:
        assert not tmp.exists()  # the dead writer's temporary file is deleted, never indexed
        assert store.names() == [block_name(1)] and not store.contains(block_name(2))
        assert read(store, block_name(2), 4096) is None
        assert read(store, block_name(1), 4096) == bytes(range(256)) * 16
    finally:
        store.close()


def test_a_write_failure_is_counted_and_the_store_goes_on(tmp_path):
    def fail(tmp: str, final: str) -> None:
        raise OSError(28, "No space left on device")

    store = KVDiskStore(tmp_path, 1 << 20, "m", rename=fail)
    store.put(block_name(1), HEADER, payload(1, 64))
    store.flush()
    assert store.write_errors == 1 and not store.contains(block_name(1))
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    store._rename = os.replace
    store.put(block_name(1), HEADER, payload(1, 64))
    store.flush()
    assert read(store, block_name(1), 64) == payload(1, 64)
    store.close()


def test_a_profiles_kv_disk_is_checked_field_by_field_with_its_line(tmp_path):
    import re

    import pytest

    from tsterm.errors import ConfigError
    from tsterm.profiles import load_profile

    for body, message in (("kv_disk:\n  path: /tmp/kv\n  max_bytes: -5\n", "kv_disk.max_bytes must be a positive"),
                          ("kv_disk: {path: /tmp/kv, size: 5}\n", "kv_disk: unknown key(s) 'size'"),
                          ("kv_disk: /tmp/kv\n", "kv_disk must be a mapping")):
        profile = tmp_path / "p.yaml"
        profile.write_text("model: demo:tiny\n" + body)
        with pytest.raises(ConfigError, match=re.escape(f"p.yaml:2: {message}")):
            load_profile(str(profile))
    profile.write_text("model: demo:tiny\nkv_disk: {path: ~/kv}\n")
    assert load_profile(str(profile)).engine["kv_disk"] == {"path": "~/kv"}


def test_writes_queued_when_the_interpreter_exits_are_finished_first(tmp_path):
    script = textwrap.dedent("""
        import sys
        from tsterm.engine.kv_store import KVDiskStore, block_name
        store = KVDiskStore(sys.argv[1], 1 << 30, "m")  # never closed: a script, `tsterm run`
        for i in range(50):
            store.put(block_name(i), {"kind": "full"}, bytes([i]) * 100_000)
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True,
                   cwd=Path(__file__).resolve().parents[2])
    store = KVDiskStore(tmp_path, 1 << 30, "m")
    assert len(store.names()) == 50 and read(store, block_name(49), 100_000) == bytes([49]) * 100_000
    store.close()
