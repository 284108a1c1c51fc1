"""OLMoE: RMSNorm over the whole q and k projections (before the head split), optional `clip_qkv`."""
from tsterm.model.arch import ArchSpec, register

SPEC = register(ArchSpec("olmoe", qk_norm="full", norm_topk_prob_default=False))
