"""A hybrid model (Gated DeltaNet layers) in the workstation: the dashboard shows the recurrent-state pool's bytes,
the snapshots kept at block boundaries and the states copied back when the next turn resumes from one."""
from __future__ import annotations

import pytest

from tests.helpers.checkpoints import make_hybrid_checkpoint
from tests.tui.helpers import chat_screen, say, text_of, turns_done, wait_until
from tsterm.tui import TstermApp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid_profile(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tui-hybrid")
    path, _ = make_hybrid_checkpoint(root / "m", "qwen3_next", {"max_position_embeddings": 2048})
    profile = root / "hybrid.yaml"
    profile.write_text("\n".join([f"model: {path}", "device: cpu", "dtype: float32", "block_size: 4",
                                  "num_kv_blocks: 512", "sampling:", "  temperature: 0", "  max_tokens: 6",
                                  "  ignore_eos: true"]) + "\n")
    return str(profile)


async def test_the_dashboard_shows_the_state_pool_and_its_snapshots(hybrid_profile, data_dir):
    app = TstermApp(hybrid_profile)
    async with app.run_test(size=(200, 60)) as pilot:
        screen = await chat_screen(pilot)
        await say(pilot, "hello there")
        await turns_done(pilot, screen.session, 1)
        await say(pilot, "and again")
        await turns_done(pilot, screen.session, 2)
        dashboard = screen.dashboard
        assert screen.session.turns[1].cached_tokens > 0  # turn 2 resumed from turn 1's snapshot
        copies = await wait_until(pilot, lambda: "state copied" in text_of(dashboard.query_one("#copies"))
                                  and dashboard.latest.get("state_copy_bytes") and text_of(
                                      dashboard.query_one("#copies")), what="a poll after turn 2")
        stats = dashboard.latest
        per_slot = stats["state_bytes"] // stats["state_slots"]
        assert stats["state_copy_bytes"] == per_slot and stats["state_snapshot_bytes"] >= 2 * per_slot
        lines = {line.split()[1]: line for line in copies.splitlines() if line.startswith("state")}
        assert f"({stats['state_snapshots']} snapshots held)" in lines["kept"] and "0 B" not in lines["kept"]
        assert "0 B" not in lines["copied"]
        assert " state " in text_of(dashboard.query_one("#engine"))
