"""The Triton implementation of every op in `dispatch.OP_NAMES`, registered in dispatch as "triton".

Imported only when `use("triton")` is called, so importing tsterm_kernels never needs a GPU. Each launcher has
the signature of its torch twin in `torch_ops`; on CPU tensors the kernels run under TRITON_INTERPRET=1 (tests).
"""
from tsterm_kernels.triton_fused_moe import fused_moe
from tsterm_kernels.triton_gated_delta import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule,
                                               recurrent_gated_delta_rule)
from tsterm_kernels.triton_moe_route import moe_route
from tsterm_kernels.triton_paged_attention import paged_attention
from tsterm_kernels.triton_rms_norm import rms_norm
from tsterm_kernels.triton_store_kv import store_kv

__all__ = ["causal_conv1d", "causal_conv1d_update", "chunk_gated_delta_rule", "decode_stack", "fused_moe", "moe_route",
           "paged_attention", "recurrent_gated_delta_rule", "rms_norm", "store_kv"]


def decode_stack(layers, num_heads, num_kv_heads, head_dim, eps, scale):
    """None: on a GPU a decode step's launches are replayed from a captured CUDA graph (tsterm.engine.cuda_graphs),
    which is what the CPU's `reference.decode_stack` does for Python's per-op cost."""
    return None
