"""An engine's float32 shape classes on the CPU and the kernel each gets at start (tsterm.model.cpu_kernels): every
class the model multiplies is chosen for, measured once and kept beside the built libraries, reported in the start
log; a class forced onto torch keeps the whole model on torch's path for it (no C decode stack)."""
from __future__ import annotations

import logging

import pytest
from tsterm_kernels import cpu_select, torch_ops

from tests.helpers.checkpoints import BASE, make_checkpoint
from tsterm.llm import LLM
from tsterm.model.cpu_kernels import shape_classes

SIZES = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             shared_expert_intermediate_size=48, num_hidden_layers=2)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("cpu-kernels") / "qwen2moe", "qwen2_moe", SIZES)
    return str(path)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """A kernel cache of its own (the plan file lands there), the measured choices forgotten before and after."""
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_select.ENV, raising=False)
    for cached in (torch_ops._machine, torch_ops._planned):
        cached.cache_clear()
    yield tmp_path
    for cached in (torch_ops._machine, torch_ops._planned):
        cached.cache_clear()


def test_every_shape_class_of_the_model_is_measured_kept_and_logged(qwen2_moe, fresh_cache, caplog):
    with caplog.at_level(logging.INFO, logger="tsterm.model.cpu_kernels"):
        llm = LLM(qwen2_moe, dtype="float32", device="cpu", num_kv_blocks=32, block_size=16)
    hidden, heads, kv_heads, head_dim = 64, BASE["num_attention_heads"], BASE["num_key_value_heads"], BASE["head_dim"]
    vocab = llm.engine.model_config.vocab_size
    want = {f"gemm:{(heads + 2 * kv_heads) * head_dim}x{hidden}", f"gemm:{hidden}x{heads * head_dim}",
            f"attention:{heads}x{kv_heads}x{head_dim}", f"gemm:8x{hidden}", f"experts:8x64x{hidden}x2",
            f"gemm:1x{hidden}", f"experts:1x96x{hidden}x1", f"gemm:{vocab}x{hidden}"}
    plan = llm.engine.executor.cpu_kernels
    assert set(plan) == want == {s.key for s in shape_classes(llm.engine.executor.model)}
    assert all(c.how == "measured" and c.candidate in cpu_select.INVARIANT for c in plan.values())
    stored = [cpu_select.read_plan(p) for p in (fresh_cache / "kernels").glob("choices-*.json")]
    assert len(stored) == 1 and stored[0] == plan  # beside the built libraries, read back at the next start
    assert llm.engine.executor.model.stack is not None  # the C decode stack, its classes on the C kernels
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels on ")]
    assert all(key in line for key in want)


def test_a_class_forced_onto_torch_runs_torch_in_decode_too(qwen2_moe, fresh_cache, monkeypatch):
    monkeypatch.setenv(cpu_select.ENV, "attention=torch")
    llm = LLM(qwen2_moe, dtype="float32", device="cpu", num_kv_blocks=32, block_size=16)
    plan = llm.engine.executor.cpu_kernels
    assert {c.candidate for k, c in plan.items() if k.startswith("attention:")} == {"torch"}
    assert llm.engine.executor.model.stack is None  # the one-call C stack would run the C attention in decode
    assert not list((fresh_cache / "kernels").glob("choices-*.json"))[0].read_text().count('"attention:')
