"""Loads an HF model directory into the decoder's packed weights.

Tensors are views of memory-mapped safetensors files (`safetensors_mmap`); a tensor already in the target dtype on
the CPU is used in place, any other is converted once (F8_E4M3 / F8_E5M2 by torch's own FP8 conversion). Only what
the layout needs is materialised, once, at load: fused q/k/v rows and the stacked expert tensors `w13 [E, 2I, H]` /
`w2 [E, H, I]`.

A rank of a parallel layout (`tsterm.model.parallel`) loads only its shard: row slices of a mapped tensor stay views
of the mapping (only their pages are ever read), column slices are copied once, contiguously, at load.

Quantized weights (a GGUF imported natively, `tsterm.convert.gguf`, config.json quant_method "gguf_blocks"): a weight
stored as `<name>.qcodes` + `<name>.qscales` loads as a `tsterm_kernels.quant.QuantizedWeight` (int8 codes: int8;
uint8 codes: int4), on the CPU read in place from the mapping like a float weight. Fusing concatenates codes and
scales along the output rows (q/k/v, gate/up; experts come stacked), which is exact; a fused matrix whose parts are
not all quantized the same way is dequantized to float, that matrix only. A shard's row slices slice codes and
scales alike; a column slice (o_proj, down_proj under tensor parallelism) must fall on whole blocks of 32 inputs,
else loading fails with an error that says to run on one rank or import the GGUF with --dequantize. On a GPU the
blocks are copied to the device as they are: the Triton kernels (quantized linear, fused MoE) read them.

MXFP4 experts (gpt-oss, quant_method "mxfp4": `<name>_blocks` / `_scales`) load as "mxfp4" QuantizedWeights, the
blocks as stored (down_proj's read in place from the mapping on the CPU; gate_up's alternating gate / up rows regrouped
in one copy of the blocks), which csrc/mxfp4.c and the Triton kernels read; under `quantization` int8 / int4 / fp16 /
fp8 they are dequantized at load and quantized to that format instead.

Block-scaled FP8 checkpoints (quant_method "fp8", `weight_block_size` [128, 128]): on a CUDA device (`keep_fp8`)
the 2-D matrices (attention, MLA's projections (`tsterm.model.mla.load_mla`), dense MLPs, each expert and the shared
expert) load as "fp8" QuantizedWeights (values and `weight_scale_inv` as they are stored; experts stacked), which the
Triton kernels read; a span that cuts a 128-block, or a fused part whose rows are not whole blocks (gate and up of an I
that is not a multiple of 128), is dequantized to the model's dtype at load, as every FP8 weight is on the CPU.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tsterm_kernels.quant import BLOCK, FP8_BLOCK, QuantizedWeight

from tsterm.config import ModelConfig
from tsterm.errors import ModelLoadError
from tsterm.model.arch import ARCHITECTURES
from tsterm.model.mla import load_mla
from tsterm.model.parallel import ParallelLayout
from tsterm.model.quant import QuantizeOnLoad
from tsterm.model.safetensors_mmap import WEIGHT_DTYPES, SafetensorsFile

ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, what)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # fine-grained FP8 / compressed-tensors checkpoints
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MTP_PREFIX = "mtp."  # a multi-token-prediction head's tensors (`tsterm.model.mtp`)

Span = tuple[int, int] | None  # (first, count) along one dimension; None: all of it
CODES, SCALES = ".qcodes", ".qscales"  # a quantized weight's two tensors (tsterm.convert.gguf writes them)
QUANT_KINDS = {torch.int8: "int8", torch.uint8: "int4"}  # codes dtype -> QuantizedWeight kind
Weight = torch.Tensor | QuantizedWeight


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: not a valid safetensors index (needs a \"weight_map\" of "
                                 "tensor name -> shard file name)")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) that are missing from {model_dir}: {', '.join(missing)} "
                                 "(an incomplete download?)")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ModelLoadError(f"{model_dir}: only pickle checkpoints found ({', '.join(pickles)}); tsterm never "
                             "unpickles weights. Convert them to safetensors first.")
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")


class WeightSource:
    """Name -> tensor over all shards, tracking which names were used so leftovers can be reported."""

    def __init__(self, files: list[Path], dtype: torch.dtype, device: torch.device, progress: ProgressFn | None,
                 fp8_block_size: tuple[int, int] | None = None, keep_fp8: bool = False):
        """fp8_block_size: `ModelConfig.fp8_block_size` (an FP8 weight with a `_scale_inv` is dequantized to `dtype`
        block by block as it is read). keep_fp8: `weight` returns such a matrix of 128 x 128 blocks as an "fp8"
        QuantizedWeight instead, where its span is whole blocks."""
        self.dtype, self.device, self.progress = dtype, device, progress
        self.fp8_block_size, self.keep_fp8 = fp8_block_size, keep_fp8
        self.where: dict[str, SafetensorsFile] = {}
        for path in files:
            shard = SafetensorsFile(path)
            for name in shard.keys():
                if name in self.where:
                    raise ModelLoadError(f"tensor {name!r} is in both {self.where[name].path.name} and {path.name}")
                self.where[name] = shard
        # Invariant: `unused` shrinks only through get()/skip(), which count the bytes, so a load that passes
        # check_all_used() has reported done == total.
        self.unused = {n for n in self.where if not n.endswith(IGNORED_SUFFIXES)}
        self.total_bytes = sum(self.where[n].nbytes(n) for n in self.unused)
        self.done_bytes = 0

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...], convert: bool | None = True, rows: Span = None,
            cols: Span = None) -> torch.Tensor:
        """The tensor `name` of full shape `shape`; `rows`/`cols`: only that span of dimension 0 / 1 (a shard).
        convert: to the target dtype and device; False: as read (FP8 dequantized); None: as stored."""
        shard = self.where.get(name)
        if shard is None:
            raise ModelLoadError(f"missing tensor {name!r} (looked in {', '.join(sorted({s.path.name for s in self.where.values()}))})")
        tensor = shard.tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(f"{shard.path.name}: tensor {name!r} has shape {list(tensor.shape)}, "
                                 f"expected {list(shape)} from config.json")
        if tensor.dtype not in WEIGHT_DTYPES.values():
            raise ModelLoadError(f"{shard.path.name}: tensor {name!r} has dtype {shard.dtype_name(name)}, which tsterm "
                                 f"does not load as a weight (it loads {', '.join(WEIGHT_DTYPES)}); convert the "
                                 "checkpoint to one of those")
        self._mark_used(name)
        if tensor.dtype in FP8_DTYPES and self.has(name + "_scale_inv") and convert is not None:
            tensor, rows, cols = self._dequantize_fp8(name, tensor, rows, cols), None, None
        if rows is not None and rows != (0, tensor.shape[0]):
            tensor = tensor.narrow(0, *rows)  # a view of the mapping: only these rows' pages are read
        if cols is not None and cols != (0, tensor.shape[1]):
            tensor = tensor.narrow(1, *cols).contiguous()  # this rank's columns, copied once
        return self.to_target(tensor) if convert else tensor

    def is_quantized(self, name: str) -> bool:
        return name + CODES in self.where

    def weight(self, name: str, shape: tuple[int, ...], rows: Span = None, cols: Span = None) -> Weight:
        """`get`, or the QuantizedWeight stored as `name`.qcodes / .qscales (its blocks copied to the device off the
        CPU). rows: a span of dimension 0; cols: of the last dimension (the inputs)."""
        if not self.is_quantized(name):
            if self.fp8_kept(name, shape, rows, cols):
                return self._fp8_weight(name, shape, rows, cols)
            if cols is not None and len(shape) > 2:
                return self.get(name, shape, rows=rows).narrow(-1, *cols).contiguous()
            return self.get(name, shape, rows=rows, cols=cols)
        weight = self._blocks(name, shape)
        if rows is not None and rows != (0, shape[0]):
            weight = narrow(weight, 0, *rows)
        if cols is not None and cols != (0, shape[-1]):
            weight = narrow(weight, len(shape) - 1, *cols, what=name)
        if self.device.type != "cpu":  # the Triton kernels read the blocks: copied to the device as they are
            return QuantizedWeight.blocks(weight.kind, weight.data.to(self.device), weight.scale.to(self.device))
        return weight

    def fp8_kept(self, name: str, shape: tuple[int, ...], rows: Span, cols: Span) -> bool:
        """Whether `weight` keeps this tensor as an fp8 QuantizedWeight (see `keep_fp8`)."""
        if not (self.keep_fp8 and self.fp8_block_size == (FP8_BLOCK, FP8_BLOCK) and len(shape) == 2
                and self.has(name) and self.has(name + "_scale_inv")):
            return False
        if self.where[name].tensor(name).dtype != torch.float8_e4m3fn:
            return False
        return all(span is None or (span[0] % FP8_BLOCK == 0 and (span[1] % FP8_BLOCK == 0 or sum(span) == size))
                   for span, size in ((rows, shape[0]), (cols, shape[1])))

    def _fp8_weight(self, name: str, shape: tuple[int, ...], rows: Span, cols: Span) -> QuantizedWeight:
        values = self.get(name, shape, convert=None, rows=rows, cols=cols)  # None: the fp8 values as stored
        scale_name = name + "_scale_inv"
        scale = self.where[scale_name].tensor(scale_name).float()
        want = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
        if tuple(scale.shape) != want:
            raise ModelLoadError(f"{self.where[scale_name].path.name}: {scale_name!r} has shape {list(scale.shape)}; "
                                 f"blocks of [{FP8_BLOCK}, {FP8_BLOCK}] over {name!r} {list(shape)} need {list(want)}")
        self._mark_used(scale_name)
        for dim, span in enumerate((rows, cols)):
            if span is not None:
                scale = scale.narrow(dim, span[0] // FP8_BLOCK, -(-span[1] // FP8_BLOCK))
        return QuantizedWeight.fp8(values.to(self.device), scale.to(self.device))

    def _blocks(self, name: str, shape: tuple[int, ...]) -> QuantizedWeight:
        codes_shard, scales_shard = self.where[name + CODES], self.where.get(name + SCALES)
        if scales_shard is None:
            raise ModelLoadError(f"{codes_shard.path.name}: {name + CODES!r} has no {name + SCALES!r} beside it")
        codes, scales = codes_shard.tensor(name + CODES), scales_shard.tensor(name + SCALES)
        kind = QUANT_KINDS.get(codes.dtype)
        *lead, out_f, in_f = shape
        if kind is None or in_f % BLOCK:
            raise ModelLoadError(f"{codes_shard.path.name}: {name + CODES!r} has dtype {codes.dtype} for a weight of "
                                 f"shape {list(shape)} (quantized codes are int8 or uint8, inputs whole blocks of "
                                 f"{BLOCK})")
        want_codes = (*lead, out_f, in_f if kind == "int8" else in_f // 2)
        want_scales = (*lead, out_f, in_f // BLOCK, *(() if kind == "int8" else (2,)))
        if tuple(codes.shape) != want_codes or tuple(scales.shape) != want_scales or scales.dtype != torch.float16:
            raise ModelLoadError(f"{codes_shard.path.name}: quantized weight {name!r} has {kind} codes "
                                 f"{list(codes.shape)} and {scales.dtype} scales {list(scales.shape)}; its shape "
                                 f"{list(shape)} from config.json needs codes {list(want_codes)} and float16 scales "
                                 f"{list(want_scales)}")
        self._mark_used(name + CODES)
        self._mark_used(name + SCALES)
        return QuantizedWeight.blocks(kind, codes, scales)

    def _dequantize_fp8(self, name: str, tensor: torch.Tensor, rows: Span, cols: Span) -> torch.Tensor:
        """Rows x cols of a block-scaled FP8 weight [O, I] as float32: each value times the `weight_scale_inv` of
        its block (Qwen's and DeepSeek's fine-grained FP8). Only the span's fp8 bytes and scales are read."""
        scale_name = name + "_scale_inv"
        shard = self.where[scale_name]
        scale = shard.tensor(scale_name)
        self._mark_used(scale_name)
        if tensor.dim() != 2:
            raise ModelLoadError(f"{shard.path.name}: FP8 tensor {name!r} has {tensor.dim()} dimensions; tsterm "
                                 "dequantizes block-scaled FP8 matrices only")
        out_f, in_f = tensor.shape
        block = self.fp8_block_size
        if block is None:
            raise ModelLoadError(f"{shard.path.name}: {scale_name!r} scales an FP8 weight, but config.json has no "
                                 "quantization_config with quant_method \"fp8\"")
        b0, b1 = block if block != (0, 0) else (out_f, in_f)  # (0, 0): one scale for the whole tensor
        expected = (-(-out_f // b0), -(-in_f // b1))
        if scale.numel() != expected[0] * expected[1]:
            raise ModelLoadError(f"{shard.path.name}: {scale_name!r} has shape {list(scale.shape)}; blocks of "
                                 f"{[b0, b1]} over {name!r} {[out_f, in_f]} need {list(expected)}")
        r0, nr = rows if rows is not None else (0, out_f)
        c0, nc = cols if cols is not None else (0, in_f)
        scale = scale.reshape(expected).float()
        block_rows = torch.arange(r0, r0 + nr) // b0
        block_cols = torch.arange(c0, c0 + nc) // b1
        return tensor[r0:r0 + nr, c0:c0 + nc].float() * scale[block_rows][:, block_cols]

    def skip(self, name: str) -> None:
        """Accept a tensor the model does not read (a tied lm_head saved anyway)."""
        self._mark_used(name)

    def _mark_used(self, name: str) -> None:
        if name in self.unused:
            self.unused.discard(name)
            self.done_bytes += self.where[name].nbytes(name)
            if self.progress:
                self.progress(self.done_bytes, self.total_bytes, name)

    def to_target(self, tensor: torch.Tensor) -> torch.Tensor:
        # A no-op (still the mmap view) when dtype and device already match.
        return tensor.to(device=self.device, dtype=self.dtype)

    def stack(self, names: list[str], shape: tuple[int, ...], cols: Span = None) -> torch.Tensor:
        """Pack several same-shape tensors (or their `cols` span) into one new [N, ...] tensor in the target
        dtype/device."""
        out_shape = shape if cols is None else (shape[0], cols[1], *shape[2:])
        out = torch.empty((len(names), *out_shape), dtype=self.dtype, device=self.device)
        for i, name in enumerate(names):
            out[i].copy_(self.get(name, shape, convert=False, cols=cols))
        return out

    def check_all_used(self) -> None:
        if self.unused:
            extra = sorted(self.unused)
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            files = ", ".join(sorted({self.where[n].path.name for n in extra}))
            blocks = [n for n in extra if n.endswith((CODES, SCALES))]
            if blocks:
                raise ModelLoadError(f"{files}: quantized blocks such as {blocks[0]!r} for a weight tsterm reads as "
                                     "floats (only linear layers load quantized); re-import the GGUF with "
                                     "--dequantize")
            scales = [n for n in extra if n.endswith(SCALE_SUFFIXES)]
            if scales:
                raise ModelLoadError(f"{files}: quantization scales such as {scales[0]!r} that tsterm did not read "
                                     "(it reads a `weight_scale_inv` next to an FP8 weight, in a checkpoint whose "
                                     "config.json says quant_method fp8); dequantize the checkpoint to bf16 first")
            raise ModelLoadError(f"unexpected tensor(s) in {files}: {', '.join(extra[:5])}{more} "
                                 "(does config.json match these weights?)")


def narrow(weight: Weight, dim: int, start: int, length: int, what: str = "a quantized weight") -> Weight:
    """`weight.narrow(dim, start, length)` for a float or quantized weight; a quantized weight's inputs (its last
    dimension) narrow on whole blocks only."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, length)
    last = len(weight.dims) - 1
    if dim < last:  # output rows, or experts: codes and scales share these dimensions
        return QuantizedWeight.blocks(weight.kind, weight.data.narrow(dim, start, length),
                                      weight.scale.narrow(dim, start, length))
    if start % BLOCK or length % BLOCK:
        raise ModelLoadError(f"{what}: a shard's columns [{start}, {start + length}) of this quantized (GGUF block) "
                             f"weight cut its blocks of {BLOCK} inputs; run the model on one rank, or import the GGUF "
                             "with --dequantize")
    per_byte = 2 if weight.kind == "int4" else 1
    return QuantizedWeight.blocks(weight.kind, weight.data.narrow(last, start // per_byte, length // per_byte),
                                  weight.scale.narrow(last, start // BLOCK, length // BLOCK))


def cat(parts: list[Weight], dim: int, dtype: torch.dtype) -> Weight:
    """Parts of one fused matrix joined along `dim` (an output dimension, or a leading one, not the inputs):
    quantized parts of one kind join as blocks (exact; fp8 along the output rows where all but the last part are
    whole 128-row blocks); a mix of kinds, or of quantized and float parts, joins as floats of `dtype`."""
    kinds = {p.kind if isinstance(p, QuantizedWeight) else None for p in parts}
    if kinds == {None}:
        return torch.cat(parts, dim)
    rows = len(parts[0].dims) - 2
    if kinds == {"fp8"} and (dim < rows or dim == rows and all(p.dims[dim] % FP8_BLOCK == 0 for p in parts[:-1])):
        return QuantizedWeight.fp8(torch.cat([p.data for p in parts], dim), torch.cat([p.scale for p in parts], dim))
    if len(kinds) == 1 and kinds != {"fp8"}:
        return QuantizedWeight.blocks(parts[0].kind, torch.cat([p.data for p in parts], dim),
                                      torch.cat([p.scale for p in parts], dim))
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantizedWeight) else p for p in parts], dim)


def stack(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Same-shape matrices stacked along a new first (expert) dimension, as `cat` joins them."""
    return cat([unsqueeze(p) for p in parts], 0, dtype)


def unsqueeze(weight: Weight) -> Weight:
    """[O, I] -> [1, O, I] (a dense MLP as one expert)."""
    if isinstance(weight, torch.Tensor):
        return weight[None]
    if weight.kind == "fp8":
        return QuantizedWeight.fp8(weight.data[None], weight.scale[None])
    return QuantizedWeight.blocks(weight.kind, weight.data[None], weight.scale[None])


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 progress: ProgressFn | None = None, layout: ParallelLayout = ParallelLayout(),
                 keep_fp8: bool | None = None, quantization: str = "none") -> dict[str, torch.Tensor]:
    """Returns the decoder's weights by canonical name (see `tsterm.model.decoder`): `layout.rank`'s shard.
    keep_fp8: keep a block-scaled FP8 checkpoint's matrices as fp8 (None: on a CUDA device; see the module doc).
    quantization: EngineConfig.quantization, applied to each linear weight as it is loaded (`QuantizeOnLoad`): the
    float model is never whole on the device."""
    model_dir = Path(model_dir)
    spec = ARCHITECTURES[cfg.model_type].for_config(cfg)
    keep_fp8 = device.type == "cuda" if keep_fp8 is None else keep_fp8
    src = WeightSource(find_weight_files(model_dir), dtype, device, progress, cfg.fp8_block_size, keep_fp8)
    for name in sorted(src.unused):  # an MTP head (`mtp.*`): loaded by `tsterm.model.mtp` when asked, never here
        if name.startswith(MTP_PREFIX):
            src.skip(name)
    H = cfg.hidden_size
    vocab_first, vocab_count, _ = layout.vocab(cfg.vocab_size)
    vocab_rows = (vocab_first, vocab_count)
    w = QuantizeOnLoad(quantization, device, dtype)  # each linear weight quantized as it is stored
    w["embed"] = src.get("model.embed_tokens.weight", (cfg.vocab_size, H), rows=vocab_rows)
    w["final_norm"] = src.get("model.norm.weight", (H,))
    if cfg.tie_word_embeddings and not src.is_quantized("lm_head.weight"):
        src.skip("lm_head.weight")
        w["lm_head"] = w["embed"]
    else:  # (a tied head stored quantized: the embedding's blocks, which the lookup's floats came from)
        w["lm_head"] = src.weight("lm_head.weight", (cfg.vocab_size, H), rows=vocab_rows)

    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        w[o + "input_norm"] = src.get(p + "input_layernorm.weight", (H,))
        w[o + "post_attn_norm"] = src.get(p + "post_attention_layernorm.weight", (H,))
        (load_mla if spec.mla else _load_attention)(src, cfg, spec, p + "self_attn.", o, w, layout, dtype)
        if cfg.is_moe_layer(i):
            _load_moe(src, cfg, spec, p + spec.moe_prefix + ".", o, w, layout, keep_mxfp4=quantization == "none")
        else:
            _load_dense_mlp(src, cfg.intermediate_size, H, p + "mlp.", o, w, (layout.tp_rank, layout.tp_size))
    if spec.mtp_layers_follow:  # the MTP head's layers (numbered from num_hidden_layers on): accounted for, not run
        for name in sorted(n for n in src.unused if n.startswith("model.layers.")):
            if int(name.split(".")[2]) >= cfg.num_hidden_layers:
                src.skip(name)
    src.check_all_used()
    return w.finish()


def _load_attention(src: WeightSource, cfg: ModelConfig, spec, a: str, o: str, w: dict[str, torch.Tensor],
                    layout: ParallelLayout, dtype: torch.dtype) -> None:
    """One full-attention block (`a`: its checkpoint prefix, `o`: its canonical one): fused q/k/v rows of this rank's
    heads, o_proj's columns, the optional biases and q/k norms."""
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    (q0, nq), (kv0, nkv) = layout.q_heads(cfg), layout.kv_heads(cfg)
    q_rows, kv_rows = (q0 * D, nq * D), (kv0 * D, nkv * D)
    w[o + "qkv"] = cat([src.weight(a + "q_proj.weight", (Hq * D, H), rows=q_rows),
                        src.weight(a + "k_proj.weight", (Hkv * D, H), rows=kv_rows),
                        src.weight(a + "v_proj.weight", (Hkv * D, H), rows=kv_rows)], 0, dtype)  # [(Hq+2Hkv)D, H]
    if (cfg.attention_bias if spec.qkv_bias is None else spec.qkv_bias):
        w[o + "qkv_bias"] = torch.cat([src.get(a + "q_proj.bias", (Hq * D,), rows=q_rows),
                                       src.get(a + "k_proj.bias", (Hkv * D,), rows=kv_rows),
                                       src.get(a + "v_proj.bias", (Hkv * D,), rows=kv_rows)])
    w[o + "o_proj"] = src.weight(a + "o_proj.weight", (H, Hq * D), cols=q_rows)  # [H, Hq D]: this rank's columns
    if spec.o_bias_from_config and cfg.attention_bias:
        w[o + "o_bias"] = src.get(a + "o_proj.bias", (H,))
    if spec.attention_sinks:  # gpt-oss: this rank's heads' sink logits, float32 as the softmax reads them
        w[o + "sinks"] = src.get(a + "sinks", (Hq,), convert=False, rows=(q0, nq)).float().to(src.device)
    if spec.qk_norm == "head":
        w[o + "q_norm"] = src.get(a + "q_norm.weight", (D,))
        w[o + "k_norm"] = src.get(a + "k_norm.weight", (D,))
    elif spec.qk_norm == "full":  # whole-projection norms: refused for tensor parallelism (ParallelLayout.check)
        w[o + "q_norm"] = src.get(a + "q_norm.weight", (Hq * D,))
        w[o + "k_norm"] = src.get(a + "k_norm.weight", (Hkv * D,))


def _load_dense_mlp(src: WeightSource, inter: int, H: int, p: str, o: str, w: dict[str, torch.Tensor],
                    part: tuple[int, int] = (0, 1)) -> None:
    """A dense MLP is the trivial MoE: one expert, always on, weight 1. `part` (index, parts): the share of the
    intermediate dimension this rank holds."""
    span = (part[0] * (inter // part[1]), inter // part[1])
    # (each matrix stored as soon as it is made, and no local name keeps it: quantized on load, its float form goes)
    w[o + "w13"] = unsqueeze(cat([src.weight(p + "gate_proj.weight", (inter, H), rows=span),
                                  src.weight(p + "up_proj.weight", (inter, H), rows=span)], 0, src.dtype))  # [1, 2I, H]
    w[o + "w2"] = unsqueeze(src.weight(p + "down_proj.weight", (H, inter), cols=span))  # [1, H, I]


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1


def _mxfp4_blocks(src: WeightSource, name: str, shape: tuple[int, int, int],
                  rows: Span) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 expert stack's two tensors as stored, the experts in `rows` (views of the mapping): `name`_blocks
    [E_rows, O, I/32, 16] uint8 (two e2m1 values a byte, the low nibble first) and `name`_scales [E_rows, O, I/32]
    uint8 (E8M0: a power of two, biased by 127, per 32 inputs)."""
    E, out_f, in_f = shape
    blocks_name, scales_name = name + "_blocks", name + "_scales"
    for n, want in ((blocks_name, (E, out_f, in_f // 32, 16)), (scales_name, (E, out_f, in_f // 32))):
        if not src.has(n):
            raise ModelLoadError(f"missing tensor {n!r} (an MXFP4 expert stack has _blocks and _scales)")
        t = src.where[n].tensor(n)
        if tuple(t.shape) != want or t.dtype != torch.uint8 or in_f % 32:
            raise ModelLoadError(f"{src.where[n].path.name}: {n!r} has {t.dtype} {list(t.shape)}; MXFP4 experts of "
                                 f"shape {[E, out_f, in_f]} need uint8 {list(want)}")
    first, count = rows if rows is not None else (0, E)
    blocks = src.where[blocks_name].tensor(blocks_name)[first:first + count]
    scales = src.where[scales_name].tensor(scales_name)[first:first + count]
    src._mark_used(blocks_name)
    src._mark_used(scales_name)
    return blocks, scales


def _mxfp4(src: WeightSource, name: str, shape: tuple[int, int, int], rows: Span) -> torch.Tensor:
    """An MXFP4 expert stack (`_mxfp4_blocks`) dequantized to [E_rows, O, I] floats of the model's dtype (where the
    engine quantizes the experts to another format on load)."""
    _, out_f, in_f = shape
    blocks, scales = _mxfp4_blocks(src, name, shape, rows)
    count = blocks.shape[0]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty((count, out_f, in_f), dtype=src.dtype, device=src.device)
    for e in range(count):  # one expert at a time: the float32 scratch stays one expert's size
        b = blocks[e].long()  # [O, I/32, 16]
        values = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).view(out_f, in_f // 32, 32)
        values = torch.ldexp(values, scales[e].long().sub(127)[..., None].float())
        out[e].copy_(values.view(out_f, in_f))
    return out


def _mxfp4_kept(src: WeightSource, e: str, E: int, H: int, inter: int, experts: tuple[int, int],
                cols: tuple[int, int]) -> tuple[QuantizedWeight, QuantizedWeight]:
    """gpt-oss's MXFP4 experts kept as "mxfp4" QuantizedWeights (`tsterm_kernels.quant`): w13 [E_local, 2I_local, H]
    (gate rows, then up rows: gate_up's alternating rows regrouped, its blocks copied once) and w2 [E_local, H,
    I_local] (down's blocks and scales as stored: views of the mapping on the CPU for one rank's whole experts; a
    tensor-parallel rank's columns must be whole blocks of 32)."""
    (i0, ni) = cols
    gate_up, gate_up_scales = _mxfp4_blocks(src, e + "gate_up_proj", (E, 2 * inter, H), experts)

    def regroup(t: torch.Tensor) -> torch.Tensor:  # rows 2i (gate i), then rows 2i + 1 (up i), this rank's i
        return torch.cat((t[:, 0::2][:, i0:i0 + ni], t[:, 1::2][:, i0:i0 + ni]), 1).to(src.device)

    w13 = QuantizedWeight.mxfp4(regroup(gate_up), regroup(gate_up_scales))
    down, down_scales = _mxfp4_blocks(src, e + "down_proj", (E, H, inter), experts)
    if ni != inter:
        if i0 % 32 or ni % 32:
            raise ModelLoadError(f"{e}down_proj: a tensor-parallel rank's columns [{i0}, {i0 + ni}) cut its MXFP4 "
                                 "blocks of 32 inputs; use fewer tensor-parallel ranks or quantization: int8")
        down, down_scales = down[:, :, i0 // 32:(i0 + ni) // 32], down_scales[:, :, i0 // 32:(i0 + ni) // 32]
    return w13, QuantizedWeight.mxfp4(down.to(src.device), down_scales.to(src.device))


def _interleaved_blocks(src: WeightSource, e: str, E: int, H: int, inter: int, experts: tuple[int, int],
                        cols: tuple[int, int]) -> tuple[QuantizedWeight, Weight]:
    """gpt-oss's experts stored as int8 / int4 blocks in tsterm's layout (`tsterm.convert.gguf`: `gate_up_proj`
    [E, 2I, H] with gate and up in alternating rows, `down_proj` [E, H, I]), kept as QuantizedWeights: w13
    [E_local, 2I_local, H] (this rank's gate rows, then its up rows: codes and scales gathered in one copy) and w2
    [E_local, H, I_local] (a tensor-parallel rank's columns: whole blocks of 32)."""
    (i0, ni) = cols
    gate_up = src.weight(e + "gate_up_proj", (E, 2 * inter, H), rows=experts)  # a QuantizedWeight: is_quantized
    rows = torch.cat((torch.arange(2 * i0, 2 * (i0 + ni), 2), torch.arange(2 * i0 + 1, 2 * (i0 + ni), 2)))
    rows = rows.to(gate_up.data.device)
    w13 = QuantizedWeight.blocks(gate_up.kind, gate_up.data.index_select(1, rows),
                                 gate_up.scale.index_select(1, rows))
    w2 = src.weight(e + "down_proj", (E, H, inter), rows=experts, cols=cols)
    return w13, w2


def _load_interleaved_experts(src: WeightSource, E: int, H: int, inter: int, e: str, o: str,
                              w: dict[str, torch.Tensor], experts: tuple[int, int], cols: tuple[int, int],
                              down_bias: bool, keep_mxfp4: bool = True) -> None:
    """gpt-oss's experts: `gate_up_proj` [E, H, 2I] with gate and up in alternating columns and `down_proj`
    [E, I, H] (the transpose of tsterm's layout; or MXFP4 `_blocks` / `_scales` [E, 2I | H, ...] in tsterm's
    layout: kept as MXFP4 (`keep_mxfp4`), else dequantized at load; or int8 / int4 `.qcodes` / `.qscales` [E, 2I | H,
    ...] in tsterm's layout: kept as blocks, `_interleaved_blocks`), with `gate_up_proj_bias` [E, 2I] and
    `down_proj_bias` [E, H]. Stored as w13 [E_local, 2I_local, H] (gate rows, then up rows), w13_bias, w2 [E_local,
    H, I_local], w2_bias (down_bias: this rank adds it)."""
    (first, count), (i0, ni) = experts, cols
    if src.is_quantized(e + "gate_up_proj"):  # int8 / int4 blocks (a GGUF of Q8_0 / K-quant experts)
        w[o + "w13"], w[o + "w2"] = _interleaved_blocks(src, e, E, H, inter, experts, cols)
    elif keep_mxfp4 and not src.has(e + "gate_up_proj"):
        w[o + "w13"], w[o + "w2"] = _mxfp4_kept(src, e, E, H, inter, experts, cols)
    elif src.has(e + "gate_up_proj"):
        gate_up = src.get(e + "gate_up_proj", (E, H, 2 * inter), convert=False, rows=(first, count)).transpose(1, 2)
        down = src.get(e + "down_proj", (E, inter, H), convert=False, rows=(first, count)).transpose(1, 2)
    else:
        gate_up = _mxfp4(src, e + "gate_up_proj", (E, 2 * inter, H), (first, count))  # [E_local, 2I, H]
        down = _mxfp4(src, e + "down_proj", (E, H, inter), (first, count))  # [E_local, H, I]
    if (not keep_mxfp4 or src.has(e + "gate_up_proj")) and not src.is_quantized(e + "gate_up_proj"):
        w13 = torch.empty((count, 2 * ni, H), dtype=src.dtype, device=src.device)
        w13[:, :ni].copy_(gate_up[:, 0::2][:, i0:i0 + ni])
        w13[:, ni:].copy_(gate_up[:, 1::2][:, i0:i0 + ni])
        del gate_up
        w[o + "w13"] = w13
        del w13
        w[o + "w2"] = down[:, :, i0:i0 + ni].to(dtype=src.dtype, device=src.device).contiguous()
    b13 = src.get(e + "gate_up_proj_bias", (E, 2 * inter), rows=(first, count))
    w[o + "w13_bias"] = torch.cat((b13[:, 0::2][:, i0:i0 + ni], b13[:, 1::2][:, i0:i0 + ni]), 1).contiguous()
    b2 = src.get(e + "down_proj_bias", (E, H), rows=(first, count))
    if down_bias:
        w[o + "w2_bias"] = b2


def _load_moe(src: WeightSource, cfg: ModelConfig, spec, p: str, o: str, w: dict[str, torch.Tensor],
              layout: ParallelLayout, keep_mxfp4: bool = True) -> None:
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = spec.expert_names
    first, count = layout.experts(E)  # this rank's experts ...
    i0, ni = layout.tp_rank * (inter // layout.tp_size), inter // layout.tp_size  # ... and their columns
    w[o + "router"] = src.get(p + spec.router_name + ".weight", (E, H))  # every rank routes every token
    if spec.router_logit_bias:  # gpt-oss: added to the logits (chooses and weighs)
        w[o + "router_logit_bias"] = src.get(p + spec.router_name + ".bias", (E,))
    if spec.router_float32:  # (the reference routes in float32 whatever the model's dtype)
        w[o + "router"] = w[o + "router"].float()
    if spec.router_bias:  # float32: a selection bias of ~1e-3 steps must not round away in bf16
        w[o + "router_bias"] = src.get(p + spec.router_bias, (E,), convert=False).float().to(src.device)
    if spec.experts_interleaved:
        _load_interleaved_experts(src, E, H, inter, p + "experts.", o, w, (first, count), (i0, ni),
                                  layout.tp_rank == 0, keep_mxfp4)
    elif src.has(p + "experts.gate_up_proj") or src.is_quantized(p + "experts.gate_up_proj"):  # transformers-5's
        # fused layout (and tsterm's GGUF import's), already stacked
        gate_up = src.weight(p + "experts.gate_up_proj", (E, 2 * inter, H), rows=(first, count))
        if ni == inter:  # whole experts: views of the mapping
            w[o + "w13"] = gate_up
            del gate_up  # (quantized on load: its float form goes before down_proj is read)
            w[o + "w2"] = src.weight(p + "experts.down_proj", (E, H, inter), rows=(first, count))
        else:
            w[o + "w13"] = cat([narrow(gate_up, 1, i0, ni), narrow(gate_up, 1, inter + i0, ni)], 1, src.dtype)
            del gate_up
            w[o + "w2"] = src.weight(p + "experts.down_proj", (E, H, inter), rows=(first, count), cols=(i0, ni))
    else:
        e = p + "experts."
        for x in range(E):
            if not first <= x < first + count:  # another rank's expert: accounted for, never read
                for name in (gate, up, down):
                    src.skip(f"{e}{x}.{name}.weight")
        mine = range(first, first + count)
        if src.fp8_kept(f"{e}{first}.{gate}.weight", (inter, H), (i0, ni), None):  # an FP8 checkpoint on a GPU
            w[o + "w13"] = stack([cat([src.weight(f"{e}{x}.{name}.weight", (inter, H), rows=(i0, ni))
                                       for name in (gate, up)], 0, src.dtype) for x in mine], src.dtype)
            w[o + "w2"] = stack([src.weight(f"{e}{x}.{down}.weight", (H, inter), cols=(i0, ni)) for x in mine],
                                src.dtype)
        else:
            w13 = torch.empty((count, 2 * ni, H), dtype=src.dtype, device=src.device)
            for x in mine:
                w13[x - first, :ni].copy_(src.get(f"{e}{x}.{gate}.weight", (inter, H), convert=False, rows=(i0, ni)))
                w13[x - first, ni:].copy_(src.get(f"{e}{x}.{up}.weight", (inter, H), convert=False, rows=(i0, ni)))
            w[o + "w13"] = w13  # [E_local, 2I_local, H]
            del w13  # (quantized on load: the float stack goes before down_proj's is made)
            w[o + "w2"] = src.stack([f"{e}{x}.{down}.weight" for x in mine], (H, inter),
                                    cols=(i0, ni))  # [E_local, H, I_local]
    if spec.shared_expert and cfg.shared_expert_intermediate_size:
        _load_dense_mlp(src, cfg.shared_expert_intermediate_size, H, p + spec.shared_expert_name + ".", o + "shared_",
                        w, (layout.rank, layout.world_size))
        if spec.shared_expert_gated:
            w[o + "shared_gate"] = src.get(p + "shared_expert_gate.weight", (1, H))
