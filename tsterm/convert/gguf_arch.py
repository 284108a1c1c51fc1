"""llama.cpp's names -> Hugging Face's: which HF architecture a GGUF `general.architecture` becomes, its config.json
(llama.cpp metadata keys -> transformers' names, rope scaling included), generation_config.json, and each tensor's
HF name and layout (llama.cpp's q/k row permutation undone).

The MoE families llama.cpp names `gpt-oss`, `glm4moe`, `deepseek2` (DeepSeek-V3 / R1, Kimi-K2) and `minimax-m2` are
read as llama.cpp's converter (convert_hf_to_gguf.py) writes them:
- per block: `attn_norm`, the norm before the MLP (`post_attention_norm` for gpt-oss and GLM, `ffn_norm` elsewhere),
  `attn_{q,k,v,output}` (+ `.bias`), `attn_{q,k}_norm`, dense `ffn_{gate,up,down}` (GLM's and DeepSeek's leading dense
  layers, `{arch}.leading_dense_block_count`), the router `ffn_gate_inp` (+ `.bias`: gpt-oss), the sigmoid routers'
  selection bias `exp_probs_b.bias` (HF's `e_score_correction_bias`), shared experts `ffn_{gate,up,down}_shexp`
  (`{arch}.expert_shared_count` of them fused into one MLP, as HF's `shared_experts`), stacked experts
  `ffn_{gate,up,down}_exps` or gate and up fused as `ffn_gate_up_exps` (rows: gate, then up), gpt-oss's sinks
  `attn_sinks.weight` and expert biases `ffn_*_exps.bias`;
- DeepSeek's MLA: `attn_q_a`, `attn_q_a_norm`, `attn_q_b` (or `attn_q` without a q LoRA), `attn_kv_a_mqa`,
  `attn_kv_a_norm`, and `attn_kv_b` (older files) or its two halves `attn_k_b` [H, kv_lora_rank, qk_nope] (the key
  half, each head's matrix transposed) and `attn_v_b` [H, v_head_dim, kv_lora_rank], put back together as HF's
  `kv_b_proj`; the file says `head_count_kv` 1 (llama.cpp runs MLA as MQA over the latent): HF's is the head count;
  its YaRN `rope.scaling.yarn_log_multiplier` is 0.1 x `mscale_all_dim` (llama.cpp assumes `mscale` equal to it);
- no q/k permutation in these families (their RoPE is NeoX-style or, DeepSeek's, interleaved pairs kept as HF has
  them);
- the MTP / NextN layers GLM's files carry after the last layer (`{arch}.nextn_predict_layers`, counted in
  `block_count`: `blk.N.nextn.*` and a whole decoder layer) are not run by tsterm: skipped at import, listed in
  gguf_import.json.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tsterm.convert.gguf_reader import GgufFile
from tsterm.errors import ModelLoadError

SOFTMAX, SIGMOID = 1, 2  # llama.cpp's {arch}.expert_gating_func values


@dataclass(frozen=True)
class GgufArch:
    model_type: str
    hf_class: str
    unpermute_qk: bool = False  # llama.cpp permutes q/k rows (interleaved rope) for its `llama` arch only
    norm_topk_prob: bool = True  # llama.cpp's behaviour when the file has no `expert_weights_norm`
    post_norm: str = "ffn_norm"  # llama.cpp's name of the norm before the MLP
    gating: int = SOFTMAX  # the expert_gating_func tsterm routes this family with
    gating_absent: int = SOFTMAX  # what llama.cpp assumes when the file has no expert_gating_func
    experts_key: str = "num_experts"  # config.json's name of the routed expert count
    expert_width_key: str = "moe_intermediate_size"  # ... and of one expert's width
    leading_dense: bool = False  # dense first layers, config.json `first_k_dense_replace` (GLM, DeepSeek)
    mla: bool = False  # DeepSeek's Multi-head Latent Attention


# `general.architecture` -> what it becomes; a dense `llama` file with experts is Mixtral (see arch_of), a
# `deepseek2` one with Kimi-K2's tokenizer is kimi_k2.
_SIGMOID_MOE = dict(gating=SIGMOID, gating_absent=SIGMOID)
GGUF_ARCHS = {
    "llama": GgufArch("llama", "LlamaForCausalLM", unpermute_qk=True),
    "qwen2": GgufArch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GgufArch("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": GgufArch("qwen2_moe", "Qwen2MoeForCausalLM", norm_topk_prob=False),
    "qwen3moe": GgufArch("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": GgufArch("gpt_oss", "GptOssForCausalLM", post_norm="post_attention_norm",
                        experts_key="num_local_experts", expert_width_key="intermediate_size"),
    "glm4moe": GgufArch("glm4_moe", "Glm4MoeForCausalLM", norm_topk_prob=False, post_norm="post_attention_norm",
                        experts_key="n_routed_experts", leading_dense=True, **_SIGMOID_MOE),
    # (a file without expert_gating_func is DeepSeek-V2's softmax routing, which tsterm does not run)
    "deepseek2": GgufArch("deepseek_v3", "DeepseekV3ForCausalLM", norm_topk_prob=False, gating=SIGMOID,
                          experts_key="n_routed_experts", leading_dense=True, mla=True),
    "minimax-m2": GgufArch("minimax_m2", "MiniMaxM2ForCausalLM", experts_key="num_local_experts",
                           expert_width_key="intermediate_size", **_SIGMOID_MOE),
}
MIXTRAL = GgufArch("mixtral", "MixtralForCausalLM", unpermute_qk=True, experts_key="num_local_experts",
                   expert_width_key="intermediate_size")
KIMI_K2_PRE = "kimi-k2"  # tokenizer.ggml.pre of Kimi-K2 files (general.architecture deepseek2)

# Per-block leaf names (llama.cpp -> HF, after blk.N. / model.layers.N.) common to every family; "{moe}" is the
# sparse block's prefix, "{router}" its router's name. The norm before the MLP and the family's own tensors are added
# by `block_names`; the experts (stacked, fused) and MLA's k_b / v_b halves are handled by the importer.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.{router}",
}
SHARED_NAMES = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}
MLA_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
             "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
             "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"}
MLA_HALVES = ("attn_k_b", "attn_v_b")  # newer files' split kv_b (see the module docstring)


GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


EXPERT_LEAVES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
LAYER_RE = re.compile(r"blk\.(\d+)\.")
# HF leaf names (after model.layers.N.) of the matrices tsterm multiplies through its linear seam
LINEAR_LEAVES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
                 "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                 "shared_experts.down_proj.weight")
# MLA's projections, which tsterm.model.mla multiplies through the linear seam too (q_proj and o_proj: LINEAR_LEAVES;
# kv_b also gives the absorbed form's float W_UK / W_UV, dequantized from it once at load)
MLA_LINEAR_LEAVES = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "self_attn.kv_b_proj.weight")


def arch_of(gf: GgufFile) -> GgufArch:
    from tsterm.model.arch import ARCHITECTURES

    arch = GGUF_ARCHS.get(gf.arch)
    if arch is not None and gf.arch == "llama" and gf.get("{arch}.expert_count", 0):
        arch = MIXTRAL
    if arch is not None and arch.mla and gf.get("tokenizer.ggml.pre") == KIMI_K2_PRE:
        arch = dataclasses.replace(arch, model_type="kimi_k2")
    if arch is None or arch.model_type not in ARCHITECTURES:
        known = sorted(a for a, spec in GGUF_ARCHS.items() if spec.model_type in ARCHITECTURES)
        what = f"{gf.arch!r}" + (f" ({arch.model_type})" if arch else "")
        raise ModelLoadError(f"{gf.path}: GGUF architecture {what} is not supported by tsterm yet "
                             f"(supported: {', '.join(known)})")
    return arch


def block_names(arch: GgufArch) -> dict[str, str]:
    """llama.cpp's `leaf.weight` / `leaf.bias` -> HF's leaf (after model.layers.N.) for this family, every tensor
    of a block but the experts and MLA's k_b / v_b halves."""
    from tsterm.model.arch import ARCHITECTURES

    spec = ARCHITECTURES[arch.model_type]
    leaves = {**BLOCK_NAMES, arch.post_norm: "post_attention_layernorm", **(MLA_NAMES if arch.mla else {})}
    if spec.shared_expert:
        leaves.update({g: f"{{moe}}.{spec.shared_expert_name}.{h}" for g, h in SHARED_NAMES.items()})
        if spec.shared_expert_gated:
            leaves["ffn_gate_inp_shexp"] = "{moe}.shared_expert_gate"
    names = {f"{g}.{suffix}": f"{h}.{suffix}".format(moe=spec.moe_prefix, router=spec.router_name)
             for g, h in leaves.items() for suffix in ("weight", "bias")}
    if spec.router_bias:  # the sigmoid routers' selection bias (llama.cpp: FFN_EXP_PROBS_B)
        names["exp_probs_b.bias"] = f"{spec.moe_prefix}.{spec.router_bias}"
    if spec.attention_sinks:
        names["attn_sinks.weight"] = "self_attn.sinks"
    return names


