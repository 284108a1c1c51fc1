"""Native GGUF import: Q8_0 / Q4_0 / Q4_1 linear weights kept as their blocks (`tsterm.convert.gguf`), loaded as
`QuantizedWeight`s (`tsterm.model.loader`) and run by the int8 / int4 kernels, checked against the file's bytes and
against the fully dequantized import of the same file. The real default model is checked in test_gguf_import.py."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tsterm_kernels.quant import QuantizedWeight

from tests.helpers.gguf import LEAF_NAMES, llama_cpp_permute, quantize_linear, tiny_model, write_gguf
from tests.helpers.probes import decisive_steps_agree, greedy, last_logits, relative_error
from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig, check_quantization
from tsterm.errors import ConfigError, ModelLoadError
from tsterm.convert.gguf import INFO_FILE, import_gguf
from tsterm.model.loader import load_weights
from tsterm.model.parallel import ParallelLayout
from tsterm.model.quant import weight_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
# Tolerance on the last position's logits, max |native - float| / max |float|. The kernels quantize each matmul's
# activations to int8 per block of 32 (as llama.cpp does), about 0.5% of a matmul's output on its own (0.4-0.9%
# measured on random inputs); over the tiny models' 2 layers (q/k/v, o, gate/up, down each) and the head it
# compounds to 1-4.6% measured on these prompts. Weights quantized another way land at 27-100% (the controls).
TOL = 6e-2
# A tied llama (q/k rows permuted in the file) mixing the three native types: layer 0's q/k/v are Q4_1/Q4_0/Q4_1
# (all int4: fused as blocks), layer 1's are Q8_0/Q4_1/F32 (mixed: fused as floats); Q5_0 stays a float type.
LLAMA_MIX = {"token_embd.weight": Q.Q8_0,
             "blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1,
             "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q4_0, "blk.0.ffn_up.weight": Q.Q4_0,
             "blk.0.ffn_down.weight": Q.Q4_1,
             "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_1, "blk.1.attn_output.weight": Q.Q5_0,
             "blk.1.ffn_gate.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q8_0}


def llama_mix(tmp_path, **overrides):
    source = tiny_model("llama", tie_word_embeddings=True, **overrides)
    path = write_gguf(tmp_path / "mix.gguf", source, quantize=LLAMA_MIX)
    return path, import_gguf(path, tmp_path / "native"), import_gguf(path, tmp_path / "float", dequantize=True)


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "lm_head.weight"  # tied: its blocks serve as the head
    _, layer, leaf = gguf_name.split(".", 2)
    hf_leaf = next(hf for hf, g in LEAF_NAMES.items() if g == leaf)
    return f"model.layers.{layer}.{hf_leaf}"


def file_blocks(codes: torch.Tensor, scales: torch.Tensor, qtype) -> np.ndarray:
    """Codes + scales packed back into GGUF blocks [rows, bytes per row], the test's own inverse of the import."""
    rows = codes.shape[0]
    nb = scales.shape[1]
    c = codes.numpy().view(np.uint8).reshape(rows, nb, -1)
    if qtype == Q.Q8_0:
        head = scales.numpy().reshape(rows, nb, 1)
    elif qtype == Q.Q4_1:
        head = scales.numpy()
    else:  # Q4_0 keeps d only; its m must be -8 d exactly
        assert torch.equal(scales[..., 1], scales[..., 0] * -8)
        head = scales.numpy()[..., :1]
    return np.concatenate([np.ascontiguousarray(head).view(np.uint8), c], axis=-1).reshape(rows, -1)


