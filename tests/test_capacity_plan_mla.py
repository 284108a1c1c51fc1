"""`tsterm plan` on DeepSeek-V3 (tsterm/models/configs/deepseek-v3.json is deepseek-ai/DeepSeek-V3's config.json, its
FP8 quantization_config included): Multi-head Latent Attention's weights and its cache of one latent per token,
shown against what full per-head K and V would take, and the deepseek-v3 profile (eight H200s, FP8, TP4 x EP2)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

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
