"""`tsterm bench` on a tiny hybrid (Gated DeltaNet + gated attention 3:1) made by tsterm's own demo generator: the
checkpoint loads in transformers, every replay of the trace generates the same greedy tokens, and turns 2+ are
served their block-aligned maximum from recurrent-state snapshots."""
from __future__ import annotations

import json

import pytest

from tsterm import LLM
from tsterm.bench import run_bench
from tsterm.bench.measure import bytes_read_per_token, parallel_ceiling, sequence_bytes
from tsterm.bench.report import format_table
from tsterm.bench.trace import TraceSpec
from tsterm.convert.demo import SPECS, RandomHybridSpec, bytes_read_per_token as demo_bytes_read, make_random_moe

TINY = RandomHybridSpec(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_random_moe(tmp_path_factory.mktemp("bench_hybrid") / "m", TINY)


@pytest.fixture(scope="module")
def llm(hybrid_dir, one_torch_thread):
    return LLM(str(hybrid_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=4)


def test_the_bench_hybrid_preset_is_a_3_to_1_qwen3_5_moe(tmp_path):
    spec = SPECS["bench-hybrid"]
    assert isinstance(spec, RandomHybridSpec) and spec.num_experts == 16 and spec.shared_expert_intermediate_size
    assert spec.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    assert 300e6 < demo_bytes_read(spec) < 500e6  # "a few hundred MB" a decoded token, like demo:bench
    first = make_random_moe(tmp_path / "a", TINY)
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["layer_types"] == TINY.layer_types
    second = make_random_moe(tmp_path / "b", TINY)  # deterministic: the same spec gives the same bytes
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_bytes_read_count_the_mixers_of_each_layer(llm):
    cfg = llm.engine.model_config
    state = 3 * (4 * 16 * 16 * 4 + (2 * 2 * 16 + 4 * 16) * 3 * 4)  # 3 linear layers: delta-rule + conv state
    kv_per_token = 1 * 2 * 2 * 16 * 4  # 1 full-attention layer
    assert sequence_bytes(cfg, 4, 10) == state + 10 * kv_per_token
    # the generator's count of the weights a token reads (it adds the norms and decay vectors, a few hundred bytes)
    weights = bytes_read_per_token(cfg, 4, 0) - state
    assert weights == pytest.approx(demo_bytes_read(TINY), rel=1e-3) and weights < demo_bytes_read(TINY)
    one = bytes_read_per_token(cfg, 4, 16)
    expert = 3 * 64 * 32 * 4
    two = one + 4 * (2 * 2 / 4) * expert + sequence_bytes(cfg, 4, 16)
    assert parallel_ceiling(cfg, 4, 16, 2) == pytest.approx(2 * one / two)


def test_bench_on_a_hybrid_reuses_every_turn_and_matches_transformers(llm):
    spec = TraceSpec(sessions=1, turns=3, system_tokens=30, task_tokens=5, turn_tokens=9, output_tokens=4)
    r = run_bench(llm, spec, baseline=["transformers-cache", "transformers"], micro_context=16, parallel=2)
    ours, cache, scratch = (r["replays"][n] for n in ("tsterm", "transformers-cache", "transformers"))
    later = [t for t in ours["turns"] if t["turn"] > 0]
    assert [t["theoretical_cached"] for t in later] == [36, 48]  # 35 + 4 - 1 -> 36, then 39 + 4 + 9 - 1 -> 48
    assert all(t["cached_tokens"] == t["theoretical_cached"] for t in later)
    assert r["hit_rate_vs_theoretical"] == 1.0
    # each later turn resumed from one snapshot: one slot's state copied (3 linear layers), nothing else
    slot = 3 * (4 * 16 * 16 * 4 + (2 * 2 * 16 + 4 * 16) * 3 * 4)
    assert [t["state_copy_bytes"] for t in ours["turns"]] == [0, slot, slot]
    # and kept its own state at block boundaries for the next turn: whole slots, at least one a turn
    assert all(t["state_snapshot_bytes"] >= slot and t["state_snapshot_bytes"] % slot == 0 for t in ours["turns"])
    assert r["engine_stats"]["state_bytes"] > 0 and r["engine_stats"]["state_snapshots"] > 0
    outputs = [[t["output_token_ids"] for t in rep["turns"]] for rep in (ours, cache, scratch)]
    assert outputs[0] == outputs[1] == outputs[2] and all(len(o) == 4 for o in outputs[0])
    assert [t["cached_tokens"] for t in cache["turns"]] == [0, 38, 51]  # all but each reply's last token
    assert set(r["speedup_vs"]) == {"transformers-cache", "transformers"}
    assert r["speedup_vs_baseline"] == min(r["speedup_vs"].values())
    table = format_table(r)
    assert "recurrent state:" in table and "speedup_vs_transformers-cache" in table
