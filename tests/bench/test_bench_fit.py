"""`tsterm bench` never loses a run: a configuration the model cannot hold is refused before the replay, naming the
option; a failure after something was measured still prints and writes it. Its table shows TTFT and cached tokens
turn by turn and the copy bytes per decoded token at both contexts; a batch speedup is judged against the most a
batch can gain over the batch-1 decode actually measured (never "met" above its ceiling)."""
from __future__ import annotations

import json

import pytest

import tsterm.bench as bench
from tsterm import LLM
from tsterm.bench import run_bench
from tsterm.bench.measure import parallel_ceiling, stored_decode_bytes
from tsterm.bench.report import format_table
from tsterm.bench.trace import TraceSpec
from tsterm.cli import main
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint

SMALL = TraceSpec(sessions=2, turns=3, system_tokens=24, task_tokens=4, turn_tokens=8, output_tokens=3)
SMALL_ARGS = ["--sessions", "2", "--turns", "3", "--system-tokens", "24", "--task-tokens", "4", "--turn-tokens", "8",
              "--output-tokens", "3", "--parallel", "2"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                   max_position_embeddings=1024))
    return path


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=512)


@pytest.fixture
def no_replay(monkeypatch):
    monkeypatch.setattr(bench, "replay_tsterm", lambda *a, **k: pytest.fail("refused runs must not replay"))


@pytest.mark.parametrize("options, message", [
    # 1024 tokens of context: the long copy audit (8 x 256 + 9) cannot fit, at most (1024 - 9) // 8 = 126
    (dict(micro_context=256), "--micro-context 256: the copy audit's long context (8 x 256 + 9 tokens = 2057) is "
                              "more than the model's context holds (1024); give --micro-context 126 or less"),
    # 8 requests of 120 + 18 tokens take 8 x 35 blocks of 4; the pool has 512 (fits); 16 x 35 = 560 do not
    (dict(micro_context=120, parallel=16), "--parallel 16 at --micro-context 120 needs 560 KV blocks at once but the "
                                           "pool has 512"),
    (dict(micro_context=16, parallel=65), "--parallel 65 is more requests than the engine runs at once"),
])
def test_a_run_that_cannot_fit_is_refused_before_the_replay(llm, no_replay, options, message):
    with pytest.raises(ConfigError) as info:
        run_bench(llm, SMALL, **options)
    assert message in str(info.value)


def test_a_trace_longer_than_the_context_names_the_options(llm, no_replay):
    with pytest.raises(ConfigError, match=r"session 1 turn 3 needs 1060 tokens .* holds 1024: lower --system-tokens"):
        run_bench(llm, TraceSpec(turns=3, system_tokens=1000, task_tokens=4, turn_tokens=16, output_tokens=8))


def test_the_default_micro_context_is_what_the_model_holds(llm, monkeypatch):
    monkeypatch.setattr(bench, "RATE_SAMPLES", 1)
    r = run_bench(llm, SMALL, parallel=2)
    assert (r["copy_audit"]["context_short"], r["copy_audit"]["context_long"]) == (126, 1008)


