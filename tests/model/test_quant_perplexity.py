"""Held-out perplexity of the shipped moe-demo model (trained on Shakespeare) with fp16 / int8 / int4 weights vs float.

The quantized model's weights are `quantize(w).dequantize()` of every matrix tsterm quantizes, run by transformers:
tests/model/test_quant.py shows tsterm's quantized model computes exactly these weights (greedy tokens equal,
log-probs within 2e-5) when its matmuls are float; this measures what the weights' quantization costs, on held-out
text, in one run. (tsterm's C kernels also round each activation to int8 per block of 32 in matmuls of few rows, as
llama.cpp does; that is not in these figures.) The figures printed here are the ones BENCHMARKS.md records
("Quantized weights").
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import tsterm
from tsterm.bench.quality import perplexity, quantizable_parameters

MODEL_DIR = Path(tsterm.__file__).parent / "models" / "moe_demo"
WINDOW = 256

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(
        (MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")).ids
    count = len(ids) // WINDOW
    return torch.tensor(ids[:count * WINDOW]).view(count, WINDOW)  # [N, T]


def test_int8_perplexity_within_one_percent_of_float_and_int4_reported(windows):
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    originals = quantizable_parameters(model)
    ppl = {mode: perplexity(model, originals, mode, windows) for mode in ("none", "fp16", "int8", "int4")}
    print(f"moe-demo held-out perplexity ({windows.numel()} tokens): "
          + ", ".join(f"{mode} {value:.3f} ({value / ppl['none'] - 1:+.2%})" for mode, value in ppl.items()))
    assert abs(ppl["fp16"] / ppl["none"] - 1) < 0.001  # a bfloat16 checkpoint: fp16 holds its weights exactly
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01
    assert ppl["int4"] != ppl["none"]  # the weights really changed
    assert ppl["int4"] / ppl["none"] - 1 < 0.10  # int4 in groups of 32 costs a few percent, not a broken model
