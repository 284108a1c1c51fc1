"""OLMoE: RMSNorm over the whole q and k projections (before the head split), optional `clip_qkv`."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("olmoe", qk_norm="full", norm_topk_prob_default=False)
