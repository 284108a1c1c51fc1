"""`tsterm bench` on a tiny checkpoint: the figures it reports are computed from what actually happened."""
from __future__ import annotations

import pytest

from tsterm import LLM
from tsterm.bench import RATE_SAMPLES, run_bench
from tsterm.bench.measure import bytes_read_per_token, parallel_ceiling
from tsterm.bench.report import format_table, write_plot
from tsterm.bench.trace import TraceSpec, make_trace, theoretical_cached
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint

SUMMARY_KEYS = ("speedup_vs_baseline", "ttft_last_over_turn2", "hit_rate_vs_theoretical",
                "copy_bytes_per_token_long_over_short", "roofline_fraction", "parallel_speedup")


def test_trace_shape_and_theoretical_maximum():
    spec = TraceSpec(sessions=3, turns=4, system_tokens=40, task_tokens=5, turn_tokens=7, output_tokens=3)
    trace = make_trace(spec, vocab_size=300)
    assert len(trace) == 3 and all(len(s) == 4 for s in trace)
    assert trace[0][0][:40] == trace[1][0][:40] and trace[0][0][40:] != trace[1][0][40:]  # shared system prompt
    assert [len(t) for t in trace[0]] == [45, 7, 7, 7]
    previous = list(range(20))  # 20 tokens, the last one never computed: 19 shareable -> 16 block-aligned
    assert theoretical_cached(previous, previous + [1, 2], 4) == 16
    assert theoretical_cached(previous, previous[:10] + [999] * 10, 4) == 8  # diverges at 10
    with pytest.raises(ConfigError):
        TraceSpec(turns=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                   max_position_embeddings=1024))
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=512)


def test_bench_reports_every_figure(llm, tmp_path):
    spec = TraceSpec(sessions=2, turns=3, system_tokens=30, task_tokens=5, turn_tokens=9, output_tokens=4)
    r = run_bench(llm, spec, baseline="transformers", ablation=True, micro_context=16, parallel=2)
    for key in SUMMARY_KEYS:
        assert isinstance(r[key], float), key
    assert r["hit_rate_vs_theoretical"] == 1.0
    assert r["copy_bytes_per_token_long_over_short"] == 1.0
    samples = r["decode"]["samples"]  # interleaved samples; each summary rate is the best of its own
    assert all(len(v) == RATE_SAMPLES for v in samples.values())
    assert r["decode"]["batch1_tokens_per_s"] == max(samples["single"])
    assert r["roofline"]["read_bandwidth_bytes_per_s"] == max(samples["read_bandwidth"])
    assert r["roofline"]["copy_bandwidth_bytes_per_s"] == max(samples["copy_bandwidth"])
    assert r["roofline_fraction"] == pytest.approx(
        r["decode"]["batch1_tokens_per_s"] * r["roofline"]["bytes_read_per_token"] / max(samples["read_bandwidth"]))
    assert r["parallel_speedup"] == max(samples["batched"]) / max(samples["single"])
    ours, ablation = r["replays"]["tsterm"], r["replays"]["no_prefix_cache"]
    assert all(t["cached_tokens"] == t["theoretical_cached"] for t in ours["turns"] if t["turn"] > 0)
    assert all(t["cached_tokens"] == 0 for t in ablation["turns"])
    assert len(r["replays"]["transformers"]["turns"]) == 6
    assert "speedup_vs_baseline" in format_table(r)
    svg = tmp_path / "ttft.svg"
    write_plot(r, str(svg))
    assert svg.read_text().startswith("<svg") and "no_prefix_cache" in svg.read_text()
    with pytest.raises(ConfigError):
        write_plot(r, str(tmp_path / "ttft.gif"))
    assert llm.stats()["used"] == 0


def test_parallel_ceiling_counts_the_experts_a_batch_touches(llm):
    cfg = llm.engine.model_config
    E, k, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    assert parallel_ceiling(cfg, 4, 16, 1) == pytest.approx(1.0)
    one = bytes_read_per_token(cfg, 4, 16)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    kv = 16 * 2 * L * cfg.num_key_value_heads * cfg.head_dim * 4
    # Two tokens touch k + k (E - k) / E experts on average: the second token's picks miss the first's w.p. (E-k)/E.
    two = one + L * (k * (E - k) / E) * expert + kv
    assert parallel_ceiling(cfg, 4, 16, 2) == pytest.approx(2 * one / two)
    assert 1.0 < parallel_ceiling(cfg, 4, 16, 8) < 8.0
