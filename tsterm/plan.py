"""`tsterm plan`: a capacity planner computed from a model's HF config.json alone (no weights are read).

For each tensor-parallel x expert-parallel layout that uses all the GPUs (TP x EP = #GPUs) it gives the weight bytes
per rank, the memory left for KV (and, for hybrid models, the recurrent state of the Gated DeltaNet layers), the
tokens and sequences that fit, and the bandwidth roofline of batch-1 decode: the bytes one rank must read per token
divided by its memory bandwidth. Pure arithmetic: no torch.

The layout model (what a rank holds):
- attention, linear attention, dense MLP, shared expert, embedding and LM head are split TP ways (by heads / by the
  intermediate or vocabulary dimension); with EP > 1 each of the EP groups holds its own TP-split copy (data-parallel
  attention), so these count on every rank at 1/TP. KV heads fewer than TP are replicated (ceil(kv_heads / TP)).
- routed experts are split EP ways by expert id, and each expert TP ways by its intermediate dimension (the usual
  "expert TP = TP" of vLLM/SGLang/Megatron), so a rank holds ceil(E / EP) experts at 1/TP width each.
- norms, the router and the shared-expert gate are replicated on every rank.
Sizes use ceil wherever a split is uneven: the figures are for the fullest rank.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import textwrap
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tsterm.config import read_config_json
from tsterm.errors import ConfigError, ModelLoadError

GB = 10**9  # GPU memory figures are decimal GB, bandwidth decimal TB/s


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float


# Documented per-GPU figures:
# - H200 SXM: 141 GB HBM3e, 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet).
# - H100 SXM: 80 GB HBM3, 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet, SXM form factor).
# - B200 (HGX/DGX B200): NVIDIA's DGX B200 page lists 1,440 GB HBM3e and 64 TB/s for 8 GPUs = 180 GB and 8 TB/s
#   per GPU. The B200 package carries 192 GB, but the HGX/DGX parts expose 180 GB (nvidia-smi shows ~179 GB), so the
#   planner uses what a deployment can allocate.
GPU_PRESETS = MappingProxyType({
    "h200": GpuSpec("H200", 141 * GB, 4.8e12),
    "h100": GpuSpec("H100 SXM", 80 * GB, 3.35e12),
    "b200": GpuSpec("B200", 180 * GB, 8.0e12),
})

# Weight formats. fp8: 1 byte per weight + one fp32 scale per 128x128 block (the block-wise FP8 of the Qwen/DeepSeek
# FP8 checkpoints); only the linear layers are quantized; embedding, LM head, router, norms, conv1d and gates stay
# bf16, as in those checkpoints. int4: what the engine's `quantization: int4` allocates (tsterm.model.quant's
# QuantizeOnLoad): tsterm_kernels.quant's int4, GGUF Q4_1's form, 4 bits a weight + an fp16 scale and an fp16 minimum
# per block of 32 inputs (5 bits a weight), for every matrix the decoder multiplies through its `linear` (q/k/v, o_proj,
# the linear-attention projections, dense MLPs, experts, the shared expert) and the LM head (a tied one gets its own
# int4 copy beside the bf16 embedding); a matrix whose inputs are not whole blocks of 32 stays bf16; MLA's q_a / q_b /
# kv_a / kv_b keep the checkpoint's form (fp8 blocks from a block-scaled FP8 checkpoint, else bf16); the embedding,
# norms, router and gates stay bf16. A checkpoint whose experts ship as MXFP4 (gpt-oss: quantization_config.quant_method
# "mxfp4") has them counted as tsterm keeps them, 4.25 bits a weight (e2m1 codes and one E8M0 byte per 32), under bf16
# and fp8; under int4 the engine re-quantizes them to int4 at load.
DTYPES = ("bf16", "fp8", "int4")
Q4_BLOCK = 32  # inputs per int4 block (tsterm_kernels.quant.BLOCK): 16 bytes of codes + fp16 scale and minimum
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "models" / "configs"  # config.json of real models, by name
CACHE_BYTES = MappingProxyType({"bf16": 2, "fp8": 1, "fp32": 4})
HYBRID_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
MLA_TYPES = ("deepseek_v3", "kimi_k2")  # Multi-head Latent Attention (tsterm.model.mla)
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "glm4_moe",
               "minimax_m2", "gpt_oss") + HYBRID_TYPES + MLA_TYPES
# the families whose router the engine holds in float32 (tsterm.model.arch: router_float32), as it does every
# sigmoid router's correction bias; counted so under int4, the engine's allocation (bf16 and fp8 count bf16)
ROUTER_FLOAT32 = ("glm4_moe", "minimax_m2") + MLA_TYPES
QK_NORM_PER_HEAD = ("qwen3", "qwen3_moe") + HYBRID_TYPES  # q_norm/k_norm of head_dim each

# TokenSpeed's published figure for Qwen3.5-397B-A17B (PyTorch blog, 2026-05-27): 580 tok/s for one user (batch 1)
# on 8x B200 (TP8), with MTP speculative decoding on.
TOKENSPEED_REFERENCE = ("reference: TokenSpeed serves Qwen3.5-397B-A17B at 580 tok/s for one user (batch 1) on 8x B200 "
                        "(TP8; PyTorch blog, 2026-05-27). That figure uses MTP speculative decoding (several tokens "
                        "accepted per forward pass); the bound above is plain decode, one token per step, and leaves "
                        "out communication, so the two are not like for like.")


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """Gated DeltaNet geometry (Qwen3-Next / Qwen3.5)."""

    key_heads: int
    key_head_dim: int
    value_heads: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """Multi-head Latent Attention geometry (DeepSeek-V3, Kimi-K2): q_lora_rank 0 when q comes straight from H."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class PlanModel:
    """What the planner needs from config.json."""

    model_type: str
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    q_gated: bool  # the q projection also yields an output gate (twice as wide)
    qkv_bias: bool
    qk_norm: int  # q/k norm weights per full-attention layer
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    dense_intermediate: int
    full_layers: tuple[bool, ...]  # per layer: full attention (else linear attention)
    moe_layers: tuple[bool, ...]  # per layer: routed experts (else a dense MLP)
    linear: LinearAttention | None
    notes: tuple[str, ...] = ()
    shared_gated: bool = True  # the shared expert has a sigmoid gate (Qwen); GLM's is added as it is
    router_bias: bool = False  # a selection bias per expert (GLM-4.5, MiniMax-M2)
    mla: LatentAttention | None = None  # the attention layers are MLA (their cache: one latent per token)
    # gpt-oss: o_proj's bias and a sink logit per head in each attention layer; biases on every expert
    attention_extras: bool = False
    expert_bias: bool = False
    expert_format: str | None = None  # "mxfp4": the routed experts ship (and load) as MXFP4 blocks
    fp8_checkpoint: bool = False  # block-scaled FP8 (quant_method "fp8", 128 x 128 blocks), which the engine keeps

    @property
    def num_layers(self) -> int:
        return len(self.full_layers)

    @property
    def num_full(self) -> int:
        return sum(self.full_layers)


