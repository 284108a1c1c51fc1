"""The one decoder every supported architecture runs through: embed -> [token mixer | MoE or MLP] x L -> norm.

Each layer's type comes from the architecture spec (`ArchSpec.layer_types`): its token mixer is built from
MIXERS, its feed-forward block is routed experts or one dense MLP. The model owns its kernel ops (`KernelOps`,
chosen by the executor) and its `StepContext`: the step's metadata is set once per step with
`model.step_context(meta, ...)`, and the step's RoPE rows are looked up once in `forward`, so a mixer takes only
`(rope, hidden)`. Nothing here is shared between two models, so two engines in one process never see each
other's step. Weights are the packed tensors from `tsterm.model.loader`; nothing here copies one.

A model is one rank's shard of a parallel layout (`tsterm.model.parallel`): its layers hold that rank's heads,
columns and experts, and join the other ranks only through the model's `ParallelContext` (one all-reduce after
attention, one after the MLP or experts; the embedding reduced, the logits gathered). The default context is a
single rank, for which every collective is a no-op.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tsterm.config import ModelConfig
from tsterm.model.arch import ARCHITECTURES, FULL_ATTENTION, LINEAR_ATTENTION, MLA
from tsterm.model.cache import ModelCache
from tsterm.model.clamped_swiglu import clamped_swiglu_experts
from tsterm.model.gated_attention import GatedAttention
from tsterm.model.huge_pages import move_to_huge_pages
from tsterm.model.linear_attention import GatedDeltaNet
from tsterm.model.mla import MLAttention
from tsterm.model.parallel import ParallelContext, SingleRank
from tsterm.model.rope import RotaryEmbedding, rotate_
from tsterm_kernels import cpu_native
from tsterm_kernels.cpu_stack import StackLayer
from tsterm_kernels.dispatch import KernelOps
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.quant import QuantizedWeight
from tsterm_kernels.routing import Routing, routing_or_default
from tsterm_kernels.torch_ops import expert_mlp, linear, sigmoid


@dataclass(slots=True)
class StepContext:
    """What every layer of one model reads during a step; set by `DecoderModel.step_context`, None between steps.

    pair_weights [T * top_k]: what each (token, expert) pair adds to the expert load (a padded CUDA-graph step
    passes 1 for its real rows, 0 for the padding); None counts every pair once.
    state_slots [S] int32: each sequence's slot in the recurrent-state pools (-1: none), for state-keeping mixers.
    snapshots: per sequence (host ints), (slot, position): where a state-keeping mixer keeps a copy of the state at
    that position, reached during this step (position 0: none); None: no snapshot this step.
    """

    meta: AttentionMetadata | None = None
    pair_weights: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    snapshots: list[tuple[int, int]] | None = None


class Attention:
    """Full causal attention over the paged KV pool; the new tokens' K/V are written into it in place."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext, ops: KernelOps, par: ParallelContext,
                 window: int | None = None, window_pool: bool = False):
        """par: the rank this layer is a shard of; it computes that rank's query heads (and KV heads). window: each
        query sees only the last `window` positions (the layer's `LayerType.window`: gpt-oss's sliding layers).
        window_pool: `cache` is the sliding layers' own pool (`tsterm.model.cache.WINDOW_POOL`), which the step's
        `meta.window` addresses."""
        spec = ARCHITECTURES[cfg.model_type].for_config(cfg)
        self.ctx, self.ops, self.par = ctx, ops, par
        self.num_heads, self.num_kv_heads = par.layout.q_heads(cfg)[1], par.layout.kv_heads(cfg)[1]
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv, self.qkv_bias = w[prefix + "qkv"], w.get(prefix + "qkv_bias")
        # o_proj's bias is added by one rank only: the all-reduce sums it once
        self.o_proj = w[prefix + "o_proj"]
        self.o_bias = w.get(prefix + "o_bias") if par.layout.tp_rank == 0 else None
        self.qk_norm = spec.qk_norm
        self.q_norm, self.k_norm = w.get(prefix + "q_norm"), w.get(prefix + "k_norm")
        self.eps, self.clip = cfg.rms_norm_eps, cfg.clip_qkv
        self.scale = self.head_dim ** -0.5
        self.qk_head_weight = None  # [Hq + Hkv, D] float32: per-head q/k norm weights, for q and k in one op
        if self.qk_norm == "head":
            self.qk_head_weight = torch.cat((self.q_norm.float().expand(self.num_heads, -1),
                                             self.k_norm.float().expand(self.num_kv_heads, -1)))
        self.k_cache, self.v_cache = cache  # [num_blocks, block_size, Hkv, D] views of the pool
        # gpt-oss: each head's sink logit [Hq_local] float32 (None: none) and the layer's window, passed to the ops'
        # attention (the C kernels, the torch twin, the Triton kernel) only where the layer has them
        self.sinks, self.window = w.get(prefix + "sinks"), window
        self.sink_window = {k: v for k, v in (("sinks", self.sinks), ("window", window)) if v is not None}
        self.window_pool = window_pool

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: the step's rotation tables (`RotaryEmbedding.tables`); x: [T, H] normed hidden states."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv, self.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qk = qkv[:, :self.q_size + self.kv_size]  # [T, (Hq + Hkv) D] view: q and k are normed and rotated together
        v = qkv[:, self.q_size + self.kv_size:].view(T, Hkv, D)  # [T, Hkv, D] view
        if self.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            # (contiguous copies: a strided slice of several rows would miss the C kernel, whose arithmetic is the
            # same for any row count, and take F.rms_norm, whose bits differ from it)
            qk = torch.cat((self.ops.rms_norm(qk[:, :self.q_size].contiguous(), self.q_norm, self.eps)[0],
                            self.ops.rms_norm(qk[:, self.q_size:].contiguous(), self.k_norm, self.eps)[0]), dim=-1)
        qk = qk.float().view(T, Hq + Hkv, D)  # float32 arithmetic (a no-op for a float32 model)
        if self.qk_norm == "head":  # Qwen3: per head, over head_dim; in place in C where it can (`csrc/decode.c`)
            native = cpu_native.load() if cpu_native.rows_contiguous_f32(qk) else None
            if native is not None:
                native.head_rms_norm(qk.data_ptr(), T, qk.stride(0), Hq + Hkv, D, self.qk_head_weight.data_ptr(),
                                     self.eps)
            else:
                qk = F.rms_norm(qk, (D,), eps=self.eps).mul_(self.qk_head_weight)
        # [T, Hq + Hkv, D]: qk is this call's own (a view of qkv's rows or a float32 copy): rotated in place
        qk = rotate_(qk, rope).to(x.dtype)
        q, k = qk[:, :Hq], qk[:, Hq:]  # views
        meta = self.ctx.meta
        if self.window_pool:  # (a sliding layer whose K/V lives in the window pool: that pool's tables and slots)
            meta = meta.window
            assert meta is not None, "a step over a window pool without its window metadata (meta.window)"
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)  # the only KV write: new tokens, in place
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, **self.sink_window)  # [T, Hq, D]
        out = linear(o.reshape(T, self.q_size), self.o_proj, self.o_bias)  # [T, H]: this rank's heads' part
        self.par.all_reduce_tp(out)
        return out


