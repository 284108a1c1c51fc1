"""`tsterm plan`: every figure below is worked out by hand from the model's config (the arithmetic is in the comments)
and compared exactly with what the planner computes.

Fixtures (the configs shipped for planning, tsterm/models/configs):
- qwen3-30b-a3b.json: Qwen/Qwen3-30B-A3B's config.json (hidden 2048, 48 layers, 32 q / 4 kv heads, head_dim
  128, 128 experts top-8, moe_intermediate 768, vocab 151936, untied).
- qwen3.5-397b-a17b.json: Qwen/Qwen3.5-397B-A17B's text_config, nested as in the HF repo (vision_config left
  out). Values from public copies of that config: 60 layers, hidden 4096, 32 q / 2 kv heads of 256 with the output
  gate, every 4th layer full attention, Gated DeltaNet 16 key heads / 64 value heads of 128, conv kernel 4,
  512 experts top-10 of width 1024, shared expert 1024, vocab 248320, untied. (One public test fixture gives the
  shared expert 4096; three other copies give 1024, and only 1024 reproduces the model's "A17B": see
  test_qwen35_parameter_counts.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsterm.cli import main
from tsterm.errors import ConfigError, ModelLoadError
from tsterm.plan import (GB, GPU_PRESETS, Tensor, kv_bytes_per_token, load_config, parameter_counts, parse_gpus,
                         parse_model, plan_layouts, state_bytes_per_sequence)

DATA = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "configs"
QWEN3_30B = DATA / "qwen3-30b-a3b.json"
QWEN35_397B = DATA / "qwen3.5-397b-a17b.json"
H200, B200 = GPU_PRESETS["h200"], GPU_PRESETS["b200"]


def model(path: Path):
    raw, source = load_config(path)
    return parse_model(raw, source)


def layout(layouts, tp: int, ep: int):
    (found,) = [lay for lay in layouts if (lay.tp, lay.ep) == (tp, ep)]
    return found


# --------------------------------------------------------------------------------------------------
# Qwen3-30B-A3B

def test_qwen3_30b_parameter_counts():
    # attention per layer: q 2048x(32*128) = 8,388,608; k, v 2048x(4*128) = 1,048,576 each; o 8,388,608
    #   = 18,874,368; x48 = 905,969,664
    # experts: one expert 3*2048*768 = 4,718,592; x128 x48 = 28,991,029,248
    # router 128*2048 x48 = 12,582,912
    # norms: per layer 2*2048 + q_norm 128 + k_norm 128 = 4,352; x48 = 208,896; + final 2048 = 210,944
    # embedding and LM head (untied): 2 x 151936*2048 = 2 x 311,164,928 = 622,329,856
    # total = 30,532,122,624 (the model card's 30.5B)
    # active = total - 120 experts x 48 x 4,718,592 (= 27,179,089,920) = 3,353,032,704 (the card's 3.3B)
    total, active = parameter_counts(model(QWEN3_30B))
    assert total == 30_532_122_624
    assert active == 3_353_032_704


def test_qwen3_30b_single_gpu_bf16():
    m = model(QWEN3_30B)
    (lay,) = plan_layouts(m, 1, H200, context=8192)
    assert (lay.tp, lay.ep) == (1, 1)
    assert lay.weight_bytes == 2 * 30_532_122_624 == 61_064_245_248
    # KV per token: 48 layers x (K and V) 2 x 4 heads x 128 x 2 bytes = 98,304
    assert lay.kv_bytes_per_token == kv_bytes_per_token(m, 1, "bf16") == 98_304
    # read per token: attention 905,969,664 + 8 experts x 48 x 4,718,592 (1,811,939,328) + router 12,582,912
    #   + norms 210,944 + LM head 311,164,928 = 3,041,867,776 params = 6,083,735,552 bytes (embedding row: negligible)
    assert lay.weight_read_bytes == 6_083_735_552
    # + KV at 8192 tokens: 8192 x 98,304 = 805,306,368 -> 6,889,041,920 bytes; 4.8e12 / that = 696.76 tok/s
    assert lay.read_bytes_per_token == 6_889_041_920
    assert lay.tokens_per_s == pytest.approx(696.76, abs=0.01)
    # free: 141e9 x 0.9 = 126,900,000,000 - 61,064,245,248 = 65,835,754,752; // 98,304 = 669,715 tokens
    assert lay.free_bytes == 65_835_754_752
    assert lay.kv_tokens == 669_715


def test_qwen3_30b_tp2_ep4_on_8xh200():
    lay = layout(plan_layouts(model(QWEN3_30B), 8, H200, context=8192), 2, 4)
    # per rank, TP2 x EP4:
    # attention: q 2048x(16*128) 4,194,304; k, v 2048x(2*128) 524,288 each; o 4,194,304 = 9,437,184; x48 = 452,984,832
    # experts: 128/4 = 32 held, each at 768/2 = 384 wide: 3*2048*384 = 2,359,296; x32 x48 = 3,623,878,656
    # router (replicated) 12,582,912; norms (replicated) 210,944
    # embedding and LM head: 151936/2 = 75,968 rows x 2048 = 155,582,464 each = 311,164,928
    # = 4,400,822,272 params = 8,801,644,544 bytes
    assert lay.weight_bytes == 8_801_644_544
    assert lay.free_bytes == 126_900_000_000 - 8_801_644_544 == 118_098_355_456
    # KV per token per rank: 48 x 2 x (4/2 = 2 heads) x 128 x 2 = 49,152; 118,098,355,456 // 49,152 = 2,402,717
    assert lay.kv_bytes_per_token == 49_152
    assert lay.kv_tokens == 2_402_717
    # a sequence of 8192 tokens: 402,653,184 bytes; 293 per replica, 4 replicas (EP groups) = 1,172
    assert lay.sequences == 1_172
    # read: attention 452,984,832 + ceil(8/4) = 2 experts x 48 x 2,359,296 (226,492,416) + router 12,582,912
    #   + norms 210,944 + LM head 155,582,464 = 847,853,568 params = 1,695,707,136 bytes; + KV 402,653,184
    #   = 2,098,360,320 bytes; 4.8e12 / that = 2287.5 tok/s
    assert lay.weight_read_bytes == 1_695_707_136
    assert lay.read_bytes_per_token == 2_098_360_320
    assert lay.tokens_per_s == pytest.approx(2287.50, abs=0.01)


def test_qwen3_30b_fp8_weights():
    (lay,) = plan_layouts(model(QWEN3_30B), 1, H200, dtype="fp8")
    # fp8: 1 byte per weight + a 4-byte scale per 128x128 block of each linear layer; the rest stays bf16.
    # q [4096, 2048]: 8,388,608 + 4*32*16 = 8,390,656; k, v [512, 2048]: 1,048,576 + 4*4*16 = 1,048,832 each;
    # o [2048, 4096]: 8,390,656 -> 18,878,976 per layer, x48 = 906,190,848
    # expert gate/up [768, 2048] and down [2048, 768]: 1,572,864 + 4*6*16 = 1,573,248 each -> 4,719,744 per expert,
    #   x128 x48 = 28,998,107,136
    # bf16: router 25,165,824 + norms 421,888 + embedding and LM head 1,244,659,712
    # = 31,174,545,408
    assert lay.weight_bytes == 31_174_545_408


def test_int4_matrix_bytes():
    # [768, 2048] at 4 bits: 786,432 bytes + an fp16 scale and minimum per 32 inputs (the engine's int4, GGUF Q4_1's
    # form): 768 x 64 x 4 = 196,608 -> 983,040
    assert Tensor("experts", 768, 2048, 1, 1).bytes("int4") == 983_040
    assert Tensor("router", 768, 2048, 1, 1, quantized=False).bytes("int4") == 2 * 768 * 2048


# --------------------------------------------------------------------------------------------------
# Qwen3.5-397B-A17B (hybrid: 15 full-attention + 45 Gated DeltaNet layers)

def test_qwen35_parameter_counts():
    m = model(QWEN35_397B)
    assert (m.num_layers, m.num_full, m.q_gated) == (60, 15, True)
    # full attention per layer (q doubled by the output gate): q 4096x(2*32*256) 67,108,864; k, v 4096x512
    #   2,097,152 each; o 8192x4096 33,554,432 = 104,857,600; x15 = 1,572,864,000; q/k norms 512 x15 = 7,680
    # Gated DeltaNet per layer: key dim 16*128 = 2048, value dim 64*128 = 8192; in_proj_qkv 4096x12288 50,331,648;
    #   in_proj_z 4096x8192 33,554,432; in_proj_b, in_proj_a 4096x64 each 524,288; out_proj 33,554,432;
    #   conv1d 12288x4 49,152; A_log + dt_bias 128; norm 128 = 118,014,208; x45 = 5,310,639,360
    # experts: 3*4096*1024 = 12,582,912 per expert, x512 x60 = 386,547,056,640
    # shared expert 12,582,912 x60 = 754,974,720; its gate 4096 x60 = 245,760; router 512*4096 x60 = 125,829,120
    # norms 121 x 4096 = 495,616; embedding + LM head 2 x 248320*4096 = 2,034,237,440
    # total = 396,346,350,336 (the model's 397B, less its vision encoder and MTP head)
    # active = total - 502 experts x 60 x 12,582,912 (378,997,309,440) = 17,349,040,896: "A17B". With a 4096-wide
    #   shared expert it would be 19.6B, which is why the fixture uses 1024.
    total, active = parameter_counts(m)
    assert total == 396_346_350_336
    assert active == 17_349_040_896


def test_qwen35_kv_and_state():
    m = model(QWEN35_397B)
    # KV: 15 full-attention layers x 2 x 2 kv heads x 256 x 2 bytes = 30,720 per token
    assert kv_bytes_per_token(m, 1, "bf16") == 30_720
    assert kv_bytes_per_token(m, 1, "fp8") == 15_360
    # state per layer: conv (2*2048 + 8192 = 12288 channels) x (4 - 1) = 36,864; recurrent 64 x 128 x 128
    #   = 1,048,576; (36,864 + 1,048,576) x 2 bytes = 2,170,880; x45 layers = 97,689,600 per sequence
    assert state_bytes_per_sequence(m, 1, "bf16") == 97_689_600
    assert state_bytes_per_sequence(m, 1, "fp32") == 2 * 97_689_600


def test_qwen35_tp8_on_8xb200():
    m = model(QWEN35_397B)
    lay = layout(plan_layouts(m, 8, B200, state_dtype="bf16", context=8192), 8, 1)
    # per rank, TP8 x EP1:
    # full attention: q 4 heads x 256 x 2 (gate) = 2048 x 4096 = 8,388,608; 2 kv heads on 8 ranks -> 1 (replicated):
    #   k, v 256x4096 = 1,048,576 each; o 4096x1024 4,194,304 = 14,680,064; x15 = 220,200,960; q/k norms 7,680
    # Gated DeltaNet: 2 key heads (256), 8 value heads (1024): in_proj_qkv 1536x4096 6,291,456; in_proj_z
    #   4,194,304; in_proj_b, a 8x4096 each 65,536; out_proj 4,194,304; conv 1536x4 6,144; A_log + dt_bias 16;
    #   norm 128 = 14,751,888; x45 = 663,834,960
    # experts: all 512 at 1024/8 = 128 wide: 3*4096*128 = 1,572,864; x512 x60 = 48,318,382,080
    # shared expert 1,572,864 x60 = 94,371,840; router 125,829,120 and shared gate 245,760 (replicated)
    # norms 495,616; embedding and LM head 248320/8 = 31,040 rows x 4096 = 127,139,840 each
    # = 49,677,647,696 params = 99,355,295,392 bytes
    assert lay.weight_bytes == 99_355_295_392
    # free: 180e9 x 0.9 = 162e9 - 99,355,295,392 = 62,644,704,608
    assert lay.free_bytes == 62_644_704_608
    # KV per token per rank: 15 x 2 x 1 x 256 x 2 = 15,360 -> 62,644,704,608 // 15,360 = 4,078,431 tokens
    assert lay.kv_bytes_per_token == 15_360
    assert lay.kv_tokens == 4_078_431
    # state per sequence per rank: conv 1536 x 3 = 4,608 + recurrent 8 x 128 x 128 = 131,072 -> 135,680 x 2 bytes
    #   x45 = 12,211,200; a sequence at 8192: 8192 x 15,360 + 12,211,200 = 138,040,320 -> 453 sequences
    assert lay.state_bytes_per_sequence == 12_211_200
    assert lay.sequences == 453
    # read: all but the embedding (127,139,840) and the 502 idle experts (502 x 60 x 1,572,864 = 47,374,663,680)
    #   = 2,175,844,176 params = 4,351,688,352 bytes; + KV 125,829,120 + state 12,211,200 = 4,489,728,672 bytes
    #   -> 8e12 / that = 1781.84 tok/s
    assert lay.weight_read_bytes == 4_351_688_352
    assert lay.read_bytes_per_token == 4_489_728_672
    assert lay.tokens_per_s == pytest.approx(1781.84, abs=0.01)


def test_qwen35_ep8_reads_two_experts_per_rank():
    lay = layout(plan_layouts(model(QWEN35_397B), 8, B200, context=1), 1, 8)
    # TP1 x EP8: 10 routed experts over 8 ranks -> some rank serves ceil(10/8) = 2; it reads everything else whole:
    # full attention 1,572,864,000 + 7,680; Gated DeltaNet 5,310,639,360; 2 experts x 60 x 12,582,912
    #   = 1,509,949,440; shared expert 754,974,720; router 125,829,120 + 245,760; norms 495,616; LM head
    #   1,017,118,720 = 10,292,124,416 params = 20,584,248,832 bytes
    assert lay.weight_read_bytes == 20_584_248_832


def test_layer_types_and_interval_agree():
    raw, source = load_config(QWEN35_397B)
    text = dict(raw["text_config"])
    del text["layer_types"]  # every 4th layer from full_attention_interval alone
    assert parse_model({**raw, "text_config": text}, source).full_layers == model(QWEN35_397B).full_layers


# --------------------------------------------------------------------------------------------------
# the command

def test_cli_json(capsys):
    assert main(["plan", "--model", str(QWEN3_30B), "--gpus", "8xH200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(lay["tp"], lay["ep"]) for lay in report["layouts"]] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert report["layouts"][1]["weight_bytes"] == 8_801_644_544
    assert report["kv_bytes_per_token"] == 98_304
    assert report["reference"] is None


def test_cli_table_with_reference(capsys, tmp_path):
    (tmp_path / "config.json").write_text(QWEN35_397B.read_text())  # a model directory
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8xB200", "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "TP8 x EP1" in out and "TP1 x EP8" in out
    # the state as tsterm keeps it, in float32 by default: twice the bf16 figure (97,689,600)
    assert "30,720 bytes per token" in out and "195,379,200 bytes per sequence (fp32" in out
    assert "580 tok/s" in out and "MTP speculative decoding" in out


def test_cli_custom_gpu(capsys):
    assert main(["plan", "--model", str(QWEN3_30B), "--gpus", "4xcustom", "--memory-gb", "80", "--bandwidth-tbs",
                 "3.35", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == {"count": 4, "name": "custom", "memory_bytes": 80 * GB, "bandwidth_bytes_per_s": 3.35e12}


@pytest.mark.parametrize("gpus, message", [
    ("8H200", "expected COUNTxKIND"),
    ("8xA100", "unknown GPU 'A100'"),
    ("0xH200", "must be in 1..4096"),
    ("4xcustom", "needs --memory-gb and --bandwidth-tbs"),
])
def test_bad_gpus(gpus, message, capsys):
    assert main(["plan", "--model", str(QWEN3_30B), "--gpus", gpus]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match=message):
        parse_gpus(gpus)


def test_missing_config(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8xH200"]) == 1
    assert "no config.json in this directory" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_config(tmp_path / "nope.json")


def test_unknown_model_type_without_moe_fields():
    raw = {"model_type": "gpt2", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
           "vocab_size": 50257}
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not one the planner knows"):
        parse_model(raw)
    # the same with MoE fields is planned, with a note
    m = parse_model({**raw, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512})
    assert m.experts == 8 and any("not a known family" in note for note in m.notes)


@pytest.mark.parametrize("raw, total", [
    # Mixtral-8x7B: 46,702,792,704 parameters (its safetensors index); experts from num_local_experts and the
    # expert width from intermediate_size
    (dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
          intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000), 46_702_792_704),
    # Llama-3-8B (dense): 8,030,261,248
    (dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
          intermediate_size=14336, vocab_size=128256), 8_030_261_248),
    # Qwen3-0.6B (dense, tied embeddings: one matrix): 596,049,920
    (dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
          head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True), 596_049_920),
])
def test_other_families_match_published_totals(raw, total):
    assert parameter_counts(parse_model(raw))[0] == total


# --------------------------------------------------------------------------------------------------
# --profile: the profile's model, or the config it names for planning (shipped with the package)

def test_plan_a_profile_without_its_weights(capsys, monkeypatch):
    """The shipped qwen3.5 profile plans from the config it names (installed with the package), its model
    directory's ${VAR} unset; the table is the one its comment shows."""
    import tsterm

    monkeypatch.delenv("QWEN3_5_397B_A17B_DIR", raising=False)
    assert main(["plan", "--profile", "qwen3.5-397b-a17b", "--gpus", "8xH200"]) == 0
    by_profile = capsys.readouterr().out
    shipped = Path(tsterm.__file__).parent / "models" / "configs" / "qwen3.5-397b-a17b.json"
    assert f"({shipped})" in by_profile.splitlines()[0]
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / "qwen3.5-397b-a17b.yaml").read_text()
    assert "#   tsterm plan --profile qwen3.5-397b-a17b --gpus 8xH200\n" in comment
    for row in ("TP1 x EP8     116.24 GB   10.66 GB            347,156        184         21.03 GB     228 tok/s",
                "TP8 x EP1      99.36 GB   27.54 GB          1,793,275        183          4.50 GB   1,066 tok/s"):
        assert f"#   {row}\n" in comment and f"  {row}\n" in by_profile
    assert main(["plan", "--model", "qwen3.5-397b-a17b", "--gpus", "8xH200"]) == 0  # a shipped config by name
    assert capsys.readouterr().out == by_profile