@dataclass(frozen=True, slots=True)
class Tensor:
    """`count` equal weight matrices [rows, cols] as one rank holds them; `read` of them are read per decoded token."""

    group: str
    rows: int
    cols: int
    count: int
    read: int
    quantized: bool = True
    # stored in that format whatever the --dtype: "mxfp4" (MXFP4 experts kept as shipped), "float32" (MLA's W_UK /
    # W_UV, made at load)
    shipped: str | None = None
    derived: bool = False  # a copy made at load from another weight: memory, not parameters
    # its form under --dtype int4 (see DTYPES): "q4_1" (quantized at load), "fp8" (an FP8 checkpoint's blocks kept),
    # "bf16", "float32"; None: "q4_1" where `quantized` (MXFP4 experts included), else what the other dtypes hold
    int4: str | None = None
    int4_only: bool = False  # held only under int4 (a tied LM head's int4 copy)
    int4_read: int | None = None  # `read` under int4, where it differs (a tied embedding: its copy is the LM head)

    def bytes(self, dtype: str) -> int:
        """Bytes of one matrix."""
        n = self.rows * self.cols
        if dtype == "int4":
            form = self.int4 or ("q4_1" if self.quantized and self.shipped != "float32" else None)
            if form == "q4_1" and self.cols % Q4_BLOCK == 0:  # 4-bit codes + fp16 scale and minimum per 32 inputs
                return n // 2 + 4 * self.rows * (self.cols // Q4_BLOCK)
            if form == "fp8":
                return n + 4 * math.ceil(self.rows / 128) * math.ceil(self.cols / 128)
            if form == "float32":
                return 4 * n
            if form is not None:
                return 2 * n
        elif self.int4_only:
            return 0
        if self.shipped == "mxfp4":  # 4-bit codes + one scale byte per 32 inputs
            return n // 2 + self.rows * math.ceil(self.cols / 32)
        if self.shipped == "float32":
            return 4 * n
        if not self.quantized or dtype == "bf16":
            return 2 * n
        return n + 4 * math.ceil(self.rows / 128) * math.ceil(self.cols / 128)  # fp8

    def reads(self, dtype: str) -> int:
        """How many of the `count` matrices one decoded token reads under `dtype`."""
        return self.int4_read if dtype == "int4" and self.int4_read is not None else self.read


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rank_tensors(m: PlanModel, tp: int, ep: int) -> list[Tensor]:
    """Every weight one rank of layout (tp, ep) holds, grouped by kind and summed over layers."""
    h, out = m.hidden, []
    n_full, n_linear = m.num_full, m.num_layers - m.num_full
    n_moe = sum(m.moe_layers)
    n_dense = m.num_layers - n_moe
    q_r = _cdiv(m.heads, tp) * m.head_dim  # q width per rank
    kv_r = _cdiv(m.kv_heads, tp) * m.head_dim  # KV heads below TP are replicated
    if n_full and m.mla:  # q_a, kv_a and their norms on every rank (the latent is every head's); heads split TP ways
        a, heads_r = m.mla, _cdiv(m.heads, tp)
        q_head, qa = a.qk_nope_head_dim + a.qk_rope_head_dim, a.q_lora_rank

        def stored(rows: int, split: bool) -> str:
            """A projection's form under int4 (`quantization` leaves MLA's projections as loaded): an FP8
            checkpoint's blocks where this rank's rows are whole 128-row blocks (tsterm.model.loader's fp8_kept),
            else dequantized to bf16."""
            return "fp8" if m.fp8_checkpoint and (not split or tp == 1 or rows % 128 == 0) else "bf16"

        q_rows, kv_b_rows = heads_r * q_head, heads_r * (a.qk_nope_head_dim + a.v_head_dim)
        out += [Tensor("attention", q_rows, qa or h, n_full, n_full, int4=stored(q_rows, True)),  # q_b (or q_proj)
                Tensor("attention", a.kv_lora_rank + a.qk_rope_head_dim, h, n_full, n_full,  # kv_a_proj_with_mqa
                       int4=stored(0, False)),
                Tensor("attention", kv_b_rows, a.kv_lora_rank, n_full, n_full, int4=stored(kv_b_rows, True)),
                Tensor("attention", h, heads_r * a.v_head_dim, n_full, n_full),  # o
                Tensor("norms", 1, a.kv_lora_rank + qa, n_full, n_full, quantized=False),  # kv_a, q_a layernorms
                # the absorbed form's per-head W_UK^T [r, dn] and W_UV [dv, r]: float32 copies of this rank's kv_b
                # rows made at load (tsterm.model.mla.MLAttention), both read by every decoded token
                Tensor("attention", heads_r * a.kv_lora_rank, a.qk_nope_head_dim + a.v_head_dim, n_full, n_full,
                       quantized=False, shipped="float32", derived=True)]
        if qa:
            out.append(Tensor("attention", qa, h, n_full, n_full, int4=stored(0, False)))  # q_a
    elif n_full:
        out += [Tensor("attention", q_r * (2 if m.q_gated else 1), h, n_full, n_full),
                Tensor("attention", kv_r, h, 2 * n_full, 2 * n_full),  # k, v
                Tensor("attention", h, q_r, n_full, n_full)]  # o
        if m.qkv_bias:
            out.append(Tensor("attention", 1, q_r + 2 * kv_r, n_full, n_full, quantized=False))
        if m.qk_norm:
            out.append(Tensor("norms", 1, m.qk_norm, n_full, n_full, quantized=False))
        if m.attention_extras:  # o_proj's bias, the sinks
            out.append(Tensor("attention", 1, h + _cdiv(m.heads, tp), n_full, n_full, quantized=False))
    if n_linear and m.linear:
        la = m.linear
        kd, vd, nv = _cdiv(la.key_heads, tp) * la.key_head_dim, _cdiv(la.value_heads, tp) * la.value_head_dim, \
            _cdiv(la.value_heads, tp)
        if m.model_type == "qwen3_next":  # fused in_proj_qkvz and in_proj_ba
            proj = [Tensor("linear_attention", 2 * kd + 2 * vd, h, n_linear, n_linear),
                    Tensor("linear_attention", 2 * nv, h, n_linear, n_linear)]
        else:  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
            proj = [Tensor("linear_attention", 2 * kd + vd, h, n_linear, n_linear),
                    Tensor("linear_attention", vd, h, n_linear, n_linear),
                    Tensor("linear_attention", nv, h, 2 * n_linear, 2 * n_linear)]
        out += proj + [
            Tensor("linear_attention", h, vd, n_linear, n_linear),  # out_proj
            Tensor("linear_attention", 2 * kd + vd, la.conv_kernel, n_linear, n_linear, quantized=False),  # conv1d
            Tensor("linear_attention", 1, 2 * nv, n_linear, n_linear, quantized=False),  # A_log, dt_bias
            Tensor("norms", 1, la.value_head_dim, n_linear, n_linear, quantized=False)]  # gated RMSNorm
    if n_dense and m.dense_intermediate:
        i_r = _cdiv(m.dense_intermediate, tp)
        out += [Tensor("dense_mlp", i_r, h, 2 * n_dense, 2 * n_dense), Tensor("dense_mlp", h, i_r, n_dense, n_dense)]
    if n_moe:
        i_r, held = _cdiv(m.moe_intermediate, tp), _cdiv(m.experts, ep)
        # batch 1 routes top_k experts; by pigeonhole some rank holds at least ceil(top_k / ep) of them
        active = min(_cdiv(m.top_k, ep), held)
        out += [Tensor("experts", i_r, h, 2 * held * n_moe, 2 * active * n_moe, shipped=m.expert_format),  # gate, up
                Tensor("experts", h, i_r, held * n_moe, active * n_moe, shipped=m.expert_format),  # down
                Tensor("router", m.experts, h, n_moe, n_moe, quantized=False,
                       int4="float32" if m.model_type in ROUTER_FLOAT32 else None)]
        if m.router_bias:  # e_score_correction_bias, float32 in the engine (gpt-oss: the router's own bias, bf16)
            out.append(Tensor("router", 1, m.experts, n_moe, n_moe, quantized=False,
                              int4=None if m.model_type == "gpt_oss" else "float32"))
        if m.expert_bias:  # gate_up_proj_bias, down_proj_bias
            out.append(Tensor("experts", held, 2 * i_r + h, n_moe, n_moe, quantized=False))
        if m.shared_intermediate:
            s_r = _cdiv(m.shared_intermediate, tp)
            out += [Tensor("shared_expert", s_r, h, 2 * n_moe, 2 * n_moe),
                    Tensor("shared_expert", h, s_r, n_moe, n_moe)]
            if m.shared_gated:
                out.append(Tensor("router", 1, h, n_moe, n_moe, quantized=False))  # shared_expert_gate
    out.append(Tensor("norms", 1, h, 2 * m.num_layers + 1, 2 * m.num_layers + 1, quantized=False))
    v_r = _cdiv(m.vocab, tp)
    if m.tied:  # one matrix, read whole as the LM head (under int4 the head is its own int4 copy, read instead)
        out += [Tensor("embedding", v_r, h, 1, 1, quantized=False, int4_read=0),
                Tensor("lm_head", v_r, h, 1, 1, quantized=False, derived=True, int4="q4_1", int4_only=True)]
    else:  # the embedding reads one row per token: negligible
        out += [Tensor("embedding", v_r, h, 1, 0, quantized=False),
                Tensor("lm_head", v_r, h, 1, 1, quantized=False, int4="q4_1")]
    return out


