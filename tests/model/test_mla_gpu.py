"""Multi-head Latent Attention on a CUDA device through the Triton kernels: the absorbed decode at DeepSeek-V3's
attention shape (128 query heads over one latent key head of 512 + 64, bfloat16 pool) against the torch twin, and a
tiny DeepSeek-V3 checkpoint decoded token-exact with transformers, eager and with CUDA graphs.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/model/test_mla_gpu.py` (to be listed in scripts/gpu_check.sh's GPU_TESTS).
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


@pytest.mark.parametrize("num_seqs, context", [(1, 4100), (5, 777)])
def test_absorbed_attention_at_deepseek_size_matches_the_torch_twin(num_seqs, context):
    from tsterm_kernels import torch_ops, triton_ops
    from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

    gen = torch.Generator().manual_seed(num_seqs)
    block, heads, width = 16, 128, 512 + 64
    per_seq = -(-context // block)
    pool = (torch.randn(num_seqs * per_seq + 3, block, 1, width, generator=gen) * 0.5).to(torch.bfloat16)
    tables = [list(range(3 + s * per_seq, 3 + (s + 1) * per_seq))[::-1] for s in range(num_seqs)]  # out of order
    q = (torch.randn(num_seqs, heads, width, generator=gen) * 0.5).to(torch.bfloat16)
    meta = AttentionMetadata(list(range(num_seqs + 1)), [context] * num_seqs,
                             [contiguous_runs(t, len(t)) for t in tables], torch.zeros(num_seqs, dtype=torch.int64),
                             torch.tensor(tables, dtype=torch.int32), block)
    want = torch_ops.paged_attention(q.float(), pool.float(), pool.float(), meta, 192 ** -0.5)
    cuda = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_runs, meta.slot_mapping.cuda(),
                             meta.block_tables.cuda(), block)
    got = triton_ops.paged_attention(q.cuda(), pool.cuda(), pool.cuda(), cuda, 192 ** -0.5)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_deepseek_checkpoint_decodes_token_exact_on_the_device(tmp_path, cuda_graphs):
    from tsterm import LLM, SamplingParams

    from tests.helpers.checkpoints import make_checkpoint

    model_dir, hf_model = make_checkpoint(tmp_path / "deepseek_v3", "deepseek_v3", dict(
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=20,
        kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10))
    llm = LLM(str(model_dir), dtype="float32", device="cuda", block_size=4, num_kv_blocks=128, kernels="triton",
              cuda_graphs=cuda_graphs)
    gen = torch.Generator().manual_seed(1)
    for n in (11, 70):  # both absorbed (deterministic): the 70-token prompt in one chunk of the MLA kernel
        prompt = torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):], f"prompt of {n}"
