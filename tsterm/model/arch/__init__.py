"""Architecture registry: each supported HF `model_type` maps to the small spec (`tsterm.model.arch.spec.ArchSpec`)
that says how its checkpoint names and wires the parts of the one generic decoder (`tsterm.model.decoder`)."""
from __future__ import annotations

from tsterm.model.arch import (deepseek_v3, glm4_moe, llama, minimax_m2, mixtral, olmoe, qwen2_moe, qwen3, qwen3_5_moe,
                               qwen3_moe, qwen3_next)
from tsterm.model.arch import gpt_oss
from tsterm.model.arch.spec import FULL_ATTENTION, LINEAR_ATTENTION, MLA, ArchSpec, LayerType

__all__ = ["ARCHITECTURES", "FULL_ATTENTION", "LINEAR_ATTENTION", "MLA", "ArchSpec", "LayerType"]

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec for spec in (gpt_oss.SPEC,
                                       llama.SPEC, mixtral.SPEC, olmoe.SPEC, qwen2_moe.SPEC, qwen3.SPEC, qwen3_moe.SPEC,
                                       qwen3_next.SPEC, qwen3_5_moe.TEXT_SPEC, qwen3_5_moe.SPEC, glm4_moe.SPEC,
                                       minimax_m2.SPEC, deepseek_v3.SPEC, deepseek_v3.KIMI_K2_SPEC)}