def parameter_counts(m: PlanModel) -> tuple[int, int]:
    """(total, active per token) parameters of the text model. Active counts the whole embedding, as model cards do
    ("A3B", "A17B"), though a decode step reads one row of it."""
    tensors = [t for t in rank_tensors(m, 1, 1) if not t.derived]
    total = sum(t.rows * t.cols * t.count for t in tensors)
    active = sum(t.rows * t.cols * (t.count if t.group == "embedding" else t.read) for t in tensors)
    return total, active


def kv_bytes_per_token(m: PlanModel, tp: int, kv_dtype: str) -> int:
    """K and V of every full-attention layer for one token, on one rank. MLA: the latent and the RoPE key, whole
    on every rank (every head is expanded from them)."""
    if m.mla:
        return m.num_full * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * CACHE_BYTES[kv_dtype]
    return m.num_full * 2 * _cdiv(m.kv_heads, tp) * m.head_dim * CACHE_BYTES[kv_dtype]


def expanded_kv_bytes_per_token(m: PlanModel, kv_dtype: str) -> int:
    """What an MLA model's cache would take per token as full per-head K ([nope | rope]) and V (0 without MLA)."""
    if not m.mla:
        return 0
    a = m.mla
    return m.num_full * m.heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * CACHE_BYTES[kv_dtype]


