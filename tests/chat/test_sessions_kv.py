"""`tsterm sessions`: the KV each saved session keeps in the disk tier (found from its exact ids, without the model),
and `drop`, which deletes a session's blocks but not those another session shares."""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.chat.session import Session, TurnStats
from tsterm.chat.store import SessionStore
from tsterm.cli import main

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("sessions_kv") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=1))
    return path


def saved_session(llm: LLM, store: SessionStore, session_id: str, prompt: list[int]) -> Session:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    session = Session(id=session_id, messages=[{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a"}],
                      token_ids=prompt + out.token_ids,
                      turns=[TurnStats(len(prompt), out.num_cached_tokens, 0, len(out.token_ids))])
    store.save(session)
    return session


def test_sessions_lists_each_sessions_kv_on_disk_and_drop_keeps_what_others_share(checkpoint, tmp_path, capsys):
    kv_dir, sessions_dir = tmp_path / "kv", tmp_path / "sessions"
    profile = tmp_path / "p.yaml"
    profile.write_text(f"model: {checkpoint}\nblock_size: {BLOCK}\nkv_disk: {{path: {kv_dir}, max_bytes: 10000000}}\n")
    store = SessionStore(sessions_dir)
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64,
              kv_disk={"path": str(kv_dir), "max_bytes": 10_000_000})
    rng = random.Random(0)
    system = [rng.randrange(8, 300) for _ in range(8)]  # two full blocks both sessions share
    saved_session(llm, store, "a", system + [rng.randrange(8, 300) for _ in range(9)])
    saved_session(llm, store, "b", system + [rng.randrange(8, 300) for _ in range(5)])
    llm.engine.shutdown()
    block_files = sorted(p for p in kv_dir.iterdir() if p.suffix in (".kvb", ".kvp"))
    # a: 17 + 5 - 1 computed tokens = 5 full blocks + a partial; b: 13 + 5 - 1 = 4 full + a partial, 2 of them a's
    assert len(block_files) == 6 + 5 - 2

    def listing() -> dict[str, int]:
        assert main(["sessions", "--profile", str(profile), "--sessions-dir", str(sessions_dir)]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        return {row[0]: int(row[3]) for row in rows}

    assert listing() == {"a": 6, "b": 5}
    assert main(["sessions", "drop", "a", "--profile", str(profile), "--sessions-dir", str(sessions_dir)]) == 0
    assert "dropped 4 KV blocks" in capsys.readouterr().out
    assert listing() == {"a": 2, "b": 5}  # the shared system prompt's blocks stay, for b
    assert len([p for p in kv_dir.iterdir() if p.suffix in (".kvb", ".kvp")]) == 5
