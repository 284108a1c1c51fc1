"""Gated full attention: the full-attention layers of the hybrid families (Qwen3-Next, Qwen3.5).

Full causal attention over the paged KV pool like `tsterm.model.decoder.Attention`, with three differences: q_proj
also yields a per-head gate, and the attention output is multiplied by sigmoid(gate) before o_proj; RoPE rotates only
the leading `rotary_dim` dims of each head (the decoder's rotation tables are built for that width); q and k are
normed per head (the zero-centred norm weights already hold their + 1 from the loader).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tsterm_kernels.torch_ops import linear

from tsterm.config import ModelConfig
from tsterm.model.parallel import ParallelContext
from tsterm.model.rope import rotate

if TYPE_CHECKING:
    from tsterm.model.decoder import StepContext
    from tsterm_kernels.dispatch import KernelOps


class GatedAttention:
    """Weights (`tsterm.model.hybrid_loader`): `qkvg` [(2 Hq + 2 Hkv) D, H] (rows: q, k, v, gate), `o_proj`
    [H, Hq D], `q_norm`, `k_norm` [D]; Hq, Hkv: this rank's heads."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext, ops: KernelOps, par: ParallelContext):
        """par: the rank this layer is a shard of; it computes that rank's query heads (and KV heads)."""
        self.ctx, self.ops, self.par = ctx, ops, par
        self.num_heads, self.num_kv_heads = par.layout.q_heads(cfg)[1], par.layout.kv_heads(cfg)[1]
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkvg, self.o_proj = w[prefix + "qkvg"], w[prefix + "o_proj"]
        # [Hq + Hkv, D] float32: per-head q/k norm weights, for q and k in one op
        self.qk_head_weight = torch.cat((w[prefix + "q_norm"].float().expand(self.num_heads, -1),
                                         w[prefix + "k_norm"].float().expand(self.num_kv_heads, -1)))
        self.eps, self.scale = cfg.rms_norm_eps, self.head_dim ** -0.5
        self.k_cache, self.v_cache = cache  # [num_blocks, block_size, Hkv, D] views of the pool

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: the step's rotation tables for `rotary_dim`; x: [T, H] normed hidden states."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkvg = linear(x, self.qkvg)  # [T, (2 Hq + 2 Hkv) D]
        qk_end = self.q_size + self.kv_size
        qk = F.rms_norm(qkvg[:, :qk_end].float().view(T, Hq + Hkv, D), (D,), eps=self.eps)
        qk.mul_(self.qk_head_weight)  # [T, Hq + Hkv, D] float32
        qk[..., :self.rotary_dim] = rotate(qk[..., :self.rotary_dim], rope)  # the rest of each head passes through
        qk = qk.to(x.dtype)
        q, k = qk[:, :Hq], qk[:, Hq:]  # views
        v = qkvg[:, qk_end:qk_end + self.kv_size].view(T, Hkv, D)  # [T, Hkv, D] view
        gate = qkvg[:, qk_end + self.kv_size:]  # [T, Hq D] view
        meta = self.ctx.meta
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)  # the only KV write, in place
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)  # [T, Hq, D]
        o = o.reshape(T, self.q_size) * torch.sigmoid(gate)  # [T, Hq D]
        out = linear(o, self.o_proj)  # [T, H]: this rank's heads' part
        self.par.all_reduce_tp(out)
        return out
