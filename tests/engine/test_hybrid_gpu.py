"""The hybrid path (Gated DeltaNet + gated attention layers, Triton kernels) on a real device: greedy output equal to
the CPU reference, and a forward that neither copies host data to the device nor waits for it, through prompts cut
where a state is kept, steps mixing decode tokens with a prompt, decode tokens keeping a state, and a later turn
resuming a kept state.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run these with
`pytest --noconftest`, as scripts/gpu_check.sh does. Self-contained: no fixtures from conftest files. Float32
throughout, so tokens can be compared with the CPU's. The CPU suite runs the same host-side checks with the CPU
standing in for the device (tests/engine/test_copy_audit.py).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests.helpers.checkpoints import make_hybrid_checkpoint
from tsterm import LLM, SamplingParams
from tsterm.engine.copy_audit import CopyAudit

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

DEVICE = "cuda"
NOT_THE_FORWARD = {"metadata", "sampling"}  # the step inputs' upload, the sampler and its read-back of the tokens


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("gpu_hybrid") / "m", "qwen3_5_moe_text",
                                     dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2))
    return str(path)


def llm_on(path: str, device: str, **options) -> LLM:
    return LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=64, **options)


def conversation(engine, params: SamplingParams, on_decode_steps=None) -> dict[str, list[int]]:
    """Two prompts (one cut at a kept state), a third joining the decode steps, then a second turn of the first
    (resumed from its kept state); returns each request's tokens. `on_decode_steps`: a context manager (entered) around
    the steps after the first (decode tokens, one step with a prompt among them)."""
    first = [5, 6, 7, 8, 9, 10, 11]
    ids = [engine.add_request(first, params), engine.add_request([3, 3, 3], params)]
    outputs: dict[str, list[int]] = {}

    def run() -> None:
        while engine.has_unfinished():
            outputs.update({out.request_id: out.token_ids for out in engine.step() if out.finished})

    engine.step()
    ids.append(engine.add_request([20, 21, 22, 23, 24, 25], params))
    with on_decode_steps or contextlib.nullcontext():
        run()
    ids.append(engine.add_request(first + outputs[ids[0]] + [30, 31], params))
    run()
    return {f"request {i}": outputs[rid] for i, rid in enumerate(ids)}


@contextlib.contextmanager
def never_waiting():
    """Any host sync torch issues inside (a blocking read-back, a copy from pageable memory) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def forward_only(counts: dict) -> dict:
    return {key: n for key, n in counts.items() if key[0] not in NOT_THE_FORWARD}


def test_hybrid_greedy_output_on_cuda_matches_the_cpu_reference(hybrid):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = conversation(llm_on(hybrid, "cpu", kernels="torch").engine, params)
    llm = llm_on(hybrid, DEVICE)
    assert llm.engine.executor.kernels == "triton"
    assert conversation(llm.engine, params) == want


def test_the_hybrid_forward_copies_no_host_data_and_never_waits(hybrid):
    """Every step audited (host-to-device copies, host syncs by phase): none in the forward; and the decode steps,
    under sync debug mode "error", never wait for the device (the token read-back goes through pinned memory and an
    event, which that mode does not flag)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    conversation(llm_on(hybrid, DEVICE).engine, params)  # warm-up: the run's kernel variants compile here
    torch.cuda.synchronize()
    engine = llm_on(hybrid, DEVICE).engine  # (a fresh cache: the same steps as the warm-up's)
    engine.audit = audit = CopyAudit()
    conversation(engine, params, on_decode_steps=never_waiting())
    phases = audit.bytes_by_phase()
    assert phases["linear_state"] and phases["state_snapshot"] and phases["attention"]  # the hybrid's work, audited
    assert audit.host_to_device[("metadata", "copy_")]  # the probe was live: the step inputs' uploads are seen
    assert forward_only(audit.host_to_device) == {}
    assert forward_only(audit.host_syncs) == {}
