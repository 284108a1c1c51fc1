"""Tiny GGUFs of gpt-oss, GLM-4.5 (glm4moe), DeepSeek-V3 (deepseek2) and MiniMax-M2 written the way llama.cpp's
convert_hf_to_gguf.py writes them, from a checkpoint transformers saved (tests.helpers.checkpoints.make_checkpoint).

gguf-py's own `TensorNameMap` names every tensor (so the names are llama.cpp's, not this module's idea of them); the
converter's per-family steps are redone here: routed experts stacked per layer ([E, out, in]), the selection bias
`e_score_correction_bias` renamed `e_score_correction.bias` before mapping (-> `exp_probs_b.bias`), gpt-oss's sinks
given a `.weight` and its interleaved `gate_up_proj` [E, H, 2I] split into gate (even columns) and up (odd ones),
transposed to [E, I, H] (likewise the biases and `down_proj`), optionally fused back as `ffn_gate_up_exps` (gate rows,
then up rows); DeepSeek's `kv_b_proj` either kept (older files) or split per head into `attn_k_b` (the key rows,
each head's matrix transposed: [H, kv_lora_rank, nope]) and `attn_v_b` [H, v, kv_lora_rank]; GLM's MTP layer written
after the last one (`nextn_predict_layers`, counted in `block_count`). No q/k permutation (these families' RoPE is
NeoX or, DeepSeek's, interleaved as HF stores it). The hyperparameters go under llama.cpp's keys.

`quantize(gguf_name, shape)` picks each tensor's GGML type (None: float32); gguf-py quantizes (MXFP4, Q8_0, ...),
tests.helpers.gguf the K-quants.
`fake_quantized(model, ...)` is the same model with every weight that became a quantized tensor replaced by what
that tensor dequantizes to, worked out in HF's layout (quantization runs along the GGUF rows: HF's last dimension,
or for gpt-oss's expert matrices, stored [E, in, out], its second): the oracle transformers runs for a quantized file.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tests.helpers.gguf import MERGES, quantize_kquant, tiny_vocab

ARCHS = {"gpt_oss": "GPT_OSS", "glm4_moe": "GLM4_MOE", "deepseek_v3": "DEEPSEEK2", "minimax_m2": "MINIMAXM2"}
PRE = {"gpt_oss": "gpt-4o", "glm4_moe": "glm4", "deepseek_v3": "deepseek-v3", "minimax_m2": "minimax-m2"}
EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
QuantizeFn = Callable[[str, tuple[int, ...]], object]


def load_state(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update({k: v.astype(np.float32) for k, v in load_file(str(file)).items()})
    return state


def add_mtp_layer(state: dict[str, np.ndarray], cfg: dict, seed: int = 5) -> None:
    """GLM's MTP layer as its checkpoints ship it, after the last decoder layer: a whole decoder layer (a copy of the
    last one's names and shapes, random values) plus the nextn tensors (eh_proj, enorm, hnorm, shared_head.norm)."""
    rng = np.random.default_rng(seed)
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = f"model.layers.{n - 1}."
    for name in [k for k in state if k.startswith(last)]:
        state[f"model.layers.{n}." + name[len(last):]] = rng.normal(0, 0.2, state[name].shape).astype(np.float32)
    state[f"model.layers.{n}.eh_proj.weight"] = rng.normal(0, 0.2, (hidden, 2 * hidden)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.{n}.{norm}.weight"] = np.ones(hidden, np.float32)


def gguf_tensors(state: dict[str, np.ndarray], cfg: dict, model_type: str, split_kv_b: bool = True,
                 fuse_gate_up: bool = False, block_count: int | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names and layout (see the module docstring)."""
    import gguf

    blocks = block_count or cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[model_type]), blocks)
    renamed: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}
    for name, w in state.items():
        if (m := EXPERT_RE.fullmatch(name)) is not None:  # stacked below, as the converter's _experts cache does
            experts.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = w
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if model_type == "gpt_oss" and name.endswith("sinks"):
            name += ".weight"
        renamed[name] = w
    for (layer, moe, leaf), per_expert in experts.items():
        renamed[f"model.layers.{layer}.{moe}.experts.{leaf}.weight"] = np.stack([per_expert[e]
                                                                                for e in sorted(per_expert)])
    if model_type == "gpt_oss":
        for name in [k for k in renamed if k.endswith(("experts.gate_up_proj", "experts.down_proj",
                                                      "experts.gate_up_proj_bias", "experts.down_proj_bias"))]:
            w, base = renamed.pop(name), name.rsplit(".", 1)[0] + "."
            if name.endswith("_bias"):
                parts = {"gate_proj": w[:, 0::2], "up_proj": w[:, 1::2]} if "gate_up" in name else {"down_proj": w}
                suffix = "bias"
            else:
                w = w.transpose(0, 2, 1)  # HF [E, in, out] -> [E, out, in]
                parts = {"gate_proj": w[:, 0::2], "up_proj": w[:, 1::2]} if "gate_up" in name else {"down_proj": w}
                suffix = "weight"
            for leaf, part in parts.items():
                renamed[f"{base}{leaf}.{suffix}"] = np.ascontiguousarray(part)
    out: dict[str, np.ndarray] = {}
    for name, w in renamed.items():
        if model_type == "deepseek_v3" and name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            assert w.shape[0] == heads * (nope + v)  # (llama.cpp splits by the HF num_key_value_heads)
            kv_b = w.reshape(heads, nope + v, w.shape[-1])
            for half, part in (("k_b_proj", kv_b[:, :nope].transpose(0, 2, 1)), ("v_b_proj", kv_b[:, nope:])):
                out[_map(tmap, name.replace("kv_b_proj", half))] = np.ascontiguousarray(part)
            continue
        out[_map(tmap, name)] = w
    if fuse_gate_up:  # newer converters' option: one [E, 2I, H] tensor (and bias [E, 2I]), gate rows first
        for gate in [k for k in out if ".ffn_gate_exps." in k]:
            up = gate.replace("ffn_gate_exps", "ffn_up_exps")
            out[gate.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([out.pop(gate), out.pop(up)],
                                                                                    axis=1)
    return out


def _map(tmap, name: str) -> str:
    mapped = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, f"gguf-py has no llama.cpp name for {name}"
    return mapped


def write(path: Path, model_dir: Path, model_type: str, quantize: QuantizeFn | None = None,
          split_kv_b: bool = True, fuse_gate_up: bool = False, mtp_layer: bool = False,
          tensors: dict[str, np.ndarray] | None = None, drop_keys: tuple[str, ...] = (),
          pre: str | None = None) -> Path:
    """Writes the checkpoint in `model_dir` as a GGUF at `path` (see the module docstring). `tensors`: written
    instead of the converted ones (a test's damaged copy); `drop_keys`: metadata keys left out ("{arch}." form);
    `pre`: tokenizer.ggml.pre (default: the family's)."""
    import gguf

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    state = load_state(model_dir)
    nextn = 1 if mtp_layer else 0
    if mtp_layer:
        add_mtp_layer(state, cfg)
    if tensors is None:
        tensors = gguf_tensors(state, cfg, model_type, split_kv_b, fuse_gate_up, cfg["num_hidden_layers"] + nextn)
    arch = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, ARCHS[model_type])]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in _metadata(cfg, model_type, nextn).items():
        if key in drop_keys:
            continue
        key = key.format(arch=arch)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_name(f"tiny-{model_type}")
    tokens, types = tiny_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or PRE[model_type])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in tensors.items():
        qtype = quantize(name, w.shape) if quantize else None
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            writer.add_tensor(name, quantized(np.ascontiguousarray(w, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _metadata(cfg: dict, model_type: str, nextn: int) -> dict[str, object]:
    """llama.cpp's hyperparameter keys for this config, as the converter's set_gguf_parameters writes them (the base
    class's, then the family's; real DeepSeek-V3 / MiniMax-M2 configs name scoring_func sigmoid, which transformers'
    config classes drop: written here as the converter writes it for them)."""
    rope = cfg.get("rope_parameters") or {}
    md: dict[str, object] = {
        "{arch}.block_count": cfg["num_hidden_layers"] + nextn,
        "{arch}.context_length": cfg["max_position_embeddings"],
        "{arch}.embedding_length": cfg["hidden_size"],
        "{arch}.feed_forward_length": cfg["intermediate_size"],
        "{arch}.attention.head_count": cfg["num_attention_heads"],
        "{arch}.attention.head_count_kv": cfg["num_key_value_heads"],
        "{arch}.rope.freq_base": float(rope["rope_theta"]),
        "{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "{arch}.expert_used_count": cfg["num_experts_per_tok"],
    }
    if rope.get("rope_type") == "yarn":
        md.update({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": float(rope["factor"]),
                   "{arch}.rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
        for key in ("beta_fast", "beta_slow"):
            if key in rope:
                md[f"{{arch}}.rope.scaling.yarn_{key}"] = float(rope[key])
    if "n_group" in cfg:
        md["{arch}.expert_group_count"] = cfg["n_group"]
        md["{arch}.expert_group_used_count"] = cfg["topk_group"]
    if model_type != "deepseek_v3" and cfg.get("head_dim"):
        md["{arch}.attention.key_length"] = md["{arch}.attention.value_length"] = cfg["head_dim"]
    if model_type in ("deepseek_v3", "minimax_m2", "glm4_moe"):
        md["{arch}.expert_gating_func"] = 2  # sigmoid
    if model_type == "gpt_oss":
        md["{arch}.expert_count"] = cfg["num_local_experts"]
        md["{arch}.attention.sliding_window"] = cfg["sliding_window"]
        md["{arch}.expert_feed_forward_length"] = cfg["intermediate_size"]
    elif model_type == "minimax_m2":
        md["{arch}.expert_count"] = cfg["num_local_experts"]
        md["{arch}.expert_feed_forward_length"] = cfg["intermediate_size"]
        md["{arch}.rope.dimension_count"] = cfg["rotary_dim"]
    elif model_type == "glm4_moe":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        md.update({"{arch}.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.5)),
                   "{arch}.expert_count": cfg["n_routed_experts"],
                   "{arch}.expert_feed_forward_length": cfg["moe_intermediate_size"],
                   "{arch}.expert_shared_count": cfg["n_shared_experts"],
                   "{arch}.leading_dense_block_count": cfg["first_k_dense_replace"],
                   "{arch}.expert_weights_scale": float(cfg["routed_scaling_factor"]),
                   "{arch}.expert_weights_norm": bool(cfg["norm_topk_prob"]),
                   "{arch}.nextn_predict_layers": nextn})
    elif model_type == "deepseek_v3":
        rank, r, nope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
        md["{arch}.attention.head_count_kv"] = 1  # MLA written as MQA over the latent
        md.update({"{arch}.leading_dense_block_count": cfg["first_k_dense_replace"],
                   "{arch}.vocab_size": cfg["vocab_size"],
                   "{arch}.attention.kv_lora_rank": rank,
                   "{arch}.attention.key_length": rank + r, "{arch}.attention.value_length": rank,
                   "{arch}.attention.key_length_mla": nope + r, "{arch}.attention.value_length_mla": cfg["v_head_dim"],
                   "{arch}.expert_feed_forward_length": cfg["moe_intermediate_size"],
                   "{arch}.expert_count": cfg["n_routed_experts"],
                   "{arch}.expert_shared_count": cfg["n_shared_experts"],
                   "{arch}.expert_weights_scale": float(cfg["routed_scaling_factor"]),
                   "{arch}.rope.dimension_count": r})
        if cfg.get("q_lora_rank"):
            md["{arch}.attention.q_lora_rank"] = cfg["q_lora_rank"]
        if cfg["norm_topk_prob"]:
            md["{arch}.expert_weights_norm"] = True
        if rope.get("mscale_all_dim"):
            md["{arch}.rope.scaling.yarn_log_multiplier"] = 0.1 * float(rope["mscale_all_dim"])
    return md


def fake_quantized(model, model_type: str, quantize: QuantizeFn, split_kv_b: bool = True):
    """`model` (transformers, float32) with each weight that `quantize` made a quantized GGUF tensor replaced by what
    that tensor dequantizes to (gguf-py's quantizer and dequantizer, along the GGUF rows), in place; returns it."""
    import gguf

    cfg = model.config.to_dict()
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[model_type]), cfg["num_hidden_layers"])
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if model_type == "deepseek_v3" and name.endswith("kv_b_proj.weight") and split_kv_b:
                param.copy_(_fake_quantized_halves(tmap, name, param, cfg, quantize))
                continue
            target = _gguf_target(tmap, name, model_type, split_kv_b)
            if target is None:
                continue
            gguf_name, transposed = target
            w = param.detach().float().numpy()
            w = w.swapaxes(-1, -2) if transposed else w  # GGUF rows last
            qtype = quantize(gguf_name, w.shape[-2:])
            if qtype is None:
                continue
            rows = w.reshape(-1, w.shape[-1])
            back = gguf.quants.dequantize(quantized(np.ascontiguousarray(rows), qtype), qtype)
            back = back.reshape(w.shape)
            param.copy_(torch.from_numpy(np.ascontiguousarray(back.swapaxes(-1, -2) if transposed else back)))
    return model


def _fake_quantized_halves(tmap, name: str, param: torch.Tensor, cfg: dict, quantize: QuantizeFn) -> torch.Tensor:
    """DeepSeek's kv_b_proj as its split GGUF halves dequantize: attn_k_b [H, rank, nope] (each head's key rows
    transposed) and attn_v_b [H, v, rank], each quantized along its own rows as `quantize` says, put back."""
    import gguf

    heads, nope = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"]
    kv_b = param.detach().float().numpy().reshape(heads, -1, param.shape[-1])
    halves = {"k_b_proj": kv_b[:, :nope].transpose(0, 2, 1), "v_b_proj": kv_b[:, nope:]}
    for half, w in halves.items():
        qtype = quantize(_map(tmap, name.replace("kv_b_proj", half)), w.shape[-2:])
        if qtype is not None:
            rows = np.ascontiguousarray(w.reshape(-1, w.shape[-1]))
            halves[half] = gguf.quants.dequantize(quantized(rows, qtype), qtype).reshape(w.shape)
    back = np.concatenate([halves["k_b_proj"].transpose(0, 2, 1), halves["v_b_proj"]], axis=1)
    return torch.from_numpy(np.ascontiguousarray(back.reshape(param.shape)))


def quantized(w: np.ndarray, qtype) -> np.ndarray:
    """gguf-py's quantization of `w` as `qtype`; the K-quants (which gguf-py cannot make) by tests.helpers.gguf's."""
    import gguf

    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        return quantize_kquant(w, qtype)


def _gguf_target(tmap, hf_name: str, model_type: str, split_kv_b: bool) -> tuple[str, bool] | None:
    """The GGUF tensor an in-memory transformers weight lands in (a representative one for split / stacked ones)
    and whether its GGUF rows run along the weight's second-to-last dimension; None for ones never quantized here
    (DeepSeek's split kv_b: `fake_quantized` quantizes its halves apart, `_fake_quantized_halves`)."""
    name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
    if model_type == "gpt_oss" and ".mlp.experts." in name:
        if name.endswith("_bias"):
            return None
        leaf = "gate_proj" if "gate_up_proj" in name else "down_proj"
        return _map(tmap, name.rsplit(".", 1)[0] + f".{leaf}.weight"), True
    if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:  # transformers-5's fused in-memory experts
        leaf = "gate_proj" if "gate_up_proj" in name else "down_proj"
        prefix = name.split(".experts.")[0]
        if model_type == "minimax_m2":
            prefix, leaf = prefix.replace(".mlp", ".block_sparse_moe"), {"gate_proj": "w1", "down_proj": "w2"}[leaf]
        return _map(tmap, f"{prefix}.experts.{leaf}.weight"), False
    if model_type == "deepseek_v3" and name.endswith("kv_b_proj.weight") and split_kv_b:
        return None
    mapped = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None and model_type == "minimax_m2" and ".mlp." in name:
        mapped = tmap.get_name(name.replace(".mlp.", ".block_sparse_moe."), try_suffixes=(".weight", ".bias"))
    assert mapped is not None, hf_name
    return mapped, False
