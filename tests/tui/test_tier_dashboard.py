"""The dashboard's KV tiers section: with `kv_disk` on, a workstation's turn writes its blocks through to the disk
store, and a second workstation over the same store (a restart) serves the same prompt's prefix from disk; the
section shows each tier's hits, the bytes written and read, the store's size, loads, as the engine counted them.
Without a disk tier the section is hidden. Waits are on the app's messages (stats polls, turn ends)."""
from __future__ import annotations

from tests.tui.helpers import Harness, chat_screen, engine_stats, say, text_of, turns_done, wait_until
from tsterm.tui import TstermApp
from tsterm.tui.widgets.dashboard import Dashboard, human_bytes

MESSAGE = "tell me about the tiers of a cache, from the device down to the disk"


async def _turn(app: TstermApp) -> tuple[dict, str]:
    """One turn of a new session; returns the engine's counters after it and the tiers section once it shows them."""
    async with app.run_test(size=(200, 60)) as pilot:
        screen = await chat_screen(pilot)
        tiers = screen.dashboard.query_one("#tiers")
        await wait_until(pilot, lambda: text_of(tiers), what="a first stats poll")
        await say(pilot, MESSAGE)
        await turns_done(pilot, screen.session, 1)
        app.host.async_engine.engine.kv.tier.flush()  # the turn's write-through is on disk: the counters hold still
        stats = await engine_stats(app)
        written = f"  in {human_bytes(stats['kv_disk_written_bytes'])}  out "
        text = await wait_until(pilot, lambda: written in text_of(tiers) and text_of(tiers),
                                what="a poll after the turn")
        assert screen.dashboard.query_one("#tiers-title").display and tiers.display
    return stats, text


async def test_a_restart_shows_the_disk_tiers_hits_and_traffic(make_profile, data_dir, tmp_path):
    store = tmp_path / "kv"
    profile = make_profile(kv_disk=f"{{path: {store}, max_bytes: 16777216}}")
    first, text = await _turn(TstermApp(profile))
    assert first["kv_disk_written_blocks"] > 0 and first["kv_tier_hit_tokens"] == 0
    assert text.splitlines()[0] == f"hits    device {first['prefix_hit_tokens']} tok  host 0 tok  disk 0 tok"
    second, text = await _turn(TstermApp(profile))  # a new engine over the same store: the same prompt's blocks
    disk = second["kv_tier_hit_tokens"]
    assert disk > 0 and second["kv_disk_read_blocks"] > 0 and second["kv_tier_loads"] == 1
    assert second["kv_disk_hit_tokens"] == disk and second["kv_host_hit_tokens"] == 0
    lines = text.splitlines()
    assert lines[0] == f"hits    device {second['prefix_hit_tokens'] - disk} tok  host 0 tok  disk {disk} tok"
    assert lines[1] == (f"disk    {human_bytes(second['kv_disk_bytes'])} / {human_bytes(16777216)}"
                        f" ({second['kv_disk_blocks']} blocks)")
    assert lines[2].startswith(f"  in {human_bytes(second['kv_disk_written_bytes'])}"
                               f"  out {human_bytes(second['kv_disk_read_bytes'])}  queued ")
    assert lines[4].startswith("loads   1  ") and lines[4].endswith(" ms each")


async def test_the_section_is_hidden_without_a_tier_and_shows_each_tier_present():
    dashboard = Dashboard("cpu float32")
    async with Harness(dashboard).run_test(size=(60, 80)) as pilot:
        base = {"generated_tokens": 0, "prefill_tokens": 0, "num_blocks": 10, "prefix_hit_tokens": 40}
        dashboard.update_stats(dict(base), {"kind": "cpu"}, 1.0)
        await pilot.pause()
        assert not dashboard.query_one("#tiers").display and not dashboard.query_one("#tiers-title").display
        disk = dict(base, kv_tier_hit_tokens=12, kv_host_hit_tokens=0, kv_disk_hit_tokens=12, kv_disk_bytes=3 << 20,
                    kv_disk_max_bytes=1 << 30, kv_disk_blocks=7, kv_disk_written_bytes=2048,
                    kv_disk_written_blocks=2, kv_disk_read_bytes=3 << 10, kv_disk_read_blocks=3,
                    kv_disk_queue_hit_blocks=1, kv_tier_loads=2, kv_tier_load_seconds=0.005,
                    kv_disk_refused_blocks=1, kv_disk_evicted_blocks=4, kv_disk_offloaded_pins=2)
        dashboard.update_stats(disk, {"kind": "cpu"}, 2.0)
        await pilot.pause()
        assert dashboard.query_one("#tiers").display
        assert text_of(dashboard.query_one("#tiers")).splitlines() == [
            "hits    device 28 tok  host 0 tok  disk 12 tok", "disk    3.0 MiB / 1.0 GiB (7 blocks)",
            "  in 2.0 KiB  out 3.0 KiB  queued 1", "  refused 1  evicted 4", "loads   2  2.5 ms each",
            "offloaded 2 pin(s)"]
        both = dict(disk, kv_tier_hit_tokens=20, kv_host_hit_tokens=8, kv_host_bytes=1 << 20,
                    kv_host_max_bytes=4 << 20, kv_host_blocks=5, kv_host_written_bytes=5 << 10,
                    kv_host_read_bytes=2 << 10, kv_host_spilled_blocks=3)
        dashboard.update_stats(both, {"kind": "cpu"}, 3.0)
        await pilot.pause()
        assert text_of(dashboard.query_one("#tiers")).splitlines()[:3] == [
            "hits    device 20 tok  host 8 tok  disk 12 tok", "host    1.0 MiB / 4.0 MiB (5 blocks)",
            "  in 5.0 KiB  out 2.0 KiB  spilled 3"]
