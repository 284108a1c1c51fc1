"""Weight-only int8 / int4 small-M matmuls on the CPU against float32, on the default and bench models' shapes.

    python benchmarks/quant_gemv.py [--rows 1,4,16] [--repeats 5] [--models smollm2,bench] [--compile]

Each candidate computes y = x @ W.T for x [M, I] and a weight W [O, I] stored in its own format; every matrix is
replicated until one pass over the copies streams at least --working-set MB of that format's bytes, so the
weights come from memory, as in decode, not from the 32 MB L3. Candidates run interleaved, round by round, and
the best round of each counts (other processes share these cores: `uptime` is printed). Reported: microseconds
per matmul, achieved GB/s of weight bytes, and speed-up over float32 `F.linear` and tsterm's float32 `linear`
(the row-split bmm) measured in the same round.

Candidates (int8: symmetric per output row; int4: asymmetric per group of 32 inputs):
- f32 F.linear, f32 tsterm linear (the row-split bmm the model runs today: the baseline)
- i8 int8pack: torch._weight_int8pack_mm (x float32) - tsterm's `int8`
- i8 tiled: plain torch per block of 256 rows: convert to float32 (stays in L2), mm, scale (--tiled: slow)
- i8 compiled: torch.compile of the dequant GEMV written as a reduction (--compile; compile time printed)
- i8 dyn fbgemm: torch.ops.quantized.linear_dynamic: int8 weights, activations quantized per call to 8 bits
  (not weight-only: a different model, listed for its speed)
- f16 fbgemm: fbgemm_linear_fp16_weight on fbgemm's packed fp16 weights - tsterm's `fp16`
- i4 g32 tinygemm: torch's _weight_int4pack_mm_for_cpu - tsterm's `int4`
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import warnings

from tsterm_kernels.quant import QuantizedWeight, quantize_fp16, quantize_int4, quantize_int8, quantized_linear
from tsterm_kernels.reference import linear

SHAPES = {  # (name, out_features, in_features)
    "smollm2": [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)],
    "bench": [("qkv", 1536, 1024), ("o_proj", 1024, 1024), ("expert w13", 1024, 1024), ("expert w2", 1024, 512),
              ("lm_head", 1024, 1024)],
}


def _tiled_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int = 256) -> torch.Tensor:
    out = torch.empty(x.shape[0], q.shape[0])
    for start in range(0, q.shape[0], block):
        tile = q[start:start + block].to(torch.float32)  # [B, I]: 256 x I floats stay in L2
        torch.mm(x, tile.t(), out=out[:, start:start + block])
    return out.mul_(scale)


def _compiled_gemv():
    def gemv(x, q, scale):
        return (x[:, None, :] * q.to(torch.float32)[None]).sum(-1) * scale  # [M, O]
    return torch.compile(gemv, dynamic=False)


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
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="smollm2,bench")
    parser.add_argument("--working-set", type=float, default=64.0, help="MB streamed per pass of each format")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd dequant GEMVs")
    parser.add_argument("--tiled", action="store_true", help="also time the plain-torch tiled dequant")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch's deprecation notes on quantized tensors
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load: {os.getloadavg()}")
    compiled = None
    if args.compile:
        compiled = _compiled_gemv()
    for model in args.models.split(","):
        for name, out_f, in_f in SHAPES[model]:
            w = torch.randn(out_f, in_f) * 0.02
            q8 = quantize_int8(w)
            formats = {"f32": (w, w.numel() * 4), "i8": (q8, w.numel()), "f16": (quantize_fp16(w), w.numel() * 2),
                       "i8dyn": (_dynamic_int8(q8), w.numel()),
                       "i4g32": (quantize_int4(w, 32), w.numel() // 2 + w.numel() // 32 * 8)}
            copies_of = {}
            for fmt, (weight, nbytes) in formats.items():
                n = max(1, int(args.working_set * 1e6 // nbytes))
                copies_of[fmt] = [weight if fmt == "i8dyn" else weight.clone() for _ in range(n)]
            copies_of["i8dyn"] = [_dynamic_int8(q) for q in copies_of["i8"]]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_f)
                cands = {
                    "f32 F.linear": ("f32", lambda w_: F.linear(x, w_)),
                    "f32 tsterm linear": ("f32", lambda w_: linear(x, w_)),
                    "i8 int8pack": ("i8", lambda q_: torch._weight_int8pack_mm(x, q_.data, q_.scale)),
                    "i8 dyn fbgemm": ("i8dyn", lambda p_: torch.ops.quantized.linear_dynamic(x, p_, True)),
                    "f16 fbgemm": ("f16", lambda q_: quantized_linear(x, q_)),
                    "i4 g32 tinygemm": ("i4g32", lambda q_: quantized_linear(x, q_)),
                }
                if args.tiled:
                    cands["i8 tiled"] = ("i8", lambda q_: _tiled_int8(x, q_.data, q_.scale))
                if compiled is not None:
                    t0 = time.perf_counter()
                    compiled(x, formats["i8"][0].data, formats["i8"][0].scale)
                    print(f"  compile {name} M={rows}: {time.perf_counter() - t0:.1f} s")
                    cands["i8 compiled"] = ("i8", lambda q_: compiled(x, q_.data, q_.scale))
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


def _dynamic_int8(q: QuantizedWeight):
    """fbgemm's packed form of the same int8 codes and row scales."""
    qweight = torch.quantize_per_channel(q.dequantize(), q.scale.double(), torch.zeros(q.shape[0], dtype=torch.long),
                                         0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None)


if __name__ == "__main__":
    main()
