"""`tsterm plan` on gpt-oss-20b (tsterm/models/configs/gpt-oss-20b.json is openai/gpt-oss-20b's config.json, its MXFP4
quantization_config included): parameters worked by hand, the profile's plan without the weights, and the shipped
config read by the engine's own ModelConfig as the loader will read the checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from tsterm.cli import main
from tsterm.plan import kv_bytes_per_token, load_config, parameter_counts, parse_model

DATA = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "configs"
GPT_OSS_20B = DATA / "gpt-oss-20b.json"


def model(path: Path):
    raw, source = load_config(path)
    return parse_model(raw, source)


def test_gpt_oss_20b_parameter_counts():
    # hidden 2880, 24 layers (sliding and full alternating), 64 q / 8 kv heads of 64, vocab 201088, 32 experts of
    # 2880 top-4 in every layer, biases on q/k/v/o, the router and the experts, a sink per head
    # embedding and LM head: 2 x 201088*2880 = 1,158,266,880
    # attention per layer: q 2880*4096 = 11,796,480; k, v 2880*512 = 1,474,560 each; o 11,796,480; q/k/v biases
    #   4096 + 2*512 = 5,120; o bias 2880 + sinks 64 = 2,944; = 26,550,144
    # experts per layer: 32 * 3*2880*2880 (24,883,200) = 796,262,400; router 32*2880 = 92,160 + bias 32; expert
    #   biases 32 * (2*2880 + 2880) = 276,480; = 796,631,072
    # norms: 2*2880 x24 + final 2880 = 141,120
    # total = 24 x 823,181,216 + 141,120 + 1,158,266,880 = 20,914,757,184 (the card's 21B)
    # active = total - 28 x 24 x 24,883,200 (= 16,721,510,400) = 4,193,246,784; less the embedding table
    #   (579,133,440): 3,614,113,344, the card's 3.6B active
    total, active = parameter_counts(model(GPT_OSS_20B))
    assert total == 20_914_757_184
    assert active == 4_193_246_784
    m = model(GPT_OSS_20B)
    assert m.num_full == 24 and all(m.moe_layers) and m.qkv_bias and m.router_bias and m.expert_bias
    assert any("sliding_attention" in note for note in m.notes)
    # K and V of all 24 layers (the sliding ones keep every position for now): 24 * 2 * 8 * 64 * 2 bytes
    assert kv_bytes_per_token(m, 1, "bf16") == 49_152


def test_the_gpt_oss_20b_profile_plans_without_its_weights(capsys, monkeypatch):
    import tsterm

    monkeypatch.delenv("GPT_OSS_20B_DIR", raising=False)
    assert main(["plan", "--profile", "gpt-oss-20b", "--gpus", "1xH100", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert f"({GPT_OSS_20B})" in out.splitlines()[0]
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / "gpt-oss-20b.yaml").read_text()
    assert "#   tsterm plan --profile gpt-oss-20b --gpus 1xH100 --dtype bf16\n" in comment
    row = "TP1 x EP1      13.76 GB   58.24 GB          1,184,870        144          4.12 GB     813 tok/s"
    assert f"#   {row}\n" in comment and f"  {row}\n" in out


def test_the_engine_reads_the_shipped_config(monkeypatch, tmp_path):
    """ModelConfig takes gpt-oss-20b's config.json as it ships (the MXFP4 quant_method, YaRN with truncate false,
    the 128-token window of every other layer), and the profile's engine options are one rank's."""
    from tsterm.config import ModelConfig
    from tsterm.model.arch import ARCHITECTURES
    from tsterm.profiles import load_profile

    cfg = ModelConfig.from_dict(json.loads(GPT_OSS_20B.read_text()), source=str(GPT_OSS_20B))
    assert cfg.quant_method == "mxfp4" and cfg.num_experts == 32 and cfg.moe_intermediate_size == 2880
    assert cfg.rope.rope_type == "yarn" and cfg.rope.truncate is False and cfg.rope.factor == 32.0
    windows = [t.window for t in ARCHITECTURES["gpt_oss"].layer_types(cfg)]
    assert windows == [128, None] * 12
    monkeypatch.setenv("GPT_OSS_20B_DIR", str(tmp_path))
    options = load_profile("gpt-oss-20b").engine_options()
    assert options.get("tensor_parallel_size", 1) == 1 and options.get("expert_parallel_size", 1) == 1
    assert options["cuda_graphs"] is False


GPT_OSS_120B = DATA / "gpt-oss-120b.json"


def test_the_120b_config_is_the_20b_one_with_36_layers_and_128_experts():
    small, big = (json.loads(path.read_text()) for path in (GPT_OSS_20B, GPT_OSS_120B))
    assert big["num_hidden_layers"] == 36 and big["num_local_experts"] == 128
    assert big["layer_types"] == ["sliding_attention", "full_attention"] * 18
    for key in ("num_hidden_layers", "num_local_experts", "layer_types"):
        del small[key], big[key]
    assert big == small


def test_gpt_oss_120b_parameter_counts():
    # as the 20b's, with 36 layers of 128 experts:
    # attention per layer 26,550,144; x36 = 955,805,184 (the card's 0.96B)
    # experts per layer: 128 * 24,883,200 = 3,185,049,600; router 128*2880 + 128 = 368,768; expert biases
    #   128 * 8,640 = 1,105,920; = 3,186,524,288; x36 = 114,714,874,368 (the card's 114.71B of MLP)
    # norms 2*2880*36 + 2880 = 210,240; embedding and LM head 1,158,266,880
    # total = 116,829,156,672 (the card's 116.83B)
    # active (the planner's count: the whole embedding, every expert's bias) = total - 124 x 36 x 24,883,200
    #   = 5,750,551,872; the card's 5.13B leaves out the embedding table (579,133,440) and the 124 unrouted experts'
    #   biases (124 x 8,640 x 36 = 38,568,960): 5,132,849,472
    m = model(GPT_OSS_120B)
    total, active = parameter_counts(m)
    assert (total, active) == (116_829_156_672, 5_750_551_872)
    assert active - 201088 * 2880 - 124 * 8640 * 36 == 5_132_849_472
    assert m.num_full == 36 and sum(m.moe_layers) == 36 and m.expert_format == "mxfp4"
    assert kv_bytes_per_token(m, 1, "bf16") == 36 * 2 * 8 * 64 * 2 == 73_728


def test_the_gpt_oss_120b_profile_fits_one_h100_with_its_kv(capsys, monkeypatch, tmp_path):
    """The plan row the profile quotes, and its KV budget inside the room the plan leaves after the MXFP4 weights."""
    import tsterm
    from tsterm.plan import GPU_PRESETS, plan_layouts
    from tsterm.profiles import load_profile

    monkeypatch.delenv("GPT_OSS_120B_DIR", raising=False)
    assert main(["plan", "--profile", "gpt-oss-120b", "--gpus", "1xH100", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert f"({GPT_OSS_120B})" in out.splitlines()[0] and "116.83 B parameters" in out
    comment = (Path(tsterm.__file__).parents[1] / "profiles" / "gpt-oss-120b.yaml").read_text()
    assert "#   tsterm plan --profile gpt-oss-120b --gpus 1xH100 --dtype bf16\n" in comment
    row = "TP1 x EP1      65.25 GB    6.75 GB             91,568         11          5.68 GB     589 tok/s"
    assert f"#   {row}\n" in comment and f"  {row}\n" in out
    # experts as MXFP4: 36 x 128 x 3 x 2880 x 2880 weights at 4.25 bits = 60,914,073,600 bytes
    (layout,) = plan_layouts(model(GPT_OSS_120B), 1, GPU_PRESETS["h100"], "bf16")
    experts = 36 * 128 * 3 * 2880 * 2880 * 17 // 32
    assert experts == 60_914_073_600 and layout.weight_bytes - experts < 4.4e9
    monkeypatch.setenv("GPT_OSS_120B_DIR", str(tmp_path))
    options = load_profile("gpt-oss-120b").engine_options()
    assert options.get("quantization", "none") == "none"  # the MXFP4 experts are kept only then
    assert options.get("tensor_parallel_size", 1) == 1 and options.get("expert_parallel_size", 1) == 1
    budget, per_block = options["kv_cache_memory"], 73_728 * options["block_size"]
    assert layout.fits and budget <= layout.free_bytes  # (80 GB less the 10% headroom and the weights)
    assert budget // per_block * options["block_size"] == 81_376 >= 2 * options["max_model_len"]
