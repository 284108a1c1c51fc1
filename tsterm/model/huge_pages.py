"""Weights that a CPU decode streams from memory every token, moved into memory backed by transparent huge pages.

Why: a batch-1 decode step on the CPU reads every weight once (the default model: ~100 MB a token) and is bound by
how fast one or two cores stream it. In 4 KB pages that stream also walks the page tables every 4 KB, which costs
most in a virtual machine (two-level walks). On a 2-core Sapphire Rapids class VM, the default model's int4 layer
GEMVs streamed at 9.3 GB/s from their load-time copies and at 10.4 GB/s from one 2 MB-page arena (one thread).

Only storages that torch allocated move (`move_to_huge_pages`): the copies the loader made (fused q/k/v, gate/up,
packed expert stacks). Views of the memory-mapped safetensors file stay views (DESIGN.md's zero-copy rule 1). The
values, shapes and strides do not change; each moved tensor is re-pointed in place (`Tensor.set_`), so every holder
of it sees the new memory; another view of a moved storage (the loader's own, while it runs) keeps the old memory
until it is dropped, with the same values. Where the OS offers no huge page advice (not Linux) nothing moves.
"""
from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each storage's start in the arena: a cache line (and any element size)


def _arena(nbytes: int) -> torch.Tensor | None:
    """nbytes of zeroed anonymous memory starting on a huge page boundary, advised to be backed by huge pages (a
    uint8 tensor that keeps its mapping alive), or None where that advice is not available."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    whole = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # (the last huge page too: pages are only faulted in as touched)
    mapping = mmap.mmap(-1, whole + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:  # THP compiled out of the kernel
        mapping.close()
        return None
    memory = torch.frombuffer(mapping, dtype=torch.uint8)  # (the tensor holds the mapping)
    skip = -memory.data_ptr() % HUGE_PAGE
    return memory[skip:skip + nbytes]


def move_to_huge_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Move the CPU storages behind `tensors` that torch owns into one huge page arena, re-pointing each tensor in
    place. Returns the bytes moved."""
    groups: dict[int, dict[int, torch.Tensor]] = {}  # storage address -> its tensors, each once
    for t in tensors:
        if t is None or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            continue
        for u in (t, t._base):  # a view's base too (it holds the storage as long as the view lives)
            if u is not None:
                groups.setdefault(u.untyped_storage().data_ptr(), {})[id(u)] = u
    moving = [(storage.nbytes(), list(group.values())) for group in groups.values()
              if (storage := next(iter(group.values())).untyped_storage()).resizable()]  # not borrowed (a file's)
    if not moving:
        return 0
    arena = _arena(sum(-(-n // ALIGN) * ALIGN for n, _ in moving))
    if arena is None:
        return 0
    offset = 0
    with torch.inference_mode(False), torch.no_grad():
        for nbytes, group in moving:
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())  # the storage's bytes
            arena[offset:offset + nbytes].copy_(old)
            del old
            for t in group:  # in bytes, arena.storage_offset() + offset: a multiple of ALIGN, so of the item size
                t.set_(arena.untyped_storage(), (arena.storage_offset() + offset) // t.element_size() + t.storage_offset(),
                       t.size(), t.stride())
            offset += -(-nbytes // ALIGN) * ALIGN
    _trim()
    return offset


def _trim() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): the moved storages' old memory, where it
    was not a mapping of its own, would otherwise stay in the process's resident set until reused."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
