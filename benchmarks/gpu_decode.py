"""Batch-1 decode tokens/s of a random-weight Qwen3-30B-A3B-shaped model built on the device, through tsterm's
engine (scheduler, model runner, Triton kernels, sampler), decoding eagerly and from CUDA graphs, against the
bandwidth roofline: bytes a decode step must read (active weights + the context's KV) / measured copy bandwidth.

The weights are random, made with torch directly on the device (no files): the engine is built on a model
directory holding only config.json and a tiny tokenizer, and its weight loader is swapped for the in-memory
weights. Both engines share one copy of them. Needs CUDA and compiled kernels; scripts/gpu_check.sh runs it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Qwen3-30B-A3B's config.json fields that tsterm reads (layers may be lowered with --layers)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}
DEVICE = "cuda"  # a CPU smoke test swaps this (and the shape) to run the code paths
DTYPE = torch.bfloat16
MEMORY_SLACK = 6 << 30  # bytes kept free for activations, graph pools, the copy-bandwidth buffers


@dataclass
class Result:
    mode: str
    tokens_per_s: float
    bytes_per_token: int
    roofline_tokens_per_s: float
    note: str = ""

    @property
    def gbytes_per_s(self) -> float:
        return self.tokens_per_s * self.bytes_per_token / 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48, help="decoder layers (default 48, the real model's)")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before decoding (default 1024)")
    parser.add_argument("--tokens", type=int, default=128, help="timed decode steps per mode (default 128)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (compiles, captures)")
    parser.add_argument("--summary-file", help="also write the summary table to this file")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.context < 1 or args.tokens < 1 or args.warmup < 1:
        parser.error("--layers, --context, --tokens and --warmup must be >= 1 (the warm-up step captures the graph)")
    return args


def check_device() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_decode.py: no CUDA device (torch.cuda.is_available() is False). This is a GPU benchmark: run "
                 "it on the GPU machine, e.g. `bash scripts/gpu_check.sh`.")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("gpu_decode.py: TRITON_INTERPRET is set, which would time the interpreter; unset it.")


def weight_shapes(cfg: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(shapes of the model-wide weights, shapes of one layer's), named as tsterm.model.loader names them."""
    H, V, D = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    Hq, Hkv, E, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
    model = {"embed": (V, H), "final_norm": (H,), "lm_head": (V, H)}
    layer = {"input_norm": (H,), "post_attn_norm": (H,), "qkv": ((Hq + 2 * Hkv) * D, H), "o_proj": (H, Hq * D),
             "q_norm": (D,), "k_norm": (D,), "router": (E, H), "w13": (E, 2 * inter, H), "w2": (E, H, inter)}
    return model, layer