class SparseMoE:
    """Routed experts (+ optional gated shared expert). A dense MLP is one expert with no router, run directly."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, ctx: StepContext, ops: KernelOps,
                 par: ParallelContext):
        """par: the rank this block is a shard of: it holds that rank's experts (and columns of them)."""
        self.ctx, self.ops, self.par = ctx, ops, par
        self.w13, self.w2 = w[prefix + "w13"], w[prefix + "w2"]  # [E_local, 2I_local, H], [E_local, H, I_local]
        self.router = w.get(prefix + "router")  # [E, H] (all experts: routing is replicated) or None (dense)
        # expert parallel: the first expert this rank holds; None when it holds them all
        self.first_expert = None
        if self.router is not None and par.layout.ep_size > 1:
            self.first_expert = par.layout.experts(self.router.shape[0])[0]
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # the router's kind (`tsterm_kernels.routing`); None: softmax. GLM-4.5, MiniMax-M2: sigmoid with a bias
        self.routing = routing_or_default(Routing(cfg.scoring_func, w.get(prefix + "router_bias"), cfg.n_group,
                                                  cfg.topk_group, cfg.routed_scaling_factor))
        self.shared_w13, self.shared_w2 = w.get(prefix + "shared_w13"), w.get(prefix + "shared_w2")
        self.shared_gate = w.get(prefix + "shared_gate")  # [1, H]
        self.expert_load = None  # [E] int64: tokens routed to each expert, accumulated on the device (read rarely)
        if self.router is not None:
            self.expert_load = torch.zeros(self.router.shape[0], dtype=torch.int64, device=self.router.device)
        self.dense = (self.w13[0], self.w2[0]) if self.router is None else None  # the one expert's weights (views)
        # gpt-oss: a bias on the router's logits, the experts' biases (b2 added by one tensor-parallel rank: the
        # all-reduce sums it once) and their clamped SwiGLU (None: silu(gate) * up, no biases, `ops.fused_moe`)
        self.router_logit_bias = w.get(prefix + "router_logit_bias")
        self.w13_bias = w.get(prefix + "w13_bias")
        self.w2_bias = w.get(prefix + "w2_bias") if par.layout.tp_rank == 0 else None
        self.clamped_swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if self.w13_bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.router is None:  # dense: the one expert's output is the result (no zeroed buffer, no routing)
            out = expert_mlp(x, *self.dense)  # [T, H]: this rank's columns' part
            self.par.all_reduce_tp(out)
            return out
        out = torch.zeros_like(x)  # [T, H]: every expert's weighted output is accumulated into it in place
        # [T, E] (a float32 router, GLM's and MiniMax's, routes float32 hidden states)
        logits = linear(x if x.dtype == self.router.dtype else x.to(self.router.dtype), self.router,
                        self.router_logit_bias)
        weights, expert_ids = self.ops.moe_route(logits, self.top_k, self.renormalize, self.routing)  # [T, k] x 2
        if self.expert_load is not None:
            pairs = expert_ids.reshape(-1)  # [T*k]
            counts = self.ctx.pair_weights
            counts = torch.ones_like(pairs, dtype=self.expert_load.dtype) if counts is None else counts
            assert counts.numel() == pairs.numel(), "pair weights for another top-k"
            self.expert_load.index_add_(0, pairs, counts.to(self.expert_load.dtype))
        local_ids = expert_ids
        if self.first_expert is not None:  # another rank's expert -> E_local, which `fused_moe` skips
            num_local = self.w13.shape[0]
            local_ids = expert_ids - self.first_expert  # [T, k]
            local_ids = local_ids.masked_fill((local_ids < 0) | (local_ids >= num_local), num_local)
        if self.clamped_swiglu is not None:
            clamped_swiglu_experts(x, self.w13, self.w13_bias, self.w2, self.w2_bias, weights, local_ids,
                                   *self.clamped_swiglu, out)
        else:
            self.ops.fused_moe(x, self.w13, self.w2, weights, local_ids, out)
        if self.shared_w13 is not None:
            # The shared expert is one more always-on expert, weighted by its sigmoid gate, accumulated into `out`
            # like the routed ones (no second [T, H] buffer).
            # (GLM's shared experts have no gate: weight 1)
            gate = sigmoid(linear(x, self.shared_gate)) if self.shared_gate is not None else x.new_ones(x.shape[0], 1)
            self.ops.fused_moe(x, self.shared_w13, self.shared_w2, gate.float(), torch.zeros_like(expert_ids[:, :1]), out)
        self.par.all_reduce_all(out)  # every rank's experts (and shared-expert columns) summed
        return out


