"""A decode step's whole stack of decoder layers as one C call (csrc/stack.c) on the CPU.

Batch-1 decode of a small model (the default SmolLM2-135M: 30 layers of 1-2 MB of weights each) spends as long
between its kernels as in them when the layers run op by op from Python: ~10 calls per layer at ~10 us each
(Python, ctypes, an OpenMP fork / join), more with routed experts. `DecodeStack` hands the C code every layer's
tensors once, at model build, and then runs a decode step's layers in one call, its threads woken once and meeting
at barriers between the ops.

It computes what the layer-by-layer path computes with the same C kernels (RMSNorm with the residual add, the
quantized or float32 matmuls, RoPE, the KV store, paged decode attention, Qwen3's per-head q/k norms, SwiGLU) plus
top-k softmax routing, and nothing else: layers of full attention without q/k clipping or OLMoE's whole-projection
q/k norm, each with one dense SwiGLU MLP or routed SwiGLU experts without a shared expert; one rank; float32
activations and KV; weights float32 or int8 / int4 (`tsterm_kernels.quant`); rotary over the whole head. `build`
returns None for anything else, and a step it does not take (a prefill, more than MAX_ROWS sequences, the copy
audit watching) makes `__call__` return None: the caller then runs its layers one by one.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tsterm_kernels import cpu_native
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.quant import NATIVE_MAX_ROWS, QuantizedWeight

_I64, _P, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_KINDS = {"int8": 1, "int4": 2}  # csrc/tsterm.h: TSTERM_Q8, TSTERM_Q4 (TSTERM_F32 = 0)
MAX_HEADS = 64  # csrc/tsterm.h: query heads the decode attention takes


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _I64), ("data", _P), ("scales", _P), ("out_f", _I64), ("in_f", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("qkv_bias", _P), ("o_bias", _P), ("qk_norm", _P), ("k_cache", _P), ("v_cache", _P),
                ("router", _P), ("num_experts", _I64), ("top_k", _I64), ("renormalize", _I64), ("expert_load", _P),
                ("shared_gate_up", _Weight), ("shared_down", _Weight), ("shared_gate", _P)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("layers", ctypes.POINTER(_Layer))]


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's tensors, as the model holds them (nothing is copied)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | QuantizedWeight  # [(Hq + 2 Hkv) D, H]
    o_proj: torch.Tensor | QuantizedWeight  # [H, Hq D]
    gate_up: torch.Tensor | QuantizedWeight  # [2 I, H]: gate rows, then up rows; routed experts: [E, 2I, H]
    down: torch.Tensor | QuantizedWeight  # [H, I]; routed experts: [E, H, I]
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: per-head RMSNorm weights of q, then k (Qwen3); None: no q/k norm
    k_cache: torch.Tensor  # [num_blocks, B, Hkv, D] view of the pool
    v_cache: torch.Tensor
    router: torch.Tensor | None = None  # [E, H]: routed experts (top_k of them per token); None: a dense MLP
    top_k: int = 0
    renormalize: bool = False  # the top-k weights renormalized to sum to 1
    expert_load: torch.Tensor | None = None  # [E] int64: pairs routed to each expert, accumulated in place
    shared_gate_up: torch.Tensor | QuantizedWeight | None = None  # [1, 2Is, H]: a shared expert (with a router)
    shared_down: torch.Tensor | QuantizedWeight | None = None  # [1, H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H]: the shared expert's weight is sigmoid(x . gate)


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(w: torch.Tensor | QuantizedWeight, shape: tuple[int, ...]) -> _Weight | None:
    """The C struct of a weight of this shape ([O, I], or a stack of experts' [E, O, I]) that the stack reads in
    place, or None when it cannot."""
    if tuple(w.shape) != shape:
        return None
    out_f, in_f = shape[-2:]
    if isinstance(w, QuantizedWeight):
        if w.kind not in _KINDS or not w.data.is_cpu or not w.data.is_contiguous() or not w.scale.is_contiguous():
            return None
        return _Weight(_KINDS[w.kind], w.data.data_ptr(), w.scale.data_ptr(), out_f, in_f)
    if not _f32(w) or in_f % 8:
        return None
    return _Weight(0, w.data_ptr(), None, out_f, in_f)


class DecodeStack:
    """Every layer of a model for its decode steps; see the module docstring. Build with `build`."""

    MAX_ROWS = NATIVE_MAX_ROWS  # sequences per step (the quantized matmuls' row limit)

    def __init__(self, native: cpu_native.NativeKernels, layers: list[StackLayer], stack: _Stack,
                 structs: ctypes.Array):
        self.native, self.layers = native, layers  # the tensors stay referenced: the C structs point into them
        self._stack, self._structs = stack, structs

    @classmethod
    def build(cls, layers: list[StackLayer], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
              scale: float) -> "DecodeStack | None":
        """The stack over these layers, or None where the C kernels are unavailable or a layer has a tensor they do
        not read (another dtype or device, a weight kind or shape they do not take)."""
        if not layers or num_heads > MAX_HEADS or head_dim % 16 or num_heads % num_kv_heads:
            return None
        hidden = layers[0].input_norm.shape[0]
        structs = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            inter = layer.down.shape[-1]
            lead = () if layer.router is None else (layer.router.shape[0],)
            shapes = {"qkv": ((num_heads + 2 * num_kv_heads) * head_dim, hidden),
                      "o_proj": (hidden, num_heads * head_dim), "gate_up": (*lead, 2 * inter, hidden),
                      "down": (*lead, hidden, inter)}
            if layer.shared_gate_up is not None:
                shared = layer.shared_down.shape[-1]
                shapes.update(shared_gate_up=(1, 2 * shared, hidden), shared_down=(1, hidden, shared))
            weights = {name: _weight(getattr(layer, name), shape) for name, shape in shapes.items()}
            cache_shape = (layer.k_cache.shape[1:], layer.v_cache.shape[1:])
            load = layer.expert_load
            if (None in weights.values() or not all(_f32(t) for t in (
                    layer.input_norm, layer.post_norm, layer.qkv_bias, layer.o_bias, layer.qk_norm, layer.k_cache,
                    layer.v_cache, layer.router))
                    or cache_shape[0] != cache_shape[1] or tuple(cache_shape[0][1:]) != (num_kv_heads, head_dim)
                    or (layer.router is not None and (tuple(layer.router.shape) != (lead[0], hidden)
                                                      or not 1 <= layer.top_k <= lead[0]))
                    or (layer.shared_gate_up is not None and (
                        layer.router is None or not _f32(layer.shared_gate) or layer.shared_gate.shape != (1, hidden)))
                    or (load is not None and (load.dtype is not torch.int64 or not load.is_cpu
                                              or not load.is_contiguous() or load.shape != lead))):
                return None
            structs[i] = _Layer(_ptr(layer.input_norm), _ptr(layer.post_norm), weights["qkv"], weights["o_proj"],
                                weights["gate_up"], weights["down"], _ptr(layer.qkv_bias), _ptr(layer.o_bias),
                                _ptr(layer.qk_norm), _ptr(layer.k_cache), _ptr(layer.v_cache), _ptr(layer.router),
                                lead[0] if lead else 0, layer.top_k, int(layer.renormalize), _ptr(load),
                                weights.get("shared_gate_up", _Weight()), weights.get("shared_down", _Weight()),
                                _ptr(layer.shared_gate))
        native = cpu_native.load()
        if native is None:
            return None
        stack = _Stack(len(layers), hidden, num_heads, num_kv_heads, head_dim, layers[0].k_cache.shape[1], eps, scale,
                       structs)
        return cls(native, layers, stack, structs)

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run a decode step's layers: hidden [S, H] the step's embeddings (overwritten), rope the step's
        (cos, sin) rows. Returns (the last layer's output, the residual it adds to), or None when this is not a
        step the stack runs (the caller then runs the layers)."""
        rows = hidden.shape[0]
        cos, sin = rope
        tables, slots = meta.block_tables, meta.slot_mapping
        if (rows != meta.num_seqs or rows > self.MAX_ROWS or not _f32(hidden) or not _f32(cos) or not _f32(sin)
                or cos.shape[-1] != self._stack.head_dim or tables.dtype is not torch.int32 or not tables.is_cpu
                or not tables.is_contiguous() or slots.dtype is not torch.int64 or not slots.is_contiguous()
                or _get_current_dispatch_mode() is not None):  # the copy audit counts torch's KV writes
            return None
        seq_lens = meta.seq_lens_device
        if seq_lens is None or not seq_lens.is_cpu:
            seq_lens = meta.seq_lens_device = torch.tensor(meta.seq_lens, dtype=torch.int32)
        residual = torch.empty_like(hidden)
        if self.native.decode_stack(ctypes.addressof(self._stack), rows, hidden.data_ptr(), residual.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                    tables.shape[1], seq_lens.data_ptr()) != 0:
            raise MemoryError("decode stack: out of memory for its scratch")
        return hidden, residual
