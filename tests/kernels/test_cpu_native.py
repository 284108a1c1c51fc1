"""tsterm's C kernels for the CPU (csrc/), through torch_ops, against the float64 oracles and plain torch, and how
they are built."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_native, torch_ops
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

from tests.kernels import oracles


@pytest.fixture(scope="module")
def native():
    kernels = cpu_native.load()
    assert kernels is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    return kernels


def _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size=4, seed=0):
    """A pool whose blocks are handed out shuffled (every context in several runs), one query per sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(order[start:start + n])
        start += n
    width = max(blocks_per_seq + [1])
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(list(range(len(seq_lens) + 1)), list(seq_lens),
                             [contiguous_runs(t, len(t)) for t in tables], torch.zeros(len(seq_lens), dtype=torch.long),
                             block_tables, block_size)
    q = torch.randn(len(seq_lens), num_heads + num_kv_heads, head_dim, generator=gen)[:, :num_heads]  # a strided view
    return q, k_cache, v_cache, tables, meta


def _from_scratch(q, k_cache, v_cache, tables, seq_lens, scale):
    """One new token per sequence: the oracle's attention over each context, gathered densely, in float64."""
    return torch.stack([oracles.attention(q[i:i + 1], oracles.gather_context(k_cache, tables[i], n),
                                          oracles.gather_context(v_cache, tables[i], n), scale)[0]
                        for i, n in enumerate(seq_lens)]).float()


@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim", [
    ([1], 4, 4, 64),  # one key
    ([31, 32, 33, 64, 130], 9, 3, 64),  # SmolLM2's heads, lengths around the 32-position chunks
    ([200, 7], 8, 1, 128),  # multi-query
    ([33], 16, 2, 256),  # Qwen3.5's gated-attention head size
    ([40, 17], 6, 2, 80),  # a head size that is not a multiple of 64
])
def test_decode_attention_reads_fragmented_blocks_like_a_from_scratch_softmax(native, seq_lens, heads, kv_heads,
                                                                              head_dim):
    q, k_cache, v_cache, tables, meta = _decode_case(seq_lens, heads, kv_heads, head_dim)
    assert sum(seq_lens) < 8 or any(len(runs) > 1 for runs in meta.block_runs)  # the case really is fragmented
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(got, _from_scratch(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5),
                               rtol=2e-5, atol=2e-5)
    # the torch path (no C kernels) gives the same result
    assert meta.seq_lens_device is not None  # the C path ran (it keeps the step's int32 lengths here)
    torch.testing.assert_close(got, _torch_path(q, k_cache, v_cache, meta, head_dim ** -0.5), rtol=2e-5, atol=2e-5)


def _torch_path(q, k_cache, v_cache, meta, scale):
    saved = cpu_native.load
    try:
        cpu_native.load = lambda: None
        return torch_ops.paged_attention(q, k_cache, v_cache, meta, scale)
    finally:
        cpu_native.load = saved


def test_decode_attention_of_a_head_size_the_kernel_does_not_take_runs_in_torch(native):
    q, k_cache, v_cache, tables, meta = _decode_case([21, 5], 4, 2, 12)  # 12: not a multiple of 8
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert meta.seq_lens_device is None  # the C kernel was not called
    torch.testing.assert_close(got, _from_scratch(q, k_cache, v_cache, tables, [21, 5], 0.3), rtol=2e-5, atol=2e-5)


def test_decode_attention_of_a_long_context_in_one_call(native):
    q, k_cache, v_cache, tables, meta = _decode_case([3000], 9, 3, 64, block_size=16, seed=3)
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, _from_scratch(q, k_cache, v_cache, tables, [3000], 0.125), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("threads", [1, 3, 16])
def test_decode_attention_merges_each_threads_run_of_chunks_at_any_thread_count(native, threads):
    """Each thread attends its contiguous share of the chunks (a sequence's chunks may span several threads, and a
    thread may get none) and the merge finds the runs from the same share arithmetic. OpenMP's thread count is fixed
    per process, so each count runs in its own."""
    script = f"""
import sys, torch
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]
from test_cpu_native import _decode_case, _from_scratch
from tsterm_kernels import torch_ops
lens = [5, 31, 33, 130, 64, 1]
q, k_cache, v_cache, tables, meta = _decode_case(lens, 8, 2, 64, block_size=16, seed=5)
got = torch_ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
assert meta.seq_lens_device is not None  # the C kernel ran
torch.testing.assert_close(got, _from_scratch(q, k_cache, v_cache, tables, lens, 0.125), rtol=2e-5, atol=2e-5)
print("matched")
"""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "matched", run.stderr[-3000:]