def state_bytes_per_sequence(m: PlanModel, tp: int, state_dtype: str) -> int:
    """Gated DeltaNet state of one sequence on one rank: the conv state keeps the last kernel-1 inputs of the
    q/k/v channels, the recurrent state one [key_head_dim, value_head_dim] matrix per value head."""
    if not m.linear:
        return 0
    la, n_linear = m.linear, m.num_layers - m.num_full
    conv_channels = 2 * _cdiv(la.key_heads, tp) * la.key_head_dim + _cdiv(la.value_heads, tp) * la.value_head_dim
    recurrent = _cdiv(la.value_heads, tp) * la.key_head_dim * la.value_head_dim
    return n_linear * (conv_channels * (la.conv_kernel - 1) + recurrent) * CACHE_BYTES[state_dtype]


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    ep: int
    weight_bytes: int  # per rank
    free_bytes: int  # per rank, for KV and state after weights and headroom (negative: does not fit)
    kv_bytes_per_token: int  # per rank
    state_bytes_per_sequence: int  # per rank
    kv_tokens: int  # per attention replica (EP of them)
    sequences: int  # at the given context, all replicas together
    weight_read_bytes: int  # per token per rank
    read_bytes_per_token: int  # weights + KV at the context + state, per rank
    tokens_per_s: float  # bandwidth / read_bytes_per_token

    @property
    def fits(self) -> bool:
        return self.free_bytes > 0


