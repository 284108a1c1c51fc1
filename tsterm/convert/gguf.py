"""Imports a llama.cpp GGUF file as an HF-format model directory: config.json, safetensors, tokenizer files.

Each tensor is renamed to its HF name and put back in HF layout: llama.cpp's rotary row permutation of q/k is
undone for `llama` files (its converter applies it only there), and MoE experts are written already stacked
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`), which the loader then uses in place.
The output appears atomically: everything is written to a temporary sibling directory, renamed at the end.

Native blocks (the default). A linear weight (attention q/k/v/o, MLP and expert gate/up/down, shared experts,
`output` / the tied `token_embd` as the LM head) stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K stays quantized,
converted with numpy into `tsterm_kernels.quant`'s layout (blocks of 32 inputs; `tsterm.convert.kquant` says how,
per GGML type) and written as two tensors in place of `<hf name>` (e.g. `model.layers.0.self_attn.q_proj.weight`):

- `<hf name>.qcodes`: int8 [..., O, I] (kind int8: Q8_0, Q5_K, Q6_K) or uint8 [..., O, I/2] (kind int4: Q4_0,
  Q4_1, Q4_K; byte j of a block's 16 holds input j in its low nibble, input j + 16 in its high one);
- `<hf name>.qscales`: float16, int8 -> [..., O, I/32] (d: W = code * d); int4 -> [..., O, I/32, 2] (d, m:
  W = code * d + m).

Every other transformation is exact: q/k rows are un-permuted as whole rows of codes and scales, gate/up experts
are concatenated along their rows when both became the same kind (else both are dequantized). A tied model keeps a
float `model.embed_tokens.weight` for the row lookup and gets `lm_head.weight.qcodes/.qscales` from the same
blocks. config.json gets `quantization_config: {"quant_method": "gguf_blocks", "block_size": 32}` (tsterm's own:
transformers cannot load such a directory), and gguf_import.json lists which tensors stayed quantized and from
which GGUF type (`quantized`), and which of them were re-quantized (`requantized`). Every other type (F32, F16,
BF16, Q2_K, Q3_K, Q5_x, ...) and every other tensor (embedding lookup, norms, router) is dequantized (the `gguf`
package's numpy reference) and cast to the target dtype. `dequantize=True` (`--dequantize`) dequantizes
everything: a plain HF checkpoint that transformers loads too.

The MoE families (`gpt-oss`, `glm4moe`, `deepseek2`, `minimax-m2`; names and keys: `gguf_arch`): llama.cpp's
`ffn_gate_up_exps` (gate and up fused) is taken as it is; DeepSeek's MLA projections (q_a, q_b or q_proj, kv_a,
kv_b, o) are linears like any other (tsterm's MLA multiplies by them through its seam; the absorbed form's float
W_UK / W_UV are dequantized from kv_b at load); its `attn_k_b` / `attn_v_b` halves are put back together as
`kv_b_proj`: floats, or where a half is of a type kept as blocks, int8 blocks along kv_lora_rank re-quantized
from the halves' values (the key half's file blocks run along nope; a Q8_0 value half comes back as its own
blocks; listed in `requantized`);
the selection bias and gpt-oss's sinks are written float32 whatever the dtype (the loader reads them so); the
layers after the last one (GLM's MTP) are left out and listed in gguf_import.json (`skipped`). gpt-oss's experts go
back to its checkpoints' layout, gate and up interleaved (HF's row 2i is gate i, 2i + 1 up i; the biases likewise):
MXFP4 in the file (the released gpt-oss GGUFs' experts) -> `<name>_blocks` / `<name>_scales` as gpt-oss's own
checkpoints store them (the blocks' bytes moved, their nibbles put in that order: exact), recorded as "MXFP4" in
`quantized` (config.json `quant_method: "mxfp4"` when nothing else stayed blocks); gate / up and down of
`NATIVE_TYPES` (gate and up of one kind) -> `.qcodes` / `.qscales` in tsterm's layout, `gate_up_proj` [E, 2I, H]
(rows interleaved as above) and `down_proj` [E, H, I], which the loader keeps as blocks; any other type -> floats,
`gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (HF's transposed layout).

The parts of the import live beside this module: `gguf_reader` (the file), `kquant` (block repacking), `gguf_arch`
(architecture maps, config.json), `gguf_tokenizer` (tokenizer files); `gguf_cli` is `tsterm import-gguf`, and
`shipped` imports the default model on first use.
"""
from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tsterm.convert.gguf_arch import (BLOCK_RE, EXPERT_LEAVES, GLOBAL_NAMES, LAYER_RE, MLA_HALVES, GgufArch, arch_of,
                                      block_names, build_config, build_generation_config, is_linear, unpermute_qk)
