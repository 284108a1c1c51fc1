"""A float model run with dtype bfloat16 on the CPU (csrc/bf16.c's linears, the ops between them in float32) loses
no more held-out perplexity than int8 weights may (tests/model/test_quant_perplexity.py: within 1% of float), measured
through tsterm's own engine: every position's logits of each held-out window's prefill, float32 against bfloat16, on
the shipped moe-demo model (trained on Shakespeare). The figure BENCHMARKS.md records for the default model's family
comes from the same measurement on SmolLM2-135M's float32 import."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer

import tsterm
from tsterm import LLM, SamplingParams

MODEL_DIR = Path(tsterm.__file__).parent / "models" / "moe_demo"
WINDOW = 256


def _perplexity(dtype: str, windows: list[list[int]]) -> float:
    """exp(mean next-token NLL) within each window, from the logits of every row of the window's one-step prefill."""
    llm = LLM(str(MODEL_DIR), dtype=dtype, device="cpu", enable_prefix_caching=False, max_num_batched_tokens=WINDOW)
    model = llm.engine.executor.model
    forward, rows = model.forward, []

    def keep_every_row(input_ids, positions):  # the prefill's final hidden states, all rows, as logits
        hidden = forward(input_ids, positions)
        if input_ids.shape[0] == WINDOW:
            rows.append(model.logits(hidden))
        return hidden
    model.forward = keep_every_row
    nll, count = 0.0, 0
    for window in windows:
        rows.clear()
        llm.generate([window], SamplingParams(temperature=0, max_tokens=1))
        assert len(rows) == 1, "the window was not prefilled in one step"
        logp = torch.log_softmax(rows[0].double(), -1)
        nll -= float(logp[torch.arange(WINDOW - 1), torch.tensor(window[1:])].sum())
        count += WINDOW - 1
    return math.exp(nll / count)


def test_bfloat16_perplexity_within_int8s_bound_of_float32():
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(
        (MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")).ids
    windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(len(ids) // WINDOW)]
    full, half = _perplexity("float32", windows), _perplexity("bfloat16", windows)
    print(f"moe-demo held-out perplexity ({len(windows) * (WINDOW - 1)} predictions): float32 {full:.3f}, "
          f"bfloat16 {half:.3f} ({half / full - 1:+.2%})")
    assert abs(half / full - 1) < 0.01
    assert half != full  # the bfloat16 run did round something (it is not the float32 model twice)
