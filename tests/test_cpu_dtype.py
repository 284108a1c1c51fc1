"""What `dtype: auto` means on the CPU (tsterm.cpu), on fake CPU descriptions: bfloat16 where AMX-BF16 is granted by the
OS and the model's linears are float, float32 where AMX is refused, with AVX512-BF16 but no AMX, on an AVX2-only CPU,
under TSTERM_CPU_ISA=avx2, on aarch64, and for a model of int8 / int4 blocks; the engine runs what was chosen and says
why (EngineInfo), and a profile's KV byte figures follow it."""
from __future__ import annotations

import json

import pytest
import torch

from tsterm import cpu
from tsterm.cpu import CpuFeatures, auto_dtype, cpu_auto_dtype, quantized_linears
from tsterm.engine.engine import dtype_choice, resolve_dtype
from tsterm.profiles import _kv_dtype_bytes, load_profile

AVX2 = CpuFeatures("x86_64", "Intel Core i7-8700", frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
ZEN4 = CpuFeatures("x86_64", "AMD Ryzen 9 7950X", AVX2.flags | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
SPR_FLAGS = ZEN4.flags | {"avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
SPR = CpuFeatures("x86_64", "Intel Xeon Platinum 8480+", SPR_FLAGS, amx_granted=True)
SPR_REFUSED = CpuFeatures("x86_64", "Intel Xeon Platinum 8480+", SPR_FLAGS, amx_granted=False)
SPR_AVX2 = CpuFeatures("x86_64", "Intel Xeon Platinum 8480+", SPR_FLAGS, amx_granted=False, isa_limit="avx2")
ARM = CpuFeatures("aarch64", "Apple M2", frozenset({"fp", "asimd", "asimddp", "bf16", "i8mm"}))


@pytest.mark.parametrize("features,want,why", [
    (SPR, "bfloat16", "AMX-BF16 granted by the OS"),
    (SPR_REFUSED, "float32", "AMX refused by the OS"),
    (SPR_AVX2, "float32", "TSTERM_CPU_ISA=avx2 leaves AMX out"),
    (ZEN4, "float32", "AVX512-BF16 without AMX"),
    (AVX2, "float32", "no AMX-BF16"),
    (ARM, "float32", "aarch64 CPU"),
], ids=["amx-granted", "amx-refused", "isa-limit-avx2", "avx512-bf16-no-amx", "avx2-only", "aarch64"])
def test_auto_is_bfloat16_only_where_amx_is_granted(features, want, why):
    choice = cpu_auto_dtype(features)
    assert choice.dtype == want and why in choice.reason and features.model in choice.reason
    assert choice.describe() == f"{want} ({choice.reason})"


def test_a_model_of_integer_blocks_stays_float32_even_with_amx():
    assert cpu_auto_dtype(SPR, quantized=True).dtype == "float32"
    assert "int8 / int4 weights" in cpu_auto_dtype(SPR, quantized=True).reason
    assert [quantized_linears(q, m) for q, m in [("none", None), ("none", "fp8"), ("int8", None), ("int4", None),
                                                  ("fp16", None), ("none", "gguf_blocks"), ("none", "mxfp4")]] == \
        [False, False, True, True, True, True, True]


def test_a_gpu_is_bfloat16_and_a_named_dtype_is_kept():
    assert auto_dtype("cuda", cpu=AVX2).dtype == "bfloat16"
    assert dtype_choice("float32", torch.device("cpu"), cpu=SPR).dtype == "float32"
    assert dtype_choice("float32", torch.device("cpu"), cpu=SPR).reason == "as configured"
    assert resolve_dtype("auto", torch.device("cpu"), cpu=SPR) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), quantized=True, cpu=SPR) is torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), cpu=ZEN4) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), cpu=AVX2) is torch.bfloat16


def test_detection_asks_the_os_only_where_the_cpu_has_amx_and_honours_the_isa_limit(monkeypatch):
    asked = []
    monkeypatch.setattr(cpu, "amx_permitted", lambda: asked.append(True) or True)
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    here = CpuFeatures.detect()
    assert bool(asked) == ("amx_tile" in here.flags) and here.amx_granted == ("amx_tile" in here.flags)
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    limited = CpuFeatures.detect()
    assert limited.isa_limit == "avx2" and not limited.amx_granted
    assert cpu_auto_dtype(limited).dtype == "float32"


def _fake_cpu(monkeypatch, features: CpuFeatures) -> None:
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: features))


@pytest.mark.parametrize("features,want", [(SPR, torch.bfloat16), (SPR_REFUSED, torch.float32),
                                           (AVX2, torch.float32)], ids=["amx-granted", "amx-refused", "avx2-only"])
def test_the_engine_runs_what_auto_chose_and_says_why(tmp_path, monkeypatch, features, want):
    from tests.helpers.checkpoints import make_checkpoint
    from tsterm import LLM
    from tsterm.engine.info import EngineInfo

    path, _ = make_checkpoint(tmp_path / "m", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                                 num_hidden_layers=1))
    _fake_cpu(monkeypatch, features)
    engine = LLM(str(path), device="cpu", num_kv_blocks=16).engine
    info = EngineInfo.of(engine)
    assert engine.dtype is want and info.dtype == str(want).removeprefix("torch.")
    assert info.dtype_reason == cpu_auto_dtype(features).reason
    assert info.dtype_line.startswith(f"{info.dtype} (auto: ")
    assert engine.executor.model.lm_head.dtype is want  # the weights are in it
    quantized = LLM(str(path), device="cpu", num_kv_blocks=16, quantization="int8").engine
    assert quantized.dtype is torch.float32
    assert ("int8 / int4" in quantized.dtype_choice.reason) == (features is SPR)
    named = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16).engine
    assert EngineInfo.of(named).dtype_line == "float32 (as configured)"


def test_a_profiles_kv_bytes_follow_auto_on_this_cpu(tmp_path, monkeypatch):
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                  max_position_embeddings=4096)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "p.yaml").write_text("model: m\ndevice: cpu\nblock_size: 16\nkv_cache_memory: 262144\n")
    per_token = {2: 4 * 2 * 2 * 16 * 2, 4: 4 * 2 * 2 * 16 * 4}  # layers x K,V x KV heads x head_dim x bytes
    for features, size in ((SPR, 2), (SPR_REFUSED, 4), (ZEN4, 4), (ARM, 4)):
        _fake_cpu(monkeypatch, features)
        assert _kv_dtype_bytes("auto", "cpu") == size
        assert _kv_dtype_bytes("auto", "cpu", quantized=True) == 4
        warning, = load_profile(str(tmp_path / "p.yaml")).kv_budget_warnings()
        assert f"{per_token[size]} bytes per token" in warning and f"x {size} bytes" in warning
    _fake_cpu(monkeypatch, SPR)
    assert _kv_dtype_bytes("auto", "auto") is None and _kv_dtype_bytes("auto", "cuda:0") == 2
    assert _kv_dtype_bytes("float32", "cpu") == 4