from tsterm.convert.gguf_reader import GgufFile
from tsterm.convert.gguf_tokenizer import build_tokenizer_config, build_tokenizer_json
from tsterm.convert.kquant import BLOCK, NATIVE_TYPES, Blocks
from tsterm.errors import ConfigError, ModelLoadError
from tsterm.paths import replace_dir

ProgressFn = Callable[[int, int, str], None]  # (tensors done, tensors total, GGUF tensor name)
IMPORTER_VERSION = 4  # bump when the output changes (2: Q8_0/Q4_x blocks, 3: K-quants too, 4: the default model's
# recommended sampling in its generation_config.json); ensure_default_model
# re-imports older dirs
DEFAULT_SHARD_BYTES = 4 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INFO_FILE = "gguf_import.json"
QUANT_METHOD = "gguf_blocks"  # config.json's quantization_config.quant_method of a native import
CODES, SCALES = ".qcodes", ".qscales"  # suffixes of a quantized weight's two tensors (after its HF name)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # ... of gpt-oss's MXFP4 experts (its checkpoints' names)


Weight = tuple[str, "torch.Tensor | Blocks | Mxfp4"]  # (HF name, float tensor, blocks or MXFP4 blocks)
KEEP_FLOAT32 = ("e_score_correction_bias", "self_attn.sinks")  # the loader reads these as float32 whatever the dtype
FloatsFn = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Mxfp4:
    """gpt-oss experts kept as MXFP4, in the layout of gpt-oss's own checkpoints: `<name>_blocks` uint8
    [E, O, I/32, 16] (input 2j in byte j's low nibble, 2j + 1 in its high one) and `<name>_scales` uint8 E8M0
    [E, O, I/32], which the loader reads as it reads those (`tsterm_kernels.quant.QuantizedWeight.mxfp4`)."""
    blocks: np.ndarray
    scales: np.ndarray


def _classify(gf: GgufFile, arch: GgufArch, names: dict[str, str], layers: int, name: str) -> tuple[str, str]:
    """What the import does with GGUF tensor `name`: ("tensor", HF name); ("experts", leaf.suffix) and ("half",
    leaf), gathered per block; ("config", ""): read into config.json (rope_freqs); ("skip", why)."""
    from tsterm.model.arch import ARCHITECTURES

    if name in GLOBAL_NAMES:
        return "tensor", GLOBAL_NAMES[name]
    if name == "rope_freqs.weight":
        return "config", ""
    layer = LAYER_RE.match(name)
    if layer and int(layer[1]) >= layers:
        return "skip", "an MTP / NextN layer, which tsterm does not run"
    match = BLOCK_RE.fullmatch(name)
    if match:
        key = f"{match[2]}.{match[3]}"
        if match[2] in EXPERT_LEAVES and (match[3] == "weight"
                                          or ARCHITECTURES[arch.model_type].experts_interleaved):
            return "experts", key
        if arch.mla and match[2] in MLA_HALVES and match[3] == "weight":
            if f"blk.{match[1]}.attn_kv_b.weight" in gf.tensors:
                return "skip", "a half of attn_kv_b, which the file has whole too"
            return "half", match[2]
        if key in names:
            return "tensor", f"model.layers.{match[1]}.{names[key]}"
    raise ModelLoadError(f"{gf.path}: tensor {name!r} has no counterpart in the {gf.arch} architecture "
                         "(an unsupported variant?)")


