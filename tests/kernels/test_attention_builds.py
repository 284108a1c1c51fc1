"""The CPU attention's bits do not depend on the build: on an AVX-512 CPU the native build's prefill path (K
transposed once a chunk, 16 keys a vector, each of dot8's lane chains its own accumulator; P V 64 outputs a row, V
read in place; exponentials 16 at a time) gives exactly what the AVX2 build's (dot8's hadd tree, gemm.c's 6 x 16
tile, 8 exponentials at a time) gives, for a prefill, an extend and a decode, over float32 and bfloat16 pools, with
sinks and a sliding window. The float64 oracle keeps the shared answer honest.
"""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native

from tests.kernels import oracles

BLOCK = 16


@pytest.fixture(scope="module")
def builds():
    native = cpu_native.load()
    assert native is not None, "the C kernels must build on the test machine (gcc, AVX2)"
    if not native.isa_bits & cpu_native.ISA_AVX512:
        pytest.skip("one build on this CPU (no AVX-512): nothing to compare it with")
    avx2 = cpu_native.load_variant("avx2")
    assert avx2 is not None and not avx2.isa_bits & cpu_native.ISA_AVX512
    return native, avx2


def _pool(seq_len, heads, kv_heads, dim, num_q, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // BLOCK)
    k = torch.randn(blocks + 3, BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(blocks + 3, BLOCK, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].to(torch.int32)  # shuffled blocks
    q = torch.randn(num_q, heads, dim, generator=gen) * 2
    sinks = torch.randn(heads, generator=gen)
    return q, k, v, table, sinks


def _prefill(lib, q, k, v, table, seq_len, kv_heads, sinks, window):
    out = torch.full_like(q, float("nan"))
    fn = lib.prefill_attention_bf16 if k.dtype == torch.bfloat16 else lib.prefill_attention_sw
    rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), table.data_ptr(), seq_len, q.shape[0], q.shape[1],
            kv_heads, q.shape[2], BLOCK, q.shape[2] ** -0.5, out.data_ptr(), out.stride(0),
            None if sinks is None else sinks.data_ptr(), window)
    assert rc == 0
    return out


def _decode(lib, q, k, v, table, seq_len, kv_heads, sinks, window):
    """q's last row alone, as a decode step of its sequence"""
    row = q[-1:].contiguous()
    out = torch.full_like(row, float("nan"))
    lens = torch.tensor([seq_len], dtype=torch.int32)
    fn = lib.decode_attention_bf16 if k.dtype == torch.bfloat16 else lib.decode_attention_sw
    rc = fn(row.data_ptr(), row.stride(0), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.numel(),
            lens.data_ptr(), 1, q.shape[1], kv_heads, q.shape[2], BLOCK, q.shape[2] ** -0.5, out.data_ptr(),
            None if sinks is None else sinks.data_ptr(), window)
    assert rc == 0
    return out


CASES = [  # (seq_len, num_q, heads, kv_heads, head_dim): prefills, extends, group sizes, head sizes
    (1536, 1536, 16, 4, 64),  # the bench model's prefill
    (700, 216, 16, 4, 64),  # an extend over a cached prefix
    (333, 333, 9, 3, 64),  # SmolLM2's heads: rows not a multiple of the tiles
    (460, 200, 8, 1, 128),  # one KV head, head_dim 128
    (150, 150, 6, 2, 48),  # head_dim 48: P V's 16-output tail, keys not a multiple of 32
    (90, 90, 4, 4, 80),  # no GQA, head_dim 80
]


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "sinks-window"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_avx512_and_avx2_builds_give_the_same_attention_bits(builds, case, extras, bf16):
    seq_len, num_q, heads, kv_heads, dim = case
    q, k, v, table, sinks = _pool(seq_len, heads, kv_heads, dim, num_q, seed=sum(case))
    if bf16:
        k, v = k.bfloat16(), v.bfloat16()
    sinks, window = (sinks, 100) if extras else (None, 0)
    wide, avx2 = (_prefill(lib, q, k, v, table, seq_len, kv_heads, sinks, window) for lib in builds)
    assert torch.equal(wide, avx2), f"prefill: max difference {(wide - avx2).abs().max().item():.3g}"
    dec_wide, dec_avx2 = (_decode(lib, q, k, v, table, seq_len, kv_heads, sinks, window) for lib in builds)
    assert torch.equal(dec_wide, dec_avx2)
    assert torch.equal(dec_wide, wide[-1:])  # the decode row is the prefill's last row
    if not extras:  # the shared answer: causal softmax attention in float64
        ctx_k = oracles.gather_context(k.float(), table.tolist(), seq_len)
        ctx_v = oracles.gather_context(v.float(), table.tolist(), seq_len)
        expect = oracles.attention(q, ctx_k, ctx_v, dim ** -0.5)
        torch.testing.assert_close(wide.double(), expect, rtol=2e-5, atol=2e-5)

