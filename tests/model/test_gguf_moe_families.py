"""`import-gguf` for gpt-oss, GLM-4.5 (glm4moe), DeepSeek-V3 (deepseek2) and MiniMax-M2: tiny random checkpoints
saved by transformers, written as GGUFs the way llama.cpp's converter writes them (tests.helpers.gguf_moe: gguf-py's
own tensor names, the converter's splits and stacks, llama.cpp's keys), imported, and run by tsterm against
transformers on the checkpoint: greedy tokens equal and the last logits close for float32 files; for quantized files
(Q8_0, gpt-oss's experts MXFP4) the import with --dequantize against transformers on the weights the file
dequantizes to, and the native import (blocks kept) against that within the int8 kernels' tolerance."""
from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tsterm_kernels.quant import QuantizedWeight

from tests.helpers import gguf_moe
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.gguf import byte_symbols
from tests.helpers.parity import random_prompts, reference_greedy
from tests.helpers.probes import greedy, last_logits, relative_error
from tsterm import LLM
from tsterm.convert.gguf import INFO_FILE, import_gguf
from tsterm.errors import ModelLoadError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

Q = gguf.GGMLQuantizationType
NEW_TOKENS = 12
# Widths that are whole blocks of 32 where a quantized file needs them (hidden, experts, q/o projections)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32)
FAMILIES = {
    # gpt-oss: odd heads, a window shorter than the prompts, sinks and biases (randomised by make_checkpoint)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, num_attention_heads=3, num_key_value_heads=1,
                    head_dim=32, sliding_window=4, num_hidden_layers=2, moe_intermediate_size=32,
                    rope_parameters=YARN),
    # GLM-4.5: a dense first layer, a shared expert, a selection bias, partial RoPE, q/k norms, q/k/v bias
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     use_qk_norm=True, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                     num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                     partial_rotary_factor=0.5),
    # DeepSeek-V3: MLA with a q LoRA, a dense first layer, shared expert, groups, a selection bias, YaRN mscale
    "deepseek_v3": dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32,
                        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=3,
                        num_key_value_heads=3, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.7,
                                             mscale_all_dim=0.7, original_max_position_embeddings=64,
                                             beta_fast=32.0, beta_slow=1.0)),
    # MiniMax-M2: q/k norms over the whole projections, a rotary_dim, sigmoid routing with a bias
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, num_attention_heads=3, num_key_value_heads=1,
                       head_dim=32, rotary_dim=16, num_hidden_layers=2, moe_intermediate_size=32),
}
# What each family's float file also exercises (the quantized file takes the other form)
FLOAT_FORM = {"gpt_oss": dict(fuse_gate_up=False), "glm4_moe": dict(mtp_layer=True),
              "deepseek_v3": dict(split_kv_b=True), "minimax_m2": dict(fuse_gate_up=True)}
# The families' pre-tokenizers (tokenizer.ggml.pre: gpt-4o / minimax-m2 = o200k, glm4 = Llama 3's, deepseek-v3's
# three splits), worked out by hand from their regexes: o200k keeps "I'm" whole, Llama 3's splits off "'m"; digits go
# by three; DeepSeek isolates digits and CJK runs and keeps a punctuation mark with the letters after it
PRE_TOKENIZED = {"gpt_oss": ("I'm HAPPY 12345 hello", ["I'm", " HAPPY", " ", "123", "45", " hello"]),
                 "minimax_m2": ("I'm HAPPY 12345 hello", ["I'm", " HAPPY", " ", "123", "45", " hello"]),
                 "glm4_moe": ("I'm HAPPY 12345 hello", ["I", "'m", " HAPPY", " ", "123", "45", " hello"]),
                 "deepseek_v3": ("ab12345\u4f60\u597d.cd", ["ab", "123", "45", "\u4f60\u597d", ".cd"])}
QUANT_FORM = {"gpt_oss": dict(fuse_gate_up=True), "glm4_moe": dict(mtp_layer=False),
              "deepseek_v3": dict(split_kv_b=False), "minimax_m2": dict(fuse_gate_up=False)}


