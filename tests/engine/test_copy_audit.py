"""The copy audit's accounting on small known cases, the engine's copy bytes per token against context length, and
the host-to-device probe: what it counts, and a hybrid forward that uploads nothing and reads nothing back."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.copy_audit import CopyAudit
from tsterm.model.linear_attention import GatedDeltaNet

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint


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


# ---- host-to-device copies: the probe, and the hybrid forward without any


def test_every_way_host_data_reaches_a_device_is_counted():
    """'meta' stands in for a GPU: the same dispatcher and torch-function paths, no memory. A tensor made from
    Python data on the device, a host index, a host tensor moved or copied in or fed to a device op: each counted
    once; device-only work, host-only work and a 0-dim host scalar are not."""
    dev = torch.arange(6, device="meta")
    on_device = torch.zeros(2, dtype=torch.int64, device="meta")
    audit = CopyAudit()
    with audit.record():
        torch.tensor([1, 2], device="meta")
        torch.as_tensor([1, 2], device="meta")
        dev[[0, 2]]
        dev[torch.tensor([0, 1])]  # a host tensor as the index (its own creation is host-only)
        dev[[1, 3]] = on_device
        torch.ones(3).to("meta")
        dev.copy_(torch.arange(6))
        dev.index_select(0, torch.tensor([1]))
        # none of these moves host data to the device
        dev[1:3], dev[0], dev + torch.tensor(2), dev.index_select(0, on_device), dev[on_device]
        torch.tensor([1, 2]).sum()
    assert dict(audit.host_to_device) == {("other", "tensor"): 2, ("other", "index"): 3, ("other", "to"): 1,
                                          ("other", "copy_"): 1, ("other", "operand"): 1}
    assert audit.summary()["host_to_device"]["other/index"] == 3


def test_a_cpu_device_makes_the_host_side_checks_testable():
    """Told that the CPU is the device, the probe counts what the same Python code would upload or read back on a
    GPU: tensors from Python data, Python-list indices, .item() / .tolist() / .numpy(); by default (CPU = host) none."""
    x = torch.arange(6)

    def host_side_work():
        torch.tensor([1, 2])
        x.new_tensor([3])
        x[[0, 2]]
        x[torch.tensor([1])]  # counted once: where the index tensor is made
        x.tolist(), x[0].item(), int(x[1]), x.numpy()
        x[1:3], x + 1, x.index_select(0, x[:2]), x[x[:2]]  # device-side work: not counted

    audit = CopyAudit(device="cpu")
    with audit.record():
        host_side_work()
    assert dict(audit.host_to_device) == {("other", "tensor"): 3, ("other", "index"): 1}
    assert dict(audit.host_syncs) == {("other", "tolist"): 1, ("other", "item"): 2, ("other", "numpy"): 1}
    default = CopyAudit()
    with default.record():
        host_side_work()
    assert not default.host_to_device and not default.host_syncs


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("audit_hybrid") / "m", "qwen3_5_moe_text",
                                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    return str(path)


NOT_THE_FORWARD = {"metadata", "sampling"}  # the step inputs' upload, the sampler's read-back of the tokens


def audited_hybrid_steps(path: str) -> CopyAudit:
    """Every step of a few hybrid requests through the Triton ops (the GPU's path; interpreted here), audited with
    the CPU as the device: fresh prompts cut at a kept state, a step mixing decode tokens with a prompt, decode tokens
    that keep a state, a later turn resuming a kept state."""
    engine = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, kernels="triton").engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.audit = audit = CopyAudit(device="cpu")
    first = [5, 6, 7, 8, 9, 10, 11]
    first_id = engine.add_request(first, params)
    engine.add_request([3, 3, 3], params)
    engine.step()  # both prompts (the first one's state kept at 4, then its rows 4..6)
    engine.add_request([20, 21, 22, 23, 24, 25], params)
    outputs = {}
    while engine.has_unfinished():  # decode steps, one with a prompt among them
        outputs.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    engine.add_request(first + outputs[first_id] + [30, 31], params)  # the next turn: resumes from a kept state
    while engine.has_unfinished():
        engine.step()
    return audit


def forward_only(counts: dict) -> dict:
    return {key: n for key, n in counts.items() if key[0] not in NOT_THE_FORWARD}


def test_the_hybrid_forward_copies_no_host_data_and_reads_nothing_back(hybrid):
    audit = audited_hybrid_steps(hybrid)
    phases = audit.bytes_by_phase()
    assert phases["linear_state"] and phases["state_snapshot"] and phases["attention"]  # the hybrid's work, audited
    assert audit.host_syncs[("sampling", "tolist")]  # the probe was live: the sampler's read-back is counted
    assert forward_only(audit.host_to_device) == {}
    assert forward_only(audit.host_syncs) == {}


@pytest.mark.parametrize("leak", ["tensor", "index"])
def test_host_data_in_a_layer_is_caught(hybrid, monkeypatch, leak):
    """A Gated DeltaNet layer that builds a tensor from a Python list on its device, or indexes with one (what the
    layer did per step before its step plan), is caught in the layer's phase."""
    split = GatedDeltaNet._split

    def leaky_split(self, qkv):
        if leak == "tensor":
            torch.tensor([0], device=qkv.device)
        else:
            qkv = qkv[list(range(qkv.shape[0]))]
        return split(self, qkv)

    monkeypatch.setattr(GatedDeltaNet, "_split", leaky_split)
    audit = audited_hybrid_steps(hybrid)
    assert forward_only(audit.host_to_device).keys() == {("linear_state", leak)}
