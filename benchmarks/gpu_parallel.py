"""One GPU against tensor / expert parallel ranks (NCCL): greedy tokens and batch-1 decode tokens/s of the same random
Qwen3-MoE-shaped checkpoint, written to disk once (each rank maps its own shard of it).

Runs the layouts the machine has GPUs for (1; TP 2 and EP 2 from two GPUs; TP 2 x EP 2 from four) and says so
when there is only one GPU (then it compares nothing and exits 0). bf16 sums in another order can change a greedy
token of a random model, so a layout reports where its tokens first differ from one GPU's instead of failing.
scripts/gpu_check.sh runs it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIG = {  # Qwen3-30B-A3B's layer shape with 2 layers of 64 experts: a 1.3 GB file, written in seconds
    "model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 2,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


def write_checkpoint(path: Path, cfg: dict) -> Path:
    """config.json, a three-word tokenizer and random bf16 weights in HF names (one safetensors file)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    gen = torch.Generator().manual_seed(0)
    H, D, V, E, I = (cfg[k] for k in ("hidden_size", "head_dim", "vocab_size", "num_experts", "moe_intermediate_size"))
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "lm_head.weight": rand(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        a = p + "self_attn."
        w |= {a + "q_proj.weight": rand(Hq * D, H), a + "k_proj.weight": rand(Hkv * D, H),
              a + "v_proj.weight": rand(Hkv * D, H), a + "o_proj.weight": rand(H, Hq * D),
              a + "q_norm.weight": torch.ones(D, dtype=torch.bfloat16), a + "k_norm.weight": torch.ones(D, dtype=torch.bfloat16)}
        w[p + "mlp.gate.weight"] = rand(E, H)
        for x in range(E):
            e = f"{p}mlp.experts.{x}."
            w |= {e + "gate_proj.weight": rand(I, H), e + "up_proj.weight": rand(I, H), e + "down_proj.weight": rand(H, I)}
    w = {k: v.clone() for k, v in w.items()}  # tied norms were one tensor: safetensors wants separate storage
    save_file(w, str(path / "model.safetensors"))
    return path


def run(path: Path, tp: int, ep: int, tokens: int, device: str) -> tuple[list[int], float, float]:
    """(greedy tokens, load seconds, decode tokens/s) of one layout."""
    from tsterm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), dtype="auto", device=device, num_kv_blocks=256, tensor_parallel_size=tp,
              expert_parallel_size=ep, distributed_timeout_s=120)
    load_s = time.perf_counter() - start
    try:
        prompt = list(range(100, 164))
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate([prompt[::-1]], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
        return out.token_ids, load_s, tokens / (time.perf_counter() - start)
    finally:
        llm.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--summary-file")
    parser.add_argument("--cpu-smoke", type=int, metavar="RANKS", help="run the code path on CPU ranks, tiny shape")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg, device = CONFIG, "cuda"
    if args.cpu_smoke:
        gpus, device = args.cpu_smoke, "cpu"
        cfg = dict(CONFIG, vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    layouts = [(1, 1)] + [(2, 1), (1, 2)] * (gpus >= 2) + [(2, 2)] * (gpus >= 4)
    lines = [f"== one GPU vs tensor/expert parallel ({gpus} GPU(s)) =="]
    if gpus < 2:
        lines.append(f"only {gpus} GPU(s) here: the TP/EP comparison needs 2 (TP 2 x EP 2: 4); nothing compared")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_checkpoint(Path(tmp) / "model", cfg)
            lines.append(f"{'layout':<12}{'load s':>8}{'tok/s':>9}  greedy tokens vs 1 GPU")
            base = None
            for tp, ep in layouts:
                tokens, load_s, rate = run(path, tp, ep, args.tokens, device)
                base = tokens if base is None else base
                same = next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b), None)
                verdict = "same" if same is None else f"first differs at token {same}"
                lines.append(f"{f'TP{tp} x EP{ep}':<12}{load_s:>8.1f}{rate:>9.1f}  {verdict}")
    summary = "\n".join(lines)
    print(summary)
    if args.summary_file:
        Path(args.summary_file).write_text(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
