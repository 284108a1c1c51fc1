"""Architecture registry: each supported HF `model_type` maps to the small spec (`tsterm.model.arch.spec.ArchSpec`)
that says how its checkpoint names and wires the parts of the one generic decoder (`tsterm.model.decoder`)."""
from __future__ import annotations

from tsterm.model.arch import llama, mixtral, olmoe, qwen2_moe, qwen3, qwen3_moe
from tsterm.model.arch.spec import FULL_ATTENTION, ArchSpec, LayerType

__all__ = ["ARCHITECTURES", "FULL_ATTENTION", "ArchSpec", "LayerType"]

ARCHITECTURES: dict[str, ArchSpec] = {
    module.SPEC.model_type: module.SPEC for module in (llama, mixtral, olmoe, qwen2_moe, qwen3, qwen3_moe)}
