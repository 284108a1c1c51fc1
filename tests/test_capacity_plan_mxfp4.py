"""`tsterm plan` counts a checkpoint's MXFP4 experts (gpt-oss: quantization_config.quant_method "mxfp4") at the
bytes tsterm keeps them in, 4.25 bits a weight, worked by hand on gpt-oss-20b's shipped config.json."""
from __future__ import annotations

import json
from pathlib import Path

from tsterm.plan import parse_model, plan_layouts, rank_tensors, GPU_PRESETS

CONFIG = Path(__file__).resolve().parents[1] / "tsterm" / "models" / "configs" / "gpt-oss-20b.json"


def _experts_bytes(raw: dict, dtype: str) -> int:
    tensors = rank_tensors(parse_model(raw), 1, 1)
    return sum(t.bytes(dtype) * t.count for t in tensors if t.group == "experts" and t.quantized)


def test_mxfp4_experts_count_their_blocks_and_scales():
    raw = json.loads(CONFIG.read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    # one [2880, 2880] matrix: 2880 * 2880 / 2 = 4,147,200 bytes of e2m1 codes + 2880 * 90 = 259,200 E8M0 scales
    #   = 4,406,400 (8,294,400 weights x 4.25 bits); gate, up and down of 32 experts in 24 layers: x 2,304
    assert _experts_bytes(raw, "bf16") == 2_304 * 4_406_400 == 10_152_345_600
    assert _experts_bytes(raw, "fp8") == 10_152_345_600  # kept as shipped
    # under int4 the engine re-quantizes them to its int4 at load: 4,147,200 + 2880 * 90 * 4 per matrix
    assert _experts_bytes(raw, "int4") == 2_304 * 5_184_000
    unquantized = {k: v for k, v in raw.items() if k != "quantization_config"}
    assert _experts_bytes(unquantized, "bf16") == 2_304 * 8_294_400 * 2  # a bf16 checkpoint's experts
    assert any("MXFP4" in note for note in parse_model(raw).notes)
    assert not any("MXFP4" in note for note in parse_model(unquantized).notes)


def test_the_plan_of_gpt_oss_20b_holds_its_real_size():
    """The whole model on one H100: 41.83 GB with bf16 experts, 13.76 GB with them MXFP4 (the release's ~13 GB of
    safetensors): 28,068,249,600 bytes less, the experts' bf16 bytes minus their MXFP4 bytes."""
    raw = json.loads(CONFIG.read_text())
    unquantized = {k: v for k, v in raw.items() if k != "quantization_config"}
    kept, = plan_layouts(parse_model(raw), 1, GPU_PRESETS["h100"])
    bf16, = plan_layouts(parse_model(unquantized), 1, GPU_PRESETS["h100"])
    assert bf16.weight_bytes - kept.weight_bytes == 38_220_595_200 - 10_152_345_600
    assert round(kept.weight_bytes / 1e9, 2) == 13.76 and round(bf16.weight_bytes / 1e9, 2) == 41.83
    assert kept.weight_read_bytes < bf16.weight_read_bytes  # a token reads its 4 experts' blocks, not bf16 matrices
