"""Weight-only int8 / int4 / fp16 small-M matmuls on the CPU against float32, on the default and bench models' shapes.

    python benchmarks/quant_gemv.py [--rows 1,4,16,64] [--repeats 5] [--models smollm2,bench] [--torch-kernels]

Each candidate computes y = x @ W.T for x [M, I] and a weight W [O, I] stored in its own format; every matrix is
replicated until one pass over the copies streams at least --working-set MB of that format's bytes, so the
weights come from memory, as in decode, not from the 32 MB L3. Candidates run interleaved, round by round, and
the best round of each counts (other processes share these cores: `uptime` is printed). Reported: microseconds
per matmul, achieved GB/s of weight bytes, and speed-up over float32 `F.linear` and tsterm's float32 `linear`
(the row-split bmm the model runs for float weights) measured in the same round.

Candidates (int8 / int4 in blocks of 32 inputs, fp16 scales: GGUF Q8_0 / Q4_1's bytes):
- f32 F.linear, f32 tsterm linear (the baseline)
- i8 tsterm, i4 tsterm: `tsterm_kernels.quant.quantized_linear`: tsterm's C kernels (x rounded to int8 per block,
  integer dot products: VNNI's vpdpbusd where the build has it), for any number of rows
- on a CPU with AVX-512, i8 / i4 tsterm AVX2: the same kernels from the build without AVX-512 and VNNI (what an
  AVX2-only CPU runs; the same bits)
- f16 fbgemm: fbgemm_linear_fp16_weight on fbgemm's packed fp16 weights - tsterm's `fp16`
- with --torch-kernels, torch's own weight-only kernels for comparison: i8 int8pack (`_weight_int8pack_mm`, per-row
  int8) and i4 tinygemm (`_weight_int4pack_mm_for_cpu`, groups of 32) - what tsterm ran before its C kernels
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from tsterm_kernels import cpu_native
from tsterm_kernels.quant import quantize_fp16, quantize_int4, quantize_int8, quantized_linear
from tsterm_kernels.torch_ops import linear

SHAPES = {  # (name, out_features, in_features)
    "smollm2": [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)],
    "bench": [("qkv", 1536, 1024), ("o_proj", 1024, 1024), ("expert w13", 1024, 1024), ("expert w2", 1024, 512),
              ("lm_head", 1024, 1024)],
}


def _torch_int8pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(-1) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _torch_int4pack(w: torch.Tensor) -> torch.Tensor:
    """torch's packed int4 (groups of 32, output rows padded to 16) and its [I/32, O, 2] scales and zeros."""
    out_f, in_f = w.shape
    pad = -out_f % 16
    w = F.pad(w, (0, 0, 0, pad))
    g = w.view(out_f + pad, in_f // 32, 32)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out_f + pad, in_f)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack((scale.t(), (low + 8 * scale).t()), -1).contiguous()


def _c_rows(build: cpu_native.NativeKernels, x: torch.Tensor, q) -> torch.Tensor:
    """quantized_linear's C call by one build of the kernels."""
    y = torch.empty(x.shape[0], q.dims[0])
    fn = build.q8_matmul if q.kind == "int8" else build.q4_matmul
    fn(x.data_ptr(), x.shape[0], x.shape[1], q.data.data_ptr(), q.scale.data_ptr(), q.dims[0], y.data_ptr())
    return y


def _timeit(fn, copies: list, reps: int) -> float:
    """Seconds per call, one pass over every copy (each copy's weights leave the cache before it comes back)."""
    fn(*copies[0])
    t0 = time.perf_counter()
    for _ in range(reps):
        for args in copies:
            fn(*args)
    return (time.perf_counter() - t0) / (reps * len(copies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="smollm2,bench")
    parser.add_argument("--working-set", type=float, default=64.0, help="MB streamed per pass of each format")
    parser.add_argument("--torch-kernels", action="store_true", help="also time torch's int8 / int4 CPU kernels")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load: {os.getloadavg()}")
    native = cpu_native.load()
    avx2 = cpu_native.load_variant("avx2") if native is not None and native.isa_bits & cpu_native.ISA_AVX512 else None
    if native is not None:
        print(f"tsterm's C kernels: {native.isa_name}" + (" (and an avx2 build beside it)" if avx2 else ""))
    for model in args.models.split(","):
        for name, out_f, in_f in SHAPES[model]:
            w = torch.randn(out_f, in_f) * 0.02
            formats = {"f32": (w, w.numel() * 4), "i8": (quantize_int8(w), w.numel() * 17 // 16),
                       "f16": (quantize_fp16(w), w.numel() * 2), "i4": (quantize_int4(w), w.numel() * 5 // 8)}
            if args.torch_kernels:
                formats["t8"] = (_torch_int8pack(w), w.numel())
                formats["t4"] = (_torch_int4pack(w), w.numel() // 2 + w.numel() // 32 * 8)
            copies_of = {}
            for fmt, (weight, nbytes) in formats.items():
                n = max(1, int(args.working_set * 1e6 // nbytes))
                copies_of[fmt] = [weight] + [tuple(t.clone() for t in weight) if isinstance(weight, tuple)
                                             else weight.clone() for _ in range(n - 1)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_f)
                cands = {
                    "f32 F.linear": ("f32", lambda w_: F.linear(x, w_)),
                    "f32 tsterm linear": ("f32", lambda w_: linear(x, w_)),
                    "f16 fbgemm": ("f16", lambda q_: quantized_linear(x, q_)),
                    "i8 tsterm": ("i8", lambda q_: quantized_linear(x, q_)),
                    "i4 tsterm": ("i4", lambda q_: quantized_linear(x, q_)),
                }
                if avx2 is not None:
                    cands["i8 tsterm AVX2"] = ("i8", lambda q_: _c_rows(avx2, x, q_))
                    cands["i4 tsterm AVX2"] = ("i4", lambda q_: _c_rows(avx2, x, q_))
                if args.torch_kernels:
                    cands["i8 int8pack"] = ("t8", lambda t_: torch._weight_int8pack_mm(x, t_[0], t_[1]))
                    cands["i4 tinygemm"] = ("t4", lambda t_: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x, t_[0], 32, t_[1]))
                best: dict[str, float] = {}
                for _ in range(args.repeats):  # interleaved: every candidate once per round
                    for cand, (fmt, fn) in cands.items():
                        reps = max(1, int(0.05 / max(best.get(cand, 1e-3) * len(copies_of[fmt]), 1e-6)))
                        sec = _timeit(lambda w_: fn(w_), [(c,) for c in copies_of[fmt]], reps)
                        best[cand] = min(best.get(cand, float("inf")), sec)
                base, ours = best["f32 F.linear"], best["f32 tsterm linear"]
                print(f"{model} {name} [{out_f}x{in_f}] M={rows}")
                for cand, sec in best.items():
                    nbytes = formats[cands[cand][0]][1]
                    print(f"  {cand:18s} {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:6.1f} GB/s  "
                          f"x{base / sec:5.2f} vs F.linear  x{ours / sec:5.2f} vs tsterm f32")


if __name__ == "__main__":
    main()
