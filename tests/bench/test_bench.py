"""`tsterm bench` on a tiny checkpoint: the figures it reports are computed from what actually happened."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM
from tsterm.bench import RATE_SAMPLES, run_bench
from tsterm.bench.measure import bytes_read_per_token, parallel_ceiling, stored_decode_bytes
from tsterm.bench.replay import load_transformers, replay_transformers
from tsterm.bench.report import format_table, write_plot
from tsterm.bench.trace import TraceSpec, agent_trace, load_agent_trace, make_trace, theoretical_cached
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint

SUMMARY_KEYS = ("speedup_vs_baseline", "ttft_last_over_turn2", "hit_rate_vs_theoretical",
                "copy_bytes_per_token_long_over_short", "roofline_fraction", "parallel_speedup",
                "parallel_fraction_of_ceiling")


def test_trace_shape_and_theoretical_maximum():
    spec = TraceSpec(sessions=3, turns=4, system_tokens=40, task_tokens=5, turn_tokens=7, output_tokens=3)
    trace = make_trace(spec, vocab_size=300)
    assert len(trace) == 3 and all(len(s) == 4 for s in trace)
    first, other = trace[0][0].new_ids, trace[1][0].new_ids
    assert first[:40] == other[:40] and first[40:] != other[40:]  # shared system prompt
    assert [len(t.new_ids) for t in trace[0]] == [45, 7, 7, 7]
    assert {(t.output_tokens, t.keep) for s in trace for t in s} == {(3, None)}
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
    r = run_bench(llm, spec, baseline=["transformers-cache", "transformers"], ablation=True, micro_context=16,
                  parallel=2)
    for key in SUMMARY_KEYS:
        assert isinstance(r[key], float), key
    assert r["hit_rate_vs_theoretical"] == 1.0
    assert r["copy_bytes_per_token_long_over_short"] == 1.0
    samples = r["decode"]["samples"]  # sampled in rounds; each rate reported is the best of its own samples
    assert all(len(v) == RATE_SAMPLES for v in samples.values())
    assert r["decode"]["batch1_tokens_per_s"] == max(samples["single"])
    assert r["roofline"]["read_bandwidth_bytes_per_s"] == max(samples["read_bandwidth"])
    assert r["roofline"]["copy_bandwidth_bytes_per_s"] == max(samples["copy_bandwidth"])
    # each ratio is the median of its rounds' ratios: a round's figures come from one state of the machine
    per_token = r["roofline"]["bytes_read_per_token"]
    fractions = sorted(t * per_token / b for t, b in zip(samples["single"], samples["read_bandwidth"]))
    speedups = sorted(b / t for b, t in zip(samples["batched"], samples["single"]))
    assert r["roofline_fraction"] == pytest.approx(fractions[RATE_SAMPLES // 2])
    assert r["parallel_speedup"] == pytest.approx(speedups[RATE_SAMPLES // 2])
    assert r["parallel_fraction_of_ceiling"] == pytest.approx(r["parallel_speedup"] / r["decode"]["parallel_ceiling"])
    ours, ablation = r["replays"]["tsterm"], r["replays"]["no_prefix_cache"]
    assert all(t["cached_tokens"] == t["theoretical_cached"] for t in ours["turns"] if t["turn"] > 0)
    assert all(t["cached_tokens"] == 0 for t in ablation["turns"])
    cache, scratch = r["replays"]["transformers-cache"], r["replays"]["transformers"]
    assert len(scratch["turns"]) == len(cache["turns"]) == 6
    # greedy tokens: the same from tsterm, transformers with its cache kept and transformers from scratch
    outputs = [{(t["session"], t["turn"]): t["output_token_ids"] for t in rep["turns"]} for rep in (ours, cache, scratch)]
    assert outputs[0] == outputs[1] == outputs[2] and all(len(ids) == 4 for ids in outputs[0].values())
    # the kept cache holds each conversation up to its last reply's last token (never fed back): 35 + 4 - 1, ...
    assert [t["cached_tokens"] for t in cache["turns"] if t["session"] == 0] == [0, 38, 51]
    assert all(t["cached_tokens"] == 0 for t in scratch["turns"])
    assert r["speedup_vs"] == {name: pytest.approx(r["replays"][name]["wall_s"] / ours["wall_s"])
                               for name in ("transformers-cache", "transformers")}
    assert r["speedup_vs_baseline"] == min(r["speedup_vs"].values())
    # and by process CPU time (what each replay computed), from each replay's own count
    assert r["cpu_speedup_vs"] == {name: pytest.approx(r["replays"][name]["phases"]["cpu_s"] / ours["phases"]["cpu_s"])
                                   for name in ("transformers-cache", "transformers")}
    table = format_table(r)
    assert "speedup_vs_transformers-cache" in table and "speedup_vs_transformers " in table
    assert "time split" in table and f"by process CPU time {r['cpu_speedup_vs']['transformers']:.2f}x" in table
    assert f"ceiling {r['decode']['parallel_ceiling']:.2f}" in table and "parallel_fraction_of_ceiling" in table
    assert f"{r['roofline_fraction']:.3f}" in table.split("sample rounds")[1].splitlines()[0]  # the rounds, shown
    svg = tmp_path / "ttft.svg"
    write_plot(r, str(svg))
    assert svg.read_text().startswith("<svg") and "no_prefix_cache" in svg.read_text()
    with pytest.raises(ConfigError):
        write_plot(r, str(tmp_path / "ttft.gif"))
    assert llm.stats()["used"] == 0


def test_table_judges_each_baseline_and_the_parallel_share_of_the_ceiling(llm):
    r = run_bench(llm, TraceSpec(turns=2, system_tokens=8, task_tokens=4, turn_tokens=4, output_tokens=2),
                  micro_context=16, parallel=2)
    assert r["speedup_vs"] == {} and r["speedup_vs_baseline"] is None
    rows = {line.split()[0]: line.split()[1:] for line in format_table(r).splitlines()[-8:]}
    assert rows["speedup_vs_baseline"][0] == "n/a"
    r.update(speedup_vs={"transformers-cache": 2.5, "transformers": 4.0}, parallel_speedup=2.1,
             parallel_fraction_of_ceiling=2.1 / 2.78)
    r["decode"]["parallel_ceiling"] = 2.78
    rows = {line.split()[0]: line.split()[1:] for line in format_table(r).splitlines()}
    assert rows["speedup_vs_transformers-cache"] == ["2.500", ">=", "2.0", "yes"]
    assert rows["speedup_vs_transformers"] == ["4.000", ">=", "5.0", "NO"]
    assert rows["parallel_speedup"] == ["2.100", "ceiling", "2.78", "-"]  # 2.1x of 8 would fail a 4x target
    assert rows["parallel_fraction_of_ceiling"] == ["0.755", ">=", "0.75", "yes"]
    with pytest.raises(ConfigError, match="unknown baseline"):
        run_bench(llm, TraceSpec(turns=2), baseline=["vllm"])


@pytest.mark.parametrize("keep_cache, forwards", [
    (True, [25, 1, 1, 7, 1, 1, 7, 1, 1]),  # turn 2: 34 prompt ids, 27 in the cache (the last reply token never fed)
    (False, [25, 1, 1, 34, 1, 1, 43, 1, 1]),
])
def test_transformers_with_its_cache_encodes_only_what_each_turn_adds(llm, keep_cache, forwards):
    model = load_transformers(llm.engine.config.model, torch.float32)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    trace = make_trace(TraceSpec(turns=3, system_tokens=20, task_tokens=5, turn_tokens=6, output_tokens=3), 300)
    result = replay_transformers(model, trace, keep_cache=keep_cache)
    assert seen == forwards  # per turn: one forward over the ids not in the cache, then one per further token
    assert [t.cached_tokens for t in result.turns] == ([0, 27, 36] if keep_cache else [0, 0, 0])


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


def test_roofline_bytes_are_the_weights_as_stored(tmp_path):
    """The roofline of a quantized model divides by the bytes its kernels read, not by its float size."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2)
    path, _ = make_checkpoint(tmp_path / "m", "qwen3_moe", sizes)
    expert = 3 * 64 * 32  # weights of one expert
    stored = {}
    for mode in ("none", "int8"):
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, quantization=mode)
        cfg = llm.engine.model_config
        stored[mode] = stored_decode_bytes(llm.engine.executor.model, cfg, 4, 16)
    one, expert_bytes = stored["none"]
    assert expert_bytes == 4 * expert
    # the config's count, plus the per-head q/k norm weights the kernels read (Qwen3: [Hq + Hkv, D] a layer)
    qk_norms = cfg.num_hidden_layers * (cfg.num_attention_heads + cfg.num_key_value_heads + 2) * cfg.head_dim * 4
    assert one == bytes_read_per_token(cfg, 4, 16) + qk_norms
    assert stored["int8"][1] == expert + expert // 32 * 2  # int8 codes + one fp16 scale per 32
    assert stored["int8"][0] < one / 2
    assert parallel_ceiling(cfg, 4, 16, 8, stored["int8"]) != parallel_ceiling(cfg, 4, 16, 8)


