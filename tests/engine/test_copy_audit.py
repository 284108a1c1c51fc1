"""The copy audit's accounting on small known cases, and the engine's copy bytes per token against context length."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.copy_audit import CopyAudit

from tests.helpers.checkpoints import make_checkpoint


def test_known_copies_are_counted_exactly():
    x = torch.randn(1000)  # 4000 bytes
    audit = CopyAudit()
    with audit.record():
        y = x.clone()
        torch.cat([x, y])  # 8000 bytes out
        x.to(torch.float64)  # 8000 bytes out
        z = torch.empty(1000)
        z.copy_(x)  # 4000 bytes moved
        x[torch.tensor([1, 2, 3])]  # 12 bytes gathered
        x.view(10, 100).t().contiguous()  # a real copy: 4000
        x.view(10, 100).contiguous()  # already contiguous: no copy
        x + y  # arithmetic is not a copy
    by_kind = {k: v for (_, k), v in audit.copy_bytes.items()}
    assert by_kind == {"clone": 4000 + 4000, "cat": 8000, "to": 8000, "copy_": 4000, "index": 12}
    assert audit.total_copy_bytes == 28012
    assert not audit.host_syncs  # .item() of CPU data is no host sync


def test_every_nth_step_and_off_by_default():
    audit = CopyAudit(every_n_steps=3)
    audited = []
    for step in range(7):
        with audit.step(step) as on:
            audited.append(on)
            torch.zeros(10).clone()
    assert audited == [True, False, False, True, False, False, True]
    assert audit.audited_steps == 3 and audit.total_copy_bytes == 3 * 40
    with pytest.raises(ValueError):
        CopyAudit(every_n_steps=0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("audit") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                   max_position_embeddings=1024))
    return LLM(str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=128)


def decode_copy_bytes_per_token(llm, context: int) -> dict[str, float]:
    engine = llm.engine
    prompt = [10 + i % 300 for i in range(context)]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # prefill (whole prompt in one chunk)
    audit = engine.enable_copy_audit()
    for _ in range(8):
        engine.step()
    engine.audit = None
    engine.abort(rid)
    tokens = audit.audited_tokens
    assert tokens == 8
    return {"per_token": audit.bytes_per_token(), **{p: n / tokens for p, n in audit.bytes_by_phase().items()}}


def test_decode_copy_bytes_per_token_do_not_grow_with_context(llm):
    assert llm.engine.audit is None  # off unless asked for
    short = decode_copy_bytes_per_token(llm, 64)
    long = decode_copy_bytes_per_token(llm, 8 * 64)
    assert short["per_token"] > 0
    assert long == short  # identical, phase by phase: nothing scales with the context
    cfg = llm.engine.model_config
    # the KV write is exactly one token's K and V per layer
    assert short["kv_write"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4


def test_stats_ledger_counts_reuse_by_reference(llm):
    engine = llm.engine
    prompt = [10 + i % 300 for i in range(100)]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))
    before = engine.stats()
    out = llm.generate(prompt + [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))[0]
    after = engine.stats()
    assert out.num_cached_tokens == 100  # 24 full blocks by reference, then 4 tokens of the partial block taken over
    per_token = after["kv_bytes_per_block"] // after["block_size"]
    assert after["kv_reused_bytes"] - before["kv_reused_bytes"] == 100 * per_token