def test_a_failure_after_the_replay_prints_and_writes_what_was_measured(model_path, monkeypatch, tmp_path, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the copy audit broke")

    monkeypatch.setattr(bench, "copy_bytes_per_token", broken)
    out = tmp_path / "r.json"
    code = main(["bench", "--model", str(model_path), "--device", "cpu", *SMALL_ARGS, "--json", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 1 and "tsterm: error: the bench stopped after measuring the tsterm replay (RuntimeError: the " \
        "copy audit broke)" in err, err
    written = json.loads(out.read_text())
    assert written["incomplete"] == "the copy audit broke" and written["measured"] == ["the tsterm replay"]
    turns = written["replays"]["tsterm"]["turns"]
    assert len(turns) == 6 and all(t["cached_tokens"] > 0 for t in turns if t["turn"] > 0)
    assert "TTFT by turn" in stdout and "incomplete: measured the tsterm replay" in stdout


def test_the_table_shows_each_turn_and_the_copy_bytes_at_both_contexts(llm, monkeypatch):
    monkeypatch.setattr(bench, "RATE_SAMPLES", 1)
    r = run_bench(llm, SMALL, micro_context=16, parallel=2, baseline="transformers-cache")
    table = format_table(r).splitlines()
    head = table.index("TTFT by turn (mean over sessions; prompt tokens from the cache / in the prompt):")
    assert table[head + 1].split() == ["turn", "tsterm", "transformers-cache"]
    for turn in range(3):
        cells = [c.strip() for c in table[head + 2 + turn].strip().split("  ") if c.strip()]
        records = [t for t in r["replays"]["tsterm"]["turns"] if t["turn"] == turn]
        cached = sum(t["cached_tokens"] for t in records) / 2
        prompt = sum(t["prompt_tokens"] for t in records) / 2
        ttft = r["replays"]["tsterm"]["ttft_by_turn_s"][turn]
        assert cells[0] == str(turn + 1) and f"{ttft * 1e3:.0f} ms, {cached:.0f}/{prompt:.0f} cached" in cells
    audit = r["copy_audit"]
    assert (f"copy bytes per decoded token: {audit['short']['copy_bytes_per_token']:,.0f} at 16 tokens of context, "
            f"{audit['long']['copy_bytes_per_token']:,.0f} at 128") in table


@pytest.mark.parametrize("regime", ["overhead-bound", "memory-bound"])
def test_a_batch_speedup_never_exceeds_its_ceiling(llm, monkeypatch, regime):
    """Rates of two engines that cannot be beaten: one whose step costs the same at any batch (a tiny model, bound
    by per-step overhead: batch P gives P x), one that streams exactly its bytes at the bandwidth. Each reaches
    its ceiling, and no more: the memory-bound ratio alone (4.9x here) would put the first at 1.6 of its "ceiling"."""
    monkeypatch.setattr(bench, "RATE_SAMPLES", 1)
    engine, parallel, bandwidth = llm.engine, 8, 50e9
    cfg = engine.model_config
    stored = stored_decode_bytes(engine.executor.model, cfg, 4, 16)
    memory_ceiling = parallel_ceiling(cfg, 4, 16, parallel, stored)
    one = stored[0]
    if regime == "overhead-bound":  # 1 ms a step whatever the batch: 1000 tok/s at batch 1, far below the roofline
        rates = {1: 1000.0, parallel: parallel * 1000.0}
    else:  # exactly the bytes of a step at the bandwidth
        rates = {1: bandwidth / one, parallel: bandwidth / one * memory_ceiling}
    monkeypatch.setattr(bench, "decode_rate", lambda engine, batch, context, salt=0: rates[batch])
    monkeypatch.setattr(bench, "read_bandwidth", lambda device: bandwidth)
    r = run_bench(llm, SMALL, micro_context=16, parallel=parallel)
    assert r["parallel_speedup"] == pytest.approx(rates[parallel] / rates[1])
    assert r["parallel_fraction_of_ceiling"] == pytest.approx(1.0)
    expected = parallel if regime == "overhead-bound" else memory_ceiling
    assert r["decode"]["parallel_ceiling"] == pytest.approx(expected)
    assert r["decode"]["memory_bound_ceiling"] == pytest.approx(memory_ceiling) and memory_ceiling < parallel * 0.7


def test_a_share_above_the_ceiling_is_not_met(llm, monkeypatch):
    """A batch speedup above every ceiling (P x) can only be a measurement gone wrong: never "met: yes"."""
    monkeypatch.setattr(bench, "RATE_SAMPLES", 1)
    monkeypatch.setattr(bench, "decode_rate", lambda engine, batch, context, salt=0: 1000.0 * batch ** 2)
    r = run_bench(llm, SMALL, micro_context=16, parallel=4)
    assert r["parallel_fraction_of_ceiling"] == pytest.approx(4.0)
    row = [line for line in format_table(r).splitlines() if line.startswith("parallel_fraction_of_ceiling")]
    assert row and row[0].split()[1:] == ["4.000", ">=", "0.75", "?", "above", "its", "ceiling"]
