"""Gated DeltaNet: the linear-attention token mixer of the hybrid families (Qwen3-Next, Qwen3.5).

Instead of a KV cache, each sequence keeps a fixed-size state in its slot of the recurrent-state pool
(`tsterm.model.cache.RecurrentStatePool`, addressed by the step's `state_slots`): the causal conv's last K-1 inputs
and the gated delta rule's matrix state per value head. A sequence whose first new token is at position 0 starts
from zeros (its slot is cleared here, so a slot needs no cleaning when it changes hands); one resuming a cached
prefix finds its state already copied from that prefix's snapshot. Where the step says so (`StepContext.snapshots`),
the layer also copies a sequence's state at a block boundary into the sequence's snapshot slot, splitting a prompt
chunk there, so that a later prompt with that prefix can resume from it. Prompt chunks run the
chunked form of the rule, decode tokens the recurrent form, each kind every sequence of the step at once (a prompt
split at a snapshot: the rows before the cut, then the rows after it), through the model's kernel ops (Triton on
CUDA), which update each sequence's state in its slot in place. The positions of a speculative verify step (a
sequence's last token and its drafts) run as decodes too, one position after the other, each keeping the state after
it in a slot of its own (`_verify`). Which rows and slots go where is the step's
`RecurrentPlan` (`tsterm_kernels.metadata`), index tensors prepared once per step with the other step inputs: a
layer reads no device value back and copies no host data to the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tsterm_kernels.metadata import build_recurrent_plan
from tsterm_kernels.torch_gated_delta import elementwise
from tsterm_kernels.torch_ops import linear

from tsterm.config import ModelConfig
from tsterm.model.parallel import ParallelContext

if TYPE_CHECKING:
    from tsterm.model.decoder import StepContext
    from tsterm_kernels.dispatch import KernelOps


class GatedDeltaNet:
    """x [T, H] -> [T, H]: fused input projection -> causal conv (q, k, v) -> gated delta rule -> gated RMSNorm -> out.

    Weights (`tsterm.model.hybrid_loader`): `in_proj` [2 Kd + 2 Vd + 2 Hv, H] (rows: q, k, v, z, b, a),
    `conv` [2 Kd + Vd, K], `neg_A` [Hv] float32 (-exp(A_log)), `dt_bias` [Hv] float32, `gated_norm` [dv],
    `out_proj` [H, Vd]; Kd = Hk dk, Vd = Hv dv.
    """

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str,
                 cache: tuple[torch.Tensor, torch.Tensor], ctx: StepContext, ops: KernelOps, par: ParallelContext):
        """cache: (conv_states [num_slots, C, K-1], recurrent_states [num_slots, Hv, dk, dv] float32) views of the
        pool; par: the rank this layer is a shard of (its key heads and the value heads that read them)."""
        self.ctx, self.ops, self.par = ctx, ops, par
        _, self.num_k_heads, _, self.num_v_heads = par.layout.linear_heads(cfg)  # this rank's heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size = 2 * self.key_size + self.value_size
        self.in_proj, self.conv = w[prefix + "in_proj"], w[prefix + "conv"]
        self.neg_A, self.dt_bias = w[prefix + "neg_A"], w[prefix + "dt_bias"]
        self.gated_norm, self.out_proj = w[prefix + "gated_norm"], w[prefix + "out_proj"]
        self.eps = cfg.rms_norm_eps
        self.conv_states, self.recurrent_states = cache

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: unused (no positions in a recurrence); x: [T, H] normed hidden states."""
        T, Hv, C = x.shape[0], self.num_v_heads, self.conv_size
        proj = linear(x, self.in_proj)  # [T, C + Vd + 2 Hv]
        mixed = proj[:, :C]  # [T, C] view: q, k, v before the conv
        z = proj[:, C:C + self.value_size].view(T, Hv, self.v_dim)  # [T, Hv, dv] view: the output gate
        b, a = proj[:, C + self.value_size:C + self.value_size + Hv], proj[:, C + self.value_size + Hv:]  # [T, Hv]
        beta = torch.sigmoid(b.float())  # [T, Hv]: how much of each token is written
        # softplus by one arithmetic whatever the step's rows: torch's CPU loops run the vector routine on whole
        # vectors and the scalar one on the rest, so on this contiguous [T, Hv] an element's bits would depend on T
        # (on a strided view of proj's rows, as b above and z below, each row is a loop of its own: no dependence)
        g = self.neg_A * elementwise(F.softplus, a.float() + self.dt_bias)  # [T, Hv]: log decay, <= 0
        core = self._mix(mixed, g, beta)  # [T, Hv, dv] float32
        core = F.rms_norm(core, (self.v_dim,), eps=self.eps).to(x.dtype) * self.gated_norm  # [T, Hv, dv]
        core = (core.float() * F.silu(z.float())).to(x.dtype)  # gated by silu(z)
        out = linear(core.view(T, self.value_size), self.out_proj)  # [T, H]: this rank's heads' part
        self.par.all_reduce_tp(out)
        return out

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, C] -> q, k [n, Hk, dk], v [n, Hv, dv] (views)."""
        n, K = qkv.shape[0], self.key_size
        return (qkv[:, :K].view(n, self.num_k_heads, self.k_dim), qkv[:, K:2 * K].view(n, self.num_k_heads, self.k_dim),
                qkv[:, 2 * K:].view(n, self.num_v_heads, self.v_dim))

    def _mix(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The conv and the delta rule of every sequence of the step, reading and writing their state slots (and
        keeping a copy of a state in its snapshot slot where the step says so).

        What goes where is the step's `RecurrentPlan` (`tsterm_kernels.metadata`), index tensors set up once per
        step with the other step inputs: this only branches on its host sizes and launches ops, so it never waits
        for the device nor copies host data to it."""
        ctx = self.ctx
        plan = ctx.meta.recurrent
        if plan is None:  # metadata built by hand (tests): the plan is built once for the step's layers
            plan = build_recurrent_plan(ctx.meta, ctx.state_slots, ctx.snapshots)
        sizes = plan.shape.sizes
        conv_states, states = self.conv_states, self.recurrent_states
        if sizes["fresh_slots"]:  # sequences starting at position 0: a clean state, whatever the slot held
            conv_states.index_fill_(0, plan.fresh_slots, 0.0)
            states.index_fill_(0, plan.fresh_slots, 0.0)
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=mixed.device)
        if sizes["decode_slots"]:  # one token per sequence: every sequence at once
            every = plan.shape.every_decode
            rows = slice(None) if every else plan.decode_rows  # [S_dec]
            qkv = self.ops.causal_conv1d_update(mixed[rows], self.conv, conv_states, plan.decode_slots)  # [S_dec, C]
            q, k, v = self._split(qkv)
            o = self.ops.recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], states, plan.decode_slots)  # in place
            if every:
                out = o
            else:
                out[rows] = o
            if sizes["decode_keep_src"]:  # a decode token that completes a block: its state is kept
                self._keep(plan.decode_keep_dst, plan.decode_keep_src)
        if sizes["verify_rows"]:  # verify steps: each position a decode, from the previous one's slot into its own
            self._verify(mixed, g, beta, plan, out)
        if sizes["prefill_slots"]:  # prompt chunks: every sequence at once, chunked; split where a snapshot is kept
            qkv = torch.empty_like(mixed)  # [T, C]: the conv's output at the prompt rows
            self._prefill(mixed, qkv, g, beta, plan.prefill_slots, plan.prefill_bounds, out)
            if sizes["prefill_keep_src"]:
                self._keep(plan.prefill_keep_dst, plan.prefill_keep_src)
            if sizes["resume_slots"]:
                self._prefill(mixed, qkv, g, beta, plan.resume_slots, plan.resume_bounds, out)
        return out

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan, out: torch.Tensor) -> None:
        """The rows of verify sequences (a decoding sequence's last token and its drafts), position by position: at
        position j, every verify sequence that has one decodes it from the state its position j-1 left (position 0:
        its own slot) into the slot that keeps the state after position j, the conv window likewise. The states
        after every position stay, so the engine keeps the one at the last accepted draft by taking its slot; and
        each position is computed as decoding it would be (the same ops, the same arithmetic), so a verified token's
        logits are those of the plain decode."""
        offset = 0
        for count in plan.shape.waves:
            rows = plan.verify_rows[offset:offset + count]
            src, dst = plan.verify_src[offset:offset + count], plan.verify_dst[offset:offset + count]
            qkv = self.ops.causal_conv1d_update(mixed[rows], self.conv, self.conv_states, src, dst)  # [n, C]
            q, k, v = self._split(qkv)
            out[rows] = self.ops.recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], self.recurrent_states,
                                                            src, dst)
            offset += count

    def _prefill(self, mixed: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 slots: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor) -> None:
        """Prompt pieces, sequence i's rows [bounds[i, 0], bounds[i, 1]) from state slot slots[i]: through the conv
        (into qkv [T, C]) and the chunked rule (into out [T, Hv, dv]), each from and into its state slot, in place."""
        self.ops.causal_conv1d(mixed, self.conv, self.conv_states, slots, bounds, qkv)
        q, k, v = self._split(qkv)
        self.ops.chunk_gated_delta_rule(q, k, v, g, beta, self.recurrent_states, slots, bounds, out)

    def _keep(self, snapshot_slots: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy the states in `slots` [n] into `snapshot_slots` [n] (a prefix's state, kept for reuse)."""
        self.conv_states.index_copy_(0, snapshot_slots, self.conv_states.index_select(0, slots))
        self.recurrent_states.index_copy_(0, snapshot_slots, self.recurrent_states.index_select(0, slots))