def test_plan_a_profile_reads_its_model_directory_first(capsys, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(QWEN3_30B.read_text())
    monkeypatch.setenv("QWEN3_5_397B_A17B_DIR", str(tmp_path))
    assert main(["plan", "--profile", "qwen3.5-397b-a17b", "--gpus", "8xH200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["source"] == str(tmp_path / "config.json")


def test_shipped_configs_are_package_data():
    import tomllib

    import tsterm

    globs = tomllib.loads((Path(tsterm.__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["tsterm"]
    configs = sorted((Path(tsterm.__file__).parent / "models" / "configs").glob("*.json"))
    assert [p.name for p in configs] == ["deepseek-v3.json", "glm-4.5-air.json", "gpt-oss-120b.json",
                                         "gpt-oss-20b.json", "kimi-k2.json", "minimax-m2.json", "qwen3-30b-a3b.json",
                                         "qwen3.5-397b-a17b.json"]
    assert all(any(p.relative_to(Path(tsterm.__file__).parent).match(g) for g in globs) for p in configs)


@pytest.mark.parametrize("argv, code, message", [
    (["--gpus", "8xH200"], 2, "give --model DIR|config.json or --profile NAME"),
    (["--profile", "moe-demo", "--model", "x", "--gpus", "8xH200"], 2, "--model or --profile, not both"),
])
def test_plan_needs_a_model_or_a_profile(capsys, argv, code, message):
    assert main(["plan", *argv]) == code
    err = capsys.readouterr().err
    assert err.startswith("tsterm: error: ") and message in err, err


def test_a_profile_whose_model_is_not_here_and_names_no_plan_config(capsys, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: weights/qwen\n")
    assert main(["plan", "--profile", str(path), "--gpus", "8xH200"]) == 2
    err = capsys.readouterr().err
    assert f"{path}" in err and "weights/qwen" in err and "plan_config" in err and err.count("\n") == 1, err


# --------------------------------------------------------------------------------------------------
# GLM-4.5-Air and MiniMax-M2 (tsterm/models/configs: glm-4.5-air.json is zai-org/GLM-4.5-Air's config.json;
# minimax-m2.json is MiniMaxAI/MiniMax-M2's, its FP8 quantization_config included)

GLM45_AIR = DATA / "glm-4.5-air.json"
MINIMAX_M2 = DATA / "minimax-m2.json"


def test_glm45_air_parameter_counts():
    # hidden 4096, 46 layers, 96 q / 8 kv heads of 128, vocab 151552, layer 0 dense (10944), 45 MoE layers of 128
    # experts of 1408 top-8 + one shared expert of 1408 (no gate), q/k/v biases, no q/k norm (use_qk_norm false)
    # embedding and LM head: 2 x 151552*4096 = 1,241,513,984
    # attention per layer: q 4096*12288 = 50,331,648; k, v 4096*1024 = 4,194,304 each; o 50,331,648;
    #   biases 12288 + 2*1024 = 14,336; = 109,066,240; x46 = 5,017,047,040
    # norms: 2*4096 x46 + final 4096 = 380,928
    # dense MLP (layer 0): 3*4096*10944 = 134,479,872
    # per MoE layer: experts 128 * 3*4096*1408 (17,301,504) = 2,214,592,512; shared 17,301,504; router 128*4096 =
    #   524,288; correction bias 128; = 2,232,418,432; x45 = 100,458,829,440
    # total = 106,852,251,264 (the model card's 106B); active = total - 120 experts x 45 x 17,301,504
    #   (= 93,428,121,600) = 13,424,129,664 (12.2B without the embedding and LM head: the card's 12B)
    total, active = parameter_counts(model(GLM45_AIR))
    assert total == 106_852_251_264
    assert active == 13_424_129_664
    m = model(GLM45_AIR)
    assert m.moe_layers == (False,) + (True,) * 45 and m.qk_norm == 0 and m.qkv_bias
    assert any("MTP" in note for note in m.notes)


def test_minimax_m2_parameter_counts():
    # hidden 3072, 62 layers, 48 q / 8 kv heads of 128, vocab 200064, 256 experts of 1536 top-8 in every layer, no
    # shared expert, q/k norms over the whole projections (6144 + 1024)
    # embedding and LM head: 2 x 200064*3072 = 1,229,193,216
    # attention per layer: q 3072*6144 = 18,874,368; k, v 3072*1024 = 3,145,728 each; o 18,874,368; = 44,040,192;
    #   q/k norms 7,168; x62 = 2,730,936,320 (+ 444,416 of norms)
    # norms: 2*3072 x62 + final 3072 = 384,000
    # per layer: experts 256 * 3*3072*1536 (14,155,776) = 3,623,878,656; router 256*3072 = 786,432; bias 256
    #   = 3,624,665,344; x62 = 224,729,251,328
    # total = 228,689,764,864 (the card's 230B); active = total - 248 x 62 x 14,155,776 (= 217,659,211,776)
    #   = 11,030,553,088 (9.8B without the embedding and LM head: the card's 10B)
    total, active = parameter_counts(model(MINIMAX_M2))
    assert total == 228_689_764_864
    assert active == 11_030_553_088
    assert model(MINIMAX_M2).qk_norm == (48 + 8) * 128


@pytest.mark.parametrize("profile, gpus, rows", [
    ("glm-4.5-air", "2xH100", ["TP1 x EP2      58.30 GB   13.70 GB             72,691         16         11.88 GB     "
                               "282 tok/s"]),
    ("minimax-m2", "4xH200", ["TP1 x EP4      61.47 GB   65.43 GB            257,636        124          7.90 GB     "
                              "608 tok/s"]),
])
def test_the_glm_and_minimax_profiles_plan_without_their_weights(capsys, monkeypatch, profile, gpus, rows):
    import tsterm

    monkeypatch.delenv("GLM_4_5_AIR_DIR", raising=False)
    monkeypatch.delenv("MINIMAX_M2_DIR", raising=False)
    assert main(["plan", "--profile", profile, "--gpus", gpus, "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert f"({DATA / profile}.json)" in out.splitlines()[0]
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / f"{profile}.yaml").read_text()
    assert f"#   tsterm plan --profile {profile} --gpus {gpus} --dtype fp8\n" in comment
    for row in rows:
        assert f"#   {row}\n" in comment and f"  {row}\n" in out


def test_the_glm_and_minimax_profiles_layouts_are_ones_the_engine_cuts(monkeypatch, tmp_path):
    """The layout each profile runs passes the engine's own check on the real config; MiniMax-M2's q/k norms over
    every head keep it off tensor parallelism, which the profile's comment says."""
    from tsterm.config import ModelConfig
    from tsterm.model.parallel import ParallelLayout
    from tsterm.profiles import load_profile

    monkeypatch.setenv("GLM_4_5_AIR_DIR", str(tmp_path))
    monkeypatch.setenv("MINIMAX_M2_DIR", str(tmp_path))
    for name, config in (("glm-4.5-air", GLM45_AIR), ("minimax-m2", MINIMAX_M2)):
        options = load_profile(name).engine_options()
        tp, ep = options.get("tensor_parallel_size", 1), options.get("expert_parallel_size", 1)
        assert (tp, ep) == ((1, 2) if name == "glm-4.5-air" else (1, 4))
        ParallelLayout(tp, ep).check(ModelConfig.from_dict(json.loads(config.read_text()), source=str(config)))
    cfg = ModelConfig.from_dict(json.loads(MINIMAX_M2.read_text()))
    assert cfg.rotary_dim == 64 and cfg.fp8_block_size == (128, 128) and cfg.scoring_func == "sigmoid"
    with pytest.raises(ConfigError, match="normalises q and k over all heads"):
        ParallelLayout(2, 2).check(cfg)
