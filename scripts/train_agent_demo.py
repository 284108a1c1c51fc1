"""Trains tsterm's shipped `agent-demo` model: a tiny Qwen3-MoE that calls the calculator tool, on the CPU.

    python scripts/train_agent_demo.py --out tsterm/models/agent_demo

Data: synthetic calculator conversations in tsterm's chat format, rendered by tsterm's own chat template with
exactly the tool the agent offers (`Calculator().spec()`) and no system message. The model learns to copy the
expression from the question into a Hermes `<tool_call>` and the tool's result into its answer; it does no
arithmetic itself. Digits are single tokens (the BPE never sees them), so copying is per digit. The loss covers the
assistant turns only, each through its `<|im_end|>`. Training model and export are scripts/train_moe_demo.py's;
the system block (the tool list, two thirds of every conversation's tokens) is computed once per batch and shared by
its rows, which is the same forward as the whole sequence (checked at start), three times cheaper.

After training, the shipped (bfloat16) weights are measured through tsterm's engine, greedily, on held-out tasks
(no expression of them was trained on): the step-1 calls and the answers after the true tool results. The numbers
go into training.json. Same arguments, same thread count: same weights.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as BackendTokenizer

from train_moe_demo import Qwen3MoeLM, balance_loss, export, optimizer, rotate_half
from tsterm import LLM, SamplingParams
from tsterm.agent.tool_calls import ToolCall, ToolCallParser
from tsterm.agent.tools import Calculator
from tsterm.convert.demo import ADDED_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS, RandomMoESpec, train_tokenizer
from tsterm.tokenizer import Tokenizer

TOOLS = [Calculator().spec()]
SINGLE = ("What is {0}?", "Compute {0}.", "Calculate {0}", "How much is {0}?", "What's {0}?", "Please calculate {0}.",
          "Evaluate {0}.", "Work out {0}.", "Can you compute {0}?", "{0} = ?", "Calculate {0}, please.",
          "what is {0}")
DOUBLE = ("What is {0} and {1}?", "Compute {0} and {1}.", "Calculate {0} and {1}", "How much is {0} and {1}?",
          "What are {0} and {1}?", "Please evaluate {0} and also {1}.", "Work out {0} and {1}.",
          "Can you compute {0} and {1}?")
GREETING = "Hello! Ask me an arithmetic question and I will work it out with the calculator."
CHAT = {"Hello": GREETING, "Hello!": GREETING, "Hi": GREETING, "Hi there": GREETING, "hello": GREETING,
        "Good morning": GREETING, "Hey": GREETING,
        "Who are you?": "I am a small demo model: I answer arithmetic questions with the calculator tool.",
        "What can you do?": "I answer arithmetic questions with the calculator tool.",
        "Thanks!": "You're welcome!", "Thank you": "You're welcome!", "thanks": "You're welcome!"}
KINDS = (("single", 0.6), ("double", 0.32), ("chat", 0.08))
NOT_BPE = re.compile(r"\d+|" + "|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))


# ---- data
@dataclass(frozen=True)
class Task:
    question: str
    expressions: tuple[str, ...]  # empty: a chat turn, answered directly
    results: tuple[str, ...]  # what the calculator returns for each expression
    reply: str  # the final assistant message


def number(rng: random.Random) -> str:
    digits = rng.choice((1, 2, 2, 3, 3, 4))
    return str(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1))


def expression(rng: random.Random) -> str:
    ops = [rng.choice("+-*") for _ in range(rng.choice((1, 1, 1, 2)))]
    a, b = number(rng), number(rng)
    if len(ops) == 1:
        return f"{a} {ops[0]} {b}"
    c = number(rng)
    form = rng.randrange(3)
    if form == 0:
        return f"({a} {ops[0]} {b}) {ops[1]} {c}"
    if form == 1:
        return f"{a} {ops[0]} ({b} {ops[1]} {c})"
    return f"{a} {ops[0]} {b} {ops[1]} {c}"


def make_task(rng: random.Random, kind: str) -> Task:
    calculator = Calculator()
    if kind == "chat":
        question = rng.choice(sorted(CHAT))
        return Task(question, (), (), CHAT[question])
    exprs = (expression(rng),) if kind == "single" else (expression(rng), expression(rng))
    results = tuple(calculator.run({"expression": e}) for e in exprs)
    question = rng.choice(SINGLE if kind == "single" else DOUBLE).format(*exprs)
    reply = " and ".join(f"{e} = {r}" for e, r in zip(exprs, results)) + "."
    return Task(question, exprs, results, reply)


def make_tasks(seed: int, conversations: int, heldout: int) -> tuple[list[Task], dict[str, list[Task]]]:
    """The training tasks, and per kind the held-out ones: `heldout` single and two-call tasks with no expression
    of the training tasks, and 8 chat turns (those are all trained on)."""
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS)
    train = [make_task(rng, rng.choices(kinds, weights)[0]) for _ in range(conversations)]
    seen = {e for t in train for e in t.expressions}
    heldout_rng, held = random.Random(seed + 1), {"single": [], "double": []}
    for kind, group in held.items():
        while len(group) < heldout:
            task = make_task(heldout_rng, kind)
            if not seen.intersection(task.expressions):
                group.append(task)
    held["chat"] = [make_task(heldout_rng, "chat") for _ in range(8)]
    return train, held


def call_message(expressions: tuple[str, ...]) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}} for e in expressions]}


def conversation(task: Task) -> list[dict]:
    messages = [{"role": "user", "content": task.question}]
    if task.expressions:
        messages.append(call_message(task.expressions))
        messages += [{"role": "tool", "content": r} for r in task.results]
    return messages + [{"role": "assistant", "content": task.reply}]


def render(chat: Tokenizer, task: Task) -> str:
    return chat.apply_chat_template(conversation(task), tools=TOOLS, add_generation_prompt=False)


def encode(tok: BackendTokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids and loss targets: a token of an assistant message (its `<|im_end|>` included) is its own target,
    every other token is -100. Targets are not shifted; the loss shifts them."""
    enc = tok.encode(text, add_special_tokens=False)
    spans, head = [], "<|im_start|>assistant\n"
    for m in re.finditer(re.escape(head), text):
        spans.append((m.end(), text.index("<|im_end|>", m.end()) + len("<|im_end|>")))
    ids, offsets = enc.ids, enc.offsets
    targets = [t if any(s <= start and end <= e for s, e in spans) else -100 for t, (start, end) in zip(ids, offsets)]
    starts = {start for start, _ in offsets}
    assert all(s in starts for s, _ in spans), "an assistant message starts inside a token"
    return ids, targets


