"""Weights that a CPU decode streams from memory every token, moved into memory backed by transparent huge pages.

Why: a batch-1 decode step on the CPU reads every weight once (the default model: ~100 MB a token) and is bound by
how fast one or two cores stream it. In 4 KB pages that stream also walks the page tables every 4 KB, which costs
most in a virtual machine (two-level walks). On a 2-core Sapphire Rapids class VM, the default model's int4 layer
GEMVs streamed at 9.3 GB/s from their load-time copies and at 10.4 GB/s from one 2 MB-page arena (one thread).

What moves (`move_to_huge_pages`): storages torch allocated (the loader's copies: fused q/k/v, gate/up, packed
expert stacks), and an int8 / int4 weight's codes and scales even where they are views of the memory-mapped
safetensors file. Those bytes are what a quantized decode streams: the default model's LM head (30 MB of int8 a
token, a view of the file) streamed at 10.5 GB/s from the file's pages and 14.4 GB/s from huge pages, and the model
decoded at 0.95x llama.cpp's AMX build with only the copies moved, 1.07-1.09x with its file-mapped matrices moved
too (one thread). That is a one-time copy at load, an exception to DESIGN.md's zero-copy rule 1 for int8 / int4
weights only; the file's pages stay in the page cache, clean and reclaimable. Other weights that view the file
(float, mxfp4, fp8) stay views.

The values, shapes and strides do not change; each moved tensor is re-pointed in place (`Tensor.set_`), so every
holder of it sees the new memory; another view of a moved storage (the loader's own, while it runs) keeps the old
memory until it is dropped, with the same values. Where the OS offers no huge page advice (not Linux) nothing moves.
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


def move_to_huge_pages(tensors: Iterable[torch.Tensor | None], mapped: Iterable[torch.Tensor | None] = ()) -> int:
    """Move the CPU storages behind `tensors` that torch owns, and those behind `mapped` whether torch owns them or
    they are borrowed (a view of the file mapping), into one huge page arena, re-pointing each tensor in place. A
    borrowed storage moves only where it holds nothing but its tensors' bytes (not a whole file's). Returns the bytes
    moved."""
    groups: dict[int, dict[int, torch.Tensor]] = {}  # storage address -> its tensors, each once
    borrowed_ok: set[int] = set()  # storages that may move though borrowed
    for t, may_borrow in [(t, False) for t in tensors] + [(t, True) for t in mapped]:
        if t is None or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            continue
        for u in (t, t._base):  # a view's base too (it holds the storage as long as the view lives)
            if u is not None:
                groups.setdefault(u.untyped_storage().data_ptr(), {})[id(u)] = u
        if may_borrow:
            borrowed_ok.add(t.untyped_storage().data_ptr())
    moving = []
    for ptr, group in groups.items():
        storage = next(iter(group.values())).untyped_storage()
        if storage.resizable() or (ptr in borrowed_ok and storage.nbytes() <= sum(t.nbytes for t in group.values())):
            moving.append((storage.nbytes(), list(group.values())))
    if not moving:
        return 0
    arena = _arena(sum(-(-n // ALIGN) * ALIGN for n, _ in moving))
    if arena is None:
        return 0
    offset = 0
    with torch.no_grad():
        for nbytes, group in moving:
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())  # the storage's bytes
            arena[offset:offset + nbytes].copy_(old)
            del old
            start = arena.storage_offset() + offset  # in bytes: a multiple of ALIGN, so of any item size
            for t in group:
                with torch.inference_mode(t.is_inference()):  # (an inference tensor changes only inside one)
                    t.set_(arena.untyped_storage(), start // t.element_size() + t.storage_offset(), t.size(),
                           t.stride())
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