def recorded_steps() -> list[dict]:
    """An agent session's shape: 3 steps, the third after a template miss that kept only 20 ids."""
    return [{"prompt_tokens": 60, "kept_tokens": 0, "cached_tokens": 0, "generated_tokens": 5, "tool_latency_s": [0.5]},
            {"prompt_tokens": 80, "kept_tokens": 65, "cached_tokens": 64, "generated_tokens": 6,
             "tool_latency_s": [0.25, 0.25]},
            {"prompt_tokens": 50, "kept_tokens": 20, "cached_tokens": 20, "generated_tokens": 3}]


def write_trace(path, steps, **extra):
    import json
    path.write_text(json.dumps({"format": "tsterm-agent-trace", "version": 1, "model": "m", "steps": steps,
                                **extra}))
    return path


def test_a_recorded_agent_trace_replays_its_shape(tmp_path):
    data = load_agent_trace(write_trace(tmp_path / "t.json", recorded_steps()))
    [turns] = agent_trace(data, vocab_size=300)
    assert [(len(t.new_ids), t.output_tokens, t.keep) for t in turns] == [(60, 5, None), (15, 6, None), (30, 3, 20)]
    two = agent_trace(data, vocab_size=300, sessions=2)
    assert len(two) == 2 and two[0][0].new_ids != two[1][0].new_ids


