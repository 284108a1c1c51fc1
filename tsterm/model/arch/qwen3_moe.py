"""Qwen3-MoE: per-head q/k norm, softmax top-k routing (`norm_topk_prob`), `decoder_sparse_step` / `mlp_only_layers`."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("qwen3_moe", qk_norm="head", norm_topk_prob_default=False)
