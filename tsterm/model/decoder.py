"""The one decoder every supported architecture runs through: embed -> [attention over paged KV | MoE] x L -> norm.

Per-step attention metadata (and, for a padded step, which rows count in the expert load) is set once per step
with `forward_context(meta, pair_weights)`, and the step's RoPE rows are looked up once in `forward`, so an
attention layer takes only `(rope, hidden)`. Weights are the packed tensors from `tsterm.model.loader`; nothing
here copies one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tsterm.config import ModelConfig
from tsterm.model.arch import ARCHITECTURES
from tsterm.model.rope import RotaryEmbedding, rotate
from tsterm_kernels.dispatch import ops
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.reference import expert_mlp, linear

_current_meta: AttentionMetadata | None = None
_current_pair_weights: torch.Tensor | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata, pair_weights: torch.Tensor | None = None) -> Iterator[None]:
    """`pair_weights` [T * top_k]: what each (token, expert) pair adds to the expert load (a padded CUDA-graph
    step passes 1 for its real rows, 0 for the padding); None counts every pair once."""
    global _current_meta, _current_pair_weights
    _current_meta, _current_pair_weights = meta, pair_weights
    try:
        yield
    finally:
        _current_meta, _current_pair_weights = None, None


class Attention:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, k_cache: torch.Tensor,
                 v_cache: torch.Tensor):
        spec = ARCHITECTURES[cfg.model_type]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv, self.qkv_bias = w[prefix + "qkv"], w.get(prefix + "qkv_bias")
        self.o_proj, self.o_bias = w[prefix + "o_proj"], w.get(prefix + "o_bias")
        self.qk_norm = spec.qk_norm
        self.q_norm, self.k_norm = w.get(prefix + "q_norm"), w.get(prefix + "k_norm")
        self.eps, self.clip = cfg.rms_norm_eps, cfg.clip_qkv
        self.scale = self.head_dim ** -0.5
        self.qk_head_weight = None  # [Hq + Hkv, D] float32: per-head q/k norm weights, for q and k in one op
        if self.qk_norm == "head":
            self.qk_head_weight = torch.cat((self.q_norm.float().expand(self.num_heads, -1),
                                             self.k_norm.float().expand(self.num_kv_heads, -1)))
        self.k_cache, self.v_cache = k_cache, v_cache  # [num_blocks, block_size, Hkv, D] views of the pool

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: the step's rotation tables (`RotaryEmbedding.tables`); x: [T, H] normed hidden states."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv, self.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qk = qkv[:, :self.q_size + self.kv_size]  # [T, (Hq + Hkv) D] view: q and k are normed and rotated together
        v = qkv[:, self.q_size + self.kv_size:].view(T, Hkv, D)  # [T, Hkv, D] view
        if self.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            qk = torch.cat((ops.rms_norm(qk[:, :self.q_size], self.q_norm, self.eps)[0],
                            ops.rms_norm(qk[:, self.q_size:], self.k_norm, self.eps)[0]), dim=-1)
        qk = qk.float().view(T, Hq + Hkv, D)  # float32 arithmetic (a no-op for a float32 model)
        if self.qk_norm == "head":  # Qwen3: per head, over head_dim
            qk = F.rms_norm(qk, (D,), eps=self.eps).mul_(self.qk_head_weight)
        qk = rotate(qk, rope).to(x.dtype)  # [T, Hq + Hkv, D]
        q, k = qk[:, :Hq], qk[:, Hq:]  # views
        meta = _current_meta
        ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)  # the only KV write: new tokens, in place
        o = ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)  # [T, Hq, D]
        return linear(o.reshape(T, self.q_size), self.o_proj, self.o_bias)  # [T, H]


class SparseMoE:
    """Routed experts (+ optional gated shared expert). A dense MLP is one expert with no router, run directly."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        self.w13, self.w2 = w[prefix + "w13"], w[prefix + "w2"]  # [E, 2I, H], [E, H, I]
        self.router = w.get(prefix + "router")  # [E, H] or None (dense)
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.shared_w13, self.shared_w2 = w.get(prefix + "shared_w13"), w.get(prefix + "shared_w2")
        self.shared_gate = w.get(prefix + "shared_gate")  # [1, H]
        self.expert_load: torch.Tensor | None = None  # [E] tokens routed per expert, accumulated on the device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.router is None:  # dense: the one expert's output is the result (no zeroed buffer, no routing)
            return expert_mlp(x, self.w13[0], self.w2[0])  # [T, H]
        out = torch.zeros_like(x)  # [T, H]: every expert's weighted output is accumulated into it in place
        logits = linear(x, self.router)  # [T, E]
        weights, expert_ids = ops.moe_route(logits, self.top_k, self.renormalize)  # [T, k], [T, k]
        if self.expert_load is not None:
            pairs = expert_ids.reshape(-1)  # [T*k]
            counts = _current_pair_weights
            counts = torch.ones_like(pairs, dtype=self.expert_load.dtype) if counts is None else counts
            assert counts.numel() == pairs.numel(), "pair weights for another top-k"
            self.expert_load.index_add_(0, pairs, counts.to(self.expert_load.dtype))
        ops.fused_moe(x, self.w13, self.w2, weights, expert_ids, out)
        if self.shared_w13 is not None:
            # The shared expert is one more always-on expert, weighted by its sigmoid gate, accumulated into `out`
            # like the routed ones (no second [T, H] buffer).
            gate = torch.sigmoid(linear(x, self.shared_gate))  # [T, 1]
            ops.fused_moe(x, self.shared_w13, self.shared_w2, gate.float(), torch.zeros_like(expert_ids[:, :1]), out)
        return out


class DecoderModel:
    """Token ids -> final hidden states over a flattened batch; `logits` maps chosen rows to the vocabulary."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], kv_cache: torch.Tensor,
                 max_positions: int):
        """kv_cache: [L, 2, num_blocks, block_size, Hkv, D], the whole paged pool."""
        self.cfg = cfg
        device = weights["embed"].device
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, cfg.max_position_embeddings, device)
        self.embed, self.final_norm, self.lm_head = weights["embed"], weights["final_norm"], weights["lm_head"]
        self.eps = cfg.rms_norm_eps
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            self.layers.append((weights[p + "input_norm"], Attention(cfg, weights, p, kv_cache[i, 0], kv_cache[i, 1]),
                                weights[p + "post_attn_norm"], SparseMoE(cfg, weights, p)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)  # [T, H]
        rope = self.rotary.tables(positions)  # looked up once per step, shared by every layer
        residual = None
        for input_norm, attn, post_norm, mlp in self.layers:
            if residual is None:
                residual = hidden
                x, _ = ops.rms_norm(hidden, input_norm, self.eps)
            else:
                x, residual = ops.rms_norm(hidden, input_norm, self.eps, residual)
            hidden = attn(rope, x)
            x, residual = ops.rms_norm(hidden, post_norm, self.eps, residual)
            hidden = mlp(x)
        hidden, _ = ops.rms_norm(hidden, self.final_norm, self.eps, residual)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()  # [S, V]
