"""MiniMax-M2 (`minimax_m2`): full attention in every layer with RMSNorm over the whole q and k projections (before
the head split, per layer), RoPE on the leading `rotary_dim` of each head, and in every layer routed experts (Mixtral's
names: `block_sparse_moe.experts.N.w1/w3/w2`) chosen by sigmoid scores plus a selection-only
`e_score_correction_bias`, the chosen scores renormalised. No shared expert. The router runs in float32, as the
reference does. MTP modules, where a checkpoint ships them after the last layer, are not run."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("minimax_m2", qk_norm="full", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
                partial_rotary=True, scoring_func="sigmoid", router_bias="e_score_correction_bias",
                router_float32=True, mtp_layers_follow=True)
