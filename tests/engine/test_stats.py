"""Engine metrics: histograms, rolling rates, the counters a /metrics scrape reads, MoE expert load."""
from __future__ import annotations

import pytest

from tsterm import LLM, SamplingParams
from tsterm.engine.stats import Histogram, RateWindow

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.metrics import scrape


def test_histogram_counts_each_value_in_its_bucket():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 0.7, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]  # <= 0.1 (a bound belongs to its bucket), <= 1.0, +Inf
    assert h.count == 5 and h.total == pytest.approx(4.35)


def test_rate_window_expires_old_events():
    w = RateWindow(seconds=2.0)
    w.add(10, now=100.0)
    w.add(10, now=101.0)
    assert w.rate(now=101.0) == pytest.approx(20.0)
    assert w.rate(now=110.0) == 0.0


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("stats") / "m", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)


def test_a_scrape_after_two_turns(llm):
    """What /metrics shows (the server's collector, through prometheus_client's text format and parser) after a
    conversation's second turn reused the first one's blocks."""
    prompt = list(range(10, 40))
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    llm.generate(prompt + first.token_ids + [7, 8], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    values = scrape(llm.engine)
    # the second prompt holds the first turn's 34 computed tokens: 8 full blocks and a partial one of 2
    assert values["tsterm:prefix_cache_hits_total"] == 34 and values["tsterm:prefix_cache_queries_total"] == 30 + 37
    assert values["tsterm:prompt_tokens_total"] == 30 + 37 and values["tsterm:generation_tokens_total"] == 10
    assert values['tsterm:request_success_total{finished_reason="length"}'] == 2
    assert values['tsterm:time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert values["tsterm:time_to_first_token_seconds_count"] == 2
    assert values["tsterm:inter_token_latency_seconds_count"] == 8
    itl = [values[f'tsterm:inter_token_latency_seconds_bucket{{le="{le}"}}'] for le in ("0.001", "0.1", "+Inf")]
    assert itl == sorted(itl) and itl[-1] == 8  # cumulative buckets
    assert 0 <= values["tsterm:kv_cache_usage_perc"] <= 1
    assert values["tsterm:num_requests_running"] == 0 and values["tsterm:num_requests_waiting"] == 0
    stats = llm.stats()  # the copy ledger and the thread count, as llm.stats() reads them
    assert values["tsterm:kv_reused_bytes_total"] == stats["kv_reused_bytes"] > 0
    assert values["tsterm:kv_cow_copies_total"] == stats["cow_copies"]
    assert values["tsterm:kv_cache_blocks_shared"] == stats["shared"]
    assert values["tsterm:cpu_threads"] == stats["cpu_threads"] >= 1


def test_expert_load_counts_every_routed_token(llm):
    before = llm.engine.expert_load()
    llm.generate(list(range(50, 61)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    after = llm.engine.expert_load()
    cfg = llm.engine.model_config
    computed_tokens = 11 + 3  # the prompt, then one decode step per generated token but the last
    for layer_before, layer_after in zip(before, after):
        assert len(layer_after) == cfg.num_experts
        assert sum(layer_after) - sum(layer_before) == computed_tokens * cfg.num_experts_per_tok
