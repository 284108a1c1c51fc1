"""gpt-oss (`gpt_oss`, 20b / 120b): layers alternating between a `sliding_window` (128) attention and full
attention (config.json `layer_types`: "sliding_attention" / "full_attention"), each head with a learned sink logit in
its softmax's denominator (`self_attn.sinks`), q/k/v/o biases, YaRN RoPE (`truncate: false`), and in every layer
routed experts chosen by a softmax over the top-k router logits (the router `mlp.router` has a bias), each expert
with biases and a clamped SwiGLU:

    gate, up = x W_gate + b_gate, x W_up + b_up         (`experts.gate_up_proj` [E, H, 2I]: gate and up alternate)
    gate     = min(gate, limit);  up = clamp(up, -limit, limit)                       (limit = swiglu_limit, 7.0)
    y        = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down              (alpha = swiglu_alpha, 1.702)

The experts run through `tsterm.model.clamped_swiglu`: on CUDA the Triton fused MoE (both biases, this activation,
one launch per layer, bf16 or MXFP4 stacks), elsewhere a torch loop over the experts (csrc/moe.c has neither yet),
so these layers stay out of the one-call decode stack. The sink / window attention
is the ops' `paged_attention(sinks=, window=)`: on the CPU in float32 the C kernels (csrc/prefill.c, decode.c: a row's
bits the same in a prefill, an extend and a decode; the splits of keys before a row's window are never read), with
the Triton ops the Triton kernel (`triton_paged_attention`), elsewhere the torch twin. CUDA graphs stay off for the
family (set so when its experts read their counts on the host; the fused MoE reads none: to be lifted once a GPU
run shows its graphs).
A sliding layer shares its block ids with the full layers (one KV pool, one block table per sequence), so the blocks
wholly outside every running sequence's window stay held: returning them needs the sliding layers in a pool and
block tables of their own.
"""
from __future__ import annotations

from tsterm.model.arch.spec import FULL_ATTENTION, SLIDING_ATTENTION, ArchSpec

SPEC = ArchSpec("gpt_oss", o_bias_from_config=True, mixers=(FULL_ATTENTION, SLIDING_ATTENTION), attention_sinks=True,
                router_name="router", router_logit_bias=True, expert_activation="clamped_swiglu",
                experts_interleaved=True)

