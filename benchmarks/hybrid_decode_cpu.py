"""CPU decode tokens/s of a small random hybrid (Qwen3.5-MoE text: 3 Gated DeltaNet layers + 1 gated attention),
for 1 and 8 sequences: the time of max_tokens=N+1 minus that of max_tokens=1 (the prefill and first token), the
best of 3. To compare two versions of tsterm, run it for each tree, interleaved, on one checkpoint made once, with
the tree first on PYTHONPATH and its `kernels/` reachable there as `tsterm_kernels` (a symlink in a shim directory);
it prints which tree it ran:

  python benchmarks/hybrid_decode_cpu.py --checkpoint /tmp/hyb --size small      # makes it if missing
  PYTHONPATH=$SHIM:$TREE python benchmarks/hybrid_decode_cpu.py --checkpoint /tmp/hyb   # $SHIM/tsterm_kernels -> $TREE/kernels

Sizes: `tiny` (the tests' hybrid: 4 value heads of 8 x 8, 1 KB of state per layer and sequence, op-overhead
bound) and `small` (4 value heads of 128 x 128, 256 KB: the state traffic shows).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"tiny": {}, "small": dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=128, linear_value_head_dim=128)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="directory of the checkpoint (made if missing)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="its linear-attention sizes, when made")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per sequence (default 32)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's thread governor's ceiling (it reads this)
    torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        sys.path.insert(0, str(ROOT))  # tests.helpers: transformers writes the checkpoint
        from tests.helpers.checkpoints import make_hybrid_checkpoint

        layer_types = ["linear_attention"] * 3 + ["full_attention"]
        make_hybrid_checkpoint(checkpoint, "qwen3_5_moe_text",
                               dict(num_hidden_layers=4, layer_types=layer_types, **SIZES[args.size]))
    import tsterm
    from tsterm import LLM, SamplingParams

    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=16, num_kv_blocks=512,
              enable_prefix_caching=False)
    results = []
    for num_seqs in (1, 8):
        prompts = [list(range(5, 45 + 3 * i)) for i in range(num_seqs)]

        def run(max_tokens: int) -> float:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            return time.perf_counter() - start

        run(3)  # warm-up
        best = min(run(args.tokens + 1) - run(1) for _ in range(3))
        results.append(f"S={num_seqs}: {num_seqs * args.tokens / best:.1f} tok/s")
    print(f"{Path(tsterm.__file__).parents[1]} | " + " | ".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