def _single(gf: GgufFile, key: str, value: Any) -> Any:
    """Some files store a per-layer array; tsterm needs one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{gf.path}: {key.format(arch=gf.arch)} differs between layers ({value}); "
                                 "tsterm needs the same value in every layer")
        return value[0]
    return value


def num_layers(gf: GgufFile) -> int:
    """The decoder layers tsterm runs: `block_count` less the MTP / NextN layers counted in it (GLM)."""
    blocks = int(gf.require("{arch}.block_count"))
    nextn = int(gf.get("{arch}.nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < blocks:
        raise ModelLoadError(f"{gf.path}: {gf.arch}.nextn_predict_layers ({nextn}) must be in [0, block_count = "
                             f"{blocks})")
    return blocks - nextn


def _require_tensor(gf: GgufFile, *names: str) -> str:
    """The first of `names` the file has (alternatives: e.g. attn_q_a or attn_q); an error naming them if none."""
    for name in names:
        if name in gf.tensors:
            return name
    raise ModelLoadError(f"{gf.path}: tensor {' or '.join(map(repr, names))} is missing; is this a complete "
                         f"{gf.arch} model?")


def build_config(gf: GgufFile, dtype: str = "float32") -> dict[str, Any]:
    """The HF config.json of this file (llama.cpp key names -> transformers names)."""
    from tsterm.model.arch import ARCHITECTURES

    arch = arch_of(gf)
    spec = ARCHITECTURES[arch.model_type]
    layers = num_layers(gf)
    heads = int(_single(gf, "{arch}.attention.head_count", gf.require("{arch}.attention.head_count")))
    kv_heads = int(_single(gf, "{arch}.attention.head_count_kv", gf.get("{arch}.attention.head_count_kv", heads)))
    for name in ("token_embd.weight", "output_norm.weight"):
        _require_tensor(gf, name)
    vocab, hidden = gf.shape("token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": int(gf.get("{arch}.context_length", 4096)),
        "rms_norm_eps": float(gf.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "dtype": dtype,
    }
    if arch.mla:
        config.update(_mla_config(gf, heads))
    else:
        head_dim = gf.shape(_require_tensor(gf, "blk.0.attn_q.weight"))[0] // heads
        rope_dim = int(gf.get("{arch}.rope.dimension_count", head_dim))
        config["head_dim"] = head_dim
        config["rope_parameters"] = _rope_parameters(gf, head_dim)
        config["attention_bias"] = "blk.0.attn_q.bias" in gf.tensors
        if rope_dim != head_dim:
            if not (spec.partial_rotary and 0 < rope_dim < head_dim and rope_dim % 2 == 0):
                raise ModelLoadError(f"{gf.path}: partial rotary embeddings ({rope_dim} of {head_dim} head dims) are "
                                     f"not supported for {gf.arch}")
            config["rope_parameters"]["partial_rotary_factor"] = rope_dim / head_dim
            if arch.model_type == "minimax_m2":  # MiniMax's config.json names the rotated width
                config["rotary_dim"] = rope_dim
    if arch.model_type == "glm4_moe":
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in gf.tensors
    if arch.model_type == "gpt_oss":
        config.update(_gpt_oss_config(gf, layers))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate.weight" in gf.tensors]
    if dense:  # the width of the dense MLPs (per-layer lists in some MoE files: 0 on the sparse layers)
        width = gf.get("{arch}.feed_forward_length")
        width = [width[i] for i in dense] if isinstance(width, list) else width
        config["intermediate_size"] = int(_single(gf, "{arch}.feed_forward_length", width) or
                                          gf.shape(f"blk.{dense[0]}.ffn_gate.weight")[0])
    if gf.get("{arch}.expert_count"):
        config.update(_moe_config(gf, arch, layers, dense))
    for key, meta in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if (token_id := gf.get(f"tokenizer.ggml.{meta}")) is not None:
            config[key] = token_id
    if eos := _eos_ids(gf):
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return config


def _mla_config(gf: GgufFile, heads: int) -> dict[str, Any]:
    """DeepSeek's MLA sizes, from the tensors' shapes (checked against the keys that name them): q_lora_rank (null
    without attn_q_a), kv_lora_rank, qk_nope / qk_rope / v head dims. HF's num_key_value_heads is the head count."""
    q_a = "blk.0.attn_q_a.weight" in gf.tensors
    q_name = _require_tensor(gf, "blk.0.attn_q_b.weight" if q_a else "blk.0.attn_q.weight")
    kv_a = _require_tensor(gf, "blk.0.attn_kv_a_mqa.weight")
    rank = gf.shape(_require_tensor(gf, "blk.0.attn_kv_a_norm.weight"))[0]
    rope = gf.shape(kv_a)[0] - rank
    q_head = gf.shape(q_name)[0] // heads
    if "blk.0.attn_kv_b.weight" in gf.tensors:
        kv_head = gf.shape("blk.0.attn_kv_b.weight")[0] // heads  # nope + v
        nope = q_head - rope
        v_dim = kv_head - nope
    else:
        k_b, v_b = (_require_tensor(gf, f"blk.0.{leaf}.weight") for leaf in MLA_HALVES)
        nope, v_dim = gf.shape(k_b)[-1], gf.shape(v_b)[-2]
    for key, have in (("{arch}.attention.kv_lora_rank", rank), ("{arch}.rope.dimension_count", rope),
                      ("{arch}.attention.key_length_mla", nope + rope), ("{arch}.attention.value_length_mla", v_dim)):
        stored = gf.get(key)
        if stored is not None and int(stored) != have:
            raise ModelLoadError(f"{gf.path}: {key.format(arch=gf.arch)} is {stored}, but the tensors' shapes say "
                                 f"{have}")
    if nope + rope != q_head or min(nope, rope, v_dim, rank) < 1:
        raise ModelLoadError(f"{gf.path}: MLA shapes do not fit: query heads of {q_head} dims, RoPE part {rope}, "
                             f"no-RoPE part {nope}, value heads {v_dim}, kv_lora_rank {rank}")
    rope_parameters = _rope_parameters(gf, rope)
    if rope_parameters["rope_type"] == "yarn" and (mul := gf.get("{arch}.rope.scaling.yarn_log_multiplier")):
        rope_parameters["mscale"] = rope_parameters["mscale_all_dim"] = float(mul) / 0.1
    return {"num_key_value_heads": heads, "head_dim": rope, "q_lora_rank": gf.shape(q_name)[1] if q_a else None,
            "kv_lora_rank": rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v_dim,
            "rope_interleave": True, "rope_parameters": rope_parameters,
            "attention_bias": "blk.0.attn_q_a.bias" in gf.tensors or "blk.0.attn_kv_a_mqa.bias" in gf.tensors}


