"""The MLA mixer's two forms against a float64 oracle written from the definition: per head, key [W_UK[h] c | k_rope],
value W_UV[h] c over the cached latents c (and k_rope), causal softmax at MLA's scale. The absorbed form (decode: the
query folded through W_UK, attention over the latent pool itself, out through W_UV) and the expanded form (prompt
chunks: K and V expanded per head) equal it, and each other, to float tolerance; a step mixing decode rows and a
prompt chunk gives each sequence the rows it gets alone. The latent pool: its bytes and its copy-on-write."""
from __future__ import annotations

import math

import pytest
import torch

from tsterm.config import ModelConfig
from tsterm.model.arch import MLA, LayerType
from tsterm.model.cache import MLALatentPool, ModelCache
from tsterm.model.decoder import StepContext
from tsterm.model.mla import MLAttention, expanded_kv_width, latent_width, softmax_scale
from tsterm.model.parallel import ParallelLayout, SingleRank
from tsterm_kernels import dispatch
from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs

BLOCK = 4
MLA_LAYER = LayerType(MLA, "moe")


def config(kv_lora_rank: int, **extra) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=3,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=16, q_lora_rank=16,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, **extra))


def layer(cfg: ModelConfig, num_blocks: int, seed: int = 0) -> MLAttention:
    gen = torch.Generator().manual_seed(seed)
    Hq, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = {"kv_b": torch.randn(Hq * (dn + dv), r, generator=gen) * 0.3,
         "kv_a": torch.randn(r + cfg.qk_rope_head_dim, cfg.hidden_size, generator=gen),
         "kv_a_norm": torch.ones(r), "q_proj": torch.randn(Hq * (dn + cfg.qk_rope_head_dim), cfg.hidden_size),
         "o_proj": torch.randn(cfg.hidden_size, Hq * dv, generator=gen)}
    pool = MLALatentPool(cfg, (0,), num_blocks, BLOCK, torch.float32, torch.device("cpu"), ParallelLayout())
    pool.latent.normal_(generator=gen)  # the cached rows: latents and RoPE keys
    return MLAttention(cfg, w, "", pool.layer(0), StepContext(), dispatch.load("torch"), SingleRank())


def oracle(mla: MLAttention, q_nope, q_rope, table: list[int], seq_len: int) -> torch.Tensor:
    """float64, from the definition: the last m positions of a context of seq_len over its cached rows."""
    m, Hq, r, dn, dv = q_nope.shape[0], mla.num_heads, mla.rank, mla.nope, mla.v_dim
    rows = torch.cat([mla.cache[b].reshape(BLOCK, -1) for b in table])[:seq_len].double()  # [n, r + dr]
    c, k_rope = rows[:, :r], rows[:, r:]
    kv_b = mla.kv_b.double().view(Hq, dn + dv, r)
    out = torch.empty(m, Hq, dv, dtype=torch.float64)
    for h in range(Hq):
        k = torch.cat((c @ kv_b[h, :dn].T, k_rope), dim=-1)  # [n, dn + dr]
        v = c @ kv_b[h, dn:].T  # [n, dv]
        q = torch.cat((q_nope[:, h], q_rope[:, h]), dim=-1).double()  # [m, dn + dr]
        scores = q @ k.T * mla.scale  # [m, n]
        for j in range(m):
            scores[j, seq_len - m + j + 1:] = float("-inf")
        out[:, h] = torch.softmax(scores, -1) @ v
    return out


def meta_for(seqs: list[tuple[list[int], int, int]]) -> AttentionMetadata:
    """seqs: (block table, context length, new tokens) per sequence."""
    starts = [0]
    for _, _, m in seqs:
        starts.append(starts[-1] + m)
    width = max(len(t) for t, _, _ in seqs)
    tables = torch.tensor([t + [-1] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32)
    return AttentionMetadata(starts, [n for _, n, _ in seqs], [contiguous_runs(t, len(t)) for t, _, _ in seqs],
                             torch.zeros(starts[-1], dtype=torch.int64), tables, BLOCK)


def queries(mla: MLAttention, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, mla.num_heads, mla.nope, generator=gen),
            torch.randn(m, mla.num_heads, mla.rope_dim, generator=gen))


