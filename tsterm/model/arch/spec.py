"""What an architecture spec says: how a family's checkpoint names and wires the parts of the one generic decoder,
and what each of its layers is."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tsterm.config import ModelConfig

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet: a recurrent state per sequence instead of a KV cache
# config.json's name for full attention over the last `sliding_window` positions only (gpt-oss): a full-attention
# layer (same KV pool) whose LayerType carries the window
SLIDING_ATTENTION = "sliding_attention"
MLA = "mla"  # DeepSeek's Multi-head Latent Attention: one compressed latent + the RoPE key per token (`model.mla`)


@dataclass(frozen=True, slots=True)
class LayerType:
    """What one decoder layer is: its token mixer (a key of the decoder's MIXERS: "full_attention" or
    "linear_attention") and its feed-forward block ("moe": routed experts; "dense": one always-on MLP)."""

    mixer: str
    mlp: str
    window: int | None = None  # full attention over the last `window` positions only (None: the whole context)


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    qk_norm: str = "none"  # "none"; "head": RMSNorm over head_dim per head (Qwen3); "full": over the projection (OLMoE)
    qkv_bias: bool | None = None  # True: q/k/v always have biases (Qwen2); None: follow config.attention_bias
    o_bias_from_config: bool = False  # o_proj has a bias when config.attention_bias (Llama)
    moe_prefix: str = "mlp"  # where the sparse block lives: model.layers.N.<moe_prefix>
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down
    shared_expert: bool = False  # Qwen2-MoE: a dense shared expert with a sigmoid gate
    norm_topk_prob_default: bool = True  # when config.json does not say
    mixers: tuple[str, ...] = (FULL_ATTENTION,)  # the token mixers this family's layers may have
    # The hybrid families (Qwen3-Next, Qwen3.5):
    full_attention_interval: int | None = None  # without `layer_types`: every n-th layer is full attention
    partial_rotary: bool = False  # RoPE may rotate only the leading `partial_rotary_factor` of each head
    attention_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    norm_offset: float = 0.0  # RMSNorm weights stored as (scale - offset): zero-centred norms store scale - 1
    text_config: bool = False  # a multimodal release: the language model's config is config.json's `text_config`
    weight_prefix: str = "model."  # where the language model's tensors live in the checkpoint
    skipped_weights: tuple[str, ...] = ()  # checkpoint name prefixes tsterm does not run (vision tower, MTP head)
    # GLM-4.5, MiniMax-M2 (and DeepSeek-V3):
    qk_norm_from_config: bool = False  # config.json's `use_qk_norm` says whether the `qk_norm` weights are there
    scoring_func: str = "softmax"  # the router's scores when config.json has no `scoring_func`
    router_bias: str | None = None  # the selection bias's name under the sparse block (`e_score_correction_bias`)
    router_float32: bool = False  # the router's weight and logits in float32 whatever the model's dtype
    shared_expert_name: str = "shared_expert"  # the shared expert's name under the sparse block
    shared_expert_gated: bool = True  # False: the shared expert's output is added as it is (no sigmoid gate)
    mtp_layers_follow: bool = False  # layers numbered from num_hidden_layers on are the MTP head's: not run
    # gpt-oss:
    attention_sinks: bool = False  # `self_attn.sinks` [Hq]: a learned logit per head in each softmax's denominator
    router_name: str = "gate"  # the router's name under the sparse block
    router_logit_bias: bool = False  # the router's linear has a bias, added to the logits (it chooses and weighs)
    # "swiglu": silu(gate) * up; "clamped_swiglu" (gpt-oss): gate clamped above at `swiglu_limit`, up to
    # [-limit, limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate); the experts have biases (b13, b2)
    expert_activation: str = "swiglu"
    experts_interleaved: bool = False  # gpt-oss: `experts.gate_up_proj` [E, H, 2I], gate and up columns alternating
    mla: bool = False  # DeepSeek-V3: attention is MLA (kv_lora_rank, qk_rope_head_dim ... in config.json)

    def for_config(self, cfg: ModelConfig) -> ArchSpec:
        """This spec as one checkpoint of the family has it: without the q/k norm where config.json turns it off
        (`use_qk_norm`, GLM-4.5-Air)."""
        if self.qk_norm_from_config and not cfg.use_qk_norm and self.qk_norm != "none":
            return dataclasses.replace(self, qk_norm="none")
        return self

    def layer_types(self, cfg: ModelConfig) -> tuple[LayerType, ...]:
        """Each layer's type: the mixer from config.json's `layer_types` (all full attention when absent), and
        MoE or dense from the family's sparse-layer rule (`ModelConfig.is_moe_layer`)."""
        mixers = cfg.layer_types or (self.mixers[0],) * cfg.num_hidden_layers
        return tuple(LayerType(FULL_ATTENTION, "moe" if cfg.is_moe_layer(i) else "dense", cfg.sliding_window)
                     if mixer == SLIDING_ATTENTION else LayerType(mixer, "moe" if cfg.is_moe_layer(i) else "dense")
                     for i, mixer in enumerate(mixers))
