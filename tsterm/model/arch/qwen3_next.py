"""Qwen3-Next: the hybrid family. Three of every four layers are Gated DeltaNet linear attention (a recurrent state
per sequence; `tsterm.model.linear_attention`), the fourth is gated full attention (a sigmoid output gate from q_proj,
RoPE on the leading quarter of each head, per-head q/k norm). Every layer's feed-forward block is routed experts plus
a sigmoid-gated shared expert. RMSNorm weights are zero-centred (stored as scale - 1). The multi-token-prediction
head (`mtp.*`) is skipped by the model's loader; it loads as a draft source (`tsterm.model.mtp`) when
speculative_method is mtp. The linear-attention input projections are fused per key head (`in_proj_qkvz`,
`in_proj_ba`): the loader regroups them once into Qwen3.5's flat order."""
from tsterm.model.arch.spec import FULL_ATTENTION, LINEAR_ATTENTION, ArchSpec

SPEC = ArchSpec("qwen3_next", qk_norm="head", shared_expert=True, mixers=(FULL_ATTENTION, LINEAR_ATTENTION),
                full_attention_interval=4, partial_rotary=True, attention_output_gate=True, norm_offset=1.0,
                skipped_weights=("mtp.",))
