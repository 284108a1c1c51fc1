"""DeepSeek-V3 / V3.1 / R1 (`deepseek_v3`) and Kimi-K2 (`kimi_k2`, the same architecture): Multi-head Latent
Attention (`tsterm.model.mla`: the cache holds one normalised latent of `kv_lora_rank` plus the `qk_rope_head_dim`
RoPE key per token), the first `first_k_dense_replace` layers dense MLPs and the rest routed experts with sigmoid
scores, a selection-only `e_score_correction_bias`, group-limited choice (`n_group` / `topk_group`),
`routed_scaling_factor`, and `n_shared_experts` always-on shared experts (one MLP, no gate). The router runs in float32,
as the reference does. The MTP layer shipped after the last layer (`model.layers.{num_hidden_layers}`) is not run."""
from tsterm.model.arch.spec import MLA, ArchSpec

_COMMON = dict(mixers=(MLA,), mla=True, shared_expert=True, scoring_func="sigmoid",
               router_bias="gate.e_score_correction_bias", router_float32=True, shared_expert_name="shared_experts",
               shared_expert_gated=False, mtp_layers_follow=True)

SPEC = ArchSpec("deepseek_v3", **_COMMON)
KIMI_K2_SPEC = ArchSpec("kimi_k2", **_COMMON)
