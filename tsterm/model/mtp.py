"""The multi-token-prediction (MTP) head that Qwen3-Next and Qwen3.5 checkpoints ship (`mtp.*`), run as a draft model.

What it computes (as vLLM's `Qwen3NextMultiTokenPredictor` and DeepSeek-V3's MTP module do): for a token `x` and the
target model's final hidden state `h` (after its final norm) at the position before it,

    u = fc([norm_e(embed(x)), norm_h(h)])        # [2H] -> [H]; embed is the target's shared embedding
    g = final_norm(layer(u))                      # one full decoder layer: attention + MoE (or a dense MLP)
    logits = lm_head(g)                           # the target's shared LM head: the token after `x`

The layer's attention runs over the head's own KV, one entry per position. tsterm stores the entry of token `t` at
position `t` (built from token t and the target's hidden state at t - 1), so an entry depends only on the tokens up
to its position: a block of it is content-addressable like the target's KV, and the head's KV lives in the paged pool
under the sequence's own block table (prefix reuse and forks hold for it unchanged). Position 0 has no hidden state
before it: its entry is built from a zero hidden state (vLLM numbers its entries one position earlier and has none at
0; the attention is over the same tokens, one extra entry at the start). Chained drafts (K > 1) feed the head its own
output `g` as the hidden state of the next position, with the token it drafted.

The head's weights are loaded apart from the target's (the target's loaders skip `mtp.*`): `load_mtp_weights` reads
the same safetensors files, into the decoder's canonical names under `mtp.layers.0.`, so the layer is built from the
decoder's own classes (`Attention` / `GatedAttention`, `SparseMoE`). Norms of the hybrid families are zero-centred
like the rest of their model. One MTP layer is supported (every released Qwen3-Next / Qwen3.5 checkpoint has one).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from tsterm_kernels.torch_ops import linear

from tsterm.config import ModelConfig
from tsterm.errors import ConfigError, ModelLoadError
from tsterm.model.arch import ARCHITECTURES, FULL_ATTENTION
from tsterm.model.cache import PagedKVPool
from tsterm.model.decoder import GATED_MIXERS, MIXERS, DecoderModel, SparseMoE
from tsterm.model.hybrid_loader import _load_gated_attention, _norm
from tsterm.model.loader import (
    MTP_PREFIX,
    WeightSource,
    _load_attention,
    _load_dense_mlp,
    _load_moe,
    find_weight_files,
)
from tsterm.model.parallel import ParallelLayout

LAYER = "mtp.layers.0."  # the head's decoder layer, in the checkpoint and in the canonical weights alike
CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3-Next / Qwen3.5; DeepSeek


def mtp_num_layers(model_dir: str | Path) -> int:
    """The MTP layers config.json declares (`mtp_num_hidden_layers`, or `num_nextn_predict_layers`; a multimodal
    release's in its `text_config`); 0 when it declares none."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None
    for section in (raw, raw.get("text_config") or {}):
        for key in CONFIG_KEYS:
            value = section.get(key)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ModelLoadError(f"{path}: {key} must be a non-negative integer, got {value!r}")
                return value
    return 0


def load_mtp_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """The head's weights by canonical name: `mtp.fc` [H, 2H], `mtp.norm_embedding`, `mtp.norm_hidden`,
    `mtp.final_norm` [H], and the layer's under `mtp.layers.0.` as the decoder names a layer's. A ConfigError when
    the checkpoint has no head (speculative_method mtp needs one)."""
    model_dir = Path(model_dir)
    spec = ARCHITECTURES[cfg.model_type]
    declared = mtp_num_layers(model_dir)
    src = WeightSource(find_weight_files(model_dir), dtype, device, None, cfg.fp8_block_size)
    names = [name for name in src.unused if name.startswith(MTP_PREFIX)]
    if not names:
        raise ConfigError(f"speculative_method mtp: {model_dir} has no MTP head (no `mtp.*` tensors in its "
                          "safetensors files); use another speculative_method (suffix, ngram) or a checkpoint that "
                          "ships one", param="speculative_method")
    if declared != 1:
        raise ConfigError(f"speculative_method mtp: {model_dir}/config.json declares {declared} MTP layers "
                          f"({' / '.join(CONFIG_KEYS)}); tsterm runs heads of exactly 1", param="speculative_method")
    for name in sorted(src.unused):  # the target's own tensors: its loader reads them
        if not name.startswith(MTP_PREFIX):
            src.skip(name)
    H = cfg.hidden_size
    layout = ParallelLayout()  # one rank (the engine refuses MTP on a multi-rank executor)
    w: dict[str, torch.Tensor] = {
        "mtp.norm_embedding": _norm(src, spec, "mtp.pre_fc_norm_embedding.weight", H),
        "mtp.norm_hidden": _norm(src, spec, "mtp.pre_fc_norm_hidden.weight", H),
        "mtp.fc": src.get("mtp.fc.weight", (H, 2 * H)),
        "mtp.final_norm": _norm(src, spec, "mtp.norm.weight", H),
        LAYER + "input_norm": _norm(src, spec, LAYER + "input_layernorm.weight", H),
        LAYER + "post_attn_norm": _norm(src, spec, LAYER + "post_attention_layernorm.weight", H),
    }
    if spec.attention_output_gate:
        _load_gated_attention(src, cfg, spec, LAYER + "self_attn.", LAYER, w, layout)
    else:
        _load_attention(src, cfg, spec, LAYER + "self_attn.", LAYER, w, layout, dtype)
    moe = LAYER + spec.moe_prefix + "."
    if src.has(moe + "gate.weight"):
        _load_moe(src, cfg, spec, moe, LAYER, w, layout)
    else:
        _load_dense_mlp(src, cfg.intermediate_size, H, LAYER + "mlp.", LAYER, w)
    src.check_all_used()
    return w


class MtpHead:
    """The head over a target `DecoderModel`: it shares the model's embedding, LM head, rotary tables, kernels and
    step context (a forward runs inside `model.step_context(meta)`, the metadata of the head's own rows).

    `kv_pool`: the head's attention KV, a one-layer `PagedKVPool` with the target's block ids (its first
    `num_blocks` blocks mirror the engine's pool; any after those are scratch for drafted positions past a
    sequence's blocks)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], model: DecoderModel,
                 kv_pool: PagedKVPool):
        spec = ARCHITECTURES[cfg.model_type]
        self.model, self.kv_pool = model, kv_pool
        self.norm_embedding, self.norm_hidden = weights["mtp.norm_embedding"], weights["mtp.norm_hidden"]
        self.fc, self.final_norm = weights["mtp.fc"], weights["mtp.final_norm"]
        self.input_norm, self.post_attn_norm = weights[LAYER + "input_norm"], weights[LAYER + "post_attn_norm"]
        mixer = (GATED_MIXERS if spec.attention_output_gate else MIXERS)[FULL_ATTENTION]
        self.attention = mixer(cfg, weights, LAYER, kv_pool.layer(kv_pool.layers[0]), model.ctx, model.ops,
                               model.par)
        self.mlp = SparseMoE(cfg, weights, LAYER, model.ctx, model.ops, model.par)
        # the kernels' one-call form of the layer, built as the target's is (`DecoderModel._decode_stack`, over this
        # one layer), where the target has one: rows of one token each (the executor's drafter feeds it so) run in it
        self.stack = None
        if model.stack is not None:
            self.stack = DecoderModel._decode_stack(SimpleNamespace(
                par=model.par, rotary=model.rotary, cfg=model.cfg, ops=model.ops, eps=model.eps,
                layers=[(self.input_norm, self.attention, self.post_attn_norm, self.mlp)]))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T], hidden [T, H]: each row's token and the target's (or, chained, the head's)
        hidden state at the position before it. Writes the rows' KV at the step's slots; returns the head's final
        hidden states [T, H] (`model.logits` maps them to the vocabulary)."""
        model = self.model
        ops, eps = model.ops, model.eps
        embedded, _ = ops.rms_norm(model.embed_tokens(input_ids), self.norm_embedding, eps)
        previous, _ = ops.rms_norm(hidden.to(embedded.dtype), self.norm_hidden, eps)
        x = linear(torch.cat((embedded, previous), dim=-1), self.fc)  # [T, H]
        rope = model.rotary.tables(positions)
        stacked = self.stack(x, rope, model.ctx.meta) if self.stack is not None else None
        if stacked is not None:  # one-token rows: the layer in one kernel call
            h, residual = stacked
            return ops.rms_norm(h, self.final_norm, eps, residual)[0]
        residual = x
        h, _ = ops.rms_norm(x, self.input_norm, eps)
        h = self.attention(rope, h)
        h, residual = ops.rms_norm(h, self.post_attn_norm, eps, residual)
        h = self.mlp(h)
        out, _ = ops.rms_norm(h, self.final_norm, eps, residual)
        return out
