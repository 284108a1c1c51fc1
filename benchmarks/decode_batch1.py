"""Batch-1 decode tokens/s of tsterm and of transformers on the same model, measured in one run.

    python benchmarks/decode_batch1.py [--model DIR | --demo tiny|bench] [--context 256] [--tokens 64]

Both decode greedily from the same prompt with their KV caches; prefill is excluded from both rates. Also
prints bytes read per token and the achieved bandwidth, next to the machine's copy bandwidth.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF-format model directory")
    parser.add_argument("--demo", default="bench", help="tsterm demo model to use when --model is not given")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tsterm import LLM, SamplingParams
    from tsterm.bench.measure import bytes_read_per_token, copy_bandwidth
    from tsterm.demo import ensure_demo_model

    model_dir = args.model or str(ensure_demo_model(args.demo))
    llm = LLM(model_dir, dtype=args.dtype, device="cpu")
    vocab = llm.engine.model_config.vocab_size
    prompt = [16 + (i * 31) % (vocab - 16) for i in range(args.context)]

    def tsterm_rate() -> float:
        params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
        out = llm.generate(prompt, params)[0]  # TTFT = prefill + first token; the rest is decode
        m = out.metrics
        return args.tokens / (m.last_token_time - m.first_token_time)

    tsterm_rate()  # warm-up
    ours = max(tsterm_rate() for _ in range(2))

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor([prompt])

    def hf_rate() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, do_sample=False,
                        pad_token_id=0)
            return args.tokens / (time.perf_counter() - t0 - prefill)

    hf_rate()
    theirs = max(hf_rate() for _ in range(2))
    cfg = llm.engine.model_config
    read = bytes_read_per_token(cfg, llm.engine.dtype.itemsize, args.context)
    bw = copy_bandwidth(torch.device("cpu"))
    print(f"model {model_dir} ({args.dtype}), context {args.context}, {args.tokens} decoded tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"bytes read per token {read / 1e6:.1f} MB; copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'engine':<14}{'tok/s':>8}{'GB/s':>8}{'of copy bw':>12}")
    for name, rate in (("tsterm", ours), ("transformers", theirs)):
        print(f"{name:<14}{rate:8.1f}{rate * read / 1e9:8.2f}{rate * read / bw:11.1%}")
    print(f"tsterm / transformers = {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