def _iter_weights(gf: GgufFile, config: dict[str, Any], dtype: torch.dtype, progress: ProgressFn | None,
                  native: bool = True, skipped: list[str] | None = None) -> Iterator[Weight]:
    """(HF name, tensor, Blocks or Mxfp4) in file order by block, so only one block is ever held in memory.
    `native`: linear weights of a `NATIVE_TYPES` type come as `Blocks` (gpt-oss's MXFP4 experts as `Mxfp4`),
    everything else as float tensors in `dtype`. The names of the tensors left out (MTP layers) go to `skipped`."""
    from tsterm.model.arch import ARCHITECTURES

    arch = arch_of(gf)
    moe_prefix = ARCHITECTURES[config["model_type"]].moe_prefix
    names = block_names(arch)
    plan = [(name, _classify(gf, arch, names, config["num_hidden_layers"], name)) for name in gf.tensors]
    plan.sort(key=lambda item: _block_order(item[0]))  # stable: token_embd, blk.0..N (file order inside), output
    done = 0

    def advance(name: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, len(plan), name)

    def floats(name: str) -> torch.Tensor:
        return torch.from_numpy(_writable(gf.dequantize(name)))  # float32, HF layout [out, in]

    for block, items in itertools.groupby(plan, key=lambda item: _block_order(item[0])):
        gathered: dict[str, dict[str, str]] = {"experts": {}, "half": {}}
        for name, (kind, what) in items:
            if kind in gathered:
                gathered[kind][what] = name
                continue
            if kind == "tensor":
                yield from _plain_tensor(gf, arch, config, name, what, dtype, native, floats)
            elif kind == "skip" and skipped is not None:
                skipped.append(name)
            advance(name)
        if experts := gathered["experts"]:
            prefix = f"model.layers.{block}.{moe_prefix}.experts."
            interleaved = ARCHITECTURES[config["model_type"]].experts_interleaved
            yield from (_interleaved_experts if interleaved else _stacked_experts)(gf, experts, prefix, dtype, native,
                                                                                  floats)
            for name in experts.values():
                advance(name)
        if halves := gathered["half"]:
            kv_b = _mla_kv_b(gf, halves, config["num_attention_heads"], floats, native)
            yield f"model.layers.{block}.self_attn.kv_b_proj.weight", \
                kv_b if isinstance(kv_b, Blocks) else kv_b.to(dtype).contiguous()
            for name in halves.values():
                advance(name)


def _plain_tensor(gf: GgufFile, arch: GgufArch, config: dict[str, Any], name: str, hf_name: str,
                  dtype: torch.dtype, native: bool, floats: FloatsFn) -> Iterator[Weight]:
    """One GGUF tensor that becomes one HF tensor (the tied head: two)."""
    match = BLOCK_RE.fullmatch(name)
    tied_head = hf_name == "model.embed_tokens.weight" and config["tie_word_embeddings"]
    blocks = gf.blocks(name) if native and (is_linear(hf_name, arch.mla) or tied_head) else None
    if tied_head:  # the lookup needs floats; the head multiplies by the file's blocks
        yield hf_name, floats(name).to(dtype).contiguous()
        if blocks is not None:
            yield "lm_head.weight", blocks
        return
    values = blocks if blocks is not None else floats(name)
    if arch.unpermute_qk and match and match[2] in ("attn_q", "attn_k"):
        n_head = config["num_attention_heads"] if match[2] == "attn_q" else config["num_key_value_heads"]
        values = values.rows(lambda w: unpermute_qk(w, n_head)) if blocks is not None \
            else unpermute_qk(values, n_head)
    if blocks is not None:
        yield hf_name, values
        return
    if match and match[2] == "ffn_gate_inp_shexp":
        values = values.reshape(1, -1)  # llama.cpp stores the shared-expert gate as a vector
    keep = hf_name.endswith(KEEP_FLOAT32)
    yield hf_name, values.to(torch.float32 if keep else dtype).contiguous()