def q8_0(model_type: str):
    """llama-quantize's choice for a Q8_0 file, as a `quantize` rule: every weight matrix of whole 32-input rows but
    the norms and the router (never a bias); gpt-oss's experts MXFP4 (as its released GGUFs are). MLA's split kv_b
    halves stay float (see gguf_moe)."""
    def rule(name: str, shape) -> object:
        if len(shape) < 2 or shape[-1] % 32 or not name.endswith(".weight") or "norm" in name \
                or "ffn_gate_inp" in name or name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            return None
        return Q.MXFP4 if model_type == "gpt_oss" and "_exps." in name else Q.Q8_0
    return rule


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type = request.param
    model_dir, hf_model = make_checkpoint(tmp_path_factory.mktemp(model_type) / "hf", model_type,
                                          FAMILIES[model_type], with_tokenizer=False)
    return model_type, model_dir, hf_model


def engine(path) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=96)


def assert_matches(llm: LLM, hf_model, seed: int = 1) -> None:
    """Greedy tokens equal to transformers' on two prompts (one longer than gpt-oss's window), the last logits of
    a prefill within 1e-4 of the largest."""
    for prompt in random_prompts(hf_model.config.vocab_size, (9, 14), seed=seed):
        expected, first_logits = reference_greedy(hf_model, prompt, NEW_TOKENS)
        assert greedy(llm, prompt, NEW_TOKENS) == expected, f"prompt of {len(prompt)} tokens"
        assert relative_error(last_logits(llm, prompt), first_logits) < 1e-4


def test_float_gguf_generates_like_transformers(family, tmp_path):
    model_type, model_dir, hf_model = family
    path = gguf_moe.write(tmp_path / "f32.gguf", model_dir, model_type, **FLOAT_FORM[model_type])
    out = import_gguf(path, tmp_path / "imported")
    config, ref = json.loads((out / "config.json").read_text()), hf_model.config
    assert config["model_type"] == model_type and config["num_hidden_layers"] == ref.num_hidden_layers
    assert config["num_key_value_heads"] == ref.num_key_value_heads  # (MLA: the file says 1)
    for key in ("first_k_dense_replace", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "sliding_window", "rotary_dim"):
        if hasattr(ref, key) and key in FAMILIES[model_type]:
            assert config[key] == getattr(ref, key), key
    info = json.loads((out / INFO_FILE).read_text())
    if model_type == "glm4_moe":  # the MTP layer (blk.2: a decoder layer and its nextn tensors) is left out
        assert info["skipped"] and all(n.startswith("blk.2.") for n in info["skipped"])
        assert any(".nextn." in n for n in info["skipped"])
    else:
        assert info["skipped"] == []
    assert_matches(engine(out), hf_model)
    text, expected = PRE_TOKENIZED[model_type]
    assert pieces(out, text) == expected


def test_quantized_gguf_generates_like_transformers_on_its_weights(family, tmp_path):
    """Q8_0 matrices (gpt-oss's experts MXFP4): imported with --dequantize, tsterm gives transformers' tokens for
    the model with the weights the file dequantizes to; imported natively the blocks stay blocks (MXFP4 experts in
    gpt-oss's own layout, bit-exact) and the logits stay within the int8 kernels' tolerance of the float import."""
    model_type, model_dir, hf_model = family
    rule, split = q8_0(model_type), QUANT_FORM[model_type].get("split_kv_b", True)
    path = gguf_moe.write(tmp_path / "q.gguf", model_dir, model_type, quantize=rule, **QUANT_FORM[model_type])
    flat = engine(import_gguf(path, tmp_path / "float", dequantize=True))
    reference = gguf_moe.fake_quantized(copy.deepcopy(hf_model), model_type, rule, split_kv_b=split)
    assert_matches(flat, reference, seed=2)
    native_dir = import_gguf(path, tmp_path / "native")
    kept = json.loads((native_dir / INFO_FILE).read_text())["quantized"]
    assert "Q8_0" in kept.values()
    if model_type == "gpt_oss":
        assert {t for n, t in kept.items() if ".experts." in n} == {"MXFP4"}
        _assert_mxfp4_is_the_files(path, native_dir)
    if model_type == "deepseek_v3":  # MLA's projections too, whole kv_b included (its Q8_0 blocks as they are)
        for leaf in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            assert kept[f"model.layers.1.self_attn.{leaf}.weight"] == "Q8_0", leaf
    native = engine(native_dir)
    layer = native.engine.executor.model.layers[-1]
    assert any(isinstance(w, QuantizedWeight) for part in layer for w in vars(part).values())
    prompt = random_prompts(hf_model.config.vocab_size, (10,), seed=3)[0]
    assert relative_error(last_logits(native, prompt), last_logits(flat, prompt)) < 6e-2  # int8 activations


