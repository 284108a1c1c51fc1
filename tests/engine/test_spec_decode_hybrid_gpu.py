"""Speculative decoding on a hybrid (Gated DeltaNet + gated attention layers, Triton kernels) on a real device: verify
steps whose positions keep their states in slots of their own, accepted and rejected from every position, give the
CPU reference's greedy tokens; and their forward neither copies host data to the device nor waits for it (the
acceptance's slot choice is host bookkeeping; the one state copy, at a block boundary, is a device copy).

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest`, as scripts/gpu_check.sh does. Self-contained: no fixtures from conftest files. Float32
throughout, so tokens can be compared with the CPU's.
"""
from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from tests.engine.test_spec_decode import Scripted
from tests.helpers.checkpoints import make_hybrid_checkpoint
from tsterm import LLM, SamplingParams
from tsterm.engine.copy_audit import CopyAudit

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

NOT_THE_FORWARD = {"metadata", "sampling"}  # the step inputs' upload, the sampler and its read-back of the tokens
K = 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("gpu_spec_hybrid") / "m", "qwen3_5_moe_text",
                                     dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2))
    return str(path)


def llm_on(path: str, device: str, method: str = "off", **options) -> LLM:
    return LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=128, speculative_method=method,
               num_speculative_tokens=K, **options)


def prompts_and_reference(path: str) -> tuple[list[list[int]], list[list[int]], SamplingParams]:
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 300) for _ in range(n)] for n in (7, 12, 3, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [list(out.outputs[0].token_ids) for out in llm_on(path, "cpu", kernels="torch").generate(prompts, params)]
    return prompts, ref, params


def scripted(path: str, prompts, ref) -> tuple[LLM, Scripted]:
    llm = llm_on(path, "cuda", "ngram")
    assert llm.engine.executor.kernels == "triton"
    source = Scripted(K, {tuple(p): p + r for p, r in zip(prompts, ref)}, lambda r: r.choice([None, 0, 1, 2, 3]))
    llm.engine.drafter = source
    llm.engine.draft_length = None  # (every draft verified, whatever the steps' times)
    return llm, source


def test_speculating_hybrid_on_cuda_matches_the_cpu_reference(hybrid):
    prompts, ref, params = prompts_and_reference(hybrid)
    llm, source = scripted(hybrid, prompts, ref)
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert out == ref
    assert source.observed == source.expected and {a for _, a in source.observed} >= {0, 1, 2, 3}
    pool = llm.engine.kv.pool
    pool.check_invariants()
    held = {slot for slot in range(pool.num_state_slots) if pool.state_slot_refs(slot)}
    assert held == {block.snapshot for block in pool.blocks if block.snapshot is not None}


@contextlib.contextmanager
def never_waiting():
    """Any host sync torch issues inside (a blocking read-back, a copy from pageable memory) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_verify_steps_copy_no_host_data_and_never_wait(hybrid):
    """Every step audited: no host-to-device copy and no host sync in the forward of verify steps; the steps after
    the prompts (decodes verifying drafts, acceptance taking slots and, at block boundaries, copying one state) run
    under sync debug mode "error"."""
    prompts, ref, params = prompts_and_reference(hybrid)
    warm, _ = scripted(hybrid, prompts, ref)
    warm.generate(prompts, params)  # the run's kernel variants compile here
    torch.cuda.synchronize()
    llm, source = scripted(hybrid, prompts, ref)
    engine = llm.engine
    engine.audit = audit = CopyAudit()
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # the prompts
    with never_waiting():
        while engine.has_unfinished():
            engine.step()
    assert sum(a for _, a in source.observed) > 0
    assert audit.bytes_by_phase()["linear_state"]
    assert {k: n for k, n in audit.host_to_device.items() if k[0] not in NOT_THE_FORWARD} == {}
    assert {k: n for k, n in audit.host_syncs.items() if k[0] not in NOT_THE_FORWARD} == {}