# kv_lora_rank + qk_rope_head_dim = 32 and 28: both run csrc/mla.c (a width that is a multiple of 16 and one that is not)
@pytest.mark.parametrize("kv_lora_rank", [24, 20])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_absorbed_and_expanded_equal_the_definition(kv_lora_rank, m):
    cfg = config(kv_lora_rank)
    mla = layer(cfg, num_blocks=32)
    table, seq_len = [7, 8, 3, 11] + list(range(12, 12 + 16)) + [4, 5], 14 + m  # out of order, the last block partial
    table = table[:-(-seq_len // BLOCK)]
    q_nope, q_rope = queries(mla, m, seed=m)
    want = oracle(mla, q_nope, q_rope, table, seq_len)
    expanded = mla.expanded(q_nope, q_rope, contiguous_runs(table, len(table)), seq_len)
    absorbed = mla.absorbed(q_nope, q_rope, meta_for([(table, seq_len, m)]), torch.float32)
    for got in (expanded, absorbed):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)


def test_a_mixed_step_gives_each_sequence_its_own_rows():
    """Rows absorbed (a decode, a short chunk: through the step's metadata cut to them) beside a long prompt chunk
    (expanded)."""
    mla = layer(config(24), num_blocks=48)
    mla.allow_expanded()  # (`deterministic: false`; by default every chunk is absorbed)
    long = mla.absorb_max_rows + 3
    assert long > 65  # a verify step's rows (64 drafts + 1) are never expanded
    seqs = [([40, 41], 6, 1), (list(range(1, 1 + -(-(long + 5) // BLOCK))), long + 5, long), ([42, 30, 31], 11, 4),
            ([44], 3, 1)]
    q_nope, q_rope = queries(mla, sum(m for _, _, m in seqs), seed=7)
    got = mla._attend(q_nope, q_rope, meta_for(seqs), torch.float32)
    row = 0
    for table, seq_len, m in seqs:
        want = oracle(mla, q_nope[row:row + m], q_rope[row:row + m], table, seq_len)
        torch.testing.assert_close(got[row:row + m].double(), want, rtol=1e-4, atol=1e-5)
        row += m


def test_the_latent_pool_holds_only_the_latent_and_copies_whole_blocks():
    cfg = config(24)
    layout = ParallelLayout()
    per_block = ModelCache.bytes_per_block(cfg, (MLA_LAYER,) * 3, BLOCK, torch.bfloat16, layout)
    assert per_block == 3 * BLOCK * latent_width(cfg) * 2  # 3 layers of [latent | k_rope] in bf16 per token
    assert latent_width(cfg) == 32 and expanded_kv_width(cfg) == 3 * (12 + 8 + 10)
    cache = ModelCache(cfg, (MLA_LAYER,) * 2, 6, BLOCK, torch.float32, torch.device("cpu"))
    pool = cache.pools["mla"]
    pool.latent.normal_()
    before = pool.latent.clone()
    copied = cache.copy_blocks([(1, 4)])
    assert copied == 2 * BLOCK * latent_width(cfg) * 4
    assert torch.equal(pool.latent[:, 4], before[:, 1]) and torch.equal(pool.latent[:, :4], before[:, :4])
    assert cache.layer(1).shape == (6, BLOCK, 1, latent_width(cfg))


def test_the_softmax_scale_follows_deepseek_yarn():
    plain = config(24)
    assert softmax_scale(plain) == pytest.approx(20 ** -0.5)
    yarn = config(24, rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=0.8,
                                        original_max_position_embeddings=64))
    assert softmax_scale(yarn) == pytest.approx(20 ** -0.5 * (0.1 * 0.8 * math.log(40) + 1) ** 2)