def plan_layouts(m: PlanModel, gpus: int, gpu: GpuSpec, dtype: str = "bf16", kv_dtype: str = "bf16",
                 state_dtype: str = "fp32", context: int = 8192, headroom: float = 0.1) -> list[Layout]:
    """Every TP x EP = gpus layout (EP only for MoE models; TP must divide the attention heads)."""
    layouts = []
    for tp in range(1, gpus + 1):
        ep = gpus // tp
        if tp * ep != gpus or (ep > 1 and not m.experts) or m.heads % tp:
            continue
        tensors = rank_tensors(m, tp, ep)
        weights = sum(t.bytes(dtype) * t.count for t in tensors)
        read = sum(t.bytes(dtype) * t.reads(dtype) for t in tensors)
        kv, state = kv_bytes_per_token(m, tp, kv_dtype), state_bytes_per_sequence(m, tp, state_dtype)
        free = math.floor(gpu.memory_bytes * (1 - Fraction(repr(headroom)))) - weights  # exact: 0.1 is 1/10
        per_seq = context * kv + state
        total_read = read + per_seq  # batch 1 reads its whole KV and state once per token
        layouts.append(Layout(tp, ep, weights, free, kv, state,
                              max(free, 0) // kv if kv else 0, ep * (max(free, 0) // per_seq) if per_seq else 0,
                              read, total_read, gpu.bandwidth_bytes_per_s / total_read))
    return layouts


# --------------------------------------------------------------------------------------------------
# config.json -> PlanModel

def load_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """The raw config.json of a model directory, of a path to the file itself, or of a config shipped with tsterm
    (tsterm/models/configs) by name."""
    p = Path(path)
    if not p.exists() and (SHIPPED_CONFIGS / f"{path}.json").is_file():
        p = SHIPPED_CONFIGS / f"{path}.json"
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"{path}: no config.json in this directory (give an HF model directory or the "
                                 f"path of its config.json)")
    elif not p.is_file():
        raise ModelLoadError(f"{path}: no such file or directory (give an HF model directory or a config.json)")
    return read_config_json(p), str(p)