def numel(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for size in shape:
            n *= size
        total += n
    return total


def layers_that_fit(cfg: dict, requested: int, free_bytes: int, kv_bytes: int) -> int:
    model, layer = weight_shapes(cfg)
    per_layer = numel(layer) * DTYPE.itemsize
    room = free_bytes - numel(model) * DTYPE.itemsize - kv_bytes - MEMORY_SLACK
    return max(1, min(requested, room // per_layer))


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights on the device, scaled so activations stay O(1); norms are ones."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    model, layer = weight_shapes(cfg)
    shapes = dict(model)
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    weights = {}
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=DTYPE, device=DEVICE)
        if name.endswith("norm"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 1.0 if name == "embed" else shape[-1] ** -0.5, generator=gen)
        weights[name] = tensor
    return weights


def bytes_read_per_token(cfg: dict, context: int) -> int:
    """What a batch-1 decode step must read: attention and router weights, the top-k experts' weights, the norms,
    one embedding row, the LM head, and the context's K and V, in every layer."""
    model, layer = weight_shapes(cfg)
    per_layer = numel(layer) - numel({k: layer[k] for k in ("w13", "w2")})
    experts = cfg["num_experts_per_tok"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    kv = 2 * context * cfg["num_key_value_heads"] * cfg["head_dim"]
    total = cfg["num_hidden_layers"] * (per_layer + experts + kv) + numel(model) - (cfg["vocab_size"] - 1) * cfg["hidden_size"]
    return total * DTYPE.itemsize


def write_model_dir(path: Path, cfg: dict) -> Path:
    """config.json and a three-word tokenizer: all the engine reads from disk here (the weights come from memory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@contextlib.contextmanager
def weights_from_memory(weights: dict[str, torch.Tensor]):
    """The engine's weight loader, swapped for the in-memory weights while an engine is built."""
    from tsterm.engine import model_runner as runner_module

    load = runner_module.load_weights
    runner_module.load_weights = lambda *args, **kwargs: weights
    try:
        yield
    finally:
        runner_module.load_weights = load


def build_engine(model_dir: Path, weights: dict[str, torch.Tensor], context: int, tokens: int, cuda_graphs: bool):
    from tsterm.config import EngineConfig
    from tsterm.engine.engine import Engine

    block = 16
    max_len = context + tokens + 2 * block
    config = EngineConfig(model=str(model_dir), dtype="bfloat16" if DTYPE == torch.bfloat16 else "float32",
                          device=DEVICE, block_size=block, num_kv_blocks=-(-max_len // block) + 2, max_model_len=max_len,
                          max_num_seqs=1, cuda_graphs=cuda_graphs, kernels="triton")
    with weights_from_memory(weights):
        return Engine(config)


def prefill(engine, context: int, max_tokens: int) -> None:
    from tsterm.config import SamplingParams

    vocab = engine.model_config.vocab_size
    prompt = [(17 + i * 7919) % (vocab - 16) + 16 for i in range(context)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_syncs_in_a_step(engine) -> str:
    """One decode step (forward, sampling, read-back) under torch.cuda.set_sync_debug_mode("error")."""
    if DEVICE != "cuda":
        return "n/a (CPU)"
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
        return "none"
    except RuntimeError as e:
        return f"FOUND: {str(e).splitlines()[0][:80]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def decode_rate(engine, context: int, tokens: int, warmup: int) -> tuple[float, str]:
    """Timed batch-1 decode steps of the engine (each ends with its token read back): (tokens/s, host syncs)."""
    prefill(engine, context, warmup + tokens + 2)
    for _ in range(warmup):
        engine.step()
    syncs = host_syncs_in_a_step(engine)
    synchronize()
    start = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    synchronize()
    return tokens / (time.perf_counter() - start), syncs


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device copy, read + write counted (as benchmarks/gpu_kernels.py measures it)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    millis = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (millis * 1e-3)


def measure(cfg: dict, context: int, tokens: int, warmup: int, bandwidth: float) -> list[Result]:
    weights = random_weights(cfg)
    read = bytes_read_per_token(cfg, context + warmup + 1 + tokens // 2)  # the mean context of the timed steps
    roofline = bandwidth / read
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "qwen3-30b-a3b-random", cfg)
        for mode, graphs in (("eager", False), ("cuda graphs", True)):
            engine = build_engine(model_dir, weights, context, warmup + tokens + 2, graphs)
            rate, syncs = decode_rate(engine, context, tokens, warmup)
            runner = engine.executor
            note = f"host syncs in a decode step: {syncs}"
            if graphs:
                note += f"; {runner.graph_steps} graph steps, {runner.eager_steps} eager; {rate / results[0].tokens_per_s:.1f}x eager"
            results.append(Result(mode, rate, read, roofline, note))
            print(f"  {mode}: {rate:.1f} tok/s ({note})", flush=True)
            del engine, runner  # its KV pool and graphs; the weights stay for the next engine
            gc.collect()
    return results


def table(results: list[Result], title: str, bandwidth: float) -> str:
    lines = [title, f"{'decode (batch 1)':<26} {'tok/s':>8} {'ms/tok':>8} {'GB/s':>8} {'of roofline':>12}  note",
             "-" * 100]
    for r in results:
        lines.append(f"{r.mode:<26} {r.tokens_per_s:8.1f} {1e3 / r.tokens_per_s:8.2f} {r.gbytes_per_s:8.0f} "
                     f"{100 * r.tokens_per_s / r.roofline_tokens_per_s:11.0f}%  {r.note}")
    if results:
        r = results[0]
        lines.append(f"{'roofline':<26} {r.roofline_tokens_per_s:8.1f} {1e3 / r.roofline_tokens_per_s:8.2f} "
                     f"{bandwidth / 1e9:8.0f} {100:11.0f}%  {r.bytes_per_token / 1e9:.2f} GB read per token / "
                     "measured copy bandwidth")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_device()
    cfg = dict(QWEN3_30B_A3B)
    kv_bytes = 2 * 2 * cfg["num_hidden_layers"] * (args.context + args.warmup + args.tokens + 64) * \
        cfg["num_key_value_heads"] * cfg["head_dim"] * DTYPE.itemsize
    layers = layers_that_fit(cfg, args.layers, torch.cuda.mem_get_info()[0], kv_bytes)
    if layers < args.layers:
        shape_note = f"{layers} of 48 layers: only these fit in free device memory"
    elif layers < QWEN3_30B_A3B["num_hidden_layers"]:
        shape_note = f"{layers} of 48 layers (--layers)"
    else:
        shape_note = f"{layers} layers"
    cfg["num_hidden_layers"] = layers
    name = torch.cuda.get_device_name()
    print(f"{name}: Qwen3-30B-A3B shape, {shape_note}, bf16 random weights, context {args.context}", flush=True)
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    results = measure(cfg, args.context, args.tokens, args.warmup, bandwidth)
    summary = table(results, f"== batch-1 decode on {name}: Qwen3-30B-A3B shape ({shape_note}, bf16, random "
                             f"weights), context {args.context} ==", bandwidth)
    print("\n" + summary)
    if args.summary_file:
        with open(args.summary_file, "w") as f:
            f.write(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
