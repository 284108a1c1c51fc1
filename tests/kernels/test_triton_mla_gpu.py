"""The Triton absorbed-MLA attention (kernels/triton_mla.py) compiled on a CUDA device at DeepSeek-V3's attention shape
(128 query heads absorbed to the 512-wide latent, 64 RoPE dims, a bfloat16 pool of 16-token blocks): against a
float64 oracle written here (each row over its gathered context), on decodes of several lengths (one split, several,
the capped eight) and a verify-like chunk; a row's output is the same bits alone, in a verify chunk and beside a
longer sequence; and a CUDA graph's replay equals the eager launch.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/kernels/test_triton_mla_gpu.py` (listed in scripts/gpu_check.sh's GPU_TESTS).
Self-contained: no fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see the module docstring)"),
]

HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 16
SCALE = 192 ** -0.5


def step(seq_lens: list[int], query_lens: list[int], seed: int):
    """(q_lat [T, Hq, R] float32, q_rope [T, Hq, DR] float32, pool bf16, meta) on the device, tables shuffled."""
    from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(counts) + 4, generator=gen).tolist()
    tables, first = [], 0
    for n in counts:
        tables.append(order[first:first + n])
        first += n
    pool = (torch.randn(len(order), BLOCK, 1, RANK + ROPE, generator=gen) * 0.5).to(torch.bfloat16)
    tokens = sum(query_lens)
    q_lat = torch.randn(tokens, HEADS, RANK, generator=gen) * 0.05
    q_rope = torch.randn(tokens, HEADS, ROPE, generator=gen) * 0.5
    width = max(counts)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(starts, list(seq_lens), [contiguous_runs(t, len(t)) for t in tables],
                             torch.zeros(tokens, dtype=torch.int64, device="cuda"),
                             torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32,
                                          device="cuda"), BLOCK)
    return q_lat.cuda(), q_rope.cuda(), pool.cuda(), meta


def oracle(q_lat, q_rope, pool, meta) -> torch.Tensor:
    """float64 on the device, row by row over its gathered context (q rounded to the pool's dtype, as the kernel
    takes it)."""
    q_lat, q_rope = q_lat.to(pool.dtype).double(), q_rope.to(pool.dtype).double()
    out = torch.zeros(q_lat.shape, dtype=torch.float64, device=q_lat.device)
    for s, seq_len in enumerate(meta.seq_lens):
        table = meta.block_tables[s, :-(-seq_len // BLOCK)]
        rows = pool[table].reshape(-1, RANK + ROPE)[:seq_len].double()  # [n, R + DR]
        first, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        for row in range(first, end):
            n = seq_len - (end - row) + 1
            scores = (torch.einsum("hr,nr->hn", q_lat[row], rows[:n, :RANK])
                      + torch.einsum("hd,nd->hn", q_rope[row], rows[:n, RANK:])) * SCALE
            out[row] = torch.softmax(scores, -1) @ rows[:n, :RANK]
    return out


@pytest.mark.parametrize("seq_lens, query_lens", [([200], [1]), ([4100, 777, 33, 1], [1, 1, 1, 1]),
                                                  ([9000, 300], [1, 6])], ids=["one-split", "decode", "verify"])
def test_matches_the_oracle_at_deepseek_size(seq_lens, query_lens):
    from tsterm_kernels.triton_mla import mla_attention

    q_lat, q_rope, pool, meta = step(seq_lens, query_lens, seed=len(seq_lens))
    out = mla_attention(q_lat, q_rope, pool, meta, SCALE)
    # bf16 latents and bf16 probabilities in the output's dot: a few parts in a thousand of the latents' scale
    torch.testing.assert_close(out.double(), oracle(q_lat, q_rope, pool, meta), atol=2e-2, rtol=2e-2)


def test_a_row_is_the_same_bits_alone_in_a_verify_chunk_and_beside_a_longer_sequence():
    from tsterm_kernels.metadata import AttentionMetadata
    from tsterm_kernels.triton_mla import mla_attention

    q_lat, q_rope, pool, meta = step([640, 9000], [40, 1], seed=5)
    tables = meta.block_tables

    def sub(seqs, seq_lens, query_lens, rows):
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        m = AttentionMetadata(starts, seq_lens, [], meta.slot_mapping[:starts[-1]], tables[seqs].contiguous(), BLOCK)
        return mla_attention(q_lat[rows], q_rope[rows], pool, m, SCALE)

    alone = sub([0], [601], [1], [0])  # row 0 of the chunk sits at position 600: 3 splits
    verify = sub([0], [640], [40], list(range(40)))
    beside = sub([0, 1], [601, 9000], [1, 1], [0, 40])  # 8 split programs in this step
    assert torch.equal(verify[0], alone[0]) and torch.equal(beside[0], alone[0])


def test_a_captured_graph_replays_the_eager_launch():
    from tsterm_kernels.triton_mla import mla_attention
    from tsterm_kernels.triton_paged_attention import device_metadata

    q_lat, q_rope, pool, meta = step([1500, 64, 700], [1, 1, 1], seed=7)
    device_metadata(meta, q_lat.device)  # a captured step's device metadata lives in static buffers
    eager = mla_attention(q_lat, q_rope, pool, meta, SCALE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles the kernels)
        mla_attention(q_lat, q_rope, pool, meta, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mla_attention(q_lat, q_rope, pool, meta, SCALE)
    q_lat.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, mla_attention(q_lat, q_rope, pool, meta, SCALE), atol=0, rtol=0)
    assert not torch.equal(captured, eager)
