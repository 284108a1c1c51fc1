"""Copy audit: bytes moved by every copy-like op, every host sync and every host-to-device copy, by op kind and
phase, for chosen steps.

Two interposers, entered only for audited steps (every Nth), so they cost nothing when off: a `TorchDispatchMode`
sees each aten op with its tensors (copies, reads of device values such as `.item()`, CPU tensors fed to an op on
the device: `.to(device)`, `.cuda()`, `copy_` from the host); a `TorchFunctionMode` sees what the dispatcher never
does: a tensor made from Python data on the device (`torch.tensor(data, device=...)`, `as_tensor`, `new_tensor`),
and a device tensor indexed with a Python list (whose index is uploaded below the dispatcher). The phase of an
op is the innermost known function on the Python stack (attention, kv_write, moe, sampling, ...), looked up only
while auditing. Work done inside Triton's interpreter (the CPU stand-in for a kernel launch) is not the step's own.

`device` says which tensors are device memory: by default every non-CPU device's (the engine's audits). Naming a
CPU device makes the probe's host-side checks testable without a GPU: the forward then runs on the CPU exactly as
its Python code runs on a GPU, and any tensor it builds from host data, indexes with host data, or reads back
(`.item()`, `.tolist()`, `.numpy()`) on that device is counted as it would be on the GPU.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
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
# tensors from Python data (lists, scalars, numpy arrays): an upload when the result is on the device
HOST_DATA_FACTORIES = {torch.tensor: "tensor", torch.as_tensor: "tensor", torch.asarray: "tensor",
                       torch.from_numpy: "tensor", torch.Tensor.new_tensor: "tensor"}
# indexing that turns a Python list (or numpy array, or host tensor) index into a device index
INDEXING = {torch.Tensor.__getitem__: "index", torch.Tensor.__setitem__: "index"}
# reads of device values that the dispatcher does not show for CPU tensors (a CPU `device` only; `.item()` and
# `int(t)` reach it as _local_scalar_dense)
HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}

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
    "ModelRunner.prepare_step": "metadata",
    "HostStaging.upload": "metadata",  # the step's inputs: one upload per dtype, before the forward
    "DecoderModel.forward": "forward",  # the forward outside the layers' own phases (embedding, norms, rotary rows)
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


def _in_interpreter() -> bool:
    """Whether the op comes from Triton's interpreter (a kernel launch's stand-in on the CPU), not the step."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False


def _host_index(index, audit: "CopyAudit") -> bool:
    """Whether an index holds host data that becomes a device index (a list, a numpy array, a host tensor)."""
    if isinstance(index, tuple):
        return any(_host_index(i, audit) for i in index)
    if isinstance(index, list):
        return True
    if isinstance(index, torch.Tensor):
        return not audit.on_device(index) and index.dim() > 0
    return type(index).__module__ == "numpy" and hasattr(index, "shape")


class _Recorder(TorchDispatchMode):
    def __init__(self, audit: "CopyAudit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        audit = self.audit
        entry = COPY_OPS.get(func)
        if entry is not None:
            kind, arg = entry
            src = args[arg] if arg is not None and len(args) > arg else out
            if func is aten._to_copy.default and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) \
                    and args[0].device != out.device:
                kind = "d2h" if out.device.type == "cpu" else "h2d"
            audit.record_copy(_phase(), kind, _nbytes(src))
        elif func in SYNC_OPS and isinstance(args[0], torch.Tensor) and audit.on_device(args[0]):
            audit.record_sync(_phase(), SYNC_OPS[func])
        if audit.device is None and isinstance(out, torch.Tensor) and out.device.type != "cpu":
            # a host tensor with data fed to an op on the device (a 0-dim one is passed by value, as a scalar)
            host = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0]
            if host and not _in_interpreter():
                kind = "copy_" if func is aten.copy_.default else "to" if func is aten._to_copy.default else "operand"
                audit.record_host_to_device(_phase(), kind)
        elif audit.device is None and func in (aten._to_copy.default, aten.copy_.default) \
                and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            src = args[1] if func is aten.copy_.default else args[0]
            non_blocking = (kwargs or {}).get("non_blocking", False) or (len(args) > 2 and args[2] is True)
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and not non_blocking:
                audit.record_sync(_phase(), "d2h")  # a blocking read-back (.cpu(), .tolist(), .numpy())
        return out


class _HostDataProbe(TorchFunctionMode):
    """The host-to-device copies (and, for a CPU `device`, the reads) that the dispatcher does not show."""

    def __init__(self, audit: "CopyAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        audit = self.audit
        kind = HOST_DATA_FACTORIES.get(func)
        if kind is not None:
            hit = isinstance(out, torch.Tensor) and audit.on_device(out)
        elif func in INDEXING:
            kind = INDEXING[func]
            hit = len(args) > 1 and isinstance(args[0], torch.Tensor) and audit.on_device(args[0]) \
                and _host_index(args[1], audit)
        elif func in HOST_READS and audit.device is not None:
            if isinstance(args[0], torch.Tensor) and audit.on_device(args[0]) and not _in_interpreter():
                audit.record_sync(_phase(), HOST_READS[func])
            return out
        else:
            return out
        if hit and not _in_interpreter():
            audit.record_host_to_device(_phase(), kind)
        return out


class CopyAudit:
    """Counts copy bytes, host syncs and host-to-device copies of audited engine steps. `every_n_steps=N` audits
    steps 0, N, 2N, ...; `device`: the device whose tensors are device memory (None: every non-CPU device; a CPU
    device: the host-side checks on the CPU, see the module's doc)."""

    def __init__(self, every_n_steps: int = 1, device: torch.device | str | None = None):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type != "cpu":
            self.device = None  # a real device: its tensors are told from the host's by their device
        self.copy_bytes: dict[tuple[str, str], int] = defaultdict(int)  # (phase, kind) -> bytes
        self.copy_calls: dict[tuple[str, str], int] = defaultdict(int)
        self.host_syncs: dict[tuple[str, str], int] = defaultdict(int)
        # (phase, kind) -> host-to-device copies: tensors from host data, host indices, host tensors into device ops
        self.host_to_device: dict[tuple[str, str], int] = defaultdict(int)
        self.audited_steps = 0
        self.audited_tokens = 0  # tokens sampled in audited steps

    def record_copy(self, phase: str, kind: str, nbytes: int) -> None:
        self.copy_bytes[(phase, kind)] += nbytes
        self.copy_calls[(phase, kind)] += 1

    def record_sync(self, phase: str, kind: str) -> None:
        self.host_syncs[(phase, kind)] += 1

    def record_host_to_device(self, phase: str, kind: str) -> None:
        self.host_to_device[(phase, kind)] += 1

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` is device memory for this audit."""
        return t.device.type != "cpu" if self.device is None else t.device == self.device

    @contextlib.contextmanager
    def step(self, step_index: int) -> Iterator[bool]:
        """Audits the enclosed step if it is one of every Nth; yields whether it does."""
        if step_index % self.every_n_steps:
            yield False
            return
        self.audited_steps += 1
        with self._probes():
            yield True

    @contextlib.contextmanager
    def record(self) -> Iterator["CopyAudit"]:
        """Audit everything in the block (tests, one-off measurements)."""
        with self._probes():
            yield self

    @contextlib.contextmanager
    def _probes(self) -> Iterator[None]:
        with _HostDataProbe(self), _Recorder(self):
            yield

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
        for d in (self.copy_bytes, self.copy_calls, self.host_syncs, self.host_to_device):
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
            "host_to_device": {f"{p}/{k}": n for (p, k), n in sorted(self.host_to_device.items())},
        }
