"""The CPU's absorbed-MLA attention (kernels/csrc/mla.c through tsterm_kernels.cpu_mla) against a float64 oracle
written here from the definition: each query row of a sequence sees the cached rows [latent | k_rope] at positions
0 .. its own; head h scores q_lat[h] . latent + q_rope[h] . k_rope, times the scale; its output is the
softmax-weighted sum of the latents. Shuffled block tables whose unused slots hold NaN, contexts that are not a
multiple of the block size and span several of the kernel's 512-key splits, 1, odd and 128 heads (a panel of 32
lanes, a half one, several), latent widths that take every tile and tail of the P C product, float32 and bfloat16
pools, every C build this CPU runs.

The batch invariance the engine promises: a row's output is the same bits alone, beside other sequences, as any row
of a verify-like chunk of its sequence (another schedule of the kernel: tasks of rows that merge their splits as they
go), on one thread or three, and on the AVX-512 and AVX2 builds; and the aarch64 build (csrc/neon/'s stand-in for the
x86 intrinsics, cross-compiled with tests/kernels/native/mla_harness.c and run under qemu-aarch64, as
tests/kernels/test_neon_kernels.py does for the other kernels) gives the x86 builds' bits."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from tsterm_kernels import cpu_mla, cpu_native, cpu_select
from tsterm_kernels.metadata import AttentionMetadata

from tests.kernels.cases import paged_batch
from tests.kernels.conftest import isa_candidates

SCALE = 0.07


def oracle(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """[T, Hq, R] float64, row by row from the block tables (not the kernel's splits or chunks)."""
    rank, block_size = q_lat.shape[2], cache.shape[1]
    out = torch.empty(q_lat.shape, dtype=torch.float64)
    for s, seq_len in enumerate(meta.seq_lens):
        table = meta.block_tables[s].tolist()
        first, end = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        rows = torch.stack([cache[table[p // block_size], p % block_size, 0].double() for p in range(seq_len)])
        for row in range(first, end):
            position = seq_len - (end - first) + (row - first)
            latent, k_rope = rows[:position + 1, :rank], rows[:position + 1, rank:]
            scores = (q_lat[row].double() @ latent.T + q_rope[row].double() @ k_rope.T) * scale  # [Hq, n]
            out[row] = torch.softmax(scores, dim=-1) @ latent
    return out


def batch(seq_lens, query_lens, heads, rank, rope, block_size, dtype, seed):
    """(q_lat [T, Hq, R] as a head-major strided view, q_rope [T, Hq, DR], NaN-poisoned pool, meta)."""
    gen = torch.Generator().manual_seed(seed)
    cache, _, meta = paged_batch(seq_lens, query_lens, block_size, 1, rank + rope, dtype, gen)
    tokens = sum(query_lens)
    q_lat = torch.randn(heads, tokens, rank, generator=gen).transpose(0, 1)  # [T, Hq, R] view, head-major
    q_rope = torch.randn(tokens, heads, rope, generator=gen)
    return q_lat, q_rope, cache, meta


def builds() -> dict[str, cpu_native.NativeKernels]:
    found = {name: cpu_native.load_variant(cpu_select.VARIANT_OF[name]) for name in isa_candidates()}
    assert all(found.values()), "the C kernels must build on the test machine"
    return found


@pytest.fixture(params=isa_candidates())
def build(request) -> cpu_native.NativeKernels:
    return builds()[request.param]


# (seq_lens, query_lens)
DECODE = ([1100, 37, 5, 1], [1, 1, 1, 1])  # three splits (the last partial), partial last blocks, a one-token context
MIXED = ([600, 30, 9, 13], [9, 1, 4, 13])  # a verify-like chunk past a split, a decode, a short chunk, a whole prompt
CASES = {"decode": DECODE, "mixed": MIXED}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, rank, rope", [(1, 72, 8), (37, 40, 12), (128, 512, 64), (16, 20, 4)],
                         ids=["1-head", "37-heads", "deepseek-128", "16-heads-odd-rank"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_oracle(build, dtype, heads, rank, rope, case):
    q_lat, q_rope, cache, meta = batch(*CASES[case], heads, rank, rope, block_size=16 if heads == 128 else 5,
                                       dtype=dtype, seed=heads + rank)
    out = cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, build)
    assert out.dtype is torch.float32 and out.shape == q_lat.shape
    # float32 sums of W products and a softmax over up to 1100 keys, against float64 on the same (pool) values
    torch.testing.assert_close(out.double(), oracle(q_lat, q_rope, cache, meta, SCALE), atol=2e-5, rtol=2e-5)


def _decode_alone(build, q_lat, q_rope, cache, table: torch.Tensor, position: int) -> torch.Tensor:
    """One row at `position` (its context: positions 0 .. position) in a step of its own."""
    meta = AttentionMetadata([0, 1], [position + 1], [[]], torch.zeros(1, dtype=torch.int64), table[None].contiguous(),
                             cache.shape[1])
    return cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, build)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_batched_in_a_chunk_on_any_threads_and_build(dtype):
    """Sequence 0 brings 9 rows over a context of 1030 (past two split boundaries: its rows take the several-rows
    schedule); each of its rows equals that row decoded alone (the one-row schedule: splits as tasks, merged after),
    and its last row decoded beside other sequences; on 1, 2 and 3 threads, on every build."""
    heads, rank, rope = 45, 44, 8  # a whole panel and a partial one; every tile of P C and its one-value tail
    q_lat, q_rope, cache, meta = batch([1030, 300, 7, 520], [9, 1, 3, 1], heads, rank, rope, 16, dtype, seed=3)
    q_lat = q_lat.contiguous()
    table = meta.block_tables[0]
    found = builds()
    reference = cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, found[isa_candidates()[0]])
    torch.testing.assert_close(reference.double(), oracle(q_lat, q_rope, cache, meta, SCALE), atol=2e-5, rtol=2e-5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # torch's and the C kernels' OpenMP threads (one libgomp)
            for name, build in found.items():
                got = cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, build)
                assert torch.equal(got, reference), f"{name}, {threads} threads: the batch's bits differ"
                for row in range(9):  # each row of the chunk, decoded alone at its position
                    alone = _decode_alone(build, q_lat[row:row + 1], q_rope[row:row + 1], cache, table, 1021 + row)
                    assert torch.equal(alone, reference[row:row + 1]), f"{name}, {threads} threads, row {row}"
                # the chunk's last row as a decode beside the other sequences' rows
                rows = [8, 9, 10, 11, 12, 13]
                beside = AttentionMetadata([0, 1, 2, 5, 6], meta.seq_lens, meta.block_runs, meta.slot_mapping[rows],
                                           meta.block_tables, meta.block_size)
                got = cpu_mla.mla_attention(q_lat[rows], q_rope[rows], cache, beside, SCALE, build)
                assert torch.equal(got, reference[rows]), f"{name}, {threads} threads: a decode beside others"
    finally:
        torch.set_num_threads(before)


def test_the_kernel_reads_the_pool_in_place_and_bad_inputs_are_named():
    """A pool row the tables do not name is never read (NaN there changes nothing: `batch` poisons every slot outside
    the contexts); each bad input is an error naming what is wrong."""
    build = builds()[isa_candidates()[0]]
    q_lat, q_rope, cache, meta = batch([40, 3], [1, 1], 4, 16, 8, 4, torch.float32, seed=9)
    assert torch.isnan(cache).any()
    assert torch.isfinite(cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, build)).all()
    with pytest.raises(ValueError, match="share T and Hq"):
        cpu_mla.mla_attention(q_lat, q_rope[:, :3], cache, meta, SCALE, build)
    with pytest.raises(ValueError, match="float32"):
        cpu_mla.mla_attention(q_lat.double(), q_rope, cache, meta, SCALE, build)
    with pytest.raises(ValueError, match="R \\+ DR"):
        cpu_mla.mla_attention(q_lat[..., :8], q_rope, cache, meta, SCALE, build)
    with pytest.raises(ValueError, match="cover the 2 query rows"):
        cpu_mla.mla_attention(q_lat, q_rope, cache, AttentionMetadata(
            [0, 1, 3], meta.seq_lens, meta.block_runs, meta.slot_mapping, meta.block_tables, 4), SCALE, build)
    outside = meta.block_tables.clone()
    outside[0, 2] = cache.shape[0]  # a block past the pool's end
    with pytest.raises(ValueError, match="bad step metadata"):
        cpu_mla.mla_attention(q_lat, q_rope, cache, AttentionMetadata(
            meta.query_start_loc, meta.seq_lens, meta.block_runs, meta.slot_mapping, outside, 4), SCALE, build)
    with pytest.raises(ValueError, match="bad step metadata"):  # a context longer than its block table
        cpu_mla.mla_attention(q_lat, q_rope, cache, AttentionMetadata(
            meta.query_start_loc, [40, 60], meta.block_runs, meta.slot_mapping, meta.block_tables, 4), SCALE, build)


def test_the_ops_object_takes_the_c_kernel_unless_torch_is_forced(monkeypatch):
    """`native_for` follows the layer's attention shape class: a C build by default, None (the model's paged-attention
    fallback) where TSTERM_CPU_KERNELS forces torch, or where the pool or queries are not what the kernel reads."""
    q_lat = torch.zeros(1, 16, 32)
    cache = torch.zeros(4, 16, 1, 40)
    assert cpu_mla.native_for(q_lat, cache) is not None
    assert cpu_mla.native_for(q_lat, cache.half()) is None and cpu_mla.native_for(q_lat.double(), cache) is None
    monkeypatch.setenv(cpu_select.ENV, "torch")
    assert cpu_mla.native_for(q_lat, cache) is None


CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
HARNESS = Path(__file__).parent / "native" / "mla_harness.c"


@pytest.fixture(scope="module")
def neon_harness(tmp_path_factory) -> Path:
    """mla_harness.c with csrc/mla.c for plain ARMv8 NEON, with the library's flags minus the host's -march."""
    if shutil.which(CC) is None or shutil.which(QEMU) is None:
        pytest.skip(f"the aarch64 check needs {CC} and {QEMU}: apt-get install -y gcc-aarch64-linux-gnu qemu-user")
    out = tmp_path_factory.mktemp("mla_neon") / "mla_harness"
    flags = [f for f in cpu_native.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    proc = subprocess.run([CC, *flags, "-march=armv8-a", "-static", "-I", str(cpu_native.NEON_HEADERS), "-o", str(out),
                           str(HARNESS), str(cpu_native.SOURCES_DIR / "mla.c"), "-lm"], capture_output=True, text=True)
    assert proc.returncode == 0, f"the aarch64 build of csrc/mla.c failed:\n{proc.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_aarch64_build_gives_the_x86_bits(neon_harness, dtype):
    heads, rank, rope, block = 37, 44, 8, 16
    q_lat, q_rope, cache, meta = batch([1100, 600, 30, 9], [1, 9, 1, 4], heads, rank, rope, block, dtype, seed=11)
    q_lat = q_lat.contiguous()
    pool = cache.view(torch.int16) if dtype is torch.bfloat16 else cache
    data = b"".join(t.contiguous().numpy().tobytes() for t in (
        q_lat, q_rope, pool, meta.block_tables, torch.tensor(meta.seq_lens, dtype=torch.int32),
        torch.tensor(meta.query_start_loc, dtype=torch.int32), torch.tensor([SCALE])))
    args = (q_lat.shape[0], heads, rank, rope, block, cache.shape[0], meta.num_seqs, meta.block_tables.shape[1],
            int(dtype is torch.bfloat16))
    proc = subprocess.run([QEMU, str(neon_harness), *map(str, args)], input=data, capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr.decode()
    got = torch.from_numpy(np.frombuffer(proc.stdout, dtype=np.float32).copy()).view(q_lat.shape)
    for name, build in builds().items():
        assert torch.equal(got, cpu_mla.mla_attention(q_lat, q_rope, cache, meta, SCALE, build)), name
