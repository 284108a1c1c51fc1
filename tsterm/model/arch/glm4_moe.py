"""GLM-4.5 / 4.6 / 4.5-Air (`glm4_moe`): RoPE on the leading `partial_rotary_factor` (one half) of each head, q/k/v
biases (`attention_bias`), per-head q/k norm when `use_qk_norm` (GLM-4.5; not 4.5-Air), the first
`first_k_dense_replace` layers dense and the rest routed experts with sigmoid scores, a selection-only
`e_score_correction_bias`, group-limited choice (`n_group` / `topk_group`), `routed_scaling_factor`, plus
`n_shared_experts` always-on shared experts (one MLP, no gate). The router runs in float32, as the reference does.
The MTP layer shipped after the last layer (`model.layers.{num_hidden_layers}`) is not run."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("glm4_moe", qk_norm="head", qk_norm_from_config=True, shared_expert=True, partial_rotary=True,
                scoring_func="sigmoid", router_bias="gate.e_score_correction_bias", router_float32=True,
                shared_expert_name="shared_experts", shared_expert_gated=False, mtp_layers_follow=True)