def chat_tokenizer(backend: BackendTokenizer) -> Tokenizer:
    """tsterm's Tokenizer around `backend`, with the template and special tokens the export writes."""
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    return Tokenizer(backend, config, chat_templates={"default": CHAT_TEMPLATE})


def build_tokenizer(texts: list[str], vocab_size: int) -> BackendTokenizer:
    """tsterm.convert.demo's byte-level BPE, trained on the rendered texts split at digits and at special/added tokens: no
    merge involves a digit, so every digit stays its own token."""
    pieces = [p for t in texts for p in NOT_BPE.split(t) if p]
    return train_tokenizer(vocab_size, pieces, min_frequency=2)


def batches(examples: list[tuple[list[int], list[int]]], batch: int, pad_id: int, rng: random.Random):
    """Endless shuffled epochs of right-padded [B, T] ids and targets; rows of a batch have similar lengths (drawn
    from a shuffled window of 16 batches sorted by length), so little of a batch is padding."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        groups = []
        for w in range(0, len(order), 16 * batch):
            window = sorted(order[w:w + 16 * batch], key=lambda j: len(examples[j][0]))
            groups += [window[i:i + batch] for i in range(0, len(window) - batch + 1, batch)]
        rng.shuffle(groups)
        for group in groups:
            chunk = [examples[j] for j in group]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((batch, width), pad_id)
            targets = torch.full((batch, width), -100)
            for row, (x, y) in enumerate(chunk):
                ids[row, :len(x)], targets[row, :len(y)] = torch.tensor(x), torch.tensor(y)
            yield ids, targets


def project(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, heads, T, D] of train_moe_demo's Attention (q/k norms, rope, k/v repeated per head group)."""
    B, T, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(B, T, attn.heads, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(B, T, attn.kv_heads, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    groups = attn.heads // attn.kv_heads
    return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def shared_prefix_forward(model: Qwen3MoeLM, prefix: torch.Tensor, ids: torch.Tensor):
    """`model(cat(prefix, row))` for every row of ids [B, S], with the prefix [P] (the system block every
    conversation starts with, two thirds of its tokens) computed once. Returns the logits of the rows' positions
    [B, S, V] and the routing of prefix and rows, as Qwen3MoeLM.forward does."""
    P, (B, S) = len(prefix), ids.shape
    freqs = torch.arange(P + S, dtype=torch.float32)[:, None] * model.inv_freq  # [P + S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.ones(S, P + S, dtype=torch.bool).tril(P)  # a row's token sees the prefix and the row up to itself
    xp, xs = model.model.embed_tokens(prefix[None]), model.model.embed_tokens(ids)  # [1, P, H], [B, S, H]
    routing = []
    for layer in model.model.layers:
        attn = layer.self_attn
        qp, kp, vp = project(attn, layer.input_layernorm(xp), cos[:P], sin[:P])
        qs, ks, vs = project(attn, layer.input_layernorm(xs), cos[P:], sin[P:])
        out_p = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        out_s = F.scaled_dot_product_attention(qs, torch.cat((kp.expand(B, -1, -1, -1), ks), 2),
                                               torch.cat((vp.expand(B, -1, -1, -1), vs), 2), attn_mask=mask)
        xp = xp + attn.o_proj(out_p.transpose(1, 2).reshape(1, P, -1))
        xs = xs + attn.o_proj(out_s.transpose(1, 2).reshape(B, S, -1))
        x = layer.post_attention_layernorm(torch.cat((xp.view(P, -1), xs.view(B * S, -1))))  # [P + B*S, H]
        moe, probs, chosen = layer.mlp(x)
        xp, xs = xp + moe[:P].view(xp.shape), xs + moe[P:].view(xs.shape)
        routing.append((probs, chosen))
    return model.lm_head(model.model.norm(xs)), routing


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-100)


@torch.no_grad()
def teacher_forced(model: Qwen3MoeLM, prefix: torch.Tensor, examples, pad_id: int) -> tuple[float, float]:
    """Assistant-token accuracy and the fraction of conversations with every assistant token right."""
    model.eval()
    right = total = whole = 0
    for i in range(0, len(examples), 32):
        chunk = examples[i:i + 32]
        ids, targets = next(batches(chunk, len(chunk), pad_id, random.Random(0)))
        logits, _ = shared_prefix_forward(model, prefix, ids)
        pred, gold = logits[:, :-1].argmax(-1), targets[:, 1:]
        mask = gold != -100
        ok = (pred == gold) | ~mask
        right += (ok & mask).sum().item()
        total += mask.sum().item()
        whole += ok.all(-1).sum().item()
    model.train()
    return right / total, whole / len(examples)


# ---- evaluation through tsterm's engine
def calls_of(text: str) -> list[ToolCall]:
    parser = ToolCallParser(tools=TOOLS)
    events = parser.feed(text) + parser.finish()
    return [e for e in events if isinstance(e, ToolCall)]


def calls_right(text: str, task: Task) -> bool:
    calls = calls_of(text)
    return [(c.ok, c.name, c.arguments) for c in calls] == [(True, "calculator", {"expression": e})
                                                            for e in task.expressions]


def run_agent_steps(llm, tasks: list[Task], max_tokens: int = 96) -> list[tuple[str, str]]:
    """Greedy step 1 (the reply to the question) and step 2 (the reply after the true calls and results)."""
    tok, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=max_tokens)
    first = [tok.apply_chat_template([{"role": "user", "content": t.question}], tools=TOOLS, tokenize=True)
             for t in tasks]
    second = [tok.apply_chat_template(conversation(t)[:-1], tools=TOOLS, tokenize=True) for t in tasks]
    outs = llm.generate(first + second, params)
    texts = [o.outputs[0].text for o in outs]
    return list(zip(texts[:len(tasks)], texts[len(tasks):]))


