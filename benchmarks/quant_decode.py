"""Batch-1 greedy decode tokens/s of one model with each weight quantization, interleaved in one run.

    python benchmarks/quant_decode.py [--model smollm2-135m-instruct] [--modes none,fp16,int8,int4]
                                      [--tokens 64] [--rounds 3]

Every mode's engine is loaded once; each round decodes the same prompt once per mode, in turn, so that the other
processes sharing these cores slow every mode alike (`uptime` is printed). Prefill is excluded from the rate.
Also printed: the bytes of the model's weights in each mode (the embedding stays float; a tied LM head gets its
own quantized copy) and the process RSS after all engines are loaded.
"""
from __future__ import annotations

import argparse
import os

from tsterm import LLM, SamplingParams
from tsterm.model.quant import weight_bytes
from tsterm.profiles import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, demo:NAME or a directory")
    parser.add_argument("--modes", default="none,fp16,int8,int4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    modes = args.modes.split(",")
    llms = {mode: LLM(model_dir, dtype="float32", device="cpu", quantization=mode, kv_cache_memory=64 << 20)
            for mode in modes}
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
        nbytes = _model_weight_bytes(llms[mode])
        same = sum(a == b for a, b in zip(first[mode], first[modes[0]]))
        print(f"  {mode:5s} best {max(rates[mode]):6.1f} tok/s (rounds: "
              f"{', '.join(f'{r:.1f}' for r in rates[mode])})  x{max(rates[mode]) / base:.2f}  "
              f"weights {nbytes / 1e6:6.1f} MB  first {same}/{len(first[mode])} tokens as {modes[0]}")


def _model_weight_bytes(llm) -> int:
    model = llm.engine.executor.model
    weights = {"embed": model.embed, "lm_head": model.lm_head, "final_norm": model.final_norm}
    for i, (input_norm, mixer, post_norm, mlp) in enumerate(model.layers):
        for name, value in (*vars(mixer).items(), *vars(mlp).items()):
            if name not in ("ctx", "ops", "par", "k_cache", "v_cache", "expert_load") and value is not None and \
                    hasattr(value, "dim"):
                weights[f"{i}.{type(mixer).__name__}.{name}"] = value
        weights[f"{i}.norms"], weights[f"{i}.post"] = input_norm, post_norm
    return weight_bytes(weights)


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
