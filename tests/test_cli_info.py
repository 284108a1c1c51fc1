"""`tsterm info`: the CPU, the C builds, what `dtype: auto` resolves to and why, and each CPU shape class's kernel as
the kernel cache holds it, through the CLI entry, on a tiny checkpoint."""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_checkpoint
from tsterm.cli import main
from tsterm.cpu import CpuFeatures, cpu_auto_dtype
from tsterm_kernels import cpu_select, torch_ops
from tsterm_kernels.cpu_select import ShapeClass

AVX2 = CpuFeatures("x86_64", "Intel Core i7-8700", frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
ZEN4 = CpuFeatures("x86_64", "AMD Ryzen 9 7950X", AVX2.flags | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
SPR = CpuFeatures("x86_64", "Intel Xeon Platinum 8480+", ZEN4.flags | {"avx512_vnni", "amx_tile", "amx_bf16",
                                                                        "amx_int8"}, amx_granted=True)
SPR_REFUSED = CpuFeatures("x86_64", "Intel Xeon Platinum 8480+", SPR.flags, amx_granted=False)
ARM = CpuFeatures("aarch64", "Apple M2", frozenset({"fp", "asimd", "asimddp", "bf16", "i8mm"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("info") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    return str(path)


def info(capsys, *argv: str) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def fake_cpu(monkeypatch, features: CpuFeatures) -> None:
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: features))


@pytest.mark.parametrize("features", [AVX2, ZEN4, SPR, SPR_REFUSED, ARM], ids=lambda f: f.model)
def test_the_dtype_auto_resolves_to_is_tsterm_cpus_choice_with_its_reason(model_dir, capsys, monkeypatch, features):
    fake_cpu(monkeypatch, features)
    monkeypatch.setenv(cpu_select.ENV, "torch")  # (forced: nothing is measured for these)
    report = info(capsys, "--model", model_dir, "--device", "cpu")
    want = cpu_auto_dtype(features)
    assert report["dtype"] == {"option": "auto", "dtype": want.dtype, "reason": want.reason, "line": want.describe()}
    assert report["device"] == "cpu" and report["model_type"] == "qwen3_moe"
    flags = report["cpu"]["flags"]
    assert flags.get("AVX512-BF16", False) == ("avx512_bf16" in features.flags)
    assert flags.get("AMX-BF16", False) == ("amx_bf16" in features.flags)
    assert flags.get("dotprod", False) == ("asimddp" in features.flags)
    kinds = {c["kind"] for c in report["kernels"]["classes"]}
    assert kinds == ({"bf16", "bf16-attention"} if want.dtype == "bfloat16" else {"gemm", "experts", "attention"})
    # the shape classes are the engine's own for this model
    assert [c["class"] for c in report["kernels"]["classes"]] == [
        s.key for s in _engine_classes(model_dir, want.dtype)]
    # (a bfloat16 pool's attention has no torch candidate: its two C arithmetics are never forced to torch)
    assert all(c["candidate"] == "torch" and c["how"] == "forced" for c in report["kernels"]["classes"]
               if c["kind"] != "bf16-attention")
    assert all(c["how"] != "forced" for c in report["kernels"]["classes"] if c["kind"] == "bf16-attention")
    assert report["cpu"]["env"][cpu_select.ENV] == "torch"


@functools.cache
def _engine_classes(model_dir: str, dtype: str) -> list[ShapeClass]:
    """The shape classes an engine on this model chose kernels for at its start."""
    from tsterm.llm import LLM

    llm = LLM(model_dir, device="cpu", dtype=dtype, kv_cache_memory=8 << 20)
    return [c.shape for c in llm.engine.executor.cpu_kernels.values()]


def test_a_configured_dtype_is_as_configured_and_an_int8_model_stays_float32(model_dir, capsys, monkeypatch):
    fake_cpu(monkeypatch, SPR)
    monkeypatch.setenv(cpu_select.ENV, "torch")
    report = info(capsys, "--model", model_dir, "--device", "cpu", "--dtype", "float32")
    assert (report["dtype"]["dtype"], report["dtype"]["reason"]) == ("float32", "as configured")
    report = info(capsys, "--model", model_dir, "--device", "cpu", "--quantization", "int8")
    assert report["dtype"]["reason"] == cpu_auto_dtype(SPR, quantized=True).reason
    assert report["dtype"]["dtype"] == "float32"


def test_the_kernel_choices_are_the_stored_plan_measured_once(model_dir, capsys, monkeypatch):
    """--measure measures what the kernel cache lacks and stores it, as an engine's start does; a later `info` reads
    the same choices and times back from the file, and they are what cpu_kernel_plan (the engine's lookup) says."""
    monkeypatch.delenv(cpu_select.ENV, raising=False)
    measured = info(capsys, "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--measure")
    kernels = measured["kernels"]
    classes = [ShapeClass(c["kind"], tuple(int(d) for d in c["class"].split(":")[1].split("x")))
               for c in kernels["classes"]]
    assert {s.kind for s in classes} == {"gemm", "experts", "attention"}
    plan = torch_ops.cpu_kernel_plan(classes)  # (read back: nothing left to measure)
    stored = cpu_select.read_plan(Path(kernels["plan_file"]))
    assert kernels["stored"]
    for entry in kernels["classes"]:
        choice = plan[entry["class"]]
        assert (entry["candidate"], entry["how"], entry["seconds"]) == (choice.candidate, choice.how,
                                                                        dict(choice.seconds))
        if choice.how == "measured":
            assert stored[entry["class"]].candidate == entry["candidate"]
            assert set(entry["seconds"]) == set(kernels["candidates"])
    again = info(capsys, "--model", model_dir, "--device", "cpu", "--dtype", "float32")
    assert again["kernels"]["classes"] == kernels["classes"]

    # and the human table names each class's kernel and every candidate's time
    assert main(["info", "--model", model_dir, "--device", "cpu", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    for entry in kernels["classes"]:
        line = next(line for line in text.splitlines() if line.startswith(entry["class"] + " "))
        assert line.split()[1] == entry["candidate"]
        assert all(name in line for name in entry["seconds"])
    # a stored choice made among other candidates is one the next start measures again: not shown as current
    measured_key = next((c["class"] for c in kernels["classes"] if c["how"] == "measured"), None)
    if measured_key is not None:
        monkeypatch.setattr(cpu_select, "read_plan", lambda path: {
            key: replace(c, seconds={**c.seconds, "c-neon": 1.0}) for key, c in stored.items()})
        stale = info(capsys, "--model", model_dir, "--device", "cpu", "--dtype", "float32")
        entry = next(c for c in stale["kernels"]["classes"] if c["class"] == measured_key)
        assert (entry["candidate"], entry["how"]) == (None, "not measured")


def test_a_missing_model_or_profile_is_one_error_line(capsys, tmp_path):
    assert main(["info", "--model", str(tmp_path / "nowhere")]) != 0
    assert "nowhere" in capsys.readouterr().err
    assert main(["info", "--profile", "no-such-profile"]) == 2
    assert "no profile named 'no-such-profile'" in capsys.readouterr().err
    assert main(["info", "--profile", "default", "--model", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
