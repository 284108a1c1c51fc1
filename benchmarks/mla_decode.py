"""MLA's cache and decode speed at a long context: DeepSeek-V3's attention shape (kv_lora_rank 512, RoPE 64, nope
128, v 128) with its latent cache and the absorbed decode, against the same model keeping full per-head K and V
(the latent expanded through kv_b_proj as each token is written, plain multi-head paged attention over it; V
zero-padded to K's 192 values, as the paged attention reads one width: 20% more than unpadded K/V), in one run, on
the CPU, random weights.

    python benchmarks/mla_decode.py [--context 8192] [--decode 32] [--heads 16] [--layers 2] [--rounds 3]
                                    [--device cpu|cuda] [--dtype float32|bfloat16] [--variants ...] [--threads N]
    python benchmarks/mla_decode.py --attention-only [--context 8192] [--heads 128] [--rounds 15] [--threads 1]

Variants (`--variants`, comma-separated; all by default):
- "latent": the latent cache, absorbed decode; on the CPU through csrc/mla.c (`tsterm_kernels.cpu_mla`: every head
  over each latent row read once), on CUDA through the Triton MLA kernel (kernels/triton_mla.py);
- "latent-paged" (CPU only): the same cache and model, the absorbed attention through the generic paged attention
  instead (the latent row as the one key head and its value, 64 heads a call: what the CPU ran before csrc/mla.c);
- "expanded": full per-head K/V, the plain paged attention (Triton on CUDA).

`--attention-only` times one decode row's absorbed attention alone (no model, random latents) on the CPU: csrc/mla.c
against the paged attention over the latent rows, interleaved: where DeepSeek-V3's 128 heads are cheap to measure
(the model's prefill at 8K with 128 heads is not).

On a CUDA device (`--device cuda`, the Triton kernels, decode steps replayed as CUDA graphs) there `--heads 128
--dtype bfloat16` is DeepSeek-V3's attention on one GPU.

The model: DeepSeek-V3's per-head dims and latent, `--heads` heads (128 in the real model), `--layers` layers (the
first dense), a tiny MoE; float32. The variants load the same weights; the expanded one swaps the decoder's MLA
mixer and cache pool for an expanded-K/V pair (defined here, in this process only). Per round and variant: a new
engine prefills a `--context`-token prompt (chunks of 512), then decodes `--decode` tokens greedily; decode tok/s is
the decoded tokens over the time from the first token to the last (with `--threads 1` on the CPU by this thread's CPU
clock, which leaves out the time it waited for a core on a busy machine; else the wall clock), and on the CPU the
attention layers' own time per decoded token (their mixers' calls on one-row steps, summed over the layers: q/kv projections, attention, W_UV and
o_proj). Rounds alternate the variants. Printed: cache bytes per token (all layers), the cache bytes one decode step
reads at the context, decode tok/s and layer ms per round, and the medians' ratios. The variants' tokens are checked
equal in float32 (the same model, ways of attending that agree to float32 rounding: a tie could flip a token, which
the check would report); in bfloat16, where they round differently, the share of equal tokens is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def config(heads: int, layers: int) -> dict:
    return {
        "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 1024, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": 2048,
        "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "norm_topk_prob": True, "q_lora_rank": 384, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 16384, "tie_word_embeddings": False,
    }


def write_checkpoint(path: Path, cfg: dict) -> Path:
    """config.json, a three-word tokenizer and random float32 weights in DeepSeek-V3's names."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    gen = torch.Generator().manual_seed(0)
    H, V, Hq = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    qa, r, dn, dr, dv = (cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    E, I, D = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * shape[-1] ** -0.5

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n)

    w = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": ones(H), "lm_head.weight": rand(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w |= {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
              a + "q_a_proj.weight": rand(qa, H), a + "q_a_layernorm.weight": ones(qa),
              a + "q_b_proj.weight": rand(Hq * (dn + dr), qa), a + "kv_a_proj_with_mqa.weight": rand(r + dr, H),
              a + "kv_a_layernorm.weight": ones(r), a + "kv_b_proj.weight": rand(Hq * (dn + dv), r),
              a + "o_proj.weight": rand(H, Hq * dv)}
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            w |= {m + "gate_proj.weight": rand(D, H), m + "up_proj.weight": rand(D, H), m + "down_proj.weight": rand(H, D)}
            continue
        w |= {m + "gate.weight": rand(E, H), m + "gate.e_score_correction_bias": torch.rand(E, generator=gen) * 0.1,
              m + "shared_experts.gate_proj.weight": rand(I, H), m + "shared_experts.up_proj.weight": rand(I, H),
              m + "shared_experts.down_proj.weight": rand(H, I)}
        for x in range(E):
            e = f"{m}experts.{x}."
            w |= {e + "gate_proj.weight": rand(I, H), e + "up_proj.weight": rand(I, H), e + "down_proj.weight": rand(H, I)}
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def expanded_variant():
    """(mixer, pool) keeping per-head K = [k_nope | k_rope] and V (zero-padded to K's width, as the paged attention
    reads one width) for every token: the cache MLA replaces, attended as plain multi-head attention."""
    from tsterm.model.cache import CachePool
    from tsterm.model.mla import MLAttention
    from tsterm_kernels.torch_ops import linear

    class ExpandedKVPool(CachePool):
        def __init__(self, cfg, layers, num_blocks, block_size, dtype, device, layout, num_slots=0):
            self.layers, self._index = layers, {layer: i for i, layer in enumerate(layers)}
            width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            self.kv = torch.zeros((len(layers), 2, num_blocks, block_size, layout.q_heads(cfg)[1], width), dtype=dtype,
                                  device=device)

        def layer(self, index):
            return self.kv[self._index[index]]

        def copy_blocks(self, pairs):
            for src, dst in pairs:
                self.kv[:, :, dst].copy_(self.kv[:, :, src])
            return len(pairs) * self.kv[:, :, 0].numel() * self.kv.element_size()

        @staticmethod
        def bytes_per_block(cfg, num_layers, block_size, dtype, layout):
            width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            return 2 * num_layers * block_size * layout.q_heads(cfg)[1] * width * dtype.itemsize

    class ExpandedMLA(MLAttention):
        def __init__(self, cfg, w, prefix, cache, ctx, ops, par):
            kv = cache  # [2, num_blocks, block_size, Hq, dn + dr]
            latent = torch.empty(1, 1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # (MLAttention's cache: unused)
            super().__init__(cfg, w, prefix, latent, ctx, ops, par)
            self.k_cache, self.v_cache, self.num_kv_heads = kv[0], kv[1], self.num_heads
            self.head_dim = self.nope + self.rope_dim

        def __call__(self, rope, x):
            from tsterm.model.rope import rotate
            T, Hq, r, dn, dr, dv = x.shape[0], self.num_heads, self.rank, self.nope, self.rope_dim, self.v_dim
            q = linear(self.ops.rms_norm(linear(x, self.q_a), self.q_a_norm, self.eps)[0], self.q_b)
            q = q.float().view(T, Hq, dn + dr)
            q = torch.cat((q[..., :dn], rotate(q[..., dn:], rope)), dim=-1)  # [T, Hq, dn + dr]
            kv = linear(x, self.kv_a)
            latent = self.ops.rms_norm(kv[:, :r].contiguous(), self.kv_a_norm, self.eps)[0]
            k_rope = rotate(kv[:, None, r:].float(), rope)  # [T, 1, dr]
            per_head = linear(latent, self.kv_b).view(T, Hq, dn + dv)  # the new tokens' K and V, expanded once
            k = torch.cat((per_head[..., :dn], k_rope.expand(T, Hq, dr)), dim=-1).contiguous()
            v = torch.zeros_like(k)
            v[..., :dv] = per_head[..., dn:]
            self.ops.store_kv(k, v, self.k_cache, self.v_cache, self.ctx.meta.slot_mapping)
            o = self.ops.paged_attention(q, self.k_cache, self.v_cache, self.ctx.meta, self.scale)[..., :dv]
            out = linear(o.reshape(T, Hq * dv).contiguous(), self.o_proj)
            self.par.all_reduce_tp(out)
            return out

    return ExpandedMLA, ExpandedKVPool


VARIANTS = ("latent", "latent-paged", "expanded")


def attention_only(context: int, heads: int, rounds: int, dtype: str) -> None:
    """`--attention-only`: one decode row's absorbed attention alone (no model) on the CPU, DeepSeek-V3's latent (512 +
    64) at `context` keys in shuffled 16-token blocks, random values: csrc/mla.c against the model's fallback (the
    paged attention over the latent rows, 64 heads a call), called in turn `rounds` times after one warm-up each;
    prints ms per call (minimum and median) and the ratio per round."""
    from tsterm.model.mla import MAX_HEADS
    from tsterm_kernels import cpu_mla, torch_ops
    from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

    rank, rope, block, scale = 512, 64, 16, 192 ** -0.5
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // block)
    cache = torch.randn(blocks, block, 1, rank + rope, generator=gen).to(getattr(torch, dtype))
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    meta = AttentionMetadata([0, 1], [context], [contiguous_runs(table[0].tolist(), blocks)],
                             torch.zeros(1, dtype=torch.int64), table, block)
    q_lat, q_rope = torch.randn(1, heads, rank, generator=gen), torch.randn(1, heads, rope, generator=gen)
    native = cpu_mla.native_for(q_lat, cache)
    if native is None:
        sys.exit("--attention-only: the C kernels are unavailable here")

    def c_kernel():
        return cpu_mla.mla_attention(q_lat, q_rope, cache, meta, scale, native)

    def paged():
        q = torch.cat((q_lat, q_rope), dim=-1).to(cache.dtype)
        parts = [torch_ops.paged_attention(q[:, h:h + MAX_HEADS], cache, cache, meta, scale)
                 for h in range(0, heads, MAX_HEADS)]
        return torch.cat(parts, 1)[..., :rank].float()

    torch.testing.assert_close(c_kernel(), paged(), rtol=1e-3 if dtype == "float32" else 3e-2, atol=1e-4)
    # wall clock, and on one thread this thread's CPU clock too (the time it ran, not the time it waited for a core:
    # steadier on a shared machine, where a wall-clock call also holds the time other processes took the core)
    one_thread = torch.get_num_threads() == 1
    clocks = {"wall": time.perf_counter, **({"thread CPU": time.thread_time} if one_thread else {})}
    times = {(name, clock): [] for name in ("csrc/mla.c", "paged attention") for clock in clocks}
    for _ in range(rounds):
        for name, fn in (("csrc/mla.c", c_kernel), ("paged attention", paged)):
            start = {clock: read() for clock, read in clocks.items()}
            fn()
            for clock, read in clocks.items():
                times[name, clock].append(read() - start[clock])
    flops = 2 * heads * context * (2 * rank + rope)
    for (name, clock), t in times.items():
        print(f"{name:16s} {heads} heads at {context}, {clock:10s}: min {1e3 * min(t):7.2f} ms  median "
              f"{1e3 * statistics.median(t):7.2f} ms  ({flops / min(t) / 1e9:.0f} GFLOP/s at the minimum)")
    for clock in clocks:
        ratios = [b / a for a, b in zip(times["csrc/mla.c", clock], times["paged attention", clock])]
        print(f"{clock}: paged / csrc/mla.c per round: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x,"
              f" max {max(ratios):.2f}x); of the minima "
              f"{min(times['paged attention', clock]) / min(times['csrc/mla.c', clock]):.2f}x")


def timed(mixer: type, spent: list[float], clock) -> type:
    """`mixer` whose calls on one-row steps (decodes) add their seconds by `clock` to `spent`."""
    class Timed(mixer):
        def __call__(self, rope, x):
            if x.shape[0] != 1:
                return super().__call__(rope, x)
            start = clock()
            out = super().__call__(rope, x)
            spent.append(clock() - start)
            return out

    return Timed


def run(path: Path, prompt: list[int], decode: int, variant: str, device: str = "cpu", dtype: str = "float32",
        clock=time.perf_counter):
    """(tokens, decode tok/s, cache bytes per token over all layers, attention layers' ms per decoded token) of one
    fresh engine, timed by `clock`."""
    from tsterm import LLM, SamplingParams
    from tsterm.model import cache, decoder, mla
    from tsterm.model.arch import ARCHITECTURES, MLA
    from tsterm.model.cache import ModelCache
    from tsterm.model.parallel import ParallelLayout

    saved = decoder.MIXERS[MLA], cache.POOLS[MLA], mla.cpu_mla.native_for
    spent: list[float] = []
    mixer, pool = expanded_variant() if variant == "expanded" else saved[:2]
    decoder.MIXERS[MLA], cache.POOLS[MLA] = timed(mixer, spent, clock), pool
    if variant == "latent-paged":
        mla.cpu_mla.native_for = lambda q_lat, cache: None  # the model's fallback: the generic paged attention
    try:
        blocks = -(-(len(prompt) + decode + 16) // 16) + 4
        llm = LLM(str(path), dtype=dtype, device=device, block_size=16, num_kv_blocks=blocks,
                  max_model_len=len(prompt) + decode + 16, max_num_batched_tokens=512, enable_prefix_caching=False)
        engine = llm.engine
        cfg = engine.model_config
        per_token = ModelCache.bytes_per_block(cfg, ARCHITECTURES[cfg.model_type].layer_types(cfg), 16,
                                               getattr(torch, dtype), ParallelLayout()) // 16
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True))
        tokens, first = [], None
        while engine.has_unfinished():
            for out in engine.step():
                if out.token_ids and first is None:
                    first = clock()
                    spent.clear()  # (the prompt's last chunk is not a one-row step; a one-token prompt's would be)
                if out.finished:
                    tokens = list(out.token_ids)
        elapsed = clock() - first
        engine.shutdown()
        layer_ms = 1e3 * sum(spent) / (decode - 1) if spent else float("nan")  # (CUDA graphs: no Python calls)
        return tokens, (decode - 1) / elapsed, per_token, layer_ms
    finally:
        decoder.MIXERS[MLA], cache.POOLS[MLA], mla.cpu_mla.native_for = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens before decoding")
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per measurement")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (DeepSeek-V3: 128)")
    parser.add_argument("--layers", type=int, default=2, help="layers (the first dense)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements of each variant")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; "
                                                          "latent-paged on the CPU only)")
    parser.add_argument("--attention-only", action="store_true",
                        help="time one decode row's absorbed attention alone (CPU: csrc/mla.c vs the paged attention)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's and the C kernels' threads (default: torch's; one thread is steadier on a busy "
                             "machine, where a parallel region waits for its slowest thread)")
    args = parser.parse_args()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # (the engine's thread governor's ceiling too)
        torch.set_num_threads(args.threads)
    if args.attention_only:
        if args.device != "cpu":
            sys.exit("--attention-only compares the CPU's two absorbed attentions")
        attention_only(args.context, args.heads, args.rounds, args.dtype)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    variants = (args.variants.split(",") if args.variants else
                [v for v in VARIANTS if args.device == "cpu" or v != "latent-paged"])
    if any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
        sys.exit(f"--variants: each of {', '.join(VARIANTS)} at most once, got {args.variants!r}")
    if args.device == "cuda" and "latent-paged" in variants:
        sys.exit("--variants: latent-paged is the CPU's fallback path (CUDA takes the Triton MLA kernel)")
    # on one CPU thread, this thread's CPU clock (the engine steps here, the C kernels run on it): the time it ran,
    # not the time it waited for a core, steadier on a shared machine; else the wall clock
    clock = time.thread_time if args.device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    print(f"timed by the {'thread CPU' if clock is time.thread_time else 'wall'} clock, {torch.get_num_threads()} "
          f"thread(s)")
    torch.manual_seed(0)
    prompt = torch.randint(3, 512, (args.context,)).tolist()
    tok_s: dict[str, list[float]] = {v: [] for v in variants}
    layer_ms: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "mla", config(args.heads, args.layers))
        reference = None
        for rnd in range(args.rounds):
            for name in variants:
                tokens, speed, per_token, ms = run(path, prompt, args.decode, name, args.device, args.dtype, clock)
                reference = reference or tokens
                if tokens != reference and args.dtype == "float32":
                    sys.exit(f"{name}: greedy tokens differ from the first run's: {tokens} vs {reference}")
                if tokens != reference:
                    print(f"{name}: {sum(a == b for a, b in zip(tokens, reference))} of {len(reference)} greedy tokens "
                          f"equal to the first run's ({args.dtype} rounds the variants differently)")
                tok_s[name].append(speed)
                layer_ms[name].append(ms)
                print(f"round {rnd}  {name:13s} cache {per_token:>9,} B/token  reads {per_token * args.context / 1e6:8.1f}"
                      f" MB/step at {args.context}  decode {speed:6.2f} tok/s  attention layers {ms:7.2f} ms/token",
                      flush=True)
    speed = {v: statistics.median(x) for v, x in tok_s.items()}
    ms = {v: statistics.median(x) for v, x in layer_ms.items()}
    print("median: " + ", ".join(f"{v} {speed[v]:.2f} tok/s ({ms[v]:.2f} ms/token in the attention layers)"
                                 for v in variants))
    base = variants[0]
    for other in variants[1:]:  # per round too: the rounds interleave, so a ratio within a round shares its load
        rounds = ", ".join(f"{a / b:.2f}x" for a, b in zip(tok_s[base], tok_s[other]))
        layers = ", ".join(f"{b / a:.2f}x" for a, b in zip(layer_ms[base], layer_ms[other]))
        print(f"{base} vs {other}: decode {speed[base] / speed[other]:.2f}x (rounds {rounds}); attention layers "
              f"{ms[other] / ms[base]:.2f}x faster (rounds {layers})")


if __name__ == "__main__":
    main()