def _stacked_experts(gf: GgufFile, experts: dict[str, str], prefix: str, dtype: torch.dtype, native: bool,
                     floats: FloatsFn) -> Iterator[Weight]:
    """A block's experts -> `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj`
    [E, H, I]: llama.cpp's fused `ffn_gate_up_exps` as it is, its `ffn_gate_exps` + `ffn_up_exps` concatenated
    (as blocks when both became the same kind, else as floats)."""
    if "ffn_gate_up_exps.weight" in experts:
        name = experts["ffn_gate_up_exps.weight"]
        fused = gf.blocks(name) if native else None
        yield prefix + "gate_up_proj", fused if fused is not None else floats(name).to(dtype)
    else:
        gate_name, up_name = (_partner(gf, experts, leaf) for leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"))
        gate, up = (gf.blocks(n) if native else None for n in (gate_name, up_name))
        if gate is not None and up is not None and gate.kind == up.kind:  # [E, 2I, H]: rows concatenated
            both = gate.ggml_type if gate.ggml_type == up.ggml_type else f"{gate.ggml_type}+{up.ggml_type}"
            yield prefix + "gate_up_proj", Blocks(both, gate.kind, np.concatenate([gate.codes, up.codes], axis=1),
                                                  np.concatenate([gate.scales, up.scales], axis=1),
                                                  gate.requantized or up.requantized)
        else:
            yield prefix + "gate_up_proj", torch.cat([floats(gate_name), floats(up_name)], dim=1).to(dtype)
    down_name = _partner(gf, experts, "ffn_down_exps.weight")
    down = gf.blocks(down_name) if native else None
    yield prefix + "down_proj", down if down is not None else floats(down_name).to(dtype)  # [E, H, I]


def _partner(gf: GgufFile, experts: dict[str, str], key: str) -> str:
    if key not in experts:
        raise ModelLoadError(f"{gf.path}: expert tensors without their partners: {sorted(experts.values())} "
                             f"(no {key.split('.')[0]} beside them)")
    return experts[key]


def _interleaved_experts(gf: GgufFile, experts: dict[str, str], prefix: str, dtype: torch.dtype, native: bool,
                         floats: FloatsFn) -> Iterator[Weight]:
    """gpt-oss's experts back in its checkpoints' layout: gate and up interleaved (HF's row / column 2i is gate i,
    2i + 1 is up i) and the biases likewise. MXFP4 in the file (all three matrices; `native`): `gate_up_proj_blocks`
    / `_scales` [E, 2I, H/32, 16 | -] and `down_proj_blocks` / `_scales` [E, H, I/32, 16 | -], the blocks' bytes
    moved and their nibbles reordered (exact); all three of `NATIVE_TYPES` (gate and up of one kind; `native`):
    Blocks `gate_up_proj` [E, 2I, H] (rows interleaved: codes and scales moved, exact) and `down_proj` [E, H, I];
    anything else as floats: `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (HF's transposed layout)."""
    fused = "ffn_gate_up_exps.weight" in experts
    matrices = [experts["ffn_gate_up_exps.weight"]] if fused else \
        [_partner(gf, experts, f"ffn_{leaf}_exps.weight") for leaf in ("gate", "up")]
    down_name = _partner(gf, experts, "ffn_down_exps.weight")
    mx = [gf.mxfp4(n) for n in (*matrices, down_name)] if native else [None]
    blocks = [gf.blocks(n) for n in (*matrices, down_name)] if native and not all(m is not None for m in mx) \
        else [None]
    if all(m is not None for m in mx):
        *gate_up, down = mx
        codes = np.concatenate([m[0] for m in gate_up], axis=1)
        scales = np.concatenate([m[1] for m in gate_up], axis=1)
        yield prefix + "gate_up_proj", Mxfp4(_interleave_rows(codes), _interleave_rows(scales))
        yield prefix + "down_proj", Mxfp4(*down)
    elif all(b is not None for b in blocks) and len({b.kind for b in blocks[:-1]}) == 1:
        *gate_up, down = blocks
        types = list(dict.fromkeys(b.ggml_type for b in gate_up))
        yield prefix + "gate_up_proj", Blocks("+".join(types), gate_up[0].kind,
                                              _interleave_rows(np.concatenate([b.codes for b in gate_up], axis=1)),
                                              _interleave_rows(np.concatenate([b.scales for b in gate_up], axis=1)),
                                              any(b.requantized for b in gate_up))
        yield prefix + "down_proj", down
    else:
        gate_up = torch.cat([floats(n) for n in matrices], dim=1)  # [E, 2I, H]: gate rows, then up rows
        yield prefix + "gate_up_proj", _interleave_rows(gate_up).transpose(1, 2).to(dtype).contiguous()
        yield prefix + "down_proj", floats(down_name).transpose(1, 2).to(dtype).contiguous()
    if "ffn_gate_up_exps.bias" in experts:
        bias = floats(experts["ffn_gate_up_exps.bias"])
    else:
        bias = torch.cat([floats(_partner(gf, experts, f"ffn_{leaf}_exps.bias")) for leaf in ("gate", "up")], dim=1)
    yield prefix + "gate_up_proj_bias", _interleave_rows(bias).to(dtype).contiguous()  # [E, 2I]
    yield prefix + "down_proj_bias", floats(_partner(gf, experts, "ffn_down_exps.bias")).to(dtype).contiguous()


def _interleave_rows(x):
    """[E, 2I, ...] of gate rows then up rows -> rows alternating gate, up (numpy arrays and tensors alike)."""
    E, rows = x.shape[:2]
    half = x.reshape(E, 2, rows // 2, *x.shape[2:])
    swapped = half.swapaxes(1, 2) if isinstance(x, np.ndarray) else half.transpose(1, 2)
    return swapped.reshape(x.shape)


def _mla_kv_b(gf: GgufFile, halves: dict[str, str], heads: int, floats: FloatsFn,
              native: bool = False) -> torch.Tensor | Blocks:
    """DeepSeek's kv_b_proj [H (nope + v), kv_lora_rank] from llama.cpp's halves: `attn_k_b` [H, kv_lora_rank, nope]
    (each head's key matrix transposed) and `attn_v_b` [H, v, kv_lora_rank]; per head, the key rows then the value
    rows. Float32, or (`native`, where a half is of a type kept as blocks and kv_lora_rank is whole blocks of 32)
    int8 Blocks re-quantized from the halves' exact dequantized values (`tsterm_kernels.quant.quantize_int8`): the
    key half's file blocks run along nope, not along kv_lora_rank. Recorded as re-quantized; a Q8_0 value half comes
    back as its own blocks (Q8_0's largest code is 127, so re-quantizing its values finds its scale and codes), a
    Q5_K / Q6_K one as its native import would be (the same re-quantization)."""
    missing = [leaf for leaf in MLA_HALVES if leaf not in halves]
    if missing:
        raise ModelLoadError(f"{gf.path}: {sorted(halves.values())} without {missing[0]} (MLA's kv_b comes as "
                             "attn_kv_b or as attn_k_b + attn_v_b)")
    k_name, v_name = halves["attn_k_b"], halves["attn_v_b"]
    k_b, v_b = floats(k_name), floats(v_name)
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != heads or v_b.shape[0] != heads \
            or k_b.shape[1] != v_b.shape[2]:
        raise ModelLoadError(f"{gf.path}: {k_name!r} {list(k_b.shape)} and {v_name!r} "
                             f"{list(v_b.shape)} are not [{heads}, rank, nope] and [{heads}, v, rank]")
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, rank]
    types = [gf.tensors[n].tensor_type.name for n in (k_name, v_name)]
    if not native or kv_b.shape[-1] % BLOCK or not any(t in NATIVE_TYPES for t in types):
        return kv_b.reshape(-1, kv_b.shape[-1])
    from tsterm_kernels.quant import quantize_int8

    q = quantize_int8(kv_b)  # codes [H, nope + v, rank], scales [H, nope + v, rank / 32]
    codes, scales = q.data.numpy(), q.scale.numpy()
    ggml_type = types[0] if types[0] == types[1] else "+".join(types)
    return Blocks(ggml_type, "int8", codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1]),
                  requantized=True)