@pytest.mark.parametrize("steps, match", [
    ([], "non-empty"), (recorded_steps()[:1], "one step only"),
    ([{"prompt_tokens": 10, "kept_tokens": 0, "generated_tokens": 2},
      {"prompt_tokens": 20, "kept_tokens": 13, "generated_tokens": 2}], "more than the previous step left"),
    ([{"prompt_tokens": "10", "kept_tokens": 0, "generated_tokens": 2}] * 2, "prompt_tokens must be"),
    ([{"prompt_tokens": 10, "kept_tokens": 0, "generated_tokens": 2, "tool_latency_s": [-1]}] * 2, "tool_latency_s"),
])
def test_a_bad_trace_file_is_a_clear_error(tmp_path, steps, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_trace(write_trace(tmp_path / "t.json", steps))
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not JSON"):
        load_agent_trace(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="not a tsterm agent trace"):
        load_agent_trace(write_trace(tmp_path / "y.json", steps, format="other"))


def test_bench_replays_a_recorded_trace_with_its_reuse(llm, tmp_path):
    data = load_agent_trace(write_trace(tmp_path / "t.json", recorded_steps()))
    r = run_bench(llm, TraceSpec(sessions=2), ablation=True, micro_context=16, parallel=2, recorded=data)
    assert r["trace"] == {"recorded": True, "model": "m", "sessions": 2, "steps": 3, "tool_seconds_not_replayed": 1.0}
    ours = r["replays"]["tsterm"]["turns"]
    assert [t["prompt_tokens"] for t in ours if t["session"] == 0] == [60, 80, 50]
    assert [t["generated_tokens"] for t in ours if t["session"] == 0] == [5, 6, 3]
    later = [t for t in ours if t["turn"] > 0]
    assert all(t["cached_tokens"] == t["theoretical_cached"] > 0 for t in later)  # block size 4: 64, then 20
    assert {t["theoretical_cached"] for t in later} == {64, 20}
    assert r["hit_rate_vs_theoretical"] == 1.0
    assert all(t["cached_tokens"] == 0 for t in r["replays"]["no_prefix_cache"]["turns"])