def _assert_mxfp4_is_the_files(path, native_dir) -> None:
    """The imported `_blocks` / `_scales` are the GGUF's MXFP4 blocks moved: dequantized by tsterm's mxfp4 kind
    they are gguf-py's dequantization of the file's tensors, gate and up rows interleaved."""
    tensors = load_file(str(native_dir / "model.safetensors"))
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = QuantizedWeight.mxfp4(tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"])
        fused = reader[f"blk.{layer}.ffn_gate_up_exps.weight"]
        ref = gguf.quants.dequantize(fused.data, Q.MXFP4).reshape(tuple(reversed(fused.shape.tolist())))
        half = ref.shape[1] // 2
        interleaved = np.stack([ref[:, :half], ref[:, half:]], axis=2).reshape(ref.shape)
        assert torch.equal(gate_up.dequantize(), torch.from_numpy(interleaved))
        down = QuantizedWeight.mxfp4(tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"])
        t = reader[f"blk.{layer}.ffn_down_exps.weight"]
        ref = gguf.quants.dequantize(t.data, Q.MXFP4).reshape(tuple(reversed(t.shape.tolist())))
        assert torch.equal(down.dequantize(), torch.from_numpy(ref))


def pieces(model_dir, text: str) -> list[str]:
    """`text` as the imported tokenizer's pre-tokenizer splits it (its byte-level pieces decoded)."""
    alphabet = {c: b for b, c in enumerate(byte_symbols())}
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [bytes(alphabet[c] for c in piece).decode() for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_kimi_k2_is_a_deepseek2_file_with_its_tokenizer(deepseek, tmp_path):
    """Kimi-K2's GGUFs say deepseek2 with tokenizer.ggml.pre kimi-k2: imported as kimi_k2 (as Moonshot's config.json
    says), with its pre-tokenizer (Han runs apart from other letters, digits by three), running DeepSeek-V3's
    architecture token for token."""
    model_dir, hf_model = deepseek
    out = import_gguf(gguf_moe.write(tmp_path / "k2.gguf", model_dir, "deepseek_v3", pre="kimi-k2"), tmp_path / "k2")
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k2"
    assert pieces(out, "\u4f60\u597dabc I'm Hello12345") == ["\u4f60\u597d", "abc", " I'm", " Hello", "123", "45"]
    prompt = random_prompts(hf_model.config.vocab_size, (9,), seed=6)[0]
    assert greedy(engine(out), prompt, NEW_TOKENS) == reference_greedy(hf_model, prompt, NEW_TOKENS)[0]


# --------------------------------------------------------------------------------------------------
# What the import refuses, by name

@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ds") / "hf", "deepseek_v3", FAMILIES["deepseek_v3"],
                           with_tokenizer=False)


def test_deepseek_v2_softmax_routing_is_refused(deepseek, tmp_path):
    """A deepseek2 file without expert_gating_func is DeepSeek-V2's softmax routing (llama.cpp's default)."""
    model_dir, _ = deepseek
    path = gguf_moe.write(tmp_path / "v2.gguf", model_dir, "deepseek_v3", drop_keys=("{arch}.expert_gating_func",))
    with pytest.raises(ModelLoadError, match=r"expert gating function 1 \(softmax\) is not supported for deepseek2.*"
                                             r"DeepSeek-V2"):
        import_gguf(path, tmp_path / "out")


def test_bad_mla_tensors_are_named(deepseek, tmp_path):
    model_dir, _ = deepseek
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = gguf_moe.gguf_tensors(gguf_moe.load_state(model_dir), cfg, "deepseek_v3")
    no_v_b = {n: w for n, w in tensors.items() if n != "blk.1.attn_v_b.weight"}
    path = gguf_moe.write(tmp_path / "half.gguf", model_dir, "deepseek_v3", tensors=no_v_b)
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_k_b\.weight'\] without attn_v_b"):
        import_gguf(path, tmp_path / "out")
    no_bias = {n: w for n, w in tensors.items() if n != "blk.1.exp_probs_b.bias"}
    path = gguf_moe.write(tmp_path / "nobias.gguf", model_dir, "deepseek_v3", tensors=no_bias)
    with pytest.raises(ModelLoadError, match=r"routed layers \[1\] have no selection bias blk\.N\.exp_probs_b\.bias"):
        import_gguf(path, tmp_path / "out")
    sinks = {**tensors, "blk.0.attn_sinks.weight": np.zeros(3, np.float32)}  # gpt-oss's, not DeepSeek's
    path = gguf_moe.write(tmp_path / "sinks.gguf", model_dir, "deepseek_v3", tensors=sinks)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_sinks\.weight' has no counterpart in the deepseek2"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_kquant_deepseek_keeps_its_blocks(tmp_path):
    """A Q4_K_M-like DeepSeek-V3 file (256-wide rows): the experts, dense and shared MLPs and q_a as Q4_K, the
    latent's kv_a as Q6_K, the rest Q8_0 where rows allow, kv_b's split halves as Q4_0 (the key half, rows along
    nope) and Q8_0 (the value half). The native import keeps them all as blocks (MLA's q_b, kv_a and kv_b too, which
    tsterm's MLA multiplies through its linear seam): kv_b as int8 along kv_lora_rank re-quantized from the halves,
    which gives back the value half's Q8_0 blocks as they are, its key rows within half an int8 step; its logits
    are the dequantized import's within the kernels' tolerance, and the dequantized import gives transformers'
    tokens on the weights the file dequantizes to."""
    overrides = dict(FAMILIES["deepseek_v3"], hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                     initializer_range=0.05)
    model_dir, hf_model = make_checkpoint(tmp_path / "hf", "deepseek_v3", overrides, with_tokenizer=False)

    def rule(name: str, shape) -> object:
        if not name.endswith(".weight") or len(shape) < 2 or "norm" in name or "ffn_gate_inp" in name:
            return None
        if name.endswith("attn_k_b.weight"):
            return Q.Q4_0
        if shape[-1] % 256 == 0 and name.startswith("blk."):
            return Q.Q6_K if "attn_kv_a_mqa" in name else Q.Q4_K
        return Q.Q8_0 if shape[-1] % 32 == 0 else None

    path = gguf_moe.write(tmp_path / "k.gguf", model_dir, "deepseek_v3", quantize=rule)
    flat_dir = import_gguf(path, tmp_path / "float", dequantize=True)
    flat = engine(flat_dir)
    assert_matches(flat, gguf_moe.fake_quantized(copy.deepcopy(hf_model), "deepseek_v3", rule), seed=4)
    native_dir = import_gguf(path, tmp_path / "native")
    info = json.loads((native_dir / INFO_FILE).read_text())
    kept = info["quantized"]
    for layer, leaf in ((0, "mlp.gate_proj.weight"), (1, "mlp.experts.gate_up_proj"), (1, "mlp.experts.down_proj"),
                        (1, "mlp.shared_experts.down_proj.weight"), (1, "self_attn.q_a_proj.weight")):
        assert kept[f"model.layers.{layer}.{leaf}"] == "Q4_K", leaf
    for layer in range(2):
        a = f"model.layers.{layer}.self_attn."
        assert (kept[a + "q_b_proj.weight"], kept[a + "kv_a_proj_with_mqa.weight"]) == ("Q8_0", "Q6_K")
        assert kept[a + "kv_b_proj.weight"] == "Q4_0+Q8_0" and a + "kv_b_proj.weight" in info["requantized"]
    _assert_kv_b_blocks(path, native_dir, flat_dir, hf_model.config)
    native = engine(native_dir)
    attention = native.engine.executor.model.layers[1][1]  # (input norm, mixer, post norm, MLP)
    for weight in ("q_b", "kv_a", "kv_b"):
        assert isinstance(getattr(attention, weight), QuantizedWeight) and getattr(attention, weight).kind == "int8"
    experts = native.engine.executor.model.layers[1][-1]
    assert any(isinstance(w, QuantizedWeight) and w.kind == "int4" for w in vars(experts).values())
    prompt = random_prompts(hf_model.config.vocab_size, (10,), seed=5)[0]
    assert relative_error(last_logits(native, prompt), last_logits(flat, prompt)) < 6e-2


def _assert_kv_b_blocks(path, native_dir, flat_dir, cfg) -> None:
    """The native kv_b's value rows are the file's attn_v_b Q8_0 blocks (codes and scales as they are); its key rows
    dequantize to the file's attn_k_b within half an int8 step of their blocks."""
    native, flat = load_file(str(native_dir / "model.safetensors")), load_file(str(flat_dir / "model.safetensors"))
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    heads, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        kv_b = QuantizedWeight.blocks("int8", native[name + ".qcodes"], native[name + ".qscales"])
        values, codes = kv_b.dequantize().view(heads, -1, rank), native[name + ".qcodes"].view(heads, -1, rank)
        v_b = np.asarray(reader[f"blk.{layer}.attn_v_b.weight"].data).reshape(heads, -1, rank // 32, 34)
        file_codes = v_b[..., 2:].copy().view(np.int8).reshape(heads, -1, rank)
        assert torch.equal(codes[:, nope:], torch.from_numpy(file_codes))
        reference = flat[name].view(heads, -1, rank)  # the file's halves dequantized (the --dequantize import)
        assert torch.equal(values[:, nope:], reference[:, nope:])
        step = native[name + ".qscales"].float().view(heads, -1, rank // 32).repeat_interleave(32, -1)
        assert ((values[:, :nope] - reference[:, :nope]).abs() <= step[:, :nope] / 2 + 1e-7).all()


@pytest.mark.parametrize("experts", ["Q8_0", "Q4_K+Q6_K"])
def test_gpt_oss_kquant_experts_stay_blocks(experts, tmp_path):
    """gpt-oss GGUFs whose experts are not MXFP4 (Q8_0; Q4_K_M-like: gate / up Q4_K, down Q6_K): the native import
    writes them as int8 / int4 blocks in tsterm's layout (gate and up rows interleaved as gpt-oss's checkpoints lay
    them), which the loader keeps as QuantizedWeights run by the clamped-SwiGLU experts: each dequantizes to the
    --dequantize import's expert matrices (Q8_0, Q6_K -> int8 exactly; Q4_K within its float16 scales' rounding);
    the logits are within the kernels' tolerance of the dequantized import, which gives transformers' tokens on the
    weights the file dequantizes to."""
    overrides = dict(FAMILIES["gpt_oss"], hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                     initializer_range=0.05)
    model_dir, hf_model = make_checkpoint(tmp_path / "hf", "gpt_oss", overrides, with_tokenizer=False)
    gate_up, down = (Q.Q8_0, Q.Q8_0) if experts == "Q8_0" else (Q.Q4_K, Q.Q6_K)

    def rule(name: str, shape) -> object:
        if len(shape) < 2 or shape[-1] % 32 or not name.endswith(".weight") or "norm" in name \
                or "ffn_gate_inp" in name:
            return None
        if "_exps." in name:
            return down if "ffn_down_exps" in name else gate_up
        return Q.Q8_0

    path = gguf_moe.write(tmp_path / "q.gguf", model_dir, "gpt_oss", quantize=rule)
    flat_dir = import_gguf(path, tmp_path / "float", dequantize=True)
    flat = engine(flat_dir)
    assert_matches(flat, gguf_moe.fake_quantized(copy.deepcopy(hf_model), "gpt_oss", rule), seed=7)
    native_dir = import_gguf(path, tmp_path / "native")
    kept = json.loads((native_dir / INFO_FILE).read_text())["quantized"]
    want = {"Q8_0": ("Q8_0", "Q8_0"), "Q4_K+Q6_K": ("Q4_K", "Q6_K")}[experts]
    native = engine(native_dir)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        assert (kept[p + "gate_up_proj"], kept[p + "down_proj"]) == want
        mine, theirs = native.engine.executor.model.layers[layer][-1], flat.engine.executor.model.layers[layer][-1]
        for weight, kind in (("w13", "int8" if experts == "Q8_0" else "int4"), ("w2", "int8")):
            kept_weight, float_weight = getattr(mine, weight), getattr(theirs, weight)
            assert isinstance(kept_weight, QuantizedWeight) and kept_weight.kind == kind, weight
            error = (kept_weight.dequantize() - float_weight).abs()
            if experts == "Q8_0":  # the file's blocks as they are
                assert error.max() == 0, weight
            elif kind == "int8":  # Q6_K re-quantized: within half an int8 step of its block
                step = kept_weight.scale.float().repeat_interleave(32, -1)
                assert (error <= step / 2 + 1e-7).all(), weight
            else:  # Q4_K: its scales rounded to float16 (2^-11 of a block's 15 d sc + dmin m, at most 3 max|w|)
                assert error.max() <= 2 ** -11 * 3 * float_weight.abs().max(), weight
    prompt = random_prompts(hf_model.config.vocab_size, (10,), seed=8)[0]
    assert relative_error(last_logits(native, prompt), last_logits(flat, prompt)) < 6e-2


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_gpt_oss_block_experts_shard(tp, ep, tmp_path):
    """gpt-oss's imported Q8_0 expert blocks, loaded by a rank of a tensor- or expert-parallel layout: its w13 holds
    its experts' gate rows then up rows of its share of the intermediate, its w2 those columns, as blocks that
    dequantize to exactly that slice of the one-rank load (the float import's layout, checked against transformers
    above)."""
    from tsterm.config import ModelConfig
    from tsterm.model.loader import load_weights
    from tsterm.model.parallel import ParallelLayout

    overrides = dict(FAMILIES["gpt_oss"], num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                     moe_intermediate_size=64)
    model_dir, _ = make_checkpoint(tmp_path / "hf", "gpt_oss", overrides, with_tokenizer=False)

    def rule(name: str, shape) -> object:
        return Q.Q8_0 if "_exps.weight" in name else None

    native_dir = import_gguf(gguf_moe.write(tmp_path / "q.gguf", model_dir, "gpt_oss", quantize=rule),
                             tmp_path / "native")
    cfg = ModelConfig.from_dir(native_dir)
    full = load_weights(native_dir, cfg, torch.float32, torch.device("cpu"))
    inter, experts = cfg.moe_intermediate_size, cfg.num_experts
    for rank in range(tp * ep):
        layout = ParallelLayout(tp, ep, rank)
        w = load_weights(native_dir, cfg, torch.float32, torch.device("cpu"), layout=layout)
        (e0, ne), (i0, ni) = layout.experts(experts), (layout.tp_rank * inter // tp, inter // tp)
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}."
            assert isinstance(w[p + "w13"], QuantizedWeight) and isinstance(w[p + "w2"], QuantizedWeight)
            w13, w2 = full[p + "w13"].dequantize()[e0:e0 + ne], full[p + "w2"].dequantize()[e0:e0 + ne]
            want = torch.cat((w13[:, i0:i0 + ni], w13[:, inter + i0:inter + i0 + ni]), 1)
            assert torch.equal(w[p + "w13"].dequantize(), want)
            assert torch.equal(w[p + "w2"].dequantize(), w2[:, :, i0:i0 + ni])
