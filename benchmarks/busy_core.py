"""Batch-1 decode beside a busy process: tsterm on 1, 2 and its default (governed) threads, and llama.cpp on 1 and 2,
side by side in one run, with and without a busy loop taking a core.

    python benchmarks/busy_core.py [--tokens 48] [--context 256] [--rounds 3] [--no-llama-cpp]

The model is the default profile's (SmolLM2-135M-Instruct: tsterm on the GGUF file's own Q4_1 / Q8_0 blocks,
llama.cpp through llama-cpp-python on the same file, the `bench` extra). The busy neighbour is another Python process
spinning (`while True: pass`), placed by the OS scheduler like any other job. Every configuration runs once per
round, in turn, so the machine's drift hits them alike; each reports its median round. tsterm's "default" is what a
user gets: the thread governor (tsterm/engine/cpu_threads.py) sizes every step to the cores the others leave free,
up to torch's thread count; "1" and "2" pin the count with the governor off. Prints the CPU model first.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from tsterm.bench.machine import cpu_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()

    from tsterm import LLM, SamplingParams
    from tsterm.convert.shipped import ensure_default_model

    max_threads = torch.get_num_threads()
    model_dir = str(ensure_default_model())
    governed = LLM(model_dir, dtype="float32", device="cpu")
    fixed = LLM(model_dir, dtype="float32", device="cpu")
    fixed.engine.executor.cpu_threads = None  # this one runs on whatever count is set
    vocab = governed.engine.model_config.vocab_size
    prompt = [16 + (i * 31) % (vocab - 16) for i in range(args.context)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)

    def tsterm_rate(llm, threads: int | None) -> float:
        governor = llm.engine.executor.cpu_threads
        torch.set_num_threads(threads if governor is None else governor.threads)
        m = llm.generate(prompt, params)[0].metrics  # decode only: first token to last
        return args.tokens / (m.last_token_time - m.first_token_time)

    rates = {"tsterm default": lambda: tsterm_rate(governed, None)}
    for n in sorted({1, max_threads}):
        rates[f"tsterm {n} thread{'s' if n > 1 else ''}"] = lambda n=n: tsterm_rate(fixed, n)
    if not args.no_llama_cpp:
        from tsterm.bench.llama_cpp import gguf_source, open_llama

        gguf = gguf_source(model_dir)
        for n in sorted({1, max_threads}):
            llama = open_llama(gguf, args.context + args.tokens + 8, n)
            rates[f"llama.cpp {n} thread{'s' if n > 1 else ''}"] = lambda llama=llama: llama_rate(llama)

    def llama_rate(llama) -> float:
        llama.reset()
        stamps = []
        for _ in llama.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            if len(stamps) == args.tokens + 1:
                break
        return args.tokens / (stamps[-1] - stamps[0])

    def measure() -> dict[str, list[float]]:
        for rate in rates.values():  # warm-up (and the governor's first look)
            rate()
        samples: dict[str, list[float]] = {name: [] for name in rates}
        for _ in range(args.rounds):
            for name, rate in rates.items():
                samples[name].append(rate())
        return samples

    results = {"quiet": measure()}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        results["one core busy"] = measure()
    finally:
        busy.kill()
        busy.wait()
    print(f"CPU: {cpu_description()}; SmolLM2-135M "
          f"batch-1 decode, context {args.context}, {args.tokens} tokens, median of {args.rounds} rounds (tok/s)")
    print(f"{'engine':<20}" + "".join(f"{label:>16}" for label in results) + "   rounds")
    for name in rates:
        medians = [statistics.median(results[label][name]) for label in results]
        rounds = " | ".join(" ".join(f"{v:.1f}" for v in results[label][name]) for label in results)
        print(f"{name:<20}" + "".join(f"{m:16.1f}" for m in medians) + f"   {rounds}")
    for label, samples in results.items():
        med = {name: statistics.median(v) for name, v in samples.items()}
        tsterm_best = max(v for name, v in med.items() if name.startswith("tsterm ") and name != "tsterm default")
        line = f"{label}: default / best fixed tsterm = {med['tsterm default'] / tsterm_best:.2f}"
        llama = [v for name, v in med.items() if name.startswith("llama.cpp")]
        if llama:
            line += f"; default / best llama.cpp = {med['tsterm default'] / max(llama):.2f}x"
        print(line)


if __name__ == "__main__":
    main()
