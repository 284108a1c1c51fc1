"""What an architecture spec says: how a family's checkpoint names and wires the parts of the one generic decoder,
and what each of its layers is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tsterm.config import ModelConfig

FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class LayerType:
    """What one decoder layer is: its token mixer (a key of the decoder's MIXERS: "full_attention", later
    "linear_attention") and its feed-forward block ("moe": routed experts; "dense": one always-on MLP)."""

    mixer: str
    mlp: str


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

    def layer_types(self, cfg: ModelConfig) -> tuple[LayerType, ...]:
        """Each layer's type: the mixer from config.json's `layer_types` (all full attention when absent), and
        MoE or dense from the family's sparse-layer rule (`ModelConfig.is_moe_layer`)."""
        mixers = cfg.layer_types or (FULL_ATTENTION,) * cfg.num_hidden_layers
        return tuple(LayerType(mixer, "moe" if cfg.is_moe_layer(i) else "dense") for i, mixer in enumerate(mixers))
