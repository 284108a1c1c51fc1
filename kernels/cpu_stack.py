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
activations and KV with weights float32 or int8 / int4 (`tsterm_kernels.quant`), or a bfloat16 model (activations,
KV and every weight bfloat16: its linears through csrc/bf16.c in the arithmetic each weight's shape class chose,
`bf16_isa`, the ops between in float32 rounded where the layer-by-layer bfloat16 path rounds, so the same bits);
rotary over the whole head. `build` returns None for anything else, and a step it does not take (a prefill, more than
MAX_ROWS sequences, the copy audit watching) makes `__call__` return None: the caller then runs its layers one by one.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tsterm_kernels import cpu_native
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.quant import NATIVE_MAX_ROWS, QuantizedWeight

_I64, _P, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_KINDS = {"int8": 1, "int4": 2}  # csrc/tsterm.h: TSTERM_Q8, TSTERM_Q4 (TSTERM_F32 = 0)
_BF16 = 3  # csrc/stack.c: TSTERM_BF16
MAX_HEADS = 64  # csrc/tsterm.h: query heads the decode attention takes


class _Weight(ctypes.Structure):
    _fields_ = [("kind", _I64), ("data", _P), ("scales", _P), ("out_f", _I64), ("in_f", _I64), ("isa", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("qkv_bias", _P), ("o_bias", _P), ("qk_norm", _P), ("k_cache", _P), ("v_cache", _P),
                ("router", _P), ("num_experts", _I64), ("top_k", _I64), ("renormalize", _I64), ("expert_load", _P),
                ("shared_gate_up", _Weight), ("shared_down", _Weight), ("shared_gate", _P), ("router_isa", _I64),
                ("shared_gate_isa", _I64)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("layers", ctypes.POINTER(_Layer)), ("bf16", _I64)]


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


def _f32(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is dtype and t.is_contiguous())


def _bf16(t: torch.Tensor | None) -> bool:
    return _f32(t, torch.bfloat16)


# A bfloat16 weight's shape (one matrix: [O, I]) -> csrc/bf16.c's instruction set its shape class runs (2 AMX,
# 1 AVX512-BF16, 0 plain), or None where that class runs torch's matmul (then the stack cannot take the model)
Bf16Isa = Callable[[tuple[int, int]], "int | None"]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(w: torch.Tensor | QuantizedWeight, shape: tuple[int, ...], bf16_isa: Bf16Isa | None) -> _Weight | None:
    """The C struct of a weight of this shape ([O, I], or a stack of experts' [E, O, I]) that the stack reads in
    place, or None when it cannot. bf16_isa: a bfloat16 stack's (its weights must be bfloat16); None: float32 / int."""
    if w is None or tuple(w.shape) != shape:
        return None
    out_f, in_f = shape[-2:]
    if bf16_isa is not None:
        isa = bf16_isa((out_f, in_f)) if _bf16(w) else None
        return None if isa is None else _Weight(_BF16, w.data_ptr(), None, out_f, in_f, isa)
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
                 structs: ctypes.Array, kept: list[torch.Tensor] = ()):
        self.native, self.layers = native, layers  # the tensors stay referenced: the C structs point into them
        self._stack, self._structs = stack, structs
        self._kept = list(kept)  # a bfloat16 model's norm weights and biases as float32 (made once, at build)
        self.dtype = torch.bfloat16 if stack.bf16 else torch.float32  # of the hidden states and the KV pools

    @classmethod
    def build(cls, layers: list[StackLayer], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
              scale: float, bf16_isa: Bf16Isa | None = None, attention_amx: bool = False) -> "DecodeStack | None":
        """The stack over these layers, or None where the C kernels are unavailable or a layer has a tensor they do
        not read (another dtype or device, a weight kind or shape they do not take). A model whose KV pools are
        bfloat16 is a bfloat16 stack: bf16_isa gives each weight's arithmetic (None: the stack does not take it),
        attention_amx its attention's (csrc/attention.c's AMX arithmetic, else the pools widened to float32)."""
        if not layers or num_heads > MAX_HEADS or head_dim % 16 or num_heads % num_kv_heads:
            return None
        bf16 = layers[0].k_cache.dtype is torch.bfloat16
        if bf16 and bf16_isa is None:
            return None
        isa = bf16_isa if bf16 else None
        act = _bf16 if bf16 else _f32  # the pools' and the hidden states' dtype
        kept: list[torch.Tensor] = []

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            """A bfloat16 stack's norm weight or bias as float32 (its exact values, kept); float32 ones as they are."""
            if t is None or not bf16 or t.dtype is torch.float32:
                return t
            kept.append(t.float().contiguous())
            return kept[-1]

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
            if bf16 and layer.router is not None:  # read by bf16.c too: the router, the shared expert's gate
                shapes["router"] = (lead[0], hidden)
                if layer.shared_gate_up is not None:
                    shapes["shared_gate"] = (1, hidden)
            weights = {name: _weight(getattr(layer, name), shape, isa) for name, shape in shapes.items()}
            cache_shape = (layer.k_cache.shape[1:], layer.v_cache.shape[1:])
            load = layer.expert_load
            norms = [f32(t) for t in (layer.input_norm, layer.post_norm, layer.qkv_bias, layer.o_bias)]
            if (None in weights.values() or not all(_f32(t) for t in (*norms, layer.qk_norm))
                    or not all(act(t) for t in (layer.k_cache, layer.v_cache))
                    or (not bf16 and not all(_f32(t) for t in (layer.router, layer.shared_gate)))
                    or cache_shape[0] != cache_shape[1] or tuple(cache_shape[0][1:]) != (num_kv_heads, head_dim)
                    or (layer.router is not None and (tuple(layer.router.shape) != (lead[0], hidden)
                                                      or not 1 <= layer.top_k <= lead[0]))
                    or (layer.shared_gate_up is not None and (
                        layer.router is None or layer.shared_gate is None or layer.shared_gate.shape != (1, hidden)))
                    or (load is not None and (load.dtype is not torch.int64 or not load.is_cpu
                                              or not load.is_contiguous() or load.shape != lead))):
                return None
            isas = {name: weights[name].isa if name in weights else 0 for name in ("router", "shared_gate")}
            structs[i] = _Layer(*map(_ptr, norms[:2]), weights["qkv"], weights["o_proj"], weights["gate_up"],
                                weights["down"], *map(_ptr, norms[2:]), _ptr(layer.qk_norm), _ptr(layer.k_cache),
                                _ptr(layer.v_cache), _ptr(layer.router), lead[0] if lead else 0, layer.top_k,
                                int(layer.renormalize), _ptr(load), weights.get("shared_gate_up", _Weight()),
                                weights.get("shared_down", _Weight()), _ptr(layer.shared_gate), isas["router"],
                                isas["shared_gate"])
        native = cpu_native.load()
        if native is None:
            return None
        stack = _Stack(len(layers), hidden, num_heads, num_kv_heads, head_dim, layers[0].k_cache.shape[1], eps, scale,
                       structs, int(bf16) * (2 if attention_amx else 1))
        return cls(native, layers, stack, structs, kept)

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run a decode step's layers: hidden [S, H] the step's embeddings (overwritten), rope the step's
        (cos, sin) rows. Returns (the last layer's output, the residual it adds to), or None when this is not a
        step the stack runs (the caller then runs the layers)."""
        rows = hidden.shape[0]
        cos, sin = rope
        tables, slots = meta.block_tables, meta.slot_mapping
        if (rows != meta.num_seqs or rows > self.MAX_ROWS or not _f32(hidden, self.dtype) or not _f32(cos)
                or not _f32(sin)
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
