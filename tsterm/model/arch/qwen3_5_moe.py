"""Qwen3.5-MoE: Qwen3-Next's layers with the linear-attention projections stored flat (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`). `qwen3_5_moe_text` is the language model alone; `qwen3_5_moe` is the multimodal release,
whose config.json nests the language model's config in `text_config` and whose checkpoint holds it under
`model.language_model.`: tsterm runs that language model on text and does not load the vision tower (`model.visual.*`);
its MTP head (`mtp.*`, beside the language model) loads only as a draft source (`tsterm.model.mtp`, speculative_method
mtp). Text-only positions make the multimodal RoPE (mrope) the plain one."""
import dataclasses

from tsterm.model.arch.qwen3_next import SPEC as QWEN3_NEXT

TEXT_SPEC = dataclasses.replace(QWEN3_NEXT, model_type="qwen3_5_moe_text")
SPEC = dataclasses.replace(QWEN3_NEXT, model_type="qwen3_5_moe", text_config=True,
                           weight_prefix="model.language_model.", skipped_weights=("mtp.", "model.visual."))
