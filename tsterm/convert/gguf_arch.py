"""llama.cpp's names -> Hugging Face's: which HF architecture a GGUF `general.architecture` becomes, its config.json
(llama.cpp metadata keys -> transformers' names, rope scaling included), generation_config.json, and each tensor's
HF name and layout (llama.cpp's q/k row permutation undone).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tsterm.convert.gguf_reader import GgufFile
from tsterm.errors import ModelLoadError


@dataclass(frozen=True)
class GgufArch:
    model_type: str
    hf_class: str
    unpermute_qk: bool = False  # llama.cpp permutes q/k rows (interleaved rope) for its `llama` arch only
    norm_topk_prob: bool = True  # llama.cpp's behaviour when the file has no `expert_weights_norm`


# `general.architecture` -> what it becomes; a dense `llama` file with experts is Mixtral (see arch_of).
GGUF_ARCHS = {
    "llama": GgufArch("llama", "LlamaForCausalLM", unpermute_qk=True),
    "qwen2": GgufArch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GgufArch("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": GgufArch("qwen2_moe", "Qwen2MoeForCausalLM", norm_topk_prob=False),
    "qwen3moe": GgufArch("qwen3_moe", "Qwen3MoeForCausalLM"),
}
MIXTRAL = GgufArch("mixtral", "MixtralForCausalLM", unpermute_qk=True)

# Per-block leaf names; "{moe}" is the architecture's sparse-block prefix. The gate/up expert pair is fused.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate", "ffn_gate_inp_shexp": "{moe}.shared_expert_gate",
    "ffn_gate_shexp": "{moe}.shared_expert.gate_proj", "ffn_up_shexp": "{moe}.shared_expert.up_proj",
    "ffn_down_shexp": "{moe}.shared_expert.down_proj",
}


GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


EXPERT_LEAVES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# HF leaf names (after model.layers.N.) of the matrices tsterm multiplies through its linear seam
LINEAR_LEAVES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")


def arch_of(gf: GgufFile) -> GgufArch:
    from tsterm.model.arch import ARCHITECTURES

    arch = GGUF_ARCHS.get(gf.arch)
    if arch is not None and gf.arch == "llama" and gf.get("{arch}.expert_count", 0):
        arch = MIXTRAL
    if arch is None or arch.model_type not in ARCHITECTURES:
        known = sorted(a for a, spec in GGUF_ARCHS.items() if spec.model_type in ARCHITECTURES)
        what = f"{gf.arch!r}" + (f" ({arch.model_type})" if arch else "")
        raise ModelLoadError(f"{gf.path}: GGUF architecture {what} is not supported by tsterm yet "
                             f"(supported: {', '.join(known)})")
    return arch


def _single(gf: GgufFile, key: str, value: Any) -> Any:
    """Some files store a per-layer array; tsterm needs one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{gf.path}: {key.format(arch=gf.arch)} differs between layers ({value}); "
                                 "tsterm needs the same value in every layer")
        return value[0]
    return value


def build_config(gf: GgufFile, dtype: str = "float32") -> dict[str, Any]:
    """The HF config.json of this file (llama.cpp key names -> transformers names)."""
    arch = arch_of(gf)
    layers = int(gf.require("{arch}.block_count"))
    heads = int(_single(gf, "{arch}.attention.head_count", gf.require("{arch}.attention.head_count")))
    kv_heads = int(_single(gf, "{arch}.attention.head_count_kv", gf.get("{arch}.attention.head_count_kv", heads)))
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"):
        if name not in gf.tensors:
            raise ModelLoadError(f"{gf.path}: tensor {name!r} is missing; is this a complete {gf.arch} model?")
    vocab, hidden = gf.shape("token_embd.weight")
    head_dim = gf.shape("blk.0.attn_q.weight")[0] // heads
    rope_dim = gf.get("{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{gf.path}: partial rotary embeddings ({rope_dim} of {head_dim} head dims) are not "
                             "supported")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(gf.get("{arch}.context_length", 4096)),
        "rms_norm_eps": float(gf.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope_parameters(gf, head_dim),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "dtype": dtype,
    }
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate.weight" in gf.tensors]
    if dense:  # the width of the dense MLPs (per-layer lists in some MoE files: 0 on the sparse layers)
        width = gf.get("{arch}.feed_forward_length")
        width = [width[i] for i in dense] if isinstance(width, list) else width
        config["intermediate_size"] = int(_single(gf, "{arch}.feed_forward_length", width) or
                                          gf.shape(f"blk.{dense[0]}.ffn_gate.weight")[0])
    if gf.get("{arch}.expert_count"):
        config.update(_moe_config(gf, arch, layers))
    for key, meta in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if (token_id := gf.get(f"tokenizer.ggml.{meta}")) is not None:
            config[key] = token_id
    if eos := _eos_ids(gf):
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return config


def _moe_config(gf: GgufFile, arch: GgufArch, layers: int) -> dict[str, Any]:
    if gf.get("{arch}.expert_gating_func", 1) != 1:
        raise ModelLoadError(f"{gf.path}: expert gating function {gf.get('{arch}.expert_gating_func')} "
                             "(sigmoid) is not supported; tsterm routes with softmax")
    experts = int(gf.require("{arch}.expert_count"))
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in gf.tensors]
    if not moe_layers:
        raise ModelLoadError(f"{gf.path}: expert_count is {experts} but no blk.N.ffn_gate_exps tensor exists")
    expert_width = gf.get("{arch}.expert_feed_forward_length") or \
        gf.shape(f"blk.{moe_layers[0]}.ffn_gate_exps.weight")[1]
    moe = {
        "num_local_experts" if arch is MIXTRAL else "num_experts": experts,
        "num_experts_per_tok": int(gf.require("{arch}.expert_used_count")),
        "moe_intermediate_size": int(expert_width),
        "norm_topk_prob": bool(gf.get("{arch}.expert_weights_norm", arch.norm_topk_prob)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in moe_layers],
    }
    if arch is MIXTRAL:  # Mixtral's config names the expert width intermediate_size
        moe["intermediate_size"] = moe["moe_intermediate_size"]
    shared = f"blk.{moe_layers[0]}.ffn_gate_shexp.weight"
    if shared in gf.tensors:
        moe["shared_expert_intermediate_size"] = int(gf.get("{arch}.expert_shared_feed_forward_length")
                                                     or gf.shape(shared)[0])
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
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for key, meta in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if (value := gf.get(f"{{arch}}.rope.scaling.{meta}")) is not None:
                params[key] = float(value)
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


def hf_name_of(gf: GgufFile, moe_prefix: str, name: str) -> str | None:
    """HF name of a GGUF tensor; None for those handled elsewhere (fused experts, rope_freqs)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name == "rope_freqs.weight":
        return None
    match = BLOCK_RE.fullmatch(name)
    if match and match[2] in EXPERT_LEAVES:
        return None
    if not match or match[2] not in BLOCK_NAMES:
        raise ModelLoadError(f"{gf.path}: tensor {name!r} has no counterpart in the {gf.arch} architecture "
                             "(an unsupported variant?)")
    return f"model.layers.{match[1]}.{BLOCK_NAMES[match[2]].format(moe=moe_prefix)}.{match[3]}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rows order per head [pairs interleaved] -> HF [first half | second half]."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def is_linear(hf_name: str) -> bool:
    """Whether tsterm multiplies by this weight through its linear seam (what may stay quantized)."""
    if hf_name == "lm_head.weight":
        return True
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else ""
    return leaf.endswith(LINEAR_LEAVES)