@pytest.mark.parametrize("rows", [1, 3, 20])
def test_add_rms_norm_adds_the_residual_in_place_and_norms(native, rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen),
                           torch.rand(576, generator=gen))
    total = x + residual
    out, new_residual = torch_ops.rms_norm(x, weight, 1e-5, residual)
    assert new_residual.data_ptr() == residual.data_ptr() and torch.equal(residual, total)  # in place
    torch.testing.assert_close(out, F.rms_norm(total, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    alone, none = torch_ops.rms_norm(x, weight, 1e-5)
    assert none is None
    torch.testing.assert_close(alone, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_build_reports_a_missing_compiler_and_load_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_native.NativeKernelError, match="no C compiler"):
        cpu_native.build(tmp_path)
    monkeypatch.setenv("TSTERM_NATIVE_KERNELS", "0")
    cpu_native.load.cache_clear()
    try:
        assert cpu_native.load() is None
    finally:
        monkeypatch.delenv("TSTERM_NATIVE_KERNELS")
        cpu_native.load.cache_clear()


def test_build_reports_the_compilers_error(monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.c").write_text("int f( {\n")
    monkeypatch.setattr(cpu_native, "SOURCES_DIR", src)
    with pytest.raises(cpu_native.NativeKernelError, match="failed to build the CPU kernels"):
        cpu_native.build(tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.so"))  # nothing half-built is left to be loaded later


def test_the_library_is_built_once_per_source_version(tmp_path):
    first = cpu_native.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_rope_in_place_equals_the_torch_rotation(native):
    from tsterm.config import RopeConfig
    from tsterm.model.rope import RotaryEmbedding, rotate, rotate_
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 512, 512, torch.device("cpu"))
    tables = rotary.tables(torch.tensor([0, 5, 511]))
    qkv = torch.randn(3, (9 + 3 + 3) * 64)
    qk = qkv[:, :12 * 64].view(3, 12, 64)  # q and k heads of each token, rows 15 heads apart
    want, v_before = rotate(qk, tables), qkv[:, 12 * 64:].clone()
    assert rotate_(qk, tables).data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # v untouched
    assert not torch.equal(qk[0, :, :], torch.zeros(12, 64)) and torch.equal(want[0], qk[0])  # position 0: identity


def test_store_kv_writes_rows_of_strided_views_and_skips_padding(native):
    qkv = torch.randn(3, (4 + 2 + 2) * 8)
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    torch_ops.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(8, 2, 8), v_cache.view(8, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2]) and torch.equal(flat_v[5], v[0])
    assert flat_k[[1, 2, 3, 4, 6, 7]].eq(0).all() and flat_v[[1, 2, 3, 4, 6, 7]].eq(0).all()  # -1: nothing written


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("out_f,in_f", [(37, 64), (200, 24), (16, 40)])
def test_float32_linear_of_few_rows_is_f_linear(native, cpu_isa, rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * out_f)
    x, w, b = torch.randn(rows, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen), torch.randn(out_f)
    torch.testing.assert_close(torch_ops.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_ops.linear(x.t().contiguous().t(), w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def _prefill_case(seq_lens, num_qs, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """_decode_case's shuffled pool, with the last num_qs[i] positions of each sequence as its new tokens."""
    _, k_cache, v_cache, tables, meta = _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed)
    meta.query_start_loc = [0]
    for n in num_qs:
        meta.query_start_loc.append(meta.query_start_loc[-1] + n)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(num_qs), num_heads + 1, head_dim, generator=gen)[:, 1:]  # rows further apart than Hq * D
    return q, k_cache, v_cache, tables, meta


def _causal_from_scratch(q, k_cache, v_cache, tables, meta, scale):
    """The oracle: each sequence's keys gathered dense; query j of n new ones sits at position seq_len - n + j and
    sees the keys at and before it. Plain softmax in float64."""
    return oracles.paged_attention(q, k_cache, v_cache, meta, scale).float()


@pytest.mark.parametrize("seq_lens,num_qs,heads,kv_heads,head_dim,block_size", [
    ([5], [5], 4, 1, 16, 4),  # a whole prompt shorter than a tile, multi-query
    ([300, 97], [300, 40], 16, 4, 64, 16),  # a prefill and an extend in one step, around the 64-key chunks
    ([130], [7], 9, 3, 64, 4),  # SmolLM2's heads: a few new tokens over a cached prefix
    ([200], [129], 8, 8, 128, 16),  # no grouping, Qwen3's head size
    ([70, 2], [70, 2], 6, 2, 80, 8),  # a head size of five 16s; two new tokens
])
def test_prefill_attention_reads_fragmented_blocks_like_a_from_scratch_causal_softmax(
        native, cpu_isa, native_spy, seq_lens, num_qs, heads, kv_heads, head_dim, block_size):
    q, k_cache, v_cache, tables, meta = _prefill_case(seq_lens, num_qs, heads, kv_heads, head_dim, block_size)
    assert sum(seq_lens) < 8 or any(len(runs) > 1 for runs in meta.block_runs)  # the case really is fragmented
    spy = native_spy("prefill_attention")
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5)
    assert spy.calls == len(seq_lens)  # csrc/prefill.c ran, once per sequence
    want = _causal_from_scratch(q, k_cache, v_cache, tables, meta, head_dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # the torch path (flash pieces merged by log-sum-exp) gives the same result
    torch.testing.assert_close(got, _torch_path(q, k_cache, v_cache, meta, head_dim ** -0.5), rtol=2e-5, atol=2e-5)


def test_prefill_attention_leaves_head_sizes_it_does_not_take_to_torch(native, native_spy):
    q, k_cache, v_cache, tables, meta = _prefill_case([40], [40], 4, 2, 24, 8)
    spy = native_spy("prefill_attention")
    got = torch_ops.paged_attention(q, k_cache, v_cache, meta, 0.2)
    assert spy.calls == 0
    torch.testing.assert_close(got, _causal_from_scratch(q, k_cache, v_cache, tables, meta, 0.2), rtol=2e-5, atol=2e-5)


def test_prefill_attention_refuses_more_new_tokens_than_the_context(native):
    q, k_cache, v_cache, tables, meta = _prefill_case([40], [40], 4, 2, 16, 8)
    meta.seq_lens = [39]
    with pytest.raises(ValueError, match="40 new tokens in a context of 39"):
        torch_ops.paged_attention(q, k_cache, v_cache, meta, 0.25)


@pytest.mark.parametrize("rows", [5, 6, 7, 13, 37, 400])
@pytest.mark.parametrize("out_f,in_f", [(16, 8), (40, 24), (33, 513), (1030, 300)])
def test_float32_linear_of_many_rows_is_a_float64_matmul(native, cpu_isa, native_spy, rows, out_f, in_f):
    """csrc/gemm.c: every tail of its tiles (rows not a multiple of 6 nor of its 384-row blocks, outputs not of 16,
    inputs over its 256-input blocks and not a multiple of 8) and x rows further apart than their length."""
    gen = torch.Generator().manual_seed(rows * out_f + in_f)
    x = torch.randn(rows, in_f + 5, generator=gen)[:, 3:in_f + 3]  # a strided view: rows in_f + 5 apart
    w, b = torch.randn(out_f, in_f, generator=gen), torch.randn(out_f, generator=gen)
    spy = native_spy("f32_gemm")
    got = torch_ops.linear(x, w, b)
    assert spy.calls == 1
    want = (x.double() @ w.double().t() + b.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_f ** 0.5)
