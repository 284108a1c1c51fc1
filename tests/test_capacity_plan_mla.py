"""`tsterm plan` on DeepSeek-V3 (tsterm/models/configs/deepseek-v3.json is deepseek-ai/DeepSeek-V3's config.json, its
FP8 quantization_config included): Multi-head Latent Attention's weights and its cache of one latent per token,
shown against what full per-head K and V would take, and the deepseek-v3 profile (eight H200s, FP8, TP4 x EP2).
Kimi-K2 (tsterm/models/configs/kimi-k2.json, moonshotai/Kimi-K2-Instruct's config.json): its FP8 release fits no
layout of eight H200s, and the kimi-k2 profile loads it with `quantization: int4` at TP4 x EP2."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tsterm.cli import main
from tsterm.plan import expanded_kv_bytes_per_token, kv_bytes_per_token, load_config, parameter_counts, parse_model

DATA = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "configs"
DEEPSEEK_V3 = DATA / "deepseek-v3.json"


def model(path: Path):
    raw, source = load_config(path)
    return parse_model(raw, source)


def test_deepseek_v3_parameter_counts():
    # hidden 7168, 61 layers, 128 heads, vocab 129280, layers 0-2 dense (18432), 58 MoE layers of 256 experts of 2048
    # top-8 + one shared expert of 2048 (no gate), a correction bias; MLA: q_lora 1536, kv_lora 512, nope 128,
    # rope 64, v 128
    # attention per layer: q_a 7168*1536 = 11,010,048; q_b 1536*128*192 = 37,748,736; kv_a 7168*576 = 4,128,768;
    #   kv_b 512*128*256 = 16,777,216; o 128*128*7168 = 117,440,512; norms 1536 + 512; = 187,107,328; x61
    #   = 11,413,547,008
    # dense MLP (3 layers): 3*7168*18432 = 396,361,728; x3 = 1,189,085,184
    # per MoE layer: experts 256 * 3*7168*2048 (44,040,192) = 11,274,289,152; shared 44,040,192; router 256*7168 =
    #   1,835,008; bias 256; = 11,320,164,608; x58 = 656,569,547,264
    # norms 2*7168*61 + 7168 = 881,664; embedding and LM head 2*129280*7168 = 1,853,358,080
    # total = 671,026,419,200 (the card's 671B, the MTP layer left out); active = total - 248 x 58 x 44,040,192
    #   = 37,552,297,472 (the card's 37B)
    m = model(DEEPSEEK_V3)
    assert parameter_counts(m) == (671_026_419_200, 37_552_297_472)
    assert m.moe_layers == (False,) * 3 + (True,) * 58 and m.router_bias and not m.shared_gated
    assert any("MTP" in note for note in m.notes)


def test_the_mla_cache_is_one_latent_per_token_on_every_rank():
    m = model(DEEPSEEK_V3)
    # 61 layers x (512 + 64) x 2 bytes; full K/V: 61 x 128 heads x (128 + 64 + 128) x 2
    assert kv_bytes_per_token(m, 1, "bf16") == 70_272 == kv_bytes_per_token(m, 4, "bf16")  # not split by TP
    assert kv_bytes_per_token(m, 1, "fp8") == 35_136
    assert expanded_kv_bytes_per_token(m, "bf16") == 4_997_120


def test_the_plan_prints_the_latent_against_full_kv(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "8xH200", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 70,272 bytes per token (bf16, 61 MLA layers" in out
    assert "full per-head K and V would take 4,997,120 bytes per token: 71.1x" in out
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "8xH200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kv_bytes_per_token"], report["kv_expanded_bytes_per_token"]) == (70_272, 4_997_120)


def test_the_deepseek_profile_plans_without_its_weights(capsys, monkeypatch):
    import tsterm

    monkeypatch.delenv("DEEPSEEK_V3_DIR", raising=False)
    assert main(["plan", "--profile", "deepseek-v3", "--gpus", "8xH200", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert f"({DEEPSEEK_V3})" in out.splitlines()[0]
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / "deepseek-v3.yaml").read_text()
    assert "#   tsterm plan --profile deepseek-v3 --gpus 8xH200 --dtype fp8\n" in comment
    rows = [line for line in out.splitlines() if line.startswith("  TP")]
    assert len(rows) == 4 and all(f"#   {row[2:]}\n" in comment for row in rows)


def test_the_deepseek_profile_layout_is_one_the_engine_cuts(monkeypatch, tmp_path):
    """The real config loads (MLA fields, DeepSeek's YaRN with mscale, FP8 blocks, groups) and the profile's TP4 x EP2
    passes the engine's own check on it."""
    from tsterm.config import ModelConfig
    from tsterm.model.mla import softmax_scale
    from tsterm.model.parallel import ParallelLayout
    from tsterm.profiles import load_profile

    monkeypatch.setenv("DEEPSEEK_V3_DIR", str(tmp_path))
    options = load_profile("deepseek-v3").engine_options()
    tp, ep = options.get("tensor_parallel_size", 1), options.get("expert_parallel_size", 1)
    assert (tp, ep) == (4, 2)
    cfg = ModelConfig.from_dict(json.loads(DEEPSEEK_V3.read_text()), source=str(DEEPSEEK_V3))
    ParallelLayout(tp, ep).check(cfg)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert cfg.head_dim == cfg.rotary_dim == 64 and cfg.fp8_block_size == (128, 128)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (8, 4, 2.5, 3)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.mscale == cfg.rope.mscale_all_dim == 1.0
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_the_absorbed_forms_float32_copies_of_kv_b_are_counted():
    """MLA's absorbed form keeps per-head W_UK^T [r, dn] and W_UV [dv, r] as float32 copies of a rank's kv_b rows
    (tsterm.model.mla.MLAttention): memory and bytes read per token, not parameters. DeepSeek-V3 at TP4: 61 layers x
    32 heads x 512 x (128 + 128) x 4 bytes = 1,023,410,176 per rank, whatever the weights' --dtype."""
    from tsterm.plan import GPU_PRESETS, plan_layouts, rank_tensors

    m = model(DEEPSEEK_V3)
    for tp, heads in ((1, 128), (4, 32), (8, 16)):
        copies = [t for t in rank_tensors(m, tp, 8 // tp) if t.derived]
        assert sum(t.bytes("fp8") * t.count for t in copies) == 61 * heads * 512 * 256 * 4
        assert sum(t.bytes("bf16") * t.read for t in copies) == 61 * heads * 512 * 256 * 4
    tp4 = {dtype: next(lay for lay in plan_layouts(m, 8, GPU_PRESETS["h200"], dtype) if lay.tp == 4) for dtype in ("fp8", "bf16")}
    without = {dtype: sum(t.bytes(dtype) * t.count for t in rank_tensors(m, 4, 2) if not t.derived)
               for dtype in tp4}
    assert all(tp4[d].weight_bytes - without[d] == 1_023_410_176 for d in tp4)
    assert parameter_counts(m)[0] == 671_026_419_200  # (copies are not parameters)


def test_kimi_k2_does_not_fit_eight_h200s(capsys, tmp_path):
    """Kimi-K2 (DeepSeek-V3's architecture with 64 heads, 384 experts, one dense layer, a 163,840 vocabulary): 1026B
    parameters, 130.00 GB of FP8 weights per rank at TP8 (its W_UK / W_UV copies: 61 x 8 x 512 x 256 x 4 bytes),
    over the 126.9 GB eight H200s leave after the headroom, as the deepseek-v3 profile says."""
    import tsterm

    raw = json.loads(DEEPSEEK_V3.read_text())
    raw.update(model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
               first_k_dense_replace=1, vocab_size=163840, n_group=1, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8xH200", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "1026.41 B parameters" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  TP")]
    assert len(rows) == 4 and all("does not fit" in " ".join(row) for row in rows)
    assert rows[-1][:5] == ["TP8", "x", "EP1", "130.00", "GB"]
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / "deepseek-v3.yaml").read_text()
    assert "(130.00 GB of weights per rank\n# at TP8" in comment


KIMI_K2 = DATA / "kimi-k2.json"
KIMI_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "kimi-k2.yaml"


def test_kimi_k2_parameter_counts():
    # DeepSeek-V3's shapes with 64 heads, 384 experts, layer 0 dense (60 MoE layers), a 163840 vocabulary:
    # attention per layer: q_a 11,010,048; q_b 1536*64*192 = 18,874,368; kv_a 4,128,768; kv_b 512*64*256 = 8,388,608;
    #   o 64*128*7168 = 58,720,256; norms 2,048; = 101,124,096; x61 = 6,168,569,856
    # dense MLP (1 layer): 396,361,728
    # per MoE layer: experts 384 * 44,040,192 = 16,911,433,728; shared 44,040,192; router 384*7168 = 2,752,512;
    #   bias 384; = 16,958,226,816; x60 = 1,017,493,608,960
    # norms 881,664; embedding and LM head 2*163840*7168 = 2,348,810,240
    # total = 1,026,408,232,448 (the card's 1T); active = total - 376 x 60 x 44,040,192 = 32,861,500,928 (the
    #   card's 32B; 31.69B without the embedding table)
    m = model(KIMI_K2)
    assert m.model_type == "kimi_k2" and m.mla is not None
    assert parameter_counts(m) == (1_026_408_232_448, 32_861_500_928)
    assert m.moe_layers == (False,) + (True,) * 60 and m.router_bias and not m.shared_gated
    assert kv_bytes_per_token(m, 4, "bf16") == 70_272 and expanded_kv_bytes_per_token(m, "bf16") == 2_498_560


def test_the_kimi_profile_plans_int4_and_says_why_not_fp8(capsys, monkeypatch):
    monkeypatch.delenv("KIMI_K2_DIR", raising=False)
    comment = KIMI_PROFILE.read_text()
    assert main(["plan", "--profile", "kimi-k2", "--gpus", "8xH200", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert f"({KIMI_K2})" in out.splitlines()[0] and "1026.41 B parameters, 32.86 B active" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  TP")]
    assert len(rows) == 4 and all("does not fit" in " ".join(row) for row in rows)
    assert rows[-1][:5] == ["TP8", "x", "EP1", "130.00", "GB"] and "(130.00 GB of weights per rank at TP8," in comment
    assert main(["plan", "--profile", "kimi-k2", "--gpus", "8xH200", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "#   tsterm plan --profile kimi-k2 --gpus 8xH200 --dtype int4\n" in comment
    rows = [line for line in out.splitlines() if line.startswith("  TP")]
    assert len(rows) == 4 and all(f"#   {row[2:]}\n" in comment for row in rows)
    assert "does not fit" not in out


def _q4_1(rows: int, cols: int) -> int:
    """Bytes of tsterm's int4 (GGUF Q4_1's form): 4 bits a weight + an fp16 scale and minimum per 32 inputs."""
    return rows * cols // 2 + 4 * rows * (cols // 32)


def _fp8(rows: int, cols: int) -> int:
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


def test_what_quantization_int4_loads_fits_tp4_ep2_with_the_kv_budget(monkeypatch, tmp_path):
    """The bytes one rank of the profile's TP4 x EP2 holds after `quantization: int4` of the FP8 release, from the
    shapes: 83.59 GB, the planner's figure, which with 30 GB of KV fits the 126.9 GB an H200 leaves after the
    headroom."""
    from tsterm_kernels.quant import quantize_fp8, quantize_int4

    from tsterm.config import ModelConfig
    from tsterm.model.mla import softmax_scale
    from tsterm.model.parallel import ParallelLayout
    from tsterm.profiles import load_profile

    assert quantize_int4(torch.randn(64, 96)).nbytes == _q4_1(64, 96)  # the formula is the kernel's format
    assert quantize_fp8(torch.randn(200, 300)).nbytes == _fp8(200, 300)
    monkeypatch.setenv("KIMI_K2_DIR", str(tmp_path))
    options = load_profile("kimi-k2").engine_options()
    tp, ep = options["tensor_parallel_size"], options["expert_parallel_size"]
    assert (tp, ep, options["quantization"], options["device"]) == (4, 2, "int4", "cuda")
    cfg = ModelConfig.from_dict(json.loads(KIMI_K2.read_text()), source=str(KIMI_K2))
    ParallelLayout(tp, ep).check(cfg)
    assert cfg.model_type == "kimi_k2" and cfg.quant_method == "fp8" and cfg.fp8_block_size == (128, 128)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (1, 1, 2.827, 1)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (384, 8, 2048)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 32 and cfg.rope.mscale == cfg.rope.mscale_all_dim == 1
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2)

    H, heads, i_moe, i_dense, vocab = 7168, 64 // tp, 2048 // tp, 18432 // tp, 163840 // tp
    mla = 61 * (_fp8(1536, H) + _fp8(heads * 192, 1536) + _fp8(576, H) + _fp8(heads * 256, 512)  # kept fp8
                + _q4_1(H, heads * 128)  # o_proj
                + 2 * (1536 + 512)  # q_a, kv_a norms
                + 4 * heads * 512 * 256)  # the absorbed form's float32 W_UK / W_UV
    experts = 60 * (384 // ep) * (_q4_1(2 * i_moe, H) + _q4_1(H, i_moe))
    rest = (_q4_1(2 * i_dense, H) + _q4_1(H, i_dense)  # layer 0's dense MLP
            + 60 * (_q4_1(2 * i_moe, H) + _q4_1(H, i_moe)  # the shared expert (2048 wide, one)
                    + 4 * 384 * H + 4 * 384)  # router and its correction bias, float32
            + 2 * (2 * 61 + 1) * H  # norms
            + 2 * vocab * H + _q4_1(vocab, H))  # the embedding (bfloat16) and the LM head (int4)
    per_rank = mla + experts + rest
    assert round(experts / 1e9, 2) == 79.27 and round(per_rank / 1e9, 2) == 83.59
    from tsterm.plan import GPU_PRESETS, parse_model, plan_layouts

    planned = next(lay for lay in plan_layouts(parse_model(json.loads(KIMI_K2.read_text())), 8, GPU_PRESETS["h200"],
                                               "int4") if lay.tp == tp)
    assert planned.weight_bytes == per_rank
    room = 141_000_000_000 * 9 // 10 - per_rank
    assert round(room / 1e9, 2) == 43.31 and options["kv_cache_memory"] < room
    blocks = options["kv_cache_memory"] // (70_272 * options["block_size"])
    assert blocks * options["block_size"] == 426_912 >= options["max_model_len"]
    comment = KIMI_PROFILE.read_text()
    assert "83.59 GB per rank (79.27 GB of it the routed experts), leaving 43.31 GB" in comment
    assert "30 GB of\n# KV = 426,912 tokens" in comment


def test_quantization_int4_of_an_fp8_kimi_checkpoint_keeps_mla_fp8_and_makes_the_rest_int4(tmp_path):
    """What the profile's `quantization: int4` does to Moonshot's FP8 release, on a tiny kimi_k2 checkpoint stored
    the same way, loaded as on a CUDA device (keep_fp8): MLA's q_a / q_b / kv_a / kv_b stay the stored fp8 blocks;
    o_proj, the routed experts, the shared expert, the dense MLP and the LM head become int4; the embedding stays
    float."""
    from tsterm_kernels.quant import QuantizedWeight

    from tsterm.config import ModelConfig
    from tsterm.model.loader import load_weights
    from tests.helpers.checkpoints import make_checkpoint, store_as_fp8

    path, _ = make_checkpoint(tmp_path / "kimi", "kimi_k2", dict(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16), with_tokenizer=False)
    store_as_fp8(path, json.loads(KIMI_K2.read_text())["quantization_config"])
    cfg = ModelConfig.from_dir(path)
    assert cfg.model_type == "kimi_k2"
    weights = load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True, quantization="int4")

    def kind(name: str) -> str | None:
        return weights[name].kind if isinstance(weights[name], QuantizedWeight) else None

    for i in range(2):
        assert [kind(f"layers.{i}.{n}") for n in ("q_a", "q_b", "kv_a", "kv_b")] == ["fp8"] * 4, i
        assert kind(f"layers.{i}.o_proj") == kind(f"layers.{i}.w13") == kind(f"layers.{i}.w2") == "int4", i
    assert kind("layers.1.shared_w13") == kind("layers.1.shared_w2") == kind("lm_head") == "int4"
    assert weights["layers.1.w13"].dims == (4, 64, 64) and kind("embed") is None
