"""MTP drafts (`tsterm.model.mtp`, `tsterm.engine.spec_decode.mtp`): the head against a float64 reference written here,
and the engine's greedy output with MTP drafts against greedy without them.

The reference reads the head's tensors from the checkpoint's own file and the target's final hidden states from
transformers (float32), and computes in float64 the head from scratch: no tsterm layer, norm, rotary table or kernel. Random
checkpoints of the three families that carry a head (Qwen3-Next and Qwen3.5 as they ship one; a Qwen3-MoE with a head
attached, as the demo model's trained one is) are held to it: logits close at every position, and the same argmax
drafts, chained.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig, ModelConfig
from tsterm.engine.executor import ExecutorSpec
from tsterm.engine.model_runner import ModelRunner
from tsterm.engine.step_inputs import HostStep
from tsterm.errors import ConfigError

from tests.engine.test_spec_decode import make_llm, mixed_batch, run
from tests.helpers.checkpoints import add_mtp_head, make_checkpoint, make_hybrid_checkpoint

BLOCK = 4
K = 3
DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "moe_demo"  # the shipped demo MoE


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def headed(request, tmp_path_factory):
    """(path, the transformers model, the head's tensors) of a tiny random checkpoint carrying an MTP head."""
    path = tmp_path_factory.mktemp("mtp") / request.param
    if request.param == "qwen3_moe":
        path, model = make_checkpoint(path, "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                             num_hidden_layers=2, norm_topk_prob=True))
    else:
        path, model = make_hybrid_checkpoint(path, request.param)
    return str(path), model, {k: v.double() for k, v in add_mtp_head(path).items()}


# ---- the reference: float64, from the head's tensors alone ------------------------------------------------------------

def text_config(path: str) -> dict:
    raw = json.loads((Path(path) / "config.json").read_text())
    return raw.get("text_config") or raw


def reference_head(w: dict[str, torch.Tensor], c: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                   tokens: list[int], prev: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over rows (token, previous hidden state, position) attending causally to each other: (hidden [T, H],
    logits [T, V])."""
    hybrid = c["model_type"].startswith(("qwen3_next", "qwen3_5"))
    eps, D = c["rms_norm_eps"], c["head_dim"]
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    rotary = int(D * (rope.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0))

    def norm(x, name):
        scale = w[name] + 1.0 if hybrid else w[name]
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale

    def rotate(x, pos):  # [T, heads, D]: the leading `rotary` dims, halves rotated (HF's rotate_half)
        inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
        angle = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None]  # [T, rotary / 2]
        cos, sin = torch.cat((angle.cos(), angle.cos()), -1)[:, None], torch.cat((angle.sin(), angle.sin()), -1)[:, None]
        r, rest = x[..., :rotary], x[..., rotary:]
        half = torch.cat((-r[..., rotary // 2:], r[..., :rotary // 2]), -1)
        return torch.cat((r * cos + half * sin, rest), -1)

    L = "mtp.layers.0."
    u = torch.cat((norm(embed[tokens], "mtp.pre_fc_norm_embedding.weight"),
                   norm(prev, "mtp.pre_fc_norm_hidden.weight")), -1) @ w["mtp.fc.weight"].T  # [T, H]
    T = len(tokens)
    x = norm(u, L + "input_layernorm.weight")
    q = (x @ w[L + "self_attn.q_proj.weight"].T).view(T, Hq, -1)
    gate = None
    if hybrid:  # per head: D query dims, then D gate dims
        q, gate = q[..., :D], q[..., D:].reshape(T, Hq * D)
    k = (x @ w[L + "self_attn.k_proj.weight"].T).view(T, Hkv, D)
    v = (x @ w[L + "self_attn.v_proj.weight"].T).view(T, Hkv, D)
    q = rotate(norm(q, L + "self_attn.q_norm.weight"), positions)
    k = rotate(norm(k, L + "self_attn.k_norm.weight"), positions)
    k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, Hq * D)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    h = u + o @ w[L + "self_attn.o_proj.weight"].T
    x = norm(h, L + "post_attention_layernorm.weight")
    probs = (x @ w[L + "mlp.gate.weight"].T).softmax(-1)
    top, ids = probs.topk(c["num_experts_per_tok"], -1)
    if c.get("norm_topk_prob") is not False:
        top = top / top.sum(-1, keepdim=True)

    def mlp(x, p):
        return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    out = torch.zeros_like(x)
    for t in range(T):
        for weight, e in zip(top[t], ids[t].tolist()):
            out[t] += weight * mlp(x[t:t + 1], f"{L}mlp.experts.{e}.")[0]
    if L + "mlp.shared_expert_gate.weight" in w:
        out += torch.sigmoid(x @ w[L + "mlp.shared_expert_gate.weight"].T) * mlp(x, L + "mlp.shared_expert.")
    g = norm(h + out, "mtp.norm.weight")
    return g, g @ lm_head.T


# ---- the head in tsterm's executor -------------------------------------------------------------------------------------

def runner_for(path: str) -> ModelRunner:
    config = EngineConfig(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64,
                          max_num_seqs=4, speculative_method="mtp", num_speculative_tokens=K)
    return ModelRunner(ExecutorSpec(config, ModelConfig.from_dir(path), Path(path), torch.float32,
                                    torch.device("cpu")))


def host_step(tokens: list[int], start: int, table: list[int], sample: list[int], state_slot: int = -1) -> HostStep:
    """One sequence's rows at positions start.. over `table`."""
    step = HostStep()
    step.input_ids = list(tokens)
    step.positions = list(range(start, start + len(tokens)))
    step.slot_mapping = [table[p // BLOCK] * BLOCK + p % BLOCK for p in step.positions]
    step.query_start_loc = [0, len(tokens)]
    step.seq_lens = [start + len(tokens)]
    step.block_tables = [table[:-(-(start + len(tokens)) // BLOCK)]]
    step.state_slots = [state_slot]
    step.sample_rows = sample
    return step


def test_mtp_head_matches_a_float64_reference(headed):
    """Catch-up over a prompt (the head's entry at each position: its token with the target's hidden state before it,
    a zero one at 0), then a chain of K drafts fed with the head's own hidden state: logits close at every position,
    argmax drafts equal."""
    path, model, w = headed
    c = text_config(path)
    prompt = [int(t) for t in torch.randint(3, c["vocab_size"], (11,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():  # the target's final hidden states (after its final norm), by transformers in float32
        target = model.model(torch.tensor([prompt])).last_hidden_state[0].double()  # [n, H]
    embed = model.get_input_embeddings().weight.detach().double()
    lm_head = model.get_output_embeddings().weight.detach().double()
    n, H = len(prompt), target.shape[1]
    prev = torch.cat((torch.zeros(1, H, dtype=torch.float64), target[:-1]))  # row p: the target's hidden at p - 1
    ref_g, ref_logits = reference_head(w, c, embed, lm_head, prompt, prev, list(range(n)))
    # the chain: the draft at each step feeds the next, with the head's own hidden state
    ref_drafts, rows_tokens, rows_prev = [], list(prompt), prev
    g = ref_g
    for _ in range(K):
        token = int(ref_logits[-1].argmax())
        ref_drafts.append(token)
        rows_tokens = rows_tokens + [token]
        rows_prev = torch.cat((rows_prev, g[-1:]))
        g, ref_logits_chain = reference_head(w, c, embed, lm_head, rows_tokens, rows_prev, list(range(len(rows_tokens))))
        ref_logits = ref_logits_chain

    runner = runner_for(path)
    table = list(range(8))
    with torch.no_grad():
        runner.run_step(host_step(prompt, 0, table, [n - 1], 0 if runner.num_state_slots else -1))
        hidden = runner.hidden_states.double()
    torch.testing.assert_close(hidden, target, rtol=1e-4, atol=1e-4)  # (the seam: the target's own hidden states)
    prev32 = torch.cat((torch.zeros(1, H), runner.hidden_states[:-1]))
    out, logits = runner.mtp_forward(host_step(prompt, 0, table, list(range(n))), prev32)
    _, full = reference_head(w, c, embed, lm_head, prompt, prev, list(range(n)))
    torch.testing.assert_close(logits.double(), full, rtol=2e-4, atol=2e-4)
    assert logits.argmax(-1).tolist() == full.argmax(-1).tolist()
    drafts, last = [], out[-1:]
    for j in range(K):  # one row a step, as the engine chains them
        token = int((logits if j == 0 else chain)[-1].argmax())
        drafts.append(token)
        last, chain = runner.mtp_forward(host_step([token], n + j, table, [0]), last)
    assert drafts == ref_drafts
    torch.testing.assert_close(chain[-1].double(), ref_logits[-1], rtol=2e-4, atol=2e-4)


def test_checkpoint_without_a_head_is_refused(tmp_path):
    path, _ = make_checkpoint(tmp_path / "plain", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                                     num_hidden_layers=1))
    with pytest.raises(ConfigError, match="speculative_method mtp: .* has no MTP head"):
        runner_for(str(path))


def test_mtp_runs_on_one_rank():
    with pytest.raises(ConfigError, match="speculative_method mtp runs the MTP head in one process") as error:
        EngineConfig(model="m", speculative_method="mtp", tensor_parallel_size=2)
    assert error.value.param == "speculative_method"


# ---- the engine: greedy with MTP drafts is greedy without them ---------------------------------------------------------

@pytest.fixture(scope="module")
def moe_with_head(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("mtp") / "moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    add_mtp_head(path)
    return str(path)


@pytest.mark.parametrize("form", ["decode_rows", "extend"])
def test_greedy_with_mtp_drafts_equals_greedy_without(moe_with_head, form):
    """The mixed batch of test_spec_decode (repeating and plain prompts, prefill chunks beside verify steps, n = 2,
    penalties, logprobs, a seeded sampled request) decodes the same tokens with MTP drafts as without; the pool is
    left empty and consistent."""
    prompts, params = mixed_batch()
    ref, ref_outs = run(make_llm(moe_with_head), prompts, params)
    llm = make_llm(moe_with_head, "mtp")
    llm.engine.draft_length = None  # (the cost-aware cut, where the engine has one: every draft verified)
    llm.engine.executor.verify_as_decode_rows = form == "decode_rows"
    out, outs = run(llm, prompts, params)
    assert out == ref
    assert [list(c.token_ids) for c in outs[4].outputs] == [list(c.token_ids) for c in ref_outs[4].outputs]
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_draft_tokens"] > 0
    assert stats["used"] == 0
    llm.engine.kv.pool.check_invariants()


def test_demo_model_head_drafts_what_the_model_says():
    """The shipped demo MoE's trained head (scripts/train_mtp.py): greedy output unchanged, and its first drafts are
    accepted on held-out text about as often as the training report says."""
    path = str(DEMO)
    text = (Path(path) / "heldout.txt").read_text(encoding="utf-8")
    prompts = [text[i:i + 300] for i in (0, 1500, 3000)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(path, dtype="float32", device="cpu", speculative_method="mtp", num_speculative_tokens=2)
    llm.engine.draft_length = None  # (the cost-aware cut, where the engine has one: every draft verified)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref
    stats = llm.stats()
    first = stats["spec_accepted_per_pos"][0] / stats["spec_drafted_per_pos"][0]
    print(f"first-draft acceptance {first:.2f}, all {stats['spec_accepted_tokens']} / {stats['spec_draft_tokens']}")
    # (scripts/train_mtp.py's report: 0.61 of the target's greedy tokens on held-out text, teacher-forced; an
    # untrained head, or one fed the wrong hidden states, is near 0)
    assert first > 0.35


# ---- the hybrids: the head drafts, the verify step keeps the Gated DeltaNet state at the last accepted token ---------

@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid_with_head(request, tmp_path_factory) -> str:
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("mtp_hybrid") / request.param, request.param)
    add_mtp_head(path)
    return str(path)


def test_hybrid_greedy_with_mtp_drafts_equals_greedy_without(hybrid_with_head, one_torch_thread):
    """Qwen3-Next and Qwen3.5 with the head they ship: the mixed batch decodes the same tokens with MTP drafts (every
    draft verified) as without; the pool and the state slots are left as test_spec_decode_hybrid requires."""
    from tests.engine.test_spec_decode_hybrid import check_state_slots
    from tests.engine.test_spec_decode_hybrid import make_llm as make_hybrid_llm

    prompts, params = mixed_batch()
    ref, ref_outs = run(make_hybrid_llm(hybrid_with_head), prompts, params)
    llm = make_hybrid_llm(hybrid_with_head, "mtp", 3)
    out, outs = run(llm, prompts, params)
    assert out == ref
    assert [list(c.token_ids) for c in outs[4].outputs] == [list(c.token_ids) for c in ref_outs[4].outputs]
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["used"] == 0
    check_state_slots(llm)


def test_drafts_near_the_end_of_the_context(moe_with_head):
    """A chain of K drafts reaches K - 1 positions past the newest token: near the end of the context the head drafts
    nothing rather than run past the model's positions, and the replies (to the last position) are greedy's."""
    prompts = [[5 + i for i in range(20)], [7, 8, 9] * 6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, _ = run(make_llm(moe_with_head, max_model_len=32), prompts, [params] * 2)
    llm = make_llm(moe_with_head, "mtp", 4, max_model_len=32)
    llm.engine.draft_length = None  # (the cost-aware cut, where the engine has one: every draft verified)
    out, outs = run(llm, prompts, [params] * 2)
    assert out == ref and [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert llm.stats()["spec_num_drafts"] > 0
