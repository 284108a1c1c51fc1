"""The shipped `moe-demo` checkpoint (trained by scripts/train_moe_demo.py): it loads, matches transformers, is as
good on held-out text as its training.json says, and routes tokens to every expert."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import tsterm
from tsterm import LLM, SamplingParams

from tests.helpers.parity import assert_last_logits_close

MODEL_DIR = Path(tsterm.__file__).parent / "models" / "moe_demo"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_moe_demo.py"

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((MODEL_DIR / "training.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout_windows(report) -> torch.Tensor:
    """heldout.txt cut into the windows the training script measured it in: [N, eval_window]."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode((MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")).ids
    window = report["eval_window"]
    count = len(ids) // window
    assert count >= 4, f"heldout.txt gives only {len(ids)} tokens"
    return torch.tensor(ids[:count * window]).view(count, window)


def test_checkpoint_is_small_and_bfloat16():
    config = json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16"
    assert config["num_experts"] == config["num_local_experts"]
    assert sum(f.stat().st_size for f in MODEL_DIR.iterdir()) < 30_000_000


def test_tsterm_matches_transformers_and_writes_text(hf_model, heldout_windows):
    llm = LLM(str(MODEL_DIR), dtype="float32", device="cpu")
    prompt = heldout_windows[0, :40].tolist()
    assert_last_logits_close(llm, hf_model, prompt)

    out = llm.generate("KING HENRY.\nWhat", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    letters = sum(c.isalpha() or c.isspace() for c in out.text)
    assert len(out.text) > 20 and letters / len(out.text) > 0.8, out.text


def test_heldout_perplexity_within_recorded_bound(hf_model, heldout_windows, report):
    with torch.no_grad():
        logits = hf_model(heldout_windows).logits  # [N, T, V]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), heldout_windows[:, 1:].flatten())
    perplexity = math.exp(nll.item())
    assert perplexity <= report["heldout_slice_perplexity"] * 1.05, (perplexity, report["heldout_slice_perplexity"])
    assert perplexity < hf_model.config.vocab_size / 8  # far from guessing


def test_every_expert_receives_tokens(hf_model, heldout_windows, report):
    with torch.no_grad():
        router_logits = hf_model(heldout_windows, output_router_logits=True).router_logits  # layers x [N*T, E]
    k, experts = hf_model.config.num_experts_per_tok, hf_model.config.num_experts
    for layer, logits in enumerate(router_logits):
        load = torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=experts)  # [E]
        ratio = (load.max() / load.min()).item() if load.min() > 0 else math.inf
        print(f"layer {layer}: expert loads {load.tolist()}, max/min {ratio:.2f}")
        assert load.min() > 0, f"layer {layer}: an expert gets no held-out tokens: {load.tolist()}"
        assert ratio < 20
    for layer, fractions in enumerate(report["expert_load_fractions"]):
        assert len(fractions) == experts and min(fractions) > 0, (layer, fractions)


def test_training_script_help():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--sdist" in result.stdout and "--steps" in result.stdout
