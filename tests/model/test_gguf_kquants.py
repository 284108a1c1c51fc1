"""K-quant GGUF import (`tsterm.convert.gguf`): Q4_K linear weights repacked into int4 blocks, Q5_K / Q6_K re-quantized
to int8 blocks, checked against gguf-py's own dequantization of the file, and, as whole tiny models, against the
fully dequantized import of the same file. The K-quant blocks come from tests.helpers.gguf's own quantizer (gguf-py
has none) and, for every bit pattern of the packed scales, from random bytes (`random_blocks`)."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tsterm_kernels.quant import QuantizedWeight, int4_codes, quantize_int8

from tests.helpers.gguf import llama_cpp_permute, quantize_linear, random_blocks, tiny_model, write_gguf
from tests.helpers.probes import decisive_steps_agree, greedy, last_logits, relative_error
from tsterm import LLM
from tsterm.errors import ModelLoadError
from tsterm.convert.gguf import IMPORTER_VERSION, INFO_FILE, import_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# K-quants need rows of whole super-blocks of 256 inputs; initializer_range 0.05 keeps a 256-wide random model's
# activations the size a trained model's are (0.2 blows them up by ~3x a layer, and every small error with them)
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, initializer_range=0.05)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
HEADS = {"attn_q.weight": 4, "attn_k.weight": 2}  # tiny_model's query / KV heads (llama's q/k rows are permuted)
RANDOM = ("blk.1.attn_output.weight", "blk.1.ffn_down.weight")  # tensors whose blocks are random bytes

# Q4_K: a weight moves only by the float16 rounding of its block's d' = d sc and m' = -dmin m: at most
# 2^-11 (15 |d'| + |m'|) (+ 2^-21 where they are subnormal); 1% on top for float32 arithmetic. Measured: up to
# 0.95 of that bound (without the 1%).
Q4_K_ULP = 2.0 ** -11 * 1.01
# Q5_K / Q6_K: at most half an int8 step, d / 2 (+ float32 arithmetic). Against the format's own step s (Q5_K: d sc,
# Q6_K: the larger d sc of a block's two halves), for weights that straddle zero (the helper's quantized ones) the
# bound is 31 / 254 s (Q5_K) and 32 / 254 s (Q6_K); measured: max 0.098 s and 0.122 s, RMS 0.039 s and 0.069 s.
# Added in quadrature to the format's own rounding error (RMS s / sqrt(12) = 0.29 s): +0.9% and +2.8% RMS error.
REQUANT_STEP = 0.13


def kquant_gguf(tmp_path, qtype):
    """A llama (q/k permuted in the file) with every linear weight in `qtype`, two of them random blocks."""
    source = tiny_model("llama", tie_word_embeddings=False, **WIDE)
    quantize = quantize_linear(source, qtype, head=False, **{"output.weight": qtype})
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", source, quantize=quantize)
    reader = gguf.GGUFReader(str(path), "r+")
    for i, t in enumerate(t for t in reader.tensors if t.name in RANDOM):
        t.data[...] = random_blocks(tuple(reversed(t.shape.tolist())), qtype, seed=i).reshape(t.data.shape)
    del reader  # flushes the memory map
    return path


def hf_name(gguf_name: str) -> str:
    from tests.helpers.gguf import LEAF_NAMES

    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, leaf = gguf_name.split(".", 2)
    return f"model.layers.{layer}." + next(hf for hf, g in LEAF_NAMES.items() if g == leaf)


def file_q4_k_codes(raw: np.ndarray) -> torch.Tensor:
    """The 4-bit codes of Q4_K super-blocks [rows, S, 144] in input order [rows, S * 8, 32], read the test's own
    way: input i of sub-block s is the low (s even) or high (s odd) nibble of code byte 32 (s // 2) + i."""
    qs = raw[..., 16:].reshape(*raw.shape[:-1], 4, 1, 32).astype(np.int64)
    codes = (qs >> np.array([0, 4]).reshape(2, 1)) & 15  # [rows, S, 4, 2, 32]
    return torch.from_numpy(codes.reshape(raw.shape[0], -1, 32).astype(np.uint8))


def format_step(raw: np.ndarray, qtype) -> np.ndarray:
    """The format's own quantization step of each block of 32 of K-quant super-blocks [rows, S, bytes] -> [rows,
    S * 8]: Q5_K d sc (the 6-bit scales decoded bit by bit), Q6_K the larger |d sc| of the block's two halves."""
    if qtype == Q.Q6_K:
        d = raw[..., 208:210].copy().view(np.float16).astype(np.float64)
        sc = np.abs(raw[..., 192:208].copy().view(np.int8).astype(np.float64)).reshape(*raw.shape[:-1], 8, 2)
        return (d * sc.max(-1)).reshape(raw.shape[0], -1)
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float64)
    bits = np.unpackbits(raw[..., 4:16], axis=-1, bitorder="little")  # [rows, S, 96]: bit b of byte k at 8 k + b
    sc = np.zeros((*raw.shape[:-1], 8))
    for j in range(8):
        # sub-block j < 4: bits 0-5 of byte j; j >= 4: bits 0-3 of byte j + 4, then bits 6-7 of byte j - 4
        where = [8 * j + b for b in range(6)] if j < 4 else [8 * (j + 4) + b for b in range(4)] + \
            [8 * (j - 4) + 6, 8 * (j - 4) + 7]
        sc[..., j] = sum(bits[..., k].astype(np.float64) * 2 ** n for n, k in enumerate(where))
    return (d * sc).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_kquant_blocks_dequantize_to_the_files_values(tmp_path, qtype):
    path = kquant_gguf(tmp_path, qtype)
    native = import_gguf(path, tmp_path / "native")
    tensors = load_file(str(native / "model.safetensors"))
    kind = "int4" if qtype == Q.Q4_K else "int8"
    kept = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type != qtype:
            continue
        name = hf_name(t.name)
        kept[name] = qtype.name
        codes, scales = tensors.pop(name + ".qcodes"), tensors.pop(name + ".qscales")
        leaf = t.name.split(".", 2)[-1]
        if leaf in HEADS:  # the import un-permuted whole rows; the file's order again
            codes, scales = (torch.from_numpy(llama_cpp_permute(x.numpy(), HEADS[leaf])) for x in (codes, scales))
        ours = QuantizedWeight.blocks(kind, codes, scales).dequantize()
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, qtype))
        rows, cols = ref.shape
        err = (ours - ref).abs().view(rows, cols // 32, 32).amax(-1)  # per block of 32
        raw = np.asarray(t.data).reshape(rows, cols // 256, -1)
        if qtype == Q.Q4_K:
            assert torch.equal(int4_codes(codes).view(rows, -1, 32), file_q4_k_codes(raw)), t.name  # exact moves
            d, m = scales.float().abs().unbind(-1)
            bound = Q4_K_ULP * (15 * d + m) + 2.0 ** -21
        else:  # the int8 blocks are exactly quantize_int8's of the file's values
            again = quantize_int8(ref)
            assert torch.equal(codes, again.data) and torch.equal(scales, again.scale), t.name
            bound = scales.float() * (0.5 + 2.0 ** -20)
            if t.name not in RANDOM:  # weights that straddle zero: an eighth of the format's own step
                step = torch.from_numpy(format_step(raw, qtype)).float()
                assert (err <= REQUANT_STEP * step).all(), (t.name, float((err / step).max()))
        assert (err <= bound).all(), (t.name, float((err / bound).max()))
    assert len(kept) == 15  # 2 layers x 7 linear weights, and the LM head
    info = json.loads((native / INFO_FILE).read_text())
    assert info["quantized"] == kept and info["importer_version"] == IMPORTER_VERSION
    assert sorted(info["requantized"]) == ([] if qtype == Q.Q4_K else sorted(kept))
    assert not any(n.endswith((".qcodes", ".qscales")) for n in tensors)  # the rest stayed floats
    assert json.loads((native / "config.json").read_text())["quantization_config"] == {
        "quant_method": "gguf_blocks", "block_size": 32}


def break_scale(path, name: str, qtype, value: float) -> None:
    """Sets the float16 super-block scale(s) of tensor `name`'s every block to `value`, in place."""
    reader = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == name)
    blocks = t.data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for offset in ((-2,) if qtype == Q.Q6_K else (0, 2)):
        blocks[:, offset:offset + 2 or None] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    del reader


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_scales_beyond_float16_fall_back_to_floats(tmp_path, qtype):
    """d sc of a Q4_K (or max|w| / 127 of a Q5_K / Q6_K block) past 65504: that tensor is imported as floats."""
    path = kquant_gguf(tmp_path, qtype)
    break_scale(path, "blk.1.ffn_down.weight", qtype, 30000.0)  # random scales: some sc >= 3, some max|w| big
    tensors = load_file(str(import_gguf(path, tmp_path / "native") / "model.safetensors"))
    ref = gguf.quants.dequantize(next(t for t in gguf.GGUFReader(str(path)).tensors
                                      if t.name == "blk.1.ffn_down.weight").data, qtype)
    assert np.isfinite(ref).all()  # the file's values are fine: only their int8 / int4 scales would not be
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(ref))
    assert "model.layers.1.self_attn.o_proj.weight.qcodes" in tensors  # the other tensors stay blocks


