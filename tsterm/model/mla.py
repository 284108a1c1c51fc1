"""Multi-head Latent Attention (DeepSeek-V2 / V3, Kimi-K2): the token mixer whose cache holds, per token, one
compressed latent instead of per-head K and V.

Per token the layer projects the hidden state to `kv_a` = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)], RMS-
normalises the latent (`kv_a_layernorm`) and rotates k_rope: that row of kv_lora_rank + qk_rope_head_dim values is all
the cache keeps (`MLALatentPool`, paged under the same block tables as the KV pool, so prefix reuse, forks and
eviction work on it unchanged). Each head's key is [k_nope | k_rope] with k_nope = W_UK[h] latent, its value
W_UV[h] latent (W_UK, W_UV: the two row groups of `kv_b_proj`); its query [q_nope | q_rope] comes from q_a_proj ->
q_a_layernorm -> q_b_proj (or q_proj when q_lora_rank is null).

Two equal ways to attend:
- absorbed (decode rows, verify steps, short chunks): W_UK is folded into the query (q_lat[h] = W_UK[h]^T q_nope[h]),
  so the scores are q_lat . latent + q_rope . k_rope, one key head of kv_lora_rank + qk_rope_head_dim shared by all
  query heads, read straight from the latent pool: by the ops' MLA kernel where they have one (`mla_attention`: the
  Triton ops, `tsterm_kernels.triton_mla`), on the CPU by csrc/mla.c (`tsterm_kernels.cpu_mla`: every head over each
  latent row read once, a float32 or bfloat16 pool), else (no C kernels, or TSTERM_CPU_KERNELS forcing torch) by the
  ordinary paged attention (the latent row as both key and value); the output's latent part goes out through W_UV.
  Nothing per head is ever materialised for the context. On a CUDA device the absorption and W_UV run as one batched
  matmul over the heads, on the CPU head by head.
- expanded (with `deterministic: false` only, prompt chunks of more than `break_even_rows` tokens: by default every
  row is absorbed, so that a prompt's bits do not depend on its chunking or cached prefix): the context's latents are
  expanded through kv_b_proj to per-head K and V once and attended as ordinary multi-head attention, cheaper once a
  chunk's queries outnumber the break-even (expanding costs r (dn + dv) per context token and head, the absorbed form
  2 (r + dr) against the expanded (dn + dr + dv) per query: ~158 rows at DeepSeek-V3's sizes). A chunk of at most
  `VERIFY_ROWS` (a verify step's most: 64 drafts + the last token) is never expanded, so a verify's rows are computed
  as the decode's are, bit for bit (each op row-invariant: `linear`, and csrc/mla.c, whose order of arithmetic for a
  row does not depend on the rows beside it, its sequence's included), and speculation stays lossless.

The softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under
DeepSeek's YaRN (the rotation tables carry the mscale / mscale_all_dim ratio). DeepSeek's checkpoints lay the RoPE
dims out as interleaved pairs (`rope_interleave`, the default): the loader reorders q_b_proj's and kv_a_proj's RoPE
rows into the rotate-half layout once, so rotation is the decoder's ordinary `rotate`.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_mla
from tsterm_kernels.cpu_stack import MAX_HEADS
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.quant import FP8_BLOCK, QuantizedWeight
from tsterm_kernels.torch_ops import linear

from tsterm.config import ModelConfig
from tsterm.model.parallel import ParallelContext, ParallelLayout
from tsterm.model.rope import rotate, yarn_mscale

if TYPE_CHECKING:
    from tsterm.model.decoder import StepContext
    from tsterm_kernels.dispatch import KernelOps


VERIFY_ROWS = 65  # the most rows one sequence has in a verify step (num_speculative_tokens <= 64, tsterm.config)


def softmax_scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale: 1/sqrt(qk head dim), times DeepSeek YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
    return scale


def latent_width(cfg: ModelConfig) -> int:
    """Values one token keeps per MLA layer: the normalised latent and the rotated RoPE key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def expanded_kv_width(cfg: ModelConfig) -> int:
    """Values one token would keep per layer as full per-head K and V (what MLA's latent replaces)."""
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


