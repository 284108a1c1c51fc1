"""gpt-oss (`gpt_oss`, 20b / 120b): layers alternating between a `sliding_window` (128) attention and full
attention (config.json `layer_types`: "sliding_attention" / "full_attention"), each head with a learned sink logit in
its softmax's denominator (`self_attn.sinks`), q/k/v/o biases, YaRN RoPE (`truncate: false`), and in every layer
routed experts chosen by a softmax over the top-k router logits (the router `mlp.router` has a bias), each expert
with biases and a clamped SwiGLU:

    gate, up = x W_gate + b_gate, x W_up + b_up         (`experts.gate_up_proj` [E, H, 2I]: gate and up alternate)
    gate     = min(gate, limit);  up = clamp(up, -limit, limit)                       (limit = swiglu_limit, 7.0)
    y        = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down              (alpha = swiglu_alpha, 1.702)

The experts run through `tsterm.model.clamped_swiglu` (torch; the C, fused-MoE and Triton kernels have neither the
biases nor this activation yet) and the sink / window attention through the torch twin's path
(`tsterm_kernels.torch_ops.paged_attention(sinks=, window=)`), so these layers stay out of the one-call decode stack.
A sliding layer keeps every block of the context in the pool; blocks outside every running sequence's window are
not returned to the pool yet.
"""
from __future__ import annotations

from tsterm.model.arch.spec import FULL_ATTENTION, SLIDING_ATTENTION, ArchSpec

SPEC = ArchSpec("gpt_oss", o_bias_from_config=True, mixers=(FULL_ATTENTION, SLIDING_ATTENTION), attention_sinks=True,
                router_name="router", router_logit_bias=True, expert_activation="clamped_swiglu",
                experts_interleaved=True)

