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
