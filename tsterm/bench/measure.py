"""Micro-measurements for the bench: memory bandwidth, bytes read per decoded token, decode rates, copy audit."""
from __future__ import annotations

import time

import torch

from tsterm.config import ModelConfig, SamplingParams
from tsterm.engine.engine import Engine
from tsterm.model.arch import ARCHITECTURES, FULL_ATTENTION, LINEAR_ATTENTION


def _best_time(device: torch.device, work, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `work()`, each fenced by device syncs on CUDA."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large device copy (read + write counted), best of `repeats`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(device, lambda: dst.copy_(src), repeats)


def read_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large device reduction (a pure read stream, like decode's weights), best of `repeats`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / _best_time(device, src.sum, repeats)


def _mixers(cfg: ModelConfig) -> tuple[str, ...]:
    return cfg.layer_types or (FULL_ATTENTION,) * cfg.num_hidden_layers


def sequence_bytes(cfg: ModelConfig, dtype_bytes: int, context: int) -> int:
    """Bytes of one sequence's own cache a decode step reads: the KV of its context in the full-attention layers
    and, in a hybrid's Gated DeltaNet layers, its recurrent state (float32) and conv state (whatever the context)."""
    mixers = _mixers(cfg)
    kv = context * 2 * mixers.count(FULL_ATTENTION) * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    conv_channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    state = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
             + conv_channels * max(cfg.linear_conv_kernel_dim - 1, 0) * dtype_bytes)
    return kv + mixers.count(LINEAR_ATTENTION) * state


def bytes_read_per_token(cfg: ModelConfig, dtype_bytes: int, context: int) -> int:
    """Bytes a batch-1 decode step must read: the active weights (top-k experts only) plus the sequence's cache
    (`sequence_bytes`). Gated attention's q_proj also yields the output gate; a Gated DeltaNet layer reads its
    q/k/v/z/b/a projections, conv weights and out_proj."""
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    gate = 2 if ARCHITECTURES[cfg.model_type].attention_output_gate else 1
    attention = H * (gate * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D + cfg.num_attention_heads * D * H
    conv_channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    value_width = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    linear = H * (conv_channels + value_width + 2 * cfg.linear_num_value_heads) + value_width * H \
        + conv_channels * cfg.linear_conv_kernel_dim
    total = 0
    for layer, mixer in enumerate(_mixers(cfg)):
        total += (linear if mixer == LINEAR_ATTENTION else attention) + 2 * H
        if cfg.is_moe_layer(layer):
            total += cfg.num_experts * H + cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                total += 3 * H * cfg.shared_expert_intermediate_size + H
        else:
            total += 3 * H * cfg.intermediate_size
    total += V * H + H + H  # lm_head, the embedding row, final norm
    return total * dtype_bytes + sequence_bytes(cfg, dtype_bytes, context)


def model_weight_bytes(model) -> int:
    """Bytes of a loaded `DecoderModel`'s weights as stored (quantized blocks count their codes and scales)."""
    from tsterm.model.quant import weight_bytes
    weights = {"embed": model.embed, "lm_head": model.lm_head, "final_norm": model.final_norm}
    for i, (input_norm, mixer, post_norm, mlp) in enumerate(model.layers):
        for name, value in (*vars(mixer).items(), *vars(mlp).items()):
            if name not in ("ctx", "ops", "par", "k_cache", "v_cache", "expert_load") and value is not None and \
                    hasattr(value, "dim"):
                weights[f"{i}.{type(mixer).__name__}.{name}"] = value
        weights[f"{i}.norms"], weights[f"{i}.post"] = input_norm, post_norm
    return weight_bytes(weights)


def stored_decode_bytes(model, cfg: ModelConfig, dtype_bytes: int, context: int) -> tuple[int, int]:
    """(`bytes_read_per_token`, the bytes of one routed expert of a layer) from a loaded `DecoderModel`'s weights as
    stored (quantized blocks count their codes and scales): every weight but the embedding table (one row of it)
    and each layer's idle experts (top-k of its E are read), plus the sequence's cache."""
    from tsterm.model.quant import weight_bytes
    embed = model.embed
    total = model_weight_bytes(model) - embed.numel() * embed.element_size() * (model.lm_head is not embed) \
        + cfg.hidden_size * embed.element_size()
    expert = 0
    for *_, mlp in model.layers:
        if mlp.router is not None:
            stack = weight_bytes({"w13": mlp.w13, "w2": mlp.w2})
            expert = stack // mlp.w13.shape[0]
            total -= stack - mlp.top_k * expert
    return total + sequence_bytes(cfg, dtype_bytes, context), expert


def parallel_ceiling(cfg: ModelConfig, dtype_bytes: int, context: int, batch: int,
                     stored: tuple[int, int] | None = None) -> float:
    """Memory-bound ceiling of batch-`batch` decode over batch-1 decode, in aggregate tokens/s.

    A batch step reads the dense weights once, every sequence's own cache (KV, recurrent state), and each expert
    that at least one of its tokens routes to: with top-k of E experts chosen uniformly, E * (1 - (1 - k/E)^batch)
    of them per layer, against k at batch 1. The ceiling is batch x (batch-1 bytes) / (batch-step bytes).
    stored: `stored_decode_bytes` of the loaded model (its weights as stored); default: from the config at
    `dtype_bytes` a weight.
    """
    one, expert = stored or (bytes_read_per_token(cfg, dtype_bytes, context),
                             3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes)
    own = sequence_bytes(cfg, dtype_bytes, context)
    if not cfg.num_experts:
        return batch * one / (one + (batch - 1) * own)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
    touched = E * (1 - (1 - k / E) ** batch)
    step = one + moe_layers * (touched - k) * expert + (batch - 1) * own
    return batch * one / step


def batch_ceiling(memory_ceiling: float, batch: int, roofline_fraction: float) -> float:
    """The most a batch-`batch` decode can gain over the measured batch-1 decode, in aggregate tokens/s.

    A batch step takes at least as long as a batch-1 step (it does all of that work and more), and at least its
    bytes over the bandwidth BW, taken as the larger of the measured one and what batch 1 itself read (a roofline
    fraction above 1 means the measurement fell short). With t1 the batch-1 step and f its roofline fraction:
    speedup = batch t1 / t_batch <= min(batch, batch t1 BW / batch-step bytes) = min(batch, memory_ceiling / min(f, 1)). A batch-1 decode at its roofline leaves the memory-bound ratio
    (`parallel_ceiling`); a tiny model bound by its per-step overhead (f << 1) leaves up to `batch` x."""
    return min(float(batch), memory_ceiling / min(max(roofline_fraction, 1e-9), 1.0))


def _prefilled(engine: Engine, batch: int, context: int, max_tokens: int, salt: int) -> list[str]:
    """Adds `batch` requests of `context` distinct tokens each and steps until all have finished prefill."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request([(17 + salt * 7919 + b * 104729 + i * 31) % (vocab - 16) + 16 for i in range(context)],
                              params) for b in range(batch)]
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    return ids


def decode_rate(engine: Engine, batch: int, context: int, steps: int = 16, salt: int = 0) -> float:
    """Aggregate decode tokens/s of `batch` concurrent requests at `context` tokens (prefill excluded): the tokens
    the steps produced, counted (a request that was not running would not add its share)."""
    ids = _prefilled(engine, batch, context, steps + 2, salt)
    engine.step()  # warm-up decode
    produced = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        produced += sum(len(out.outputs[0].delta_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    return produced / elapsed


def copy_bytes_per_token(engine: Engine, context: int, steps: int = 8, salt: int = 0) -> dict:
    """Copy-audit summary of `steps` batch-1 decode steps at `context` tokens."""
    ids = _prefilled(engine, 1, context, steps + 1, salt)
    previous = engine.audit
    audit = engine.enable_copy_audit()
    for _ in range(steps):
        engine.step()
    engine.audit = previous
    for rid in ids:
        engine.abort(rid)
    return audit.summary()