def parse_model(raw: dict[str, Any], source: str = "config.json") -> PlanModel:
    """The planner's view of an HF config: multimodal configs (Qwen3.5) are read from their `text_config`."""
    notes = []
    text = raw.get("text_config")
    if isinstance(text, dict):
        cfg = {**raw, **text}
        notes.append("text model only: the vision encoder (vision_config) is not counted")
    else:
        cfg = raw
    model_type = raw.get("model_type") or cfg.get("model_type")
    experts = _int(cfg, source, "num_experts", "num_local_experts", "n_routed_experts") or 0
    if model_type not in KNOWN_TYPES and not experts:
        raise ModelLoadError(f"{source}: model_type {model_type!r} is not one the planner knows "
                             f"({', '.join(KNOWN_TYPES)}) and the config has no MoE fields (num_experts, "
                             f"num_experts_per_tok, moe_intermediate_size) to plan it from")
    if model_type not in KNOWN_TYPES:
        notes.append(f"model_type {model_type!r} is not a known family: planned from its MoE fields, assuming "
                     f"standard grouped-query attention")
    hidden = _int(cfg, source, "hidden_size", required=True)
    layers = _int(cfg, source, "num_hidden_layers", required=True)
    heads = _int(cfg, source, "num_attention_heads", required=True)
    kv_heads = _int(cfg, source, "num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                             f"({kv_heads})")
    top_k = _int(cfg, source, "num_experts_per_tok") or (1 if experts else 0)
    if experts and not 1 <= top_k <= experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k}) must be in [1, num_experts={experts}]")
    dense_intermediate = _int(cfg, source, "intermediate_size") or 0
    moe_intermediate = _int(cfg, source, "moe_intermediate_size") or dense_intermediate
    if experts and not moe_intermediate:
        raise ModelLoadError(f"{source}: an MoE config needs moe_intermediate_size (or intermediate_size)")
    sparse_step = _int(cfg, source, "decoder_sparse_step") or 1
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    first_dense = _int(cfg, source, "first_k_dense_replace") or 0  # GLM-4.5, DeepSeek-V3: the first layers dense
    moe_layers = tuple(bool(experts) and i not in mlp_only and i >= first_dense and (i + 1) % sparse_step == 0
                       for i in range(layers))
    full_layers, linear = _mixers(cfg, model_type, layers, source, notes)
    head_dim = _int(cfg, source, "head_dim") or hidden // heads
    per_head = model_type in QK_NORM_PER_HEAD or (model_type == "glm4_moe" and cfg.get("use_qk_norm", True))
    qk_norm = 2 * head_dim if per_head else \
        (heads + kv_heads) * head_dim if model_type in ("olmoe", "minimax_m2") else 0  # these norm the whole q and k
    mla = None
    if cfg.get("kv_lora_rank") is not None:
        keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        missing = [k for k in keys if not cfg.get(k)]
        if missing:
            raise ModelLoadError(f"{source}: multi-head latent attention (kv_lora_rank) needs {', '.join(missing)}")
        mla = LatentAttention(_int(cfg, source, "q_lora_rank") or 0, *(_int(cfg, source, k) for k in keys))
    qc = raw.get("quantization_config")
    expert_format = "mxfp4" if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4" and experts else None
    if expert_format:
        notes.append("the routed experts ship as MXFP4 and are counted as tsterm keeps them, 4.25 bits a weight, "
                     "under bf16 and fp8 (the other weights take --dtype); under int4 as the int4 they are "
                     "re-quantized to at load")
    fp8_checkpoint = isinstance(qc, dict) and qc.get("quant_method") == "fp8" and \
        list(qc.get("weight_block_size") or ()) == [128, 128]
    if cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_modules"):
        notes.append("the MTP layers shipped after the last layer are not counted: plain decode does not run them")
    if cfg.get("mtp_num_hidden_layers"):
        notes.append(f"the MTP head ({cfg['mtp_num_hidden_layers']} layer(s)) is not counted: plain decode does not "
                     f"run it")
    return PlanModel(
        model_type=str(model_type), hidden=hidden, vocab=_int(cfg, source, "vocab_size", required=True),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        tied=bool(cfg.get("tie_word_embeddings", False)),
        q_gated=bool(cfg.get("attn_output_gate", model_type in HYBRID_TYPES)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        qk_norm=qk_norm,
        experts=experts, top_k=top_k, moe_intermediate=moe_intermediate if experts else 0,
        shared_intermediate=_int(cfg, source, "shared_expert_intermediate_size") or  # GLM: n_shared_experts of them
        (_int(cfg, source, "n_shared_experts") or 0) * moe_intermediate,
        dense_intermediate=dense_intermediate, full_layers=full_layers, moe_layers=moe_layers, linear=linear,
        notes=tuple(notes), shared_gated=model_type not in ("glm4_moe",) + MLA_TYPES,
        router_bias=model_type in ("glm4_moe", "minimax_m2", "gpt_oss") + MLA_TYPES, mla=mla,
        attention_extras=model_type == "gpt_oss", expert_bias=model_type == "gpt_oss", expert_format=expert_format,
        fp8_checkpoint=fp8_checkpoint,
    )


def _int(cfg: dict[str, Any], source: str, *keys: str, required: bool = False) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelLoadError(f"{source}: field {key!r} must be a non-negative integer, got {value!r}")
            return value
    if required:
        raise ModelLoadError(f"{source}: missing field {keys[0]!r}")
    return None


def _mixers(cfg: dict[str, Any], model_type: Any, layers: int, source: str,
            notes: list[str]) -> tuple[tuple[bool, ...], LinearAttention | None]:
    """Which layers are full attention, from `layer_types`, else `full_attention_interval` (hybrid families: every
    interval-th layer), else all; and the Gated DeltaNet geometry when some are linear attention."""
    kinds = cfg.get("layer_types")
    if kinds is not None:
        if not (isinstance(kinds, list) and len(kinds) == layers):
            raise ModelLoadError(f"{source}: field 'layer_types' must list {layers} layer types, got {kinds!r}")
        unknown = sorted({k for k in kinds if k not in ("full_attention", "linear_attention", "sliding_attention")})
        if unknown:
            raise ModelLoadError(f"{source}: layer type(s) {', '.join(map(repr, unknown))} are not modelled by the "
                                 f"planner (only full_attention, sliding_attention and linear_attention)")
        if "sliding_attention" in kinds:  # gpt-oss
            notes.append("sliding_attention layers are counted as full attention (an upper bound): the engine "
                         "keeps them in a window pool of their own (window_kv_blocks), whose blocks go back once out "
                         "of every running sequence's window, so a long context costs less than shown")
        full = tuple(k in ("full_attention", "sliding_attention") for k in kinds)
    elif cfg.get("full_attention_interval") is not None or model_type in HYBRID_TYPES:
        interval = _int(cfg, source, "full_attention_interval") or 4  # the HF default of these families
        if "full_attention_interval" not in cfg:
            notes.append("no layer_types or full_attention_interval: assumed every 4th layer is full attention")
        full = tuple((i + 1) % interval == 0 for i in range(layers))
    else:
        return (True,) * layers, None
    if all(full):
        return full, None
    keys = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ModelLoadError(f"{source}: linear-attention layers need {', '.join(missing)}")
    return full, LinearAttention(*(_int(cfg, source, k) for k in keys))


# --------------------------------------------------------------------------------------------------
# The command

def parse_gpus(text: str, memory_gb: float | None = None, bandwidth_tbs: float | None = None) -> tuple[int, GpuSpec]:
    """`8xH200`, `4xB200`, `2xH100` or `4xcustom` (with --memory-gb and --bandwidth-tbs); the two options also
    override a preset's figures."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*([A-Za-z0-9_-]+)\s*", text or "")
    if not match:
        raise ConfigError(f"--gpus {text!r}: expected COUNTxKIND, e.g. 8xH200, 8xB200, 4xH100 or 4xcustom "
                          f"(with --memory-gb and --bandwidth-tbs)")
    count, kind = int(match.group(1)), match.group(2).lower().removesuffix("-sxm")
    if not 1 <= count <= 4096:
        raise ConfigError(f"--gpus {text!r}: the GPU count must be in 1..4096")
    for name, value in (("--memory-gb", memory_gb), ("--bandwidth-tbs", bandwidth_tbs)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive number, got {value}")
    if kind == "custom":
        if memory_gb is None or bandwidth_tbs is None:
            raise ConfigError(f"--gpus {text!r}: a custom GPU needs --memory-gb and --bandwidth-tbs")
        return count, GpuSpec("custom", int(memory_gb * GB), bandwidth_tbs * 1e12)
    if kind not in GPU_PRESETS:
        raise ConfigError(f"--gpus {text!r}: unknown GPU {match.group(2)!r} (known: "
                          f"{', '.join(p.name for p in GPU_PRESETS.values())}, or custom)")
    preset = GPU_PRESETS[kind]
    return count, GpuSpec(preset.name, preset.memory_bytes if memory_gb is None else int(memory_gb * GB),
                          preset.bandwidth_bytes_per_s if bandwidth_tbs is None else bandwidth_tbs * 1e12)


def is_qwen35_397b(m: PlanModel) -> bool:
    """Qwen3.5-397B-A17B, recognised by its shape rather than its directory name."""
    return (m.model_type.startswith("qwen3_5_moe") and m.hidden == 4096 and m.num_layers == 60
            and m.experts == 512 and m.top_k == 10)


def build_report(m: PlanModel, source: str, gpus: int, gpu: GpuSpec, dtype: str, kv_dtype: str, state_dtype: str,
                 context: int, headroom: float) -> dict[str, Any]:
    layouts = plan_layouts(m, gpus, gpu, dtype, kv_dtype, state_dtype, context, headroom)
    if not layouts:
        raise ConfigError(f"no TP x EP layout of {gpus} GPUs splits {m.heads} attention heads evenly"
                          f"{'' if m.experts else ' (a dense model uses TP only)'}; try another GPU count")
    total, active = parameter_counts(m)
    return {
        "model": {"source": source, "model_type": m.model_type, "layers": m.num_layers,
                  "full_attention_layers": m.num_full, "linear_attention_layers": m.num_layers - m.num_full,
                  "experts": m.experts, "experts_per_token": m.top_k, "parameters": total,
                  "active_parameters": active, "notes": list(m.notes)},
        "gpus": {"count": gpus, "name": gpu.name, "memory_bytes": gpu.memory_bytes,
                 "bandwidth_bytes_per_s": gpu.bandwidth_bytes_per_s},
        "options": {"dtype": dtype, "kv_dtype": kv_dtype, "state_dtype": state_dtype, "context": context,
                    "headroom": headroom},
        "kv_bytes_per_token": kv_bytes_per_token(m, 1, kv_dtype),
        "kv_expanded_bytes_per_token": expanded_kv_bytes_per_token(m, kv_dtype),
        "state_bytes_per_sequence": state_bytes_per_sequence(m, 1, state_dtype),
        "layouts": [{**asdict(layout), "fits": layout.fits} for layout in layouts],
        "reference": TOKENSPEED_REFERENCE if is_qwen35_397b(m) else None,
    }


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def format_report(r: dict[str, Any]) -> str:
    m, g, o = r["model"], r["gpus"], r["options"]
    mixers = (f"{m['layers']} layers ({m['full_attention_layers']} full attention, {m['linear_attention_layers']} "
              f"linear attention)" if m["linear_attention_layers"] else f"{m['layers']} layers")
    moe = f", {m['experts']} experts top-{m['experts_per_token']}" if m["experts"] else ", dense"
    lines = [f"tsterm plan: {m['model_type']} ({m['source']})",
             f"  {mixers}{moe}",
             f"  {m['parameters'] / 1e9:.2f} B parameters, {m['active_parameters'] / 1e9:.2f} B active per token",
             f"  KV cache: {r['kv_bytes_per_token']:,} bytes per token ({o['kv_dtype']}, {m['full_attention_layers']} "
             f"full-attention layers; a TP group splits it by KV head)" if not r["kv_expanded_bytes_per_token"] else
             f"  KV cache: {r['kv_bytes_per_token']:,} bytes per token ({o['kv_dtype']}, {m['full_attention_layers']} "
             f"MLA layers: one latent + RoPE key per token, whole on every rank)\n"
             f"  (full per-head K and V would take {r['kv_expanded_bytes_per_token']:,} bytes per token: "
             f"{r['kv_expanded_bytes_per_token'] / r['kv_bytes_per_token']:.1f}x)"]
    if r["state_bytes_per_sequence"]:
        lines.append(f"  recurrent state: {r['state_bytes_per_sequence']:,} bytes per sequence ({o['state_dtype']}, "
                     f"{m['linear_attention_layers']} Gated DeltaNet layers: conv + recurrent)")
    lines += [f"  GPUs: {g['count']} x {g['name']} ({_gb(g['memory_bytes'])}, {g['bandwidth_bytes_per_s'] / 1e12:g} "
              f"TB/s each); weights {o['dtype']}; headroom {o['headroom']:.0%} of memory; context {o['context']:,}",
              ""]
    header = ("layout", "weights/rank", "free/rank", "KV tokens/replica", f"seqs@{o['context']}", "read/token/rank",
              "decode bound")
    rows = []
    for lay in r["layouts"]:
        fits = lay["fits"]
        rows.append((f"TP{lay['tp']} x EP{lay['ep']}", _gb(lay["weight_bytes"]),
                     _gb(lay["free_bytes"]) if fits else "does not fit",
                     f"{lay['kv_tokens']:,}" if fits else "-", f"{lay['sequences']:,}" if fits else "-",
                     _gb(lay["read_bytes_per_token"]), f"{lay['tokens_per_s']:,.0f} tok/s" if fits else "-"))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append("  " + "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                                      enumerate(zip(row, widths))).rstrip())
    lines += ["",
              "  decode bound = bandwidth / bytes one rank reads per token at batch 1 (its weight shard with the",
              "  routed experts it must serve, plus KV at the context and the recurrent state); it leaves out",
              "  inter-GPU communication, kernel launches and compute, so real decode is slower."]
    lines += [f"  note: {note}" for note in m["notes"]]
    if r["reference"]:
        lines += [""] + textwrap.wrap(r["reference"], 110, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="memory and decode-speed plan for a model on N GPUs, from config.json alone")
    p.add_argument("--model", help="HF model directory, its config.json (no weights are read) or a config shipped "
                   "with tsterm by name (qwen3-30b-a3b, qwen3.5-397b-a17b)")
    p.add_argument("--profile", default=argparse.SUPPRESS, help="plan the profile's model: its directory's "
                   "config.json when it is on disk, else the profile's plan_config (resolved by tsterm.cli)")
    p.add_argument("--gpus", required=True, help="COUNTxKIND: 8xH200, 8xB200, 4xH100, or 4xcustom with the "
                   "two options below")
    p.add_argument("--memory-gb", dest="memory_gb", type=float,
                   help="memory per GPU in GB (custom; overrides a preset)")
    p.add_argument("--bandwidth-tbs", dest="bandwidth_tbs", type=float,
                   help="memory bandwidth per GPU in TB/s (custom; overrides a preset)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="weight format (default bf16)")
    p.add_argument("--kv-dtype", dest="kv_dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--state-dtype", dest="state_dtype", choices=("bf16", "fp32"), default="fp32",
                   help="Gated DeltaNet state format (hybrid models; default fp32, what tsterm keeps)")
    p.add_argument("--context", type=int, default=8192, help="tokens of context for the decode bound (default 8192)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory kept for activations, buffers and fragmentation (default 0.1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ConfigError(f"--context must be a positive number of tokens, got {args.context}")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {args.headroom}")
    gpus, gpu = parse_gpus(args.gpus, args.memory_gb, args.bandwidth_tbs)
    if args.model is None:
        raise ConfigError("give --model DIR|config.json or --profile NAME")
    raw, source = load_config(args.model)
    model = parse_model(raw, source)
    report = build_report(model, source, gpus, gpu, args.dtype, args.kv_dtype, args.state_dtype, args.context,
                          args.headroom)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