def _block_order(name: str) -> int:
    if match := LAYER_RE.match(name):
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
        skipped: list[str] = []  # GGUF tensors left out (MTP layers)
        for name, tensor in _iter_weights(gf, config, DTYPES[dtype], progress, native=not dequantize,
                                          skipped=skipped):
            if isinstance(tensor, Blocks):
                quantized[name] = tensor.ggml_type
                if tensor.requantized:
                    requantized.append(name)
                writer.add(name + CODES, torch.from_numpy(tensor.codes))
                writer.add(name + SCALES, torch.from_numpy(tensor.scales))
            elif isinstance(tensor, Mxfp4):  # gpt-oss's experts, as its own checkpoints store them
                quantized[name] = "MXFP4"
                writer.add(name + MXFP4_BLOCKS, torch.from_numpy(np.ascontiguousarray(tensor.blocks)))
                writer.add(name + MXFP4_SCALES, torch.from_numpy(np.ascontiguousarray(tensor.scales)))
            else:
                writer.add(name, tensor)
        writer.finish()
        if any(t != "MXFP4" for t in quantized.values()):
            config["quantization_config"] = {"quant_method": QUANT_METHOD, "block_size": BLOCK}
        elif quantized:  # MXFP4 experts only: what gpt-oss's own config.json says
            config["quantization_config"] = {"quant_method": "mxfp4"}
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", build_tokenizer_config(gf, config))
        _write_json(tmp / "generation_config.json", {**build_generation_config(gf, config), **(sampling or {})})
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}  # what a damaged copy is checked against
        _write_json(tmp / INFO_FILE, _import_info(gf, dtype, files, dequantize, quantized, requantized, skipped))
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _import_info(gf: GgufFile, dtype: str, files: dict[str, int], dequantize: bool,
                 quantized: dict[str, str], requantized: list[str], skipped: list[str]) -> dict[str, Any]:
    from gguf import LlamaFileType

    file_type = gf.get("general.file_type")
    try:
        file_type = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        pass
    return {"importer_version": IMPORTER_VERSION, "source": gf.path.name, "source_bytes": gf.path.stat().st_size,
            "source_path": str(gf.path.resolve()), "name": gf.get("general.name"), "architecture": gf.arch,
            "file_type": file_type, "dtype": dtype, "dequantize": dequantize, "quantized": quantized,
            "requantized": requantized, "skipped": skipped, "files": files}


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