def test_kquant_rows_of_partial_super_blocks_are_refused(tmp_path):
    """GGML cannot store a K-quant row of 128 inputs; the GGUF reader refuses the file, with the reason."""
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 18), np.float32), raw_shape=(4, 128), raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"not a readable GGUF file .*128.* not a multiple of Q4_K block size "
                                             r"\(256\)"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")


# Tolerance on the last position's logits, max |native - float| / max |float| (as in test_gguf_native.py): the
# kernels' int8 activations (~0.5% of each matmul), Q4_K's float16 scales (~1e-4 of a weight), Q5_K / Q6_K's int8
# re-quantization (+1-3% RMS weight error): 1.1-2.6% measured over these models and prompts. The same model
# quantized to Q4_0 instead (the control) lands at 27-41%.
TOL = 5e-2
MIN_DECISIVE = 6  # steps of 33 where the float import's top two logits are > 2 TOL apart; measured: 10-19
CASES = {  # name: (model_type, overrides, qtype of every linear weight, overrides of that, GGML types kept)
    # Q4_K_M-like: Q4_K, with Q6_K down projections and head; the q/k rows are un-permuted as blocks
    "llama-Q4_K": ("llama", dict(tie_word_embeddings=False), Q.Q4_K,
                   {"blk.0.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K}, {"Q4_K", "Q6_K"}),
    # experts: gate Q5_K + up Q6_K fuse as int8 blocks; layer 1's gate Q4_K (int4) + up Q5_K (int8) as floats
    "qwen3_moe-Q5_K": ("qwen3_moe", MOE, Q.Q5_K, {"blk.0.ffn_up_exps.weight": Q.Q6_K,
                                                 "blk.1.ffn_gate_exps.weight": Q.Q4_K}, {"Q5_K", "Q5_K+Q6_K"}),
    # the tied head from the embedding's Q6_K blocks
    "qwen3-Q6_K-tied": ("qwen3", dict(tie_word_embeddings=True), Q.Q6_K, {}, {"Q6_K"}),
}


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_kquant_model_generates_like_the_dequantized_one(tmp_path, case):
    model_type, overrides, qtype, mix, types = CASES[case]
    source = tiny_model(model_type, **WIDE, **overrides)
    path = write_gguf(tmp_path / "m.gguf", source, quantize=quantize_linear(source, qtype, **mix))
    other = write_gguf(tmp_path / "other.gguf", source, quantize=quantize_linear(source, Q.Q4_0))
    native_dir = import_gguf(path, tmp_path / "native")
    native, flat = engine(native_dir), engine(import_gguf(path, tmp_path / "float", dequantize=True))
    control = engine(import_gguf(other, tmp_path / "control", dequantize=True))
    weights = vars(native.engine.executor.model.layers[0][-1]).values()  # layer 0's MLP
    assert any(isinstance(w, QuantizedWeight) for w in weights)
    assert set(json.loads((native_dir / INFO_FILE).read_text())["quantized"].values()) == types
    decisive = 0
    for seed in range(3):
        prompt = torch.randint(3, 300, (4 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = last_logits(flat, prompt)
        assert relative_error(last_logits(native, prompt), ref) < TOL
        assert relative_error(last_logits(control, prompt), ref) > 4 * TOL  # the tolerance tells weights apart
        assert len(greedy(native, prompt, 16 - len(prompt))) == 16 - len(prompt)
        decisive += decisive_steps_agree(native, flat, prompt, 16 - len(prompt), TOL)
    assert decisive >= MIN_DECISIVE


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_requantized_blocks_run_exactly_as_quantize_on_load(tmp_path, qtype):
    """Q5_K / Q6_K blocks are quantize_int8 of the file's values, so the native import and the float import
    quantized to int8 on load are the same weights run by the same kernels: equal logits and tokens."""
    source = tiny_model("qwen3", tie_word_embeddings=True, **WIDE)
    path = write_gguf(tmp_path / "q.gguf", source, quantize=quantize_linear(source, qtype))
    native = engine(import_gguf(path, tmp_path / "native"))
    on_load = engine(import_gguf(path, tmp_path / "float", dequantize=True), quantization="int8")
    for prompt in ([5, 6, 7], list(range(10, 40))):  # the kernels' rows, and a prefill's dequantize + GEMM
        assert torch.equal(last_logits(native, prompt), last_logits(on_load, prompt))
    assert greedy(native, [5, 6, 7], 12) == greedy(on_load, [5, 6, 7], 12)
