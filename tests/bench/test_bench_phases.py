"""Where a bench replay's time went: tsterm's engine steps counted as prefill or decode steps (and whether a decode
step advanced several sessions at once), the baselines' turns split at their first token, wall and process CPU
seconds for each, and the table line that shows them."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM
from tsterm.bench.replay import PHASES, load_transformers, replay_transformers, replay_tsterm
from tsterm.bench.report import format_table
from tsterm.bench.trace import TraceSpec, make_trace

from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("phases") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                   max_position_embeddings=1024))
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=512)


def _adds_up(phases: dict, wall_s: float) -> None:
    assert sum(phases[f"{p}_s"] for p in PHASES) == pytest.approx(wall_s)
    assert sum(phases[f"{p}_cpu_s"] for p in PHASES) == pytest.approx(phases["cpu_s"])
    assert phases["prefill_cpu_s"] > 0 and phases["decode_cpu_s"] > 0 and phases["other_cpu_s"] >= 0


@pytest.mark.parametrize("sessions", [1, 2])
def test_tsterm_steps_are_counted_as_prefill_or_decode_and_by_the_sessions_they_advance(llm, sessions):
    # 3 turns of 4 tokens: each turn one step over its prompt (it samples the first token) and 3 decode steps. Two
    # sessions run in lockstep (same prompt lengths): their prompts share a step, and so does each decode.
    trace = make_trace(TraceSpec(sessions=sessions, turns=3, system_tokens=20, task_tokens=5, turn_tokens=6,
                                 output_tokens=4), llm.engine.model_config.vocab_size)
    result = replay_tsterm(llm.engine, trace, f"phases{sessions}", cache_salt=f"phases{sessions}")
    p = result.phases
    assert (p["prefill_steps"], p["decode_steps"]) == (3, 9)
    assert (p["batched_decode_steps"], p["decode_rows"]) == ((0, 9) if sessions == 1 else (9, 18))
    _adds_up(p, result.wall_s)


def test_a_baseline_turn_splits_at_its_first_token(llm):
    model = load_transformers(llm.engine.config.model, torch.float32)
    trace = make_trace(TraceSpec(turns=3, system_tokens=20, task_tokens=5, turn_tokens=6, output_tokens=4), 300)
    result = replay_transformers(model, trace, keep_cache=True)
    p = result.phases
    assert p["prefill_s"] == pytest.approx(sum(t.ttft for t in result.turns))
    assert p["decode_s"] == pytest.approx(sum(t.e2e - t.ttft for t in result.turns))
    assert all(0 < t.ttft_cpu < t.e2e_cpu for t in result.turns)
    _adds_up(p, result.wall_s)
    table = format_table({"model": "m", "dtype": "float32", "device": "cpu", "replays": {"transformers-cache": {
        "wall_s": result.wall_s, "ttft_by_turn_s": result.ttft_by_turn(), "cached_tokens": 0, "phases": p,
        "turns": [t.__dict__ for t in result.turns]}}})
    line = table.split("time split")[1].splitlines()[1]
    assert line.startswith("  transformers-cache: prefill ") and f"CPU {p['cpu_s']:.2f} s in all" in line