class MLAttention:
    """Weights (`load_mla`): `q_a` [q_lora, H] + `q_a_norm` [q_lora] + `q_b` [Hq (dn + dr), q_lora], or `q_proj`
    [Hq (dn + dr), H]; `kv_a` [r + dr, H], `kv_a_norm` [r]; `kv_b` [Hq (dn + dv), r]; `o_proj` [H, Hq dv] (Hq: this
    rank's heads; optional `q_a_bias`, `kv_a_bias`, `o_bias`). cache: the layer's [num_blocks, block_size, 1, r + dr]
    view of the latent pool."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, cache: torch.Tensor,
                 ctx: StepContext, ops: KernelOps, par: ParallelContext):
        self.ctx, self.ops, self.par = ctx, ops, par
        self.num_heads = par.layout.q_heads(cfg)[1]
        self.rank, self.nope, self.rope_dim, self.v_dim = (cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                                           cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.eps, self.scale = cfg.rms_norm_eps, softmax_scale(cfg)
        self.q_a, self.q_a_norm, self.q_b = w.get(prefix + "q_a"), w.get(prefix + "q_a_norm"), w.get(prefix + "q_b")
        self.q_proj, self.q_a_bias = w.get(prefix + "q_proj"), w.get(prefix + "q_a_bias")
        self.kv_a, self.kv_a_bias, self.kv_a_norm = w[prefix + "kv_a"], w.get(prefix + "kv_a_bias"), w[prefix + "kv_a_norm"]
        self.kv_b = w[prefix + "kv_b"]
        self.o_proj = w[prefix + "o_proj"]
        self.o_bias = w.get(prefix + "o_bias") if par.layout.tp_rank == 0 else None
        kv_b = self.kv_b.dequantize() if isinstance(self.kv_b, QuantizedWeight) else self.kv_b
        kv_b = kv_b.view(self.num_heads, self.nope + self.v_dim, self.rank)
        # the absorbed form's per-head matrices as `linear` weights [out, in], once: q_nope [dn] -> q_lat [r], and
        # the output's latent [r] -> [dv] (`linear`: a row's bits do not depend on the step's row count)
        self.w_uk_t = kv_b[:, :self.nope].float().transpose(1, 2).contiguous()  # [Hq, r, dn]
        self.w_uv = kv_b[:, self.nope:].float().contiguous()  # [Hq, dv, r]
        r, dn, dr, dv = self.rank, self.nope, self.rope_dim, self.v_dim
        break_even = -(-r * (dn + dv) // max(2 * (r + dr) - (dn + dr + dv), 1))
        self.break_even_rows = max(VERIFY_ROWS, break_even)
        # a longer chunk of one sequence is expanded: by default none (one arithmetic for every row, the invariance
        # promise: a prompt's bits must not depend on its chunking or its cached prefix); `allow_expanded`
        # (`deterministic: false`) lowers it to the break-even
        self.absorb_max_rows = sys.maxsize
        self.cache = cache
        # the attention's shape as the kernels see it (`cpu_kernels.shape_classes`): one latent key head
        self.k_cache, self.num_kv_heads, self.head_dim = cache, 1, self.rank + self.rope_dim

    def allow_expanded(self) -> None:
        """`deterministic: false`: prompt chunks longer than the break-even take the expanded form (cheaper there, but
        another arithmetic: a long prompt's bits then depend on how it was chunked and what of it was cached)."""
        self.absorb_max_rows = self.break_even_rows

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: the step's rotation tables (qk_rope_head_dim wide); x: [T, H] normed hidden states."""
        T, Hq, r, dn, dr = x.shape[0], self.num_heads, self.rank, self.nope, self.rope_dim
        if self.q_a is not None:
            q = linear(self.ops.rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.eps)[0], self.q_b)
        else:
            q = linear(x, self.q_proj)
        q = q.float().view(T, Hq, dn + dr)
        q_nope, q_rope = q[..., :dn], rotate(q[..., dn:], rope)  # [T, Hq, dn] view, [T, Hq, dr]
        kv = linear(x, self.kv_a, self.kv_a_bias)  # [T, r + dr]
        latent = self.ops.rms_norm(kv[:, :r].contiguous(), self.kv_a_norm, self.eps)[0]  # [T, r]
        k_rope = rotate(kv[:, None, r:].float(), rope)[:, 0]  # [T, dr]
        entry = torch.cat((latent, k_rope.to(latent.dtype)), dim=-1)[:, None]  # [T, 1, r + dr]: what is cached
        meta = self.ctx.meta
        # the only cache write (the same row through both of store_kv's pools: the latent is key and value)
        self.ops.store_kv(entry, entry, self.cache, self.cache, meta.slot_mapping)
        o = self._attend(q_nope, q_rope, meta, x.dtype)  # [T, Hq, dv]
        out = linear(o.reshape(T, Hq * self.v_dim).to(x.dtype), self.o_proj, self.o_bias)  # [T, H]: this rank's part
        self.par.all_reduce_tp(out)
        return out

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                dtype: torch.dtype) -> torch.Tensor:
        """[T, Hq, dv] float32: the sequences with more than `absorb_max_rows` new tokens expanded, the rest
        absorbed (in one call, through the step's metadata cut to them)."""
        starts = meta.query_start_loc
        counts = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
        if all(n <= self.absorb_max_rows for n in counts):
            return self.absorbed(q_nope, q_rope, meta, dtype)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        absorbed = [i for i, n in enumerate(counts) if n <= self.absorb_max_rows]
        if absorbed:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in absorbed]).to(q_nope.device)
            out[rows] = self.absorbed(q_nope[rows], q_rope[rows], _subset(meta, absorbed), dtype)
        for i, n in enumerate(counts):
            if n > self.absorb_max_rows:
                s = slice(starts[i], starts[i + 1])
                out[s] = self.expanded(q_nope[s], q_rope[s], meta.block_runs[i], meta.seq_lens[i])
        return out

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                 dtype: torch.dtype) -> torch.Tensor:
        """Attention over the latent pool itself: [T, Hq, dn], [T, Hq, dr] float32 -> [T, Hq, dv] float32. The ops'
        own MLA kernel where they have one (Triton: `tsterm_kernels.triton_mla`, the latent read once per tile for
        scores and output), on the CPU csrc/mla.c (`tsterm_kernels.cpu_mla`), else their paged attention with the
        latent row as the one key head and its value."""
        T, Hq, r = q_nope.shape[0], self.num_heads, self.rank
        if q_nope.is_cuda:  # one batched matmul over the heads (the GPU's GEMMs are not row-invariant anyway)
            q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk_t.transpose(1, 2)).transpose(0, 1)  # [T, Hq, r]
        else:  # head by head through `linear`: a row's bits do not depend on the step's rows
            q_lat = q_nope.new_empty(T, Hq, r)
            for h in range(Hq):
                q_lat[:, h] = linear(q_nope[:, h].contiguous(), self.w_uk_t[h])
        if self.ops.mla_attention is not None:
            q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
            o_lat = self.ops.mla_attention(q_lat, q_rope, self.cache, meta, self.scale)  # [T, Hq, r] float32
        elif (native := cpu_mla.native_for(q_lat, self.cache)) is not None:
            # csrc/mla.c: every head over each latent row read once, float32 or bfloat16 rows, in place
            q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
            o_lat = cpu_mla.mla_attention(q_lat, q_rope, self.cache, meta, self.scale, native)  # [T, Hq, r] float32
        else:
            q = torch.cat((q_lat, q_rope), dim=-1).to(dtype)  # [T, Hq, r + dr]: [q_lat | q_rope]
            # at most MAX_HEADS query heads a call, the C decode kernel's limit (DeepSeek-V3 has 128 on one rank); a
            # head's bits do not depend on the other heads of its call
            parts = [self.ops.paged_attention(q[:, h:h + MAX_HEADS], self.cache, self.cache, meta, self.scale)
                     for h in range(0, Hq, MAX_HEADS)]
            o_lat = (parts[0] if len(parts) == 1 else torch.cat(parts, 1))[..., :r].float()
        if o_lat.is_cuda:
            return torch.bmm(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, Hq, dv]
        return torch.stack([linear(o_lat[:, h].contiguous(), self.w_uv[h]) for h in range(Hq)], 1)  # [T, Hq, dv]

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, runs: list[tuple[int, int]],
                 seq_len: int) -> torch.Tensor:
        """One sequence's m new tokens (the last m of its `seq_len`) over its context's latents expanded to per-head
        K and V: [m, Hq, dn], [m, Hq, dr] float32 -> [m, Hq, dv] float32."""
        m, Hq, r = q_nope.shape[0], self.num_heads, self.rank
        rows = context_rows(self.cache, runs, seq_len).float()  # [n, r + dr]
        kv = linear(rows[:, :r].to(self.cache.dtype), self.kv_b).float().view(seq_len, Hq, self.nope + self.v_dim)
        k = torch.cat((kv[..., :self.nope], rows[:, None, r:].expand(seq_len, Hq, self.rope_dim)), dim=-1)
        v = kv[..., self.nope:]  # [n, Hq, dv]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [m, Hq, dn + dr]
        # query j sits at position seq_len - m + j and sees keys 0 .. that position
        mask = torch.arange(seq_len, device=q.device)[None] <= torch.arange(seq_len - m, seq_len, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           scale=self.scale)  # [Hq, m, dv]
        return o.transpose(0, 1)


