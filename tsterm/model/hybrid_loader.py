"""Loads a hybrid checkpoint (Qwen3-Next, Qwen3.5-MoE) into the decoder's weights: Gated DeltaNet layers
(`tsterm.model.linear_attention`), gated full-attention layers (`tsterm.model.gated_attention`), routed experts with
a gated shared expert (`tsterm.model.decoder.SparseMoE`).

What is materialised once, at load: the fused projections (`in_proj`: q, k, v, z, b, a rows; `qkvg`: q, k, v, gate
rows), the + 1 of the zero-centred RMSNorm weights, -exp(A_log), and the stacked experts (`tsterm.model.loader`).
Qwen3-Next stores its linear-attention projections grouped per key head (`in_proj_qkvz`, `in_proj_ba`); they are
regrouped here into Qwen3.5's flat order, so one layer class runs both. Tensors under the spec's `skipped_weights`
(the MTP head, a multimodal release's vision tower) are accounted for and never read.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tsterm.config import ModelConfig
from tsterm.errors import ModelLoadError
from tsterm.model.arch import ARCHITECTURES, LINEAR_ATTENTION, ArchSpec
from tsterm.model.loader import ProgressFn, WeightSource, _load_dense_mlp, _load_moe, find_weight_files
from tsterm.model.parallel import ParallelLayout
from tsterm.model.quant import QuantizeOnLoad


def load_hybrid_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                        progress: ProgressFn | None = None, layout: ParallelLayout = ParallelLayout(),
                        quantization: str = "none") -> dict[str, torch.Tensor]:
    """The decoder's weights by canonical name, as `tsterm.model.loader.load_weights` returns them: `layout.rank`'s
    shard (the experts split as for every family; the heads of both mixers, the embedding and the LM head over the
    tensor-parallel ranks, as `tsterm.model.parallel` describes). quantization: as for `load_weights`, each linear
    weight quantized as it is stored (`QuantizeOnLoad`): the float model is never whole on the device."""
    spec = ARCHITECTURES[cfg.model_type]
    if cfg.attention_bias:
        raise ModelLoadError(f"{cfg.source}: attention_bias is not supported for {cfg.model_type}")
    src = WeightSource(find_weight_files(Path(model_dir)), dtype, device, progress, cfg.fp8_block_size)
    if spec.skipped_weights:
        for name in sorted(src.unused):
            if name.startswith(spec.skipped_weights):
                src.skip(name)
    P, H = spec.weight_prefix, cfg.hidden_size
    vocab_first, vocab_count, _ = layout.vocab(cfg.vocab_size)
    w = QuantizeOnLoad(quantization, device, dtype)
    w["embed"] = src.get(P + "embed_tokens.weight", (cfg.vocab_size, H), rows=(vocab_first, vocab_count))
    w["final_norm"] = _norm(src, spec, P + "norm.weight", H)
    if cfg.tie_word_embeddings:
        if src.has("lm_head.weight"):
            src.skip("lm_head.weight")
        w["lm_head"] = w["embed"]
    else:
        w["lm_head"] = src.get("lm_head.weight", (cfg.vocab_size, H), rows=(vocab_first, vocab_count))
    for i, layer_type in enumerate(spec.layer_types(cfg)):
        p, o = f"{P}layers.{i}.", f"layers.{i}."
        w[o + "input_norm"] = _norm(src, spec, p + "input_layernorm.weight", H)
        w[o + "post_attn_norm"] = _norm(src, spec, p + "post_attention_layernorm.weight", H)
        if layer_type.mixer == LINEAR_ATTENTION:
            _load_gated_deltanet(src, cfg, p + "linear_attn.", o, w, layout)
        else:
            _load_gated_attention(src, cfg, spec, p + "self_attn.", o, w, layout)
        if layer_type.mlp == "moe":
            _load_moe(src, cfg, spec, p + spec.moe_prefix + ".", o, w, layout)
        else:
            _load_dense_mlp(src, cfg.intermediate_size, H, p + "mlp.", o, w, (layout.tp_rank, layout.tp_size))
    src.check_all_used()
    return w.finish()


def _norm(src: WeightSource, spec: ArchSpec, name: str, size: int) -> torch.Tensor:
    """An RMSNorm weight as the plain scale the decoder multiplies by (zero-centred ones get their offset back)."""
    weight = src.get(name, (size,), convert=False)
    return src.to_target(weight.float() + spec.norm_offset) if spec.norm_offset else src.to_target(weight)


def _load_gated_attention(src: WeightSource, cfg: ModelConfig, spec: ArchSpec, p: str, o: str,
                          w: dict[str, torch.Tensor], layout: ParallelLayout) -> None:
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    (q0, nq), (kv0, nkv) = layout.q_heads(cfg), layout.kv_heads(cfg)
    # per query head: D query rows, then D gate rows; this rank's heads
    q_gate = src.get(p + "q_proj.weight", (Hq * 2 * D, H), rows=(q0 * 2 * D, nq * 2 * D)).view(nq, 2 * D, H)
    kv_rows = (kv0 * D, nkv * D)
    w[o + "qkvg"] = torch.cat([q_gate[:, :D].reshape(nq * D, H), src.get(p + "k_proj.weight", (Hkv * D, H), rows=kv_rows),
                               src.get(p + "v_proj.weight", (Hkv * D, H), rows=kv_rows), q_gate[:, D:].reshape(nq * D, H)])
    w[o + "o_proj"] = src.get(p + "o_proj.weight", (H, Hq * D), cols=(q0 * D, nq * D))
    w[o + "q_norm"] = _norm(src, spec, p + "q_norm.weight", D)
    w[o + "k_norm"] = _norm(src, spec, p + "k_norm.weight", D)


def _load_gated_deltanet(src: WeightSource, cfg: ModelConfig, p: str, o: str, w: dict[str, torch.Tensor],
                         layout: ParallelLayout) -> None:
    """`in_proj` [q | k | v | z | b | a] rows and `conv` [q | k | v] channels of this rank's key heads and the value
    heads that read them; its columns of `out_proj`."""
    H, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    key_size, value_size = Hk * dk, Hv * dv
    conv_size = 2 * key_size + value_size
    k0, nk, v0, nv = layout.linear_heads(cfg)
    if src.has(p + "in_proj_qkvz.weight"):  # Qwen3-Next: per key head, [q dk | k dk | v r dv | z r dv] and [b r | a r]
        r = Hv // Hk  # value heads per key head: this rank's key heads carry exactly its value heads
        per_head = 2 * dk + 2 * r * dv
        qkvz = src.get(p + "in_proj_qkvz.weight", (2 * key_size + 2 * value_size, H),
                       rows=(k0 * per_head, nk * per_head)).view(nk, per_head, H)
        ba = src.get(p + "in_proj_ba.weight", (2 * Hv, H), rows=(k0 * 2 * r, nk * 2 * r)).view(nk, 2 * r, H)
        v_end = 2 * dk + r * dv
        rows = [qkvz[:, :dk], qkvz[:, dk:2 * dk], qkvz[:, 2 * dk:v_end], qkvz[:, v_end:], ba[:, :r], ba[:, r:]]
        w[o + "in_proj"] = torch.cat([part.reshape(-1, H) for part in rows])
    else:  # Qwen3.5: flat [q all heads | k | v], z, b, a
        qkv = src.get(p + "in_proj_qkv.weight", (conv_size, H))
        w[o + "in_proj"] = torch.cat([qkv[k0 * dk:(k0 + nk) * dk], qkv[key_size + k0 * dk:key_size + (k0 + nk) * dk],
                                      qkv[2 * key_size + v0 * dv:2 * key_size + (v0 + nv) * dv],
                                      src.get(p + "in_proj_z.weight", (value_size, H), rows=(v0 * dv, nv * dv)),
                                      src.get(p + "in_proj_b.weight", (Hv, H), rows=(v0, nv)),
                                      src.get(p + "in_proj_a.weight", (Hv, H), rows=(v0, nv))])  # [C + Vd + 2 Hv, H]
    conv = src.get(p + "conv1d.weight", (conv_size, 1, K)).reshape(conv_size, K)
    w[o + "conv"] = torch.cat([conv[k0 * dk:(k0 + nk) * dk], conv[key_size + k0 * dk:key_size + (k0 + nk) * dk],
                               conv[2 * key_size + v0 * dv:2 * key_size + (v0 + nv) * dv]])
    a_log = src.get(p + "A_log", (Hv,), convert=False)[v0:v0 + nv]
    w[o + "neg_A"] = -a_log.float().exp().to(src.device)  # float32: exp of a half-precision A_log can overflow
    w[o + "dt_bias"] = src.get(p + "dt_bias", (Hv,), convert=False)[v0:v0 + nv].float().to(src.device)
    w[o + "gated_norm"] = src.get(p + "norm.weight", (dv,))  # a plain scale (not zero-centred)
    w[o + "out_proj"] = src.get(p + "out_proj.weight", (H, value_size), cols=(v0 * dv, nv * dv))
