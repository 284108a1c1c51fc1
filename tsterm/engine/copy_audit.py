"""Copy audit: bytes moved by every copy-like op and every host sync, by op kind and phase, for chosen steps.

It is a `TorchDispatchMode`, entered only for audited steps (every Nth), so it costs nothing when off. The
phase of an op is the innermost known function on the Python stack (attention, kv_write, moe, sampling, ...),
looked up only while auditing.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten op -> (kind, which argument's bytes count; None = the output's)
COPY_OPS = {
    aten.copy_.default: ("copy_", 1),
    aten.clone.default: ("clone", None),
    aten._to_copy.default: ("to", None),  # dtype / device conversions; device moves are re-labelled below
    aten.cat.default: ("cat", None),
    aten.stack.default: ("stack", None),
    aten.index_select.default: ("index_select", None),
    aten.gather.default: ("gather", None),
    aten.index.Tensor: ("index", None),
    aten.index_copy_.default: ("index_copy_", 3),
    aten.index_copy.default: ("index_copy_", 3),
    aten.index_put_.default: ("index_put_", 2),
    aten.index_put.default: ("index_put_", 2),
    aten.embedding.default: ("embedding", None),
    aten.repeat.default: ("repeat", None),
    aten._unsafe_index.Tensor: ("index", None),
    aten.masked_select.default: ("masked_select", None),
}
SYNC_OPS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero"}

# innermost matching function (co_qualname) -> phase
PHASES = {
    "store_kv": "kv_write",
    "paged_attention": "attention",
    "Attention.__call__": "attention",
    "GatedAttention.__call__": "attention",
    "GatedDeltaNet._mix": "linear_state",  # the recurrent state's reads and writes (slots, conv windows)
    "GatedDeltaNet._keep": "state_snapshot",  # a state kept at a block boundary, for prefix reuse
    "GatedDeltaNet.__call__": "linear_attention",
    "moe_route": "moe",
    "fused_moe": "moe",
    "SparseMoE.__call__": "moe",
    "PagedKVPool.copy_blocks": "kv_cow",
    "RecurrentStatePool.copy_slots": "state_restore",  # a hybrid's cached prefix: its snapshot copied in
    "ModelRunner.prepare": "metadata",
    "Sampler.__call__": "sampling",
    "DecoderModel.logits": "logits",
}


def _phase() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        phase = PHASES.get(frame.f_code.co_qualname)
        if phase is not None:
            return phase
        frame = frame.f_back
    return "other"


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class _Recorder(TorchDispatchMode):
    def __init__(self, audit: "CopyAudit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        entry = COPY_OPS.get(func)
        if entry is not None:
            kind, arg = entry
            src = args[arg] if arg is not None and len(args) > arg else out
            if func is aten._to_copy.default and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) \
                    and args[0].device != out.device:
                kind = "d2h" if out.device.type == "cpu" else "h2d"
            self.audit.record_copy(_phase(), kind, _nbytes(src))
        elif func in SYNC_OPS and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.audit.record_sync(_phase(), SYNC_OPS[func])
        return out


class CopyAudit:
    """Counts copy bytes and host syncs of audited engine steps. `every_n_steps=N` audits steps 0, N, 2N, ..."""

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.copy_bytes: dict[tuple[str, str], int] = defaultdict(int)  # (phase, kind) -> bytes
        self.copy_calls: dict[tuple[str, str], int] = defaultdict(int)
        self.host_syncs: dict[tuple[str, str], int] = defaultdict(int)
        self.audited_steps = 0
        self.audited_tokens = 0  # tokens sampled in audited steps

    def record_copy(self, phase: str, kind: str, nbytes: int) -> None:
        self.copy_bytes[(phase, kind)] += nbytes
        self.copy_calls[(phase, kind)] += 1

    def record_sync(self, phase: str, kind: str) -> None:
        self.host_syncs[(phase, kind)] += 1

    @contextlib.contextmanager
    def step(self, step_index: int) -> Iterator[bool]:
        """Audits the enclosed step if it is one of every Nth; yields whether it does."""
        if step_index % self.every_n_steps:
            yield False
            return
        self.audited_steps += 1
        with _Recorder(self):
            yield True

    @contextlib.contextmanager
    def record(self) -> Iterator["CopyAudit"]:
        """Audit everything in the block (tests, one-off measurements)."""
        with _Recorder(self):
            yield self

    @property
    def total_copy_bytes(self) -> int:
        return sum(self.copy_bytes.values())

    def bytes_by_phase(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (phase, _), n in self.copy_bytes.items():
            out[phase] += n
        return dict(out)

    def bytes_per_token(self) -> float:
        return self.total_copy_bytes / self.audited_tokens if self.audited_tokens else 0.0

    def reset(self) -> None:
        for d in (self.copy_bytes, self.copy_calls, self.host_syncs):
            d.clear()
        self.audited_steps = self.audited_tokens = 0

    def summary(self) -> dict:
        return {
            "audited_steps": self.audited_steps,
            "audited_tokens": self.audited_tokens,
            "copy_bytes": self.total_copy_bytes,
            "copy_bytes_per_token": self.bytes_per_token(),
            "copy_bytes_by_phase": self.bytes_by_phase(),
            "copy_bytes_by_kind": {f"{p}/{k}": n for (p, k), n in sorted(self.copy_bytes.items())},
            "host_syncs": {f"{p}/{k}": n for (p, k), n in sorted(self.host_syncs.items())},
        }
