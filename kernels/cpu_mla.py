"""MLA's absorbed attention on the CPU: csrc/mla.c through ctypes, the CPU twin of `triton_mla.mla_attention`.

The heads of an MLA layer share one key row per position, [latent | k_rope]; the C kernel reads each row once for all
heads (scores and the softmax-weighted latents as two small GEMMs per chunk of keys, the heads as the lanes), in
place from the pool through the block table, float32 or bfloat16 rows, with one order of arithmetic for a row
whatever the batch, the rows its sequence brings (a decode, a verify step), the thread count and the build
(csrc/mla.c). `tsterm.model.mla` calls it for CPU tensors; where it cannot run (the C kernels unavailable, or
`TSTERM_CPU_KERNELS` forcing torch for the layer's attention class) the model takes the paged attention instead.
"""
from __future__ import annotations

import torch

from tsterm_kernels import cpu_native
from tsterm_kernels.metadata import AttentionMetadata
from tsterm_kernels.torch_ops import _chosen

POOL_DTYPES = (torch.float32, torch.bfloat16)  # the pools the kernel reads (bfloat16 rows converted exactly)


def native_for(q_lat: torch.Tensor, cache: torch.Tensor) -> "cpu_native.NativeKernels | None":
    """The C build that runs this layer's absorbed attention: CPU tensors, float32 queries, a float32 or bfloat16 pool
    [num_blocks, B, 1, R + DR]; the build the layer's attention shape class runs (`torch_ops._chosen`), else None."""
    if not (q_lat.is_cpu and cache.is_cpu and q_lat.dtype is torch.float32 and cache.dtype in POOL_DTYPES
            and cache.dim() == 4 and cache.shape[2] == 1):
        return None
    return _chosen("attention", (q_lat.shape[1], 1, cache.shape[3]))


def _int32_cpu(t: torch.Tensor | None, n: int) -> bool:
    return t is not None and t.is_cpu and t.dtype is torch.int32 and t.is_contiguous() and t.numel() == n


def mla_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, native: "cpu_native.NativeKernels | None" = None) -> torch.Tensor:
    """Absorbed MLA attention of each sequence's new rows over its context, read in place from the latent pool.

    q_lat [T, Hq, R] float32 (the queries absorbed through W_UK), q_rope [T, Hq, DR] float32 (rotated), any token and
    head strides, unit last stride; cache [num_blocks, B, 1, R + DR] float32 or bfloat16, contiguous, already holding
    the new rows'; meta: the step's (query_start_loc, seq_lens, block_tables int32). Returns [T, Hq, R] float32: each
    head's softmax-weighted latents (out through W_UV). native: the build (default: `native_for`'s)."""
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat [T, Hq, R] and q_rope [T, Hq, DR] must share T and Hq; got {tuple(q_lat.shape)} "
                         f"and {tuple(q_rope.shape)}")
    if q_lat.dtype is not torch.float32 or q_rope.dtype is not torch.float32 or not (q_lat.is_cpu and q_rope.is_cpu):
        raise ValueError(f"q_lat and q_rope must be float32 CPU tensors; got {q_lat.dtype} on {q_lat.device} and "
                         f"{q_rope.dtype} on {q_rope.device}")
    if q_lat.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError(f"q_lat and q_rope need a unit last stride; got {q_lat.stride()} and {q_rope.stride()}")
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_rope.shape[2]
    if (cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != rank + rope or not cache.is_contiguous()
            or cache.dtype not in POOL_DTYPES or not cache.is_cpu):
        raise ValueError(f"cache must be a contiguous float32 or bfloat16 CPU pool [num_blocks, block_size, 1, R + DR "
                         f"= {rank + rope}]; got {tuple(cache.shape)} {cache.dtype} on {cache.device}")
    if meta.block_size != cache.shape[1]:
        raise ValueError(f"meta.block_size {meta.block_size} != the pool's block size {cache.shape[1]}")
    num_seqs = meta.num_seqs
    if len(meta.query_start_loc) != num_seqs + 1 or meta.query_start_loc[-1] != num_tokens:
        raise ValueError(f"query_start_loc {meta.query_start_loc} does not cover the {num_tokens} query rows")
    tables = meta.block_tables
    if (tables.dim() != 2 or tables.shape[0] != num_seqs or tables.dtype is not torch.int32 or not tables.is_cpu
            or not tables.is_contiguous()):
        raise ValueError(f"block_tables must be a contiguous int32 CPU tensor [num_seqs = {num_seqs}, width]; got "
                         f"{tuple(tables.shape)} {tables.dtype} on {tables.device}")
    native = native or native_for(q_lat, cache)
    if native is None:
        raise RuntimeError("the CPU MLA kernel is unavailable (no C kernels, or torch forced for this attention)")
    out = torch.empty((num_tokens, num_heads, rank), dtype=torch.float32)
    if num_tokens == 0:
        return out
    starts, seq_lens = meta.query_start_loc_device, meta.seq_lens_device  # the model runner's step buffers
    if not (_int32_cpu(starts, num_seqs + 1) and _int32_cpu(seq_lens, num_seqs)):
        both = torch.tensor(list(meta.query_start_loc) + list(meta.seq_lens), dtype=torch.int32)
        starts, seq_lens = both[:num_seqs + 1], both[num_seqs + 1:]
    rc = native.mla_attention(q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_rope.data_ptr(), q_rope.stride(0),
                              q_rope.stride(1), cache.data_ptr(), int(cache.dtype is torch.bfloat16), cache.shape[0],
                              cache.shape[1], rank, rope, tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(),
                              starts.data_ptr(), num_seqs, num_heads, scale, out.data_ptr())
    if rc == -1:
        raise MemoryError("MLA attention: out of memory for its scratch")
    if rc == -2:
        raise ValueError(f"MLA attention: bad sizes ({num_heads} heads, rank {rank}, RoPE width {rope}, block size "
                         f"{cache.shape[1]})")
    if rc != 0:
        raise ValueError(f"MLA attention: bad step metadata (query_start_loc {meta.query_start_loc}, seq_lens "
                         f"{meta.seq_lens}: rows in order, no more than the context, block tables covering the "
                         f"context with blocks of the pool's {cache.shape[0]})")
    return out