def test_blocks_are_the_files_bytes(tmp_path):
    path, native, _ = llama_mix(tmp_path)
    tensors = load_file(str(native / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    heads = {"attn_q.weight": 4, "attn_k.weight": 2}  # tiny_model's query / KV heads
    kept = {}
    for t in reader.tensors:
        if t.tensor_type not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
            continue
        name = hf_name(t.name)
        kept[name] = t.tensor_type.name
        codes, scales = tensors.pop(name + ".qcodes"), tensors.pop(name + ".qscales")
        assert codes.dtype == (torch.int8 if t.tensor_type == Q.Q8_0 else torch.uint8) and scales.dtype == torch.float16
        raw = np.asarray(t.data)
        rebuilt = file_blocks(codes, scales, t.tensor_type)
        leaf = t.name.split(".", 2)[-1]
        if leaf in heads:  # the import un-permuted whole rows; permuting them back gives the file's bytes
            rebuilt = llama_cpp_permute(rebuilt, heads[leaf])
        assert np.array_equal(rebuilt, raw), t.name
        ours = QuantizedWeight.blocks("int8" if t.tensor_type == Q.Q8_0 else "int4", codes, scales).dequantize()
        if leaf in heads:
            ours = torch.from_numpy(llama_cpp_permute(ours.numpy(), heads[leaf]))
        assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type))), t.name
    assert len(kept) == 13  # every Q8_0 / Q4_x tensor of LLAMA_MIX
    embed = reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")]
    assert torch.equal(tensors.pop("model.embed_tokens.weight"),
                       torch.from_numpy(gguf.quants.dequantize(embed.data, embed.tensor_type)))
    assert not any(n.endswith((".qcodes", ".qscales")) for n in tensors)  # F32 / Q5_0 stay floats
    assert "model.layers.1.self_attn.o_proj.weight" in tensors and "model.layers.1.self_attn.v_proj.weight" in tensors
    assert json.loads((native / INFO_FILE).read_text())["quantized"] == kept
    config = json.loads((native / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gguf_blocks", "block_size": 32}
    assert config["tie_word_embeddings"] is True


def test_loaded_weights_are_blocks_of_the_right_kind(tmp_path):
    path, native, flat = llama_mix(tmp_path)
    cfg = ModelConfig.from_dir(native)
    assert cfg.quant_method == "gguf_blocks" and ModelConfig.from_dir(flat).quant_method is None
    ours = load_weights(native, cfg, torch.float32, CPU)
    ref = load_weights(flat, ModelConfig.from_dir(flat), torch.float32, CPU)
    kinds = {name: w.kind for name, w in ours.items() if isinstance(w, QuantizedWeight)}
    assert kinds == {"lm_head": "int8", "layers.0.qkv": "int4", "layers.0.o_proj": "int8", "layers.0.w13": "int4",
                     "layers.0.w2": "int4", "layers.1.w13": "int8", "layers.1.w2": "int8"}
    for name, weight in ours.items():  # fused or not, the blocks stand for exactly the floats of the other import
        assert torch.equal(weight.dequantize() if name in kinds else weight, ref[name]), name
    assert ours["lm_head"] is not ours["embed"] and not isinstance(ours["embed"], QuantizedWeight)
    # layer 1's q/k/v mix Q8_0, Q4_1 and F32: that one matrix is dequantized
    assert isinstance(ours["layers.1.qkv"], torch.Tensor)
    # the blocks' bytes are the file's (Q4_0 also stores its m = -8 d: 20 bytes a block instead of 18)
    reader = gguf.GGUFReader(str(path))
    fused = {t.name for t in reader.tensors if t.name.startswith("blk.1.attn_")}
    file_bytes = sum(int(t.n_bytes) + (2 * t.n_elements // 32 if t.tensor_type == Q.Q4_0 else 0)
                     for t in reader.tensors if t.tensor_type in (Q.Q8_0, Q.Q4_0, Q.Q4_1) and t.name not in fused)
    assert sum(ours[name].nbytes for name in kinds) == file_bytes
    floats = sum(w.numel() * w.element_size() for w in ours.values() if isinstance(w, torch.Tensor))
    assert weight_bytes(ours) == file_bytes + floats < weight_bytes(ref)


def engine(path) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
CASES = {  # name: (model_type, overrides, qtype of every linear weight, overrides of that, control's qtype)
    "llama": ("llama", {}, Q.Q4_1, {"blk.0.attn_k.weight": Q.Q4_0, "output.weight": Q.Q8_0}, Q.Q4_0),
    "qwen3_moe": ("qwen3_moe", MOE, Q.Q8_0, {"blk.0.ffn_gate_exps.weight": Q.Q4_0, "blk.0.ffn_up_exps.weight": Q.Q4_1,
                                              "blk.1.ffn_down_exps.weight": Q.Q4_1}, Q.Q4_1),
}


MIN_DECISIVE = {"llama": 4, "qwen3_moe": 6}  # of 33 steps; measured: 6 and 10


@pytest.mark.parametrize("case", list(CASES))
def test_native_import_generates_like_the_dequantized_one(tmp_path, case):
    model_type, overrides, qtype, mix, control_qtype = CASES[case]
    source = tiny_model(model_type, **overrides)
    path = write_gguf(tmp_path / "m.gguf", source, quantize=quantize_linear(source, qtype, **mix))
    other = write_gguf(tmp_path / "other.gguf", source, quantize=quantize_linear(source, control_qtype))
    native, flat = engine(import_gguf(path, tmp_path / "native")), engine(import_gguf(path, tmp_path / "float",
                                                                                         dequantize=True))
    control = engine(import_gguf(other, tmp_path / "control", dequantize=True))
    layer = native.engine.executor.model.layers[0]
    assert any(isinstance(w, QuantizedWeight) for w in vars(layer[-1]).values())  # the MLP runs from blocks
    decisive = 0
    for seed in range(3):  # up to 16 tokens in all: every matmul of a prompt runs the kernels (not a GEMM)
        prompt = torch.randint(3, 300, (4 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = last_logits(flat, prompt)
        assert relative_error(last_logits(native, prompt), ref) < TOL
        assert relative_error(last_logits(control, prompt), ref) > 4 * TOL  # the tolerance tells weights apart
        decisive += decisive_steps_agree(native, flat, prompt, 16 - len(prompt), TOL)
    assert decisive >= MIN_DECISIVE[case]


@pytest.mark.parametrize("qtype, mode", [(Q.Q8_0, "int8"), (Q.Q4_1, "int4")])
def test_blocks_run_exactly_as_quantize_on_load(tmp_path, qtype, mode):
    """Q8_0 / Q4_1 blocks are what quantize_int8 / quantize_int4 make of their own dequantization (measured: every
    block of this model), so the native import and the float import quantized on load are the same weights, run
    by the same kernels: equal logits and tokens, not just close ones."""
    source = tiny_model("qwen3", tie_word_embeddings=True)
    path = write_gguf(tmp_path / "q.gguf", source, quantize=quantize_linear(source, qtype))
    native = engine(import_gguf(path, tmp_path / "native"))
    on_load = LLM(str(import_gguf(path, tmp_path / "float", dequantize=True)), dtype="float32", device="cpu",
                  block_size=4, num_kv_blocks=64, quantization=mode)
    for prompt in ([5, 6, 7], list(range(10, 40))):  # the kernels' rows, and a prefill's dequantize + GEMM
        assert torch.equal(last_logits(native, prompt), last_logits(on_load, prompt))
    assert greedy(native, [5, 6, 7], 12) == greedy(on_load, [5, 6, 7], 12)


def test_parallel_shards_slice_the_blocks(tmp_path):
    """Row splits slice codes and scales; column splits (o_proj, down_proj) on whole blocks of 32 do too."""
    _, native, flat = llama_mix(tmp_path, intermediate_size=128)
    cfg, ref_cfg = ModelConfig.from_dir(native), ModelConfig.from_dir(flat)
    for rank in range(2):
        layout = ParallelLayout(tp_size=2, rank=rank)
        ours = load_weights(native, cfg, torch.float32, CPU, layout=layout)
        ref = load_weights(flat, ref_cfg, torch.float32, CPU, layout=layout)
        assert isinstance(ours["layers.0.w2"], QuantizedWeight) and ours["layers.0.w2"].dims == (1, 64, 64)
        assert isinstance(ours["layers.0.o_proj"], QuantizedWeight) and ours["layers.0.o_proj"].dims == (64, 32)
        for name, weight in ours.items():
            plain = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
            assert torch.equal(plain, ref[name]), (rank, name)


def test_column_split_inside_a_block_is_refused(tmp_path):
    _, native, _ = llama_mix(tmp_path)  # intermediate 96: two ranks would cut down_proj's inputs at 48
    with pytest.raises(ModelLoadError, match=r"cut its blocks of 32 inputs; run the model on one rank, or import "
                                             r"the GGUF with --dequantize"):
        load_weights(native, ModelConfig.from_dir(native), torch.float32, CPU, layout=ParallelLayout(tp_size=2))


def test_off_the_cpu_the_blocks_load_on_the_device_as_blocks(tmp_path):
    """A GPU (here the meta device, which takes that branch) gets the blocks as they are, for the Triton kernels."""
    _, native, _ = llama_mix(tmp_path)
    cfg = ModelConfig.from_dir(native)
    meta = load_weights(native, cfg, torch.bfloat16, torch.device("meta"))
    cpu = load_weights(native, cfg, torch.float32, CPU)
    assert meta.keys() == cpu.keys()
    for name, weight in meta.items():
        assert weight.device.type == "meta" and weight.shape == cpu[name].shape, name
        if isinstance(cpu[name], QuantizedWeight):
            assert isinstance(weight, QuantizedWeight) and weight.kind == cpu[name].kind, name
            assert weight.data.dtype == cpu[name].data.dtype and weight.scale.shape == cpu[name].scale.shape, name
        else:
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16, name


def test_quantize_on_load_of_quantized_weights_is_refused(tmp_path):
    _, native, flat = llama_mix(tmp_path)
    cfg = ModelConfig.from_dir(native)
    check_quantization("none", cfg)
    check_quantization("int4", ModelConfig.from_dir(flat))
    for mode in ("int8", "int4", "fp16"):
        with pytest.raises(ConfigError, match=rf"already quantized \(GGUF blocks.*quantization: {mode} cannot apply"):
            check_quantization(mode, cfg)
    with pytest.raises(ConfigError, match="already quantized"):  # the engine asks before it loads anything
        LLM(str(native), dtype="float32", device="cpu", quantization="int4")


def test_damaged_block_tensors_are_named(tmp_path):
    from safetensors.torch import save_file

    _, native, _ = llama_mix(tmp_path)
    tensors = load_file(str(native / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name + ".qscales"] = tensors[name + ".qscales"].float()
    save_file(tensors, str(native / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"quantized weight '{name}' has int4 codes .* torch.float32 scales"):
        load_weights(native, ModelConfig.from_dir(native), torch.float32, CPU)
    del tensors[name + ".qscales"]
    save_file(tensors, str(native / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"'{name}.qcodes' has no '{name}.qscales' beside it"):
        load_weights(native, ModelConfig.from_dir(native), torch.float32, CPU)
