"""`tsterm sessions` on a hybrid (Gated DeltaNet) model's KV store: a session's state snapshot (`<hash>.kvs`, the
recurrent state at the last block boundary its turn computed) is counted with its blocks and dropped with them."""
from __future__ import annotations

import random

from tsterm import LLM, SamplingParams
from tsterm.chat.session import Session, TurnStats
from tsterm.chat.store import SessionStore
from tsterm.cli import main

from tests.helpers.checkpoints import make_hybrid_checkpoint

BLOCK = 4


def test_a_hybrid_sessions_state_snapshot_is_listed_and_dropped_with_its_blocks(tmp_path, capsys):
    path, _ = make_hybrid_checkpoint(tmp_path / "hybrid", "qwen3_next")
    kv_dir, sessions_dir = tmp_path / "kv", tmp_path / "sessions"
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model: {path}\nblock_size: {BLOCK}\nkv_disk: {{path: {kv_dir}, max_bytes: 100000000}}\n")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64,
              kv_disk={"path": str(kv_dir), "max_bytes": 100_000_000})
    prompt = [random.Random(0).randrange(8, 300) for _ in range(13)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    llm.engine.shutdown()
    SessionStore(sessions_dir).save(Session(
        id="h", messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        token_ids=prompt + out.token_ids, turns=[TurnStats(len(prompt), out.num_cached_tokens, 0, len(out.token_ids))]))
    snapshots = list(kv_dir.glob("*.kvs"))
    blocks = [p for p in kv_dir.iterdir() if p.suffix == ".kvb"]
    assert len(snapshots) == 1 and len(blocks) == (len(prompt) + len(out.token_ids) - 1) // BLOCK == 4

    assert main(["sessions", "--profile", str(profile), "--sessions-dir", str(sessions_dir)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "h" and int(row[3]) == len(blocks) + len(snapshots)  # (a hybrid keeps no partial block)
    assert main(["sessions", "drop", "h", "--profile", str(profile), "--sessions-dir", str(sessions_dir)]) == 0
    assert f"dropped {len(blocks) + 1} KV blocks" in capsys.readouterr().out
    assert not list(kv_dir.glob("*.kvs")) and not list(kv_dir.glob("*.kvb"))