def _gpt_oss_config(gf: GgufFile, layers: int) -> dict[str, Any]:
    """gpt-oss: the sliding window and which layers use it (llama.cpp: every even layer, unless the file lists a
    per-layer `attention.sliding_window_pattern`), YaRN without truncation (as the released config says), the
    SwiGLU clamp (llama.cpp's constant 7 unless `swiglu_clamp_exp` says otherwise)."""
    window = int(gf.require("{arch}.attention.sliding_window"))
    pattern = gf.get("{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) < layers:
            raise ModelLoadError(f"{gf.path}: {gf.arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                 f"for {layers} layers")
        sliding = [bool(p) for p in pattern[:layers]]
    else:
        sliding = [i % 2 == 0 for i in range(layers)]
    out: dict[str, Any] = {"sliding_window": window, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if (clamp := gf.get("{arch}.swiglu_clamp_exp")) is not None:
        out["swiglu_limit"] = float(_single(gf, "{arch}.swiglu_clamp_exp", clamp))
    return out


def _moe_config(gf: GgufFile, arch: GgufArch, layers: int, dense: list[int]) -> dict[str, Any]:
    gating = gf.get("{arch}.expert_gating_func", arch.gating_absent)
    if gating != arch.gating:
        names = {SOFTMAX: "softmax", SIGMOID: "sigmoid"}
        raise ModelLoadError(f"{gf.path}: expert gating function {gating} ({names.get(gating, 'unknown')}) is not "
                             f"supported for {gf.arch}; tsterm routes it with {names[arch.gating]}"
                             + (" (a file without expert_gating_func is DeepSeek-V2's softmax routing)"
                                if arch.mla and gating == SOFTMAX else ""))
    experts = int(gf.require("{arch}.expert_count"))
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in gf.tensors
                  or f"blk.{i}.ffn_gate_up_exps.weight" in gf.tensors]
    if not moe_layers:
        raise ModelLoadError(f"{gf.path}: expert_count is {experts} but no blk.N.ffn_gate_exps tensor exists")
    first = f"blk.{moe_layers[0]}."
    expert_width = gf.get("{arch}.expert_feed_forward_length") or (
        gf.shape(first + "ffn_gate_exps.weight")[1] if first + "ffn_gate_exps.weight" in gf.tensors
        else gf.shape(first + "ffn_gate_up_exps.weight")[1] // 2)
    moe: dict[str, Any] = {
        arch.experts_key: experts,
        "num_experts_per_tok": int(gf.require("{arch}.expert_used_count")),
        "moe_intermediate_size": int(expert_width),
    }
    if arch.model_type != "gpt_oss":  # (gpt-oss: a softmax over the chosen logits, normalised by construction)
        moe["norm_topk_prob"] = bool(gf.get("{arch}.expert_weights_norm", arch.norm_topk_prob))
    if arch.expert_width_key != "moe_intermediate_size":  # Mixtral, gpt-oss, MiniMax: intermediate_size
        moe[arch.expert_width_key] = moe["moe_intermediate_size"]
    if arch.leading_dense:  # GLM, DeepSeek: the first k layers dense, every other one routed
        leading = int(gf.get("{arch}.leading_dense_block_count", len(dense)))
        if dense != list(range(leading)) or moe_layers != list(range(leading, layers)):
            raise ModelLoadError(f"{gf.path}: {gf.arch}.leading_dense_block_count is {leading}, but the dense "
                                 f"layers are {dense} and the routed ones {moe_layers}")
        moe["first_k_dense_replace"] = leading
    else:
        moe.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if i not in moe_layers])
    if arch.gating == SIGMOID:
        moe["scoring_func"] = "sigmoid"
        moe["routed_scaling_factor"] = float(gf.get("{arch}.expert_weights_scale", 1.0) or 1.0)
        if arch.leading_dense:
            moe["n_group"] = int(gf.get("{arch}.expert_group_count", 1) or 1)
            moe["topk_group"] = int(gf.get("{arch}.expert_group_used_count", 1) or 1)
        if arch.mla:
            moe["topk_method"] = "noaux_tc"
        missing = [i for i in moe_layers if f"blk.{i}.exp_probs_b.bias" not in gf.tensors]
        if missing:
            raise ModelLoadError(f"{gf.path}: routed layers {missing} have no selection bias blk.N.exp_probs_b.bias "
                                 f"(e_score_correction_bias), which {arch.model_type}'s sigmoid routing needs")
    shared = first + "ffn_gate_shexp.weight"
    if shared in gf.tensors:
        width = int(gf.shape(shared)[0])
        if arch.leading_dense:  # HF: n_shared_experts fused into one MLP n x moe_intermediate_size wide
            count = int(gf.get("{arch}.expert_shared_count", 0) or width // int(expert_width))
            if count * int(expert_width) != width:
                raise ModelLoadError(f"{gf.path}: the shared expert is {width} wide, not {gf.arch}.expert_shared_count"
                                     f" ({count}) x expert_feed_forward_length ({expert_width})")
            moe["n_shared_experts"] = count
        else:
            moe["shared_expert_intermediate_size"] = int(gf.get("{arch}.expert_shared_feed_forward_length")
                                                         or width)
    elif arch.leading_dense:
        moe["n_shared_experts"] = 0
    return moe


def _rope_parameters(gf: GgufFile, head_dim: int) -> dict[str, Any]:
    theta = float(gf.get("{arch}.rope.freq_base", 10000.0))
    kind = gf.get("{arch}.rope.scaling.type", "none")
    factor = gf.get("{arch}.rope.scaling.factor")
    original = gf.get("{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in gf.tensors:  # llama 3.x: per-frequency divisors instead of parameters
        return _llama3_rope(gf, theta, head_dim, original)
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        if factor is None or original is None:
            raise ModelLoadError(f"{gf.path}: yarn rope scaling needs {gf.arch}.rope.scaling.factor and "
                                 f"{gf.arch}.rope.scaling.original_context_length")
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for key, meta in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if (value := gf.get(f"{{arch}}.rope.scaling.{meta}")) is not None:
                params[key] = float(value)
        if gf.arch == "gpt-oss":  # gpt-oss's YaRN keeps its correction range unrounded (config.json truncate: false)
            params["truncate"] = False
        return params
    raise ModelLoadError(f"{gf.path}: rope scaling {kind!r} is not supported (supported: none, linear, yarn, "
                         "llama3)")


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs.weight` for llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ratio = original * inv_freq / (2 * np.pi)  # original context / wavelength
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_rope(gf: GgufFile, theta: float, head_dim: int, original: int | None) -> dict[str, Any]:
    stored = gf.dequantize("rope_freqs.weight").astype(np.float64)
    factor = float(stored.max())
    for original_ctx in dict.fromkeys([original or 8192, 8192, 4096, 2048]):
        expected = llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, original_ctx)
        if expected.shape == stored.shape and np.allclose(stored, expected, rtol=1e-3):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": int(original_ctx)}
    raise ModelLoadError(f"{gf.path}: rope_freqs.weight does not match llama3 rope scaling with the usual "
                         "low/high frequency factors (1, 4); this rope variant is not supported")


def _eos_ids(gf: GgufFile) -> list[int]:
    """llama.cpp ends generation at eos and also at end-of-turn / end-of-message tokens."""
    ids = [gf.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def build_generation_config(gf: GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for key, meta in (("temperature", "temp"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("repetition_penalty", "penalty_repeat")):
        if (value := gf.get(f"general.sampling.{meta}")) is not None:
            out[key] = value
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rows order per head [pairs interleaved] -> HF [first half | second half]."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def is_linear(hf_name: str, mla: bool = False) -> bool:
    """Whether tsterm multiplies by this weight through its linear seam (what may stay quantized). `mla`: DeepSeek's
    attention, whose q_a / q_b / kv_a / kv_b projections are linears too."""
    if hf_name == "lm_head.weight":
        return True
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else ""
    return leaf.endswith(LINEAR_LEAVES) or (mla and leaf.endswith(MLA_LINEAR_LEAVES))