# mixer name (a `LayerType.mixer`) -> its layer class: (cfg, weights, prefix, cache views, ctx, ops, par) -> callable
MIXERS = {FULL_ATTENTION: Attention, LINEAR_ATTENTION: GatedDeltaNet, MLA: MLAttention}
# the hybrid families' layers (`ArchSpec.attention_output_gate`): their full attention is gated
GATED_MIXERS = {**MIXERS, FULL_ATTENTION: GatedAttention}


class DecoderModel:
    """Token ids -> final hidden states over a flattened batch; `logits` maps chosen rows to the vocabulary."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], cache: ModelCache, max_positions: int,
                 ops: KernelOps, par: ParallelContext | None = None):
        """cache: every layer's cache pool (`tsterm.model.cache`); ops: the kernels this model runs; par: the rank
        whose shard `weights` and `cache` are (default: one rank holding everything)."""
        self.cfg, self.ops = cfg, ops
        self.par = par = par if par is not None else SingleRank()
        self.ctx = StepContext()
        self.vocab_first, _, self.vocab_per_rank = par.layout.vocab(cfg.vocab_size)
        device = weights["embed"].device
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, max_positions, cfg.max_position_embeddings, device)
        self.embed, self.final_norm, self.lm_head = weights["embed"], weights["final_norm"], weights["lm_head"]
        self.eps = cfg.rms_norm_eps
        spec = ARCHITECTURES[cfg.model_type]
        self.layer_types = spec.layer_types(cfg)
        mixers = GATED_MIXERS if spec.attention_output_gate else MIXERS
        self.layers = []
        for i, layer_type in enumerate(self.layer_types):
            p = f"layers.{i}."
            window = {"window": layer_type.window} if layer_type.window else {}  # (gpt-oss's sliding layers)
            if i in cache.window_layers:  # (their K/V in the window pool)
                window["window_pool"] = True
            mixer = mixers[layer_type.mixer](cfg, weights, p, cache.layer(i), self.ctx, ops, par, **window)
            self.layers.append((weights[p + "input_norm"], mixer, weights[p + "post_attn_norm"],
                                SparseMoE(cfg, weights, p, self.ctx, ops, par)))
        # on the CPU, before the stack takes the weights' addresses: the bytes of them moved into huge pages
        self.huge_page_bytes = move_to_huge_pages(*self._streamed_weights()) if device.type == "cpu" else 0
        self.stack = self._decode_stack()

    def _streamed_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The matrices a decode step reads whole (every layer's, the LM head): the tensors that move where torch owns
        them, and the int8 / int4 codes and scales, which `move_to_huge_pages` moves even where they view the file."""
        matrices = [self.lm_head]
        for _, mixer, _, mlp in self.layers:
            matrices += [getattr(mixer, "qkv", None), getattr(mixer, "o_proj", None), mlp.w13, mlp.w2,
                         mlp.shared_w13, mlp.shared_w2, *(mlp.dense or ())]
        owned = [m for m in matrices if isinstance(m, torch.Tensor)]
        mapped = []
        for m in matrices:
            if isinstance(m, QuantizedWeight):
                tensors = [t for t in (m.data, m.scale) if isinstance(t, torch.Tensor)]
                (mapped if m.kind in ("int8", "int4") else owned).extend(tensors)
        return owned, mapped

    def _decode_stack(self):
        """The kernels' one-call form of every layer for decode steps (`KernelOps.decode_stack`), where the model is
        one rank's stack of layers that it takes (full attention; a dense MLP or routed experts, with or without a
        shared expert); else None (each step runs layer by layer)."""
        plain = self.par.layout.world_size == 1 and self.rotary.cos.shape[-1] == self.cfg.head_dim and all(
            type(mixer) is Attention and mixer.qk_norm in ("none", "head") and mixer.clip is None
            and mlp.routing is None and (mlp.shared_w13 is None or mlp.shared_gate is not None)
            and mixer.sinks is None and mixer.window is None and mlp.clamped_swiglu is None
            and mlp.router_logit_bias is None
            for _, mixer, _, mlp in self.layers)
        if not plain:
            return None
        att = self.layers[0][1]
        layers = []
        for norm, mixer, post, mlp in self.layers:
            experts = dict(router=mlp.router, top_k=mlp.top_k, renormalize=mlp.renormalize,
                           expert_load=mlp.expert_load, shared_gate_up=mlp.shared_w13, shared_down=mlp.shared_w2,
                           shared_gate=mlp.shared_gate) if mlp.router is not None else {}
            gate_up, down = mlp.dense if mlp.router is None else (mlp.w13, mlp.w2)
            layers.append(StackLayer(norm, post, mixer.qkv, mixer.o_proj, gate_up, down, mixer.qkv_bias,
                                     mixer.o_bias, mixer.qk_head_weight, mixer.k_cache, mixer.v_cache, **experts))
        return self.ops.decode_stack(layers, att.num_heads, att.num_kv_heads, att.head_dim, self.eps, att.scale)

    @contextlib.contextmanager
    def step_context(self, meta: AttentionMetadata, pair_weights: torch.Tensor | None = None,
                     state_slots: torch.Tensor | None = None,
                     snapshots: list[tuple[int, int]] | None = None) -> Iterator[StepContext]:
        """Set this model's step metadata for the forward inside the block (see StepContext)."""
        ctx = self.ctx
        ctx.meta, ctx.pair_weights, ctx.state_slots, ctx.snapshots = meta, pair_weights, state_slots, snapshots
        try:
            yield ctx
        finally:
            ctx.meta = ctx.pair_weights = ctx.state_slots = ctx.snapshots = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        hidden = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.tables(positions)  # looked up once per step, shared by every layer
        stacked = None
        if self.stack is not None and self.ctx.pair_weights is None:  # (a padded graph step counts pairs itself)
            stacked = self.stack(hidden, rope, self.ctx.meta)
        if stacked is not None:  # a decode step, every layer in one kernel call
            hidden, residual = stacked
            return ops.rms_norm(hidden, self.final_norm, self.eps, residual)[0]
        residual = None
        for input_norm, mixer, post_norm, mlp in self.layers:
            if residual is None:
                residual = hidden
                x, _ = ops.rms_norm(hidden, input_norm, self.eps)
            else:
                x, residual = ops.rms_norm(hidden, input_norm, self.eps, residual)
            hidden = mixer(rope, x)
            x, residual = ops.rms_norm(hidden, post_norm, self.eps, residual)
            hidden = mlp(x)
        hidden, _ = ops.rms_norm(hidden, self.final_norm, self.eps, residual)
        return hidden

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, H]. Vocabulary-parallel: each rank looks up the ids in its rows, zeroes the others, and
        the sum over the ranks is every row."""
        if self.par.layout.tp_size == 1:
            return F.embedding(input_ids, self.embed)  # [T, H]
        local = input_ids - self.vocab_first  # [T]
        outside = (local < 0) | (local >= self.embed.shape[0])  # [T]: another rank's rows
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill_(outside[:, None], 0.0)  # [T, H]
        self.par.all_reduce_tp(hidden)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] -> [S, V] float32. Vocabulary-parallel: each rank's rows of the LM head, gathered."""
        logits = linear(hidden, self.lm_head).float()  # [S, V_local]
        if self.par.layout.tp_size == 1:
            return logits
        if logits.shape[1] < self.vocab_per_rank:  # the last rank's shorter share: padded for the gather
            logits = F.pad(logits, (0, self.vocab_per_rank - logits.shape[1]))
        gathered = self.par.all_gather_tp(logits)  # [tp, S, V_per_rank]
        return gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.cfg.vocab_size]  # [S, V]