def measure(model_dir: Path, tasks: dict[str, list[Task]]) -> dict:
    """Per kind: the fractions of tasks whose step-1 calls are exactly right (as ToolCallParser reads them), whose
    answer holds every `= RESULT`, whose answer is exactly the trained one, and with both steps right."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    report, failures = {}, []
    for kind, group in tasks.items():
        if kind == "chat":
            replies = [b for b, _ in run_agent_steps(llm, group)]
            report["chat_exact"] = sum(r == t.reply for r, t in zip(replies, group)) / len(group)
            continue
        steps = run_agent_steps(llm, group)
        calls = [calls_right(a, t) for (a, _), t in zip(steps, group)]
        has = [all(re.search(rf"= {re.escape(r)}(?!\d)", b) for r in t.results) for (_, b), t in zip(steps, group)]
        exact = [b == t.reply for (_, b), t in zip(steps, group)]
        report[kind] = {"tasks": len(group), "call_right": sum(calls) / len(group),
                        "answer_has_results": sum(has) / len(group), "answer_exact": sum(exact) / len(group),
                        "both_steps_right": sum(c and h for c, h in zip(calls, has)) / len(group)}
        failures += [{"question": t.question, "step1": a, "step2": b}
                     for (a, b), t, c, h in zip(steps, group, calls, has) if not (c and h)][:3]
    report["failure_examples"] = failures
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tsterm/models/agent_demo")
    ap.add_argument("--conversations", type=int, default=32000, help="synthetic training conversations")
    ap.add_argument("--heldout", type=int, default=100, help="held-out tasks per kind (single, double)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (part of what makes a run reproducible); at this size one thread is as fast "
                         "as two, and far faster when anything else runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    train_tasks, heldout = make_tasks(args.seed, args.conversations, args.heldout)

    chat = chat_tokenizer(train_tokenizer(len(SPECIAL_TOKENS) + 256 + len(ADDED_TOKENS) + 1))  # renders only
    texts = [render(chat, t) for t in train_tasks]
    tok = build_tokenizer(texts, args.vocab)
    assert all(tok.token_to_id(d) is not None for d in "0123456789")
    examples = [encode(tok, text) for text in texts]
    valid = [encode(tok, render(chat, t)) for t in heldout["single"][:64] + heldout["double"][:64]]
    lengths = [len(ids) for ids, _ in examples]
    system = texts[0][:texts[0].index("<|im_start|>user")]  # the same in every conversation: trained once a step
    prefix = tok.encode(system, add_special_tokens=False).ids
    assert all(ids[:len(prefix)] == prefix and max(ys[:len(prefix)]) == -100 for ids, ys in examples + valid)
    examples, valid = ([(ids[len(prefix):], ys[len(prefix):]) for ids, ys in group] for group in (examples, valid))
    prefix = torch.tensor(prefix)
    print(f"{len(examples):,} conversations, {sum(lengths):,} tokens (max {max(lengths)}), "
          f"{sum(sum(y != -100 for y in ys) for _, ys in examples):,} trained; "
          f"data {time.perf_counter() - started:.1f}s", flush=True)

    spec = RandomMoESpec(vocab_size=args.vocab, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=128, max_position_embeddings=1024, dtype="bfloat16",
                         seed=args.seed, init_std=0.02, rope_theta=10000.0)
    assert max(lengths) <= spec.max_position_embeddings
    model = Qwen3MoeLM(spec)
    with torch.no_grad():  # the shared-prefix forward is the plain forward of prefix + row
        ids, _ = next(batches(valid[:2], 2, 0, random.Random(0)))
        full, _ = model(torch.cat((prefix.expand(2, -1), ids), 1))
        shared, _ = shared_prefix_forward(model, prefix, ids)
        assert torch.allclose(full[:, len(prefix):], shared, atol=1e-5), (full[:, len(prefix):] - shared).abs().max()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} parameters", flush=True)
    opt, schedule = optimizer(model, args.lr, args.steps, floor=0.05, amplitude=0.475)
    pad_id = tok.token_to_id("<|endoftext|>")
    stream = batches(examples, args.batch, pad_id, random.Random(args.seed))
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, targets = next(stream)
        logits, routing = shared_prefix_forward(model, prefix, ids)
        ce = loss_fn(logits, targets)
        aux = balance_loss(routing, spec.num_experts)
        opt.zero_grad(set_to_none=True)
        (ce + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % 25 == 0 or step == 1:
            elapsed = time.perf_counter() - train_start
            print(f"step {step:5d}  loss {ce.item():.4f}  aux {aux.item():.3f}  {elapsed:6.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            token_acc, whole = teacher_forced(model, prefix, valid, pad_id)
            print(f"step {step:5d}  held-out assistant tokens right {token_acc:.4f}, conversations right {whole:.3f}",
                  flush=True)
    train_seconds = time.perf_counter() - train_start

    with torch.no_grad():  # what ships is bfloat16: measure those weights
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    token_acc, whole = teacher_forced(model, prefix, valid, pad_id)
    report = {"seed": args.seed, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "aux_loss_coef": args.aux_coef, "threads": args.threads, "parameters": params,
              "conversations": args.conversations, "kinds": dict(KINDS),
              "train_tokens_seen": round(args.steps * args.batch * sum(lengths) / len(lengths)),
              "train_seconds": round(train_seconds, 1),
              "heldout_teacher_forced": {"assistant_token_accuracy": round(token_acc, 4),
                                         "conversations_all_right": round(whole, 4)},
              "spec": asdict(spec), "tools": TOOLS,
              "data": "synthetic calculator conversations (this script), rendered with tsterm's chat template"}
    export(args.out, model, tok, report)
    report["heldout_engine_greedy"] = measure(args.out, heldout)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "training.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n",
                                            encoding="utf-8")
    print(json.dumps({k: report[k] for k in ("heldout_engine_greedy", "train_seconds", "wall_seconds")}, indent=1),
          flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
