"""The dashboard's KV counts show the sliding-window pool (gpt-oss) when the engine keeps one: its blocks, the window,
the blocks in use, cached and released; the KV pool's bytes count both pools. Without one, nothing of it shows."""
from __future__ import annotations

from tests.tui.helpers import Harness, text_of
from tsterm.tui.widgets.dashboard import Dashboard, human_bytes


async def test_the_window_pool_shows_beside_the_main_pool():
    dashboard = Dashboard("cpu float32")
    async with Harness(dashboard).run_test(size=(60, 80)) as pilot:
        base = {"generated_tokens": 0, "prefill_tokens": 0, "num_blocks": 10, "block_size": 16,
                "kv_bytes_per_block": 1 << 20, "window_bytes_per_block": 0}
        dashboard.update_stats(dict(base), {"kind": "cpu"}, 1.0)
        await pilot.pause()
        assert "window" not in text_of(dashboard.query_one("#kv-counts"))
        assert f"KV pool {human_bytes(10 << 20)}" in text_of(dashboard.query_one("#engine"))
        window = dict(base, window=128, window_blocks=6, window_used=2, window_cached=3, window_released=17,
                      window_bytes_per_block=1 << 19)
        dashboard.update_stats(window, {"kind": "cpu"}, 2.0)
        await pilot.pause()
        lines = text_of(dashboard.query_one("#kv-counts")).splitlines()
        assert lines[-1] == "window 6 blocks (128 tok): used 2  cached 3  released 17"
        # 10 main blocks of 1 MiB, 7 window blocks (its reserved null block too) of 512 KiB
        assert f"KV pool {human_bytes((10 << 20) + 7 * (1 << 19))}" in text_of(dashboard.query_one("#engine"))
