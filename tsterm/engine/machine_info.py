"""`tsterm info`: what an engine would run on this machine, and why, without starting one.

The CPU (its model name and the instruction sets the kernels care about, AMX as the OS grants it), the variables that
limit or force the kernels (TSTERM_CPU_ISA, TSTERM_CPU_KERNELS, TSTERM_NATIVE_KERNELS), the C builds loaded
(`tsterm_kernels.cpu_native`), what the dtype option resolves to and why (`tsterm.cpu`, as `Engine` resolves it), and
per CPU shape class of the model the kernel chosen, with each candidate's measured time (`tsterm_kernels.cpu_select`'s
choices file next to the built libraries; measured now only when asked).

The shape classes are read off the model as the engine builds it (`tsterm.model.cpu_kernels.shape_classes`: the
loader's fused q/k/v, its quantized linears, the dtype each weight ends in), so the weights are loaded on the CPU
(memory-mapped; no KV cache beyond one block). Neither the meta device nor torch's fake tensors can stand in: the
loader reads each tensor through safetensors, which gives real storage, and shape_classes asks for CPU tensors. The
CPU and dtype sections need only config.json.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tsterm.config import EngineConfig, ModelConfig
from tsterm.cpu import quantized_linears
from tsterm.engine.engine import dtype_choice, resolve_device

# /proc/cpuinfo flags the kernels and the dtype choice look at, as (flag, the name shown)
X86_FLAGS = (("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"),
             ("avx512vl", "AVX512VL"), ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"),
             ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16"), ("amx_tile", "AMX-TILE"),
             ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"))
ARM_FLAGS = (("asimd", "NEON"), ("asimddp", "dotprod"), ("i8mm", "i8mm"), ("bf16", "BF16"), ("sve", "SVE"),
             ("sve2", "SVE2"))
ENV_VARS = ("TSTERM_CPU_ISA", "TSTERM_CPU_KERNELS", "TSTERM_NATIVE_KERNELS")


def cpu_report() -> dict[str, Any]:
    """The CPU as the kernel choice sees it (`cpu_select.CpuInfo`, after TSTERM_CPU_ISA's limit) and as the dtype
    choice sees it (`tsterm.cpu.CpuFeatures`): the flags that matter, each as the CPU reports it."""
    from tsterm.cpu import CpuFeatures
    from tsterm_kernels import torch_ops

    cpu = torch_ops.cpu_machine()
    features = CpuFeatures.detect()  # (the flags before TSTERM_CPU_ISA's limit)
    names = X86_FLAGS if features.x86 else ARM_FLAGS
    return {"model": cpu.model, "machine": cpu.machine, "summary": cpu.describe(),
            "flags": {name: flag in features.flags for flag, name in names},
            "amx": ("granted" if cpu.amx_allowed else "refused by the OS" if "amx_tile" in cpu.flags
                    else "left out by TSTERM_CPU_ISA" if "amx_tile" in features.flags else "absent")
            if cpu.x86 else "absent",
            "env": {name: os.environ.get(name) for name in ENV_VARS}}


def builds_report() -> dict[str, Any]:
    """The C kernels' builds this process loads (built on first use, as an engine would): each variant's path and
    instruction set, or None where absent (no compiler, TSTERM_NATIVE_KERNELS=0, not x86-64 / aarch64)."""
    from tsterm_kernels import cpu_native

    native = cpu_native.load()
    out: dict[str, Any] = {}
    for variant in cpu_native.VARIANTS:
        build = cpu_native.load_variant(variant) if native is not None else None
        if variant != "native" and build is native:  # an AVX2-only CPU: its native build is the AVX2 code
            build = None
        out[variant] = None if build is None else {"path": str(build.path), "isa": build.isa_name}
    return out


def dtype_report(config: EngineConfig, cfg: ModelConfig, device: torch.device) -> dict[str, Any]:
    """The dtype option, what it resolves to on `device` and why (Engine's own `dtype_choice`)."""
    choice = dtype_choice(config.dtype, device, quantized_linears(config.quantization, cfg.quant_method))
    return {"option": config.dtype, "dtype": choice.dtype, "reason": choice.reason, "line": choice.describe()}


def model_shape_classes(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, quantization: str):
    """The model's CPU shape classes, as the engine would choose for them (one rank, weights on the CPU)."""
    from tsterm.model.arch import ARCHITECTURES
    from tsterm.model.cache import ModelCache
    from tsterm.model.cpu_kernels import shape_classes
    from tsterm.model.decoder import DecoderModel
    from tsterm.model.loader import load_weights
    from tsterm_kernels import dispatch

    cpu = torch.device("cpu")
    weights = load_weights(model_dir, cfg, dtype, cpu, quantization=quantization)
    block = 16
    cache = ModelCache(cfg, ARCHITECTURES[cfg.model_type].layer_types(cfg), 1, block, dtype, cpu)
    return shape_classes(DecoderModel(cfg, weights, cache, block, dispatch.load("torch")))


def kernels_report(shapes, measure: bool) -> dict[str, Any]:
    """Each shape class's kernel: the one stored in the choices file (or forced by TSTERM_CPU_KERNELS), with each
    candidate's seconds; with `measure`, the classes the file lacks are measured now and stored, as an engine's start
    does (`torch_ops.cpu_kernel_plan`)."""
    from tsterm_kernels import cpu_select, torch_ops

    path = torch_ops.cpu_plan_path()  # (the plan file the engine reads and writes)
    candidates, bf16 = torch_ops.cpu_candidates("gemm"), torch_ops.cpu_candidates("bf16")
    forced = cpu_select.parse_override(os.environ.get(cpu_select.ENV, ""))
    plan = torch_ops.cpu_kernel_plan(shapes) if measure else None
    stored = cpu_select.read_plan(path)
    classes = []
    for shape in shapes:
        choice = plan[shape.key] if plan is not None else None
        if choice is None:
            kind_forced = forced.get(shape.kind) or (forced.get("*") if forced.get("*") in
                                                     cpu_select.kind_candidates(shape.kind) else None)
            choice = (cpu_select.Choice(shape, kind_forced, "forced") if kind_forced is not None
                      else _current(stored.get(shape.key), torch_ops.cpu_candidates(shape.kind)))
        classes.append({"class": shape.key, "kind": shape.kind, "rows_timed": shape.rows,
                        "candidate": None if choice is None else choice.candidate,
                        "how": "not measured" if choice is None else choice.how,
                        "seconds": {} if choice is None else dict(choice.seconds)})
    return {"plan_file": str(path), "stored": path.is_file(), "candidates": list(candidates),
            "bf16_candidates": list(bf16),
            "bf16_attention_candidates": list(torch_ops.cpu_candidates("bf16-attention")), "classes": classes}


def _current(choice, candidates: tuple[str, ...]):
    """A stored choice that an engine's start would use as it is (`cpu_select.resolve`), else None: one made among
    other candidates (a build added or gone) is measured again."""
    if choice is None or choice.candidate not in candidates:
        return None
    if choice.how == "measured" and set(choice.seconds) != set(candidates):
        return None
    return None if choice.how == "only" and tuple(candidates) != (choice.candidate,) else choice


def gpu_report(config: EngineConfig, device: torch.device) -> dict[str, Any] | None:
    """The GPU an engine on `device` runs on, and its kernel settings; None on the CPU."""
    if device.type != "cuda":
        return None
    return {"name": torch.cuda.get_device_name(device), "capability": ".".join(
        map(str, torch.cuda.get_device_capability(device))), "kernels": config.kernels,
        "cuda_graphs": config.cuda_graphs}


def machine_info(model_dir: str, options: dict[str, Any], measure: bool = False) -> dict[str, Any]:
    """Everything `tsterm info` prints, as plain data (`--json`)."""
    config = EngineConfig.from_options(model_dir, **options)
    cfg = ModelConfig.from_dir(Path(model_dir))
    device = resolve_device(config.device)
    dtype = dtype_report(config, cfg, device)
    report = {"model": model_dir, "model_type": cfg.model_type, "device": str(device), "dtype": dtype,
              "cpu": cpu_report(), "builds": builds_report(), "gpu": gpu_report(config, device), "kernels": None}
    if device.type == "cpu":
        shapes = model_shape_classes(Path(model_dir), cfg, getattr(torch, dtype["dtype"]), config.quantization)
        report["kernels"] = kernels_report(shapes, measure)
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def format_info(report: dict[str, Any]) -> str:
    """The human form of `machine_info`'s report."""
    cpu, dtype = report["cpu"], report["dtype"]
    lines = [f"model     {report['model']} ({report['model_type']})",
             f"device    {report['device']}",
             f"dtype     {dtype['line']}" + (f" [option: {dtype['option']}]" if dtype["option"] != "auto" else ""),
             f"cpu       {cpu['summary']}",
             "flags     " + " ".join(name for name, present in cpu["flags"].items() if present),
             f"amx       {cpu['amx']}",
             "env       " + (", ".join(f"{k}={v}" for k, v in cpu["env"].items() if v is not None) or "none set")]
    for variant, build in report["builds"].items():
        lines.append(f"C build   {variant}: " + (f"{build['isa']} ({build['path']})" if build else "absent"))
    gpu = report["gpu"]
    if gpu is not None:
        lines.append(f"gpu       {gpu['name']} (sm {gpu['capability']}), kernels {gpu['kernels']}, "
                     f"CUDA graphs {'on' if gpu['cuda_graphs'] else 'off'}")
    kernels = report["kernels"]
    if kernels is not None:
        lines.append(f"choices   {kernels['plan_file']}" + ("" if kernels["stored"] else " (not written yet)"))
        lines.append(f"candidates float32: {', '.join(kernels['candidates'])}; bfloat16: "
                     f"{', '.join(kernels['bf16_candidates'])}; bfloat16 attention: "
                     f"{', '.join(kernels['bf16_attention_candidates'])} (torch is chosen only where no C kernel is "
                     "built or TSTERM_CPU_KERNELS forces it: it does not keep a row's bits whatever the batch)")
        rows = [(c["class"], c["candidate"] or "-", c["how"],
                 ", ".join(f"{name} {_ms(t)}" for name, t in sorted(c["seconds"].items(), key=lambda x: x[1])))
                for c in kernels["classes"]]
        if rows:
            widths = [max(len(r[i]) for r in rows + [("shape class", "kernel", "how", "")]) for i in range(3)]
            lines.append("")
            lines.append("  ".join(h.ljust(w) for h, w in zip(("shape class", "kernel", "how"), widths)) +
                         "  each candidate, one call on one thread")
            lines += ["  ".join(v.ljust(w) for v, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        if any(c["how"] == "not measured" for c in kernels["classes"]):
            lines.append("(not measured: no stored choice for these candidates yet; `tsterm info --measure` or an "
                         "engine's start measures it)")
    return "\n".join(lines)