def allow_expanded_prefill(model) -> None:
    """`deterministic: false`: every MLA layer of `model` (a `DecoderModel`) may expand long prompt chunks."""
    for _, mixer, _, _ in model.layers:
        if isinstance(mixer, MLAttention):
            mixer.allow_expanded()


def context_rows(cache: torch.Tensor, runs: list[tuple[int, int]], seq_len: int) -> torch.Tensor:
    """A sequence's cached rows, in position order: [seq_len, r + dr] from the [num_blocks, block_size, 1, r + dr]
    pool through its block table's runs of consecutive blocks."""
    return torch.cat([cache[b:b + n].flatten(0, 2) for b, n in runs])[:seq_len]


def _subset(meta: AttentionMetadata, seqs: list[int]) -> AttentionMetadata:
    """The step's metadata restricted to some of its sequences (their rows, in order: the absorbed ones of a step
    that also expands)."""
    starts = meta.query_start_loc
    index = torch.tensor(seqs, device=meta.block_tables.device)
    sub_starts = [0]
    for i in seqs:
        sub_starts.append(sub_starts[-1] + starts[i + 1] - starts[i])
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(meta.slot_mapping.device)
    return AttentionMetadata(query_start_loc=sub_starts, seq_lens=[meta.seq_lens[i] for i in seqs],
                             block_runs=[meta.block_runs[i] for i in seqs], slot_mapping=meta.slot_mapping[rows],
                             block_tables=meta.block_tables[index].contiguous(), block_size=meta.block_size)


