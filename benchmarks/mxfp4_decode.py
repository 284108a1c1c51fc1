"""Batch-1 decode tokens/s and resident memory of a gpt-oss-shaped random model with its experts kept MXFP4 (as
gpt-oss ships them: csrc/mxfp4.c reads the blocks) against the same weights dequantized (a bf16 checkpoint of the
very values the blocks stand for, loaded float32: the float C kernels), interleaved in one run.

    python benchmarks/mxfp4_decode.py [--dir /tmp/tsterm-mxfp4-bench] [--layers 2] [--experts 8] [--tokens 32]
                                      [--rounds 3] [--modes mxfp4,float]

The two checkpoints are written once into --dir (`mxfp4/`, `float/`): gpt-oss-20b's shapes (hidden 2880, experts of
2880 with top-4 routing, 64 query / 8 KV heads of 64, sinks, biases, a 128-token window every other layer) with
fewer layers and experts and a small vocabulary, so that both fit beside each other on a small machine. A decode step
reads the same 4 experts per layer whatever --experts is; only the resident memory grows with it. Other --modes:
`int8`, `int4` (the MXFP4 checkpoint with `quantization:` that format: the experts re-quantized at load).

Every mode's engine is loaded once, its resident memory taken as the growth of the process's RSS (anonymous +
file-mapped pages) over its load and a warm-up generation; then each round decodes the same prompt once per mode, in
turn, so that other processes sharing these cores slow every mode alike. Prefill is excluded from the rate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tsterm import LLM, SamplingParams
from tsterm.bench.measure import model_weight_bytes
from tsterm.convert.demo import train_tokenizer

GPT_OSS_20B = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "configs" / "gpt-oss-20b.json"


def _config(layers: int, experts: int, vocab: int) -> dict:
    raw = json.loads(GPT_OSS_20B.read_text())
    raw.update(num_hidden_layers=layers, num_local_experts=experts, vocab_size=vocab, eos_token_id=vocab - 1,
               pad_token_id=vocab - 2, layer_types=raw["layer_types"][:layers], max_position_embeddings=4096)
    return raw


def _write(out: Path, cfg: dict, tensors: dict[str, torch.Tensor], mxfp4: bool, vocab: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if not mxfp4:
        cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    train_tokenizer(vocab).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|im_end|>"}))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def make_checkpoints(root: Path, layers: int, experts: int, vocab: int, seed: int = 0) -> tuple[Path, Path]:
    """root/mxfp4 (experts as `_blocks` / `_scales`) and root/float (the same values in bf16), made once (a
    directory made with other --layers / --experts / --vocab is not remade: use another --dir)."""
    mx_dir, float_dir = root / "mxfp4", root / "float"
    if (mx_dir / "model.safetensors").is_file() and (float_dir / "model.safetensors").is_file():
        return mx_dir, float_dir
    from tsterm_kernels.quant import mxfp4_dequantize

    cfg = _config(layers, experts, vocab)
    H, inter, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).bfloat16()

    common = {"model.embed_tokens.weight": randn(vocab, H), "lm_head.weight": randn(vocab, H),
              "model.norm.weight": torch.ones(H).bfloat16()}
    mx, fl = {}, {}
    for i in range(layers):
        p = f"model.layers.{i}."
        common.update({
            p + "input_layernorm.weight": torch.ones(H).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(H).bfloat16(),
            p + "self_attn.q_proj.weight": randn(Hq * D, H), p + "self_attn.q_proj.bias": randn(Hq * D),
            p + "self_attn.k_proj.weight": randn(Hkv * D, H), p + "self_attn.k_proj.bias": randn(Hkv * D),
            p + "self_attn.v_proj.weight": randn(Hkv * D, H), p + "self_attn.v_proj.bias": randn(Hkv * D),
            p + "self_attn.o_proj.weight": randn(H, Hq * D), p + "self_attn.o_proj.bias": randn(H),
            p + "self_attn.sinks": randn(Hq, std=1.0).float(),
            p + "mlp.router.weight": randn(experts, H, std=1.0), p + "mlp.router.bias": randn(experts, std=0.1),
            p + "mlp.experts.gate_up_proj_bias": randn(experts, 2 * inter),
            p + "mlp.experts.down_proj_bias": randn(experts, H),
        })
        for name, rows, cols in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
            blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(119, 123, (experts, rows, cols // 32), generator=gen).to(torch.uint8)  # 2^-8..2^-5
            mx[p + f"mlp.experts.{name}_blocks"], mx[p + f"mlp.experts.{name}_scales"] = blocks, scales
            values = torch.stack([mxfp4_dequantize(blocks[e].view(rows, cols // 2), scales[e])
                                  for e in range(experts)])  # [E, out, in] float32, exact in bf16
            fl[p + f"mlp.experts.{name}"] = values.transpose(1, 2).contiguous().bfloat16()  # HF's [E, in, out]
    _write(mx_dir, cfg, {**common, **mx}, True, vocab)
    _write(float_dir, cfg, {**common, **fl}, False, vocab)
    return mx_dir, float_dir


def _rss() -> dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/tsterm-mxfp4-bench", help="where the two checkpoints are made")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--modes", default="mxfp4,float")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_only:
        make_checkpoints(Path(args.dir), args.layers, args.experts, args.vocab)
        return
    # made in a child process: the memory it allocates and frees would hide the engines' growth of this one's RSS
    subprocess.run([sys.executable, __file__, "--make-only", "--dir", args.dir, "--layers", str(args.layers),
                    "--experts", str(args.experts), "--vocab", str(args.vocab)], check=True)
    mx_dir, float_dir = make_checkpoints(Path(args.dir), args.layers, args.experts, args.vocab)
    modes = args.modes.split(",")
    options = dict(dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    prompt = [16 + (i * 31) % (args.vocab - 16) for i in range(args.context)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
    llms, memory, first = {}, {}, {}
    for mode in modes:
        before = _rss()
        if mode == "float":
            llms[mode] = LLM(str(float_dir), **options)
        else:
            llms[mode] = LLM(str(mx_dir), quantization="none" if mode == "mxfp4" else mode, **options)
        first[mode] = llms[mode].generate(prompt, params)[0].token_ids  # warm-up: every weight page touched
        after = _rss()
        memory[mode] = {k: after[k] - before[k] for k in after}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode, llm in llms.items():
            m = llm.generate(prompt, params)[0].metrics
            rates[mode].append(args.tokens / (m.last_token_time - m.first_token_time))
            print(f"round {round_} {mode}: {rates[mode][-1]:.2f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"gpt-oss-shaped random model: {args.layers} layers, {args.experts} experts of 2880 top-4, hidden 2880; "
          f"batch-1 decode, {args.context}-token prompt, {args.tokens} tokens, {args.rounds} interleaved rounds; "
          f"load {os.getloadavg()}")
    base = max(rates[modes[0]])
    for mode in modes:
        nbytes = model_weight_bytes(llms[mode].engine.executor.model)
        same = sum(a == b for a, b in zip(first[mode], first[modes[0]]))
        mem = memory[mode]
        print(f"  {mode:6s} best {max(rates[mode]):6.2f} tok/s (rounds: {', '.join(f'{r:.2f}' for r in rates[mode])})"
              f"  x{max(rates[mode]) / base:.2f}  weights {nbytes / 1e6:7.1f} MB  RSS +{mem['VmRSS'] / 1e6:7.1f} MB "
              f"(anon +{mem['RssAnon'] / 1e6:.1f}, file +{mem['RssFile'] / 1e6:.1f})  first {same}/{len(first[mode])}"
              f" tokens as {modes[0]}")


if __name__ == "__main__":
    main()
