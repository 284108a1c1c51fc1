"""Batch-1 greedy decode tokens/s of one model with each weight quantization, interleaved in one run.

    python benchmarks/quant_decode.py [--model smollm2-135m-instruct] [--modes none,fp16,int8,int4,gguf]
                                      [--tokens 64] [--rounds 3]

For the default model, `none` / `fp16` / `int8` / `int4` load a float32 import of its GGUF (`import-gguf
--dequantize`, made once in the cache) and quantize on load; `gguf` is the default import itself, which runs the
file's own Q4_1 / Q8_0 blocks. For any other --model, every mode quantizes that model on load.

Every mode's engine is loaded once; each round decodes the same prompt once per mode, in turn, so that the other
processes sharing these cores slow every mode alike (`uptime` is printed). Prefill is excluded from the rate.
Also printed: the bytes of the model's weights in each mode (the embedding stays float; a tied LM head gets its
own quantized copy) and the process RSS after all engines are loaded.
"""
from __future__ import annotations

import argparse
import os

from tsterm import LLM, SamplingParams
from tsterm.bench.measure import model_weight_bytes
from tsterm.convert.shipped import DEFAULT_MODEL_NAME, ensure_default_model, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, demo:NAME or a directory")
    parser.add_argument("--modes", default="none,fp16,int8,int4,gguf")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    modes = args.modes.split(",")
    default = args.model == DEFAULT_MODEL_NAME
    float_dir = str(ensure_default_model(dequantize=True)) if default else model_dir

    def engine(mode: str) -> LLM:
        if mode == "gguf":
            if not default:
                parser.error("mode gguf is the default model's own blocks: use it with the default --model")
            return LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=64 << 20)
        return LLM(float_dir, dtype="float32", device="cpu", quantization=mode, kv_cache_memory=64 << 20)

    llms = {mode: engine(mode) for mode in modes}
    vocab = llms[modes[0]].engine.model_config.vocab_size
    prompt = [16 + (i * 31) % (vocab - 16) for i in range(args.context)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
    first = {}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode, llm in llms.items():  # warm-up, and the tokens each mode picks
        first[mode] = llm.generate(prompt, params)[0].token_ids
    for round_ in range(args.rounds):
        for mode, llm in llms.items():
            m = llm.generate(prompt, params)[0].metrics
            rates[mode].append(args.tokens / (m.last_token_time - m.first_token_time))
            print(f"round {round_} {mode}: {rates[mode][-1]:.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    rss = _rss_mb()
    print(f"{model_dir}: batch-1 decode, {args.context}-token prompt, {args.tokens} tokens, "
          f"{args.rounds} interleaved rounds; load {os.getloadavg()}; RSS {rss:.0f} MB with all engines")
    base = max(rates[modes[0]])
    for mode in modes:
        nbytes = model_weight_bytes(llms[mode].engine.executor.model)
        same = sum(a == b for a, b in zip(first[mode], first[modes[0]]))
        print(f"  {mode:5s} best {max(rates[mode]):6.1f} tok/s (rounds: "
              f"{', '.join(f'{r:.1f}' for r in rates[mode])})  x{max(rates[mode]) / base:.2f}  "
              f"weights {nbytes / 1e6:6.1f} MB  first {same}/{len(first[mode])} tokens as {modes[0]}")


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