def load_mla(src, cfg: ModelConfig, spec, a: str, o: str, w: dict[str, torch.Tensor], layout: ParallelLayout,
             dtype: torch.dtype) -> None:
    """One MLA block from the checkpoint (`a`: its prefix, `o`: the canonical one; `src`: the loader's
    `WeightSource`): this rank's heads of q_b / q_proj, kv_b and o_proj's columns; q_a, kv_a and the norms whole (the
    latent is every rank's). Interleaved RoPE rows (`rope_interleave`) are reordered to rotate-half here.

    Every matrix is read through `src.weight`, so a block-scaled FP8 checkpoint on a CUDA device keeps them all as
    fp8 QuantizedWeights (where the span is whole 128-blocks, as for any matrix): the RoPE reordering moves rows
    within their 128-row block (each head's RoPE rows start at a multiple of 64 at DeepSeek's sizes), so the block
    scales stand unchanged; a reordering that would carry a row across blocks dequantizes that matrix instead.
    kv_b stays fp8 for the expanded form's `linear`; the absorbed form's per-head W_UK / W_UV are float32 copies
    made from it once (`MLAttention`: no fp8 kernel takes a matrix per head)."""
    H, Hq, r, dn, dr, dv = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.v_head_dim)
    h0, nh = layout.q_heads(cfg)
    # rotate-half order of an interleaved RoPE part: the even dims, then the odd ones
    order = torch.cat((torch.arange(0, dr, 2), torch.arange(1, dr, 2))) if cfg.rope_interleave else torch.arange(dr)
    q_order = torch.cat([h * (dn + dr) + torch.cat((torch.arange(dn), dn + order)) for h in range(nh)])
    kv_a_order = torch.cat((torch.arange(r), r + order))
    q_rows = (h0 * (dn + dr), nh * (dn + dr))
    if cfg.q_lora_rank:
        w[o + "q_a"] = src.weight(a + "q_a_proj.weight", (cfg.q_lora_rank, H))
        w[o + "q_a_norm"] = src.get(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        if cfg.attention_bias:
            w[o + "q_a_bias"] = src.get(a + "q_a_proj.bias", (cfg.q_lora_rank,))
        w[o + "q_b"] = _rows(src.weight(a + "q_b_proj.weight", (Hq * (dn + dr), cfg.q_lora_rank), rows=q_rows),
                             q_order, dtype)
    else:
        w[o + "q_proj"] = _rows(src.weight(a + "q_proj.weight", (Hq * (dn + dr), H), rows=q_rows), q_order, dtype)
    w[o + "kv_a"] = _rows(src.weight(a + "kv_a_proj_with_mqa.weight", (r + dr, H)), kv_a_order, dtype)
    if cfg.attention_bias:
        w[o + "kv_a_bias"] = _rows(src.get(a + "kv_a_proj_with_mqa.bias", (r + dr,)), kv_a_order, dtype)
    w[o + "kv_a_norm"] = src.get(a + "kv_a_layernorm.weight", (r,))
    w[o + "kv_b"] = src.weight(a + "kv_b_proj.weight", (Hq * (dn + dv), r), rows=(h0 * (dn + dv), nh * (dn + dv)))
    w[o + "o_proj"] = src.weight(a + "o_proj.weight", (H, Hq * dv), cols=(h0 * dv, nh * dv))
    if cfg.attention_bias:
        w[o + "o_bias"] = src.get(a + "o_proj.bias", (H,))


def _rows(t: torch.Tensor | QuantizedWeight, order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """t's rows in `order` (a copy only when the order is not the identity). An fp8 weight keeps its values and
    scales where every row stays in its 128-row block, else it is dequantized to `dtype`; int8 / int4 blocks (one
    scale row per output row) move with their rows."""
    if torch.equal(order, torch.arange(t.shape[0])):
        return t
    if not isinstance(t, QuantizedWeight):
        return t.index_select(0, order.to(t.device))
    index = order.to(t.device)
    if t.kind == "fp8" and torch.equal(order // FP8_BLOCK, torch.arange(len(order)) // FP8_BLOCK):
        # (float8 has no index_select: its bytes move)
        return QuantizedWeight.fp8(t.data.view(torch.uint8).index_select(0, index).view(t.data.dtype), t.scale)
    if t.kind in ("int8", "int4"):
        return QuantizedWeight.blocks(t.kind, t.data.index_select(0, index), t.scale.index_select(0, index))
    return t.dequantize().to(dtype).index_select(0, index)
