"""One Gated DeltaNet layer against transformers' own layer: several sequences share a step (prompt chunks and decode
tokens mixed), each keeps its conv and recurrent state in its own slot between steps, and a slot handed to a new
sequence starts from zeros whatever its previous holder left there."""
from __future__ import annotations

import pytest
import torch

from tsterm.config import ModelConfig
from tsterm.model.decoder import StepContext
from tsterm.model.hybrid_loader import load_hybrid_weights
from tsterm.model.linear_attention import GatedDeltaNet
from tsterm.model.parallel import SingleRank
from tsterm_kernels import dispatch
from tsterm_kernels.metadata import AttentionMetadata

from tests.helpers.checkpoints import make_hybrid_checkpoint


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe_text"])
def layer(request, tmp_path_factory):
    """(our layer 0, transformers' layer 0, ctx, conv states, recurrent states) of a one-layer checkpoint."""
    overrides = dict(num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=3)
    path, hf = make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param, overrides,
                                      with_tokenizer=False)
    cfg = ModelConfig.from_dir(path)
    weights = load_hybrid_weights(path, cfg, torch.float32, torch.device("cpu"))
    conv = torch.randn(5, 2 * 2 * 8 + 6 * 4, 2)  # 5 slots, garbage left by earlier holders
    states = torch.randn(5, 6, 8, 4)
    ctx = StepContext()
    ours = GatedDeltaNet(cfg, weights, "layers.0.", (conv, states), ctx, dispatch.load("torch"), SingleRank())
    return ours, hf.model.layers[0].linear_attn, ctx, conv, states


def run_step(ours, ctx, pieces: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """One step: (new hidden rows [n, H], context length after them, slot) per sequence; returns each one's output."""
    starts = [0]
    for x, _, _ in pieces:
        starts.append(starts[-1] + x.shape[0])
    ctx.meta = AttentionMetadata(query_start_loc=starts, seq_lens=[s for _, s, _ in pieces], block_runs=[],
                                 slot_mapping=torch.empty(0), block_tables=torch.empty(0), block_size=4)
    ctx.state_slots = torch.tensor([slot for *_, slot in pieces], dtype=torch.int32)
    out = ours(None, torch.cat([x for x, _, _ in pieces]))
    return [out[a:b] for a, b in zip(starts, starts[1:])]


def test_mixed_steps_through_state_slots_equal_transformers_whole_sequences(layer):
    ours, hf_layer, ctx, conv, states = layer
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, 32, generator=gen) for n in (9, 1, 14)]  # hidden states of three sequences
    slots = [3, 0, 4]
    done = [0, 0, 0]
    outs = [[], [], []]
    # step 1: seq 0's first chunk (5 tokens), seq 1's only prompt token, seq 2's first chunk (8)
    # step 2: seq 0's rest (4) and seq 2's next chunk (3), then decode token by token
    schedule = [[(0, 5), (1, 1), (2, 8)], [(0, 4), (2, 3)], [(2, 1)], [(2, 1), (0, 0)], [(2, 1)]]
    for step in schedule:
        pieces, who = [], []
        for i, n in step:
            if n == 0:
                continue
            pieces.append((seqs[i][done[i]:done[i] + n], done[i] + n, slots[i]))
            who.append(i)
            done[i] += n
        for i, o in zip(who, run_step(ours, ctx, pieces)):
            outs[i].append(o)
    assert done == [9, 1, 14]
    with torch.no_grad():
        for i, x in enumerate(seqs):
            ref = hf_layer(x[None])[0]  # the whole sequence at once, no cache
            torch.testing.assert_close(torch.cat(outs[i]), ref, rtol=1e-4, atol=1e-5)

    # slot 3 passes to a new sequence: it starts from zeros, not from sequence 0's state
    fresh = torch.randn(6, 32, generator=gen)
    (o,) = run_step(ours, ctx, [(fresh, 6, 3)])
    with torch.no_grad():
        torch.testing.assert_close(o, hf_layer(fresh[None])[0], rtol=1e-4, atol=1e-5)


def test_the_step_plan_travels_with_the_step_inputs():
    """A hybrid step's plan (`RecurrentPlan`) is laid out with the other step inputs: per sequence kind its slots and
    rows, a prompt cut where its state is kept (rows before the cut, the copy, rows after), a decode token keeping
    a state; a step of a model without state slots carries none."""
    from tsterm.engine.step_inputs import DeviceBuffers, HostStaging, HostStep, StepLayout, step_inputs

    # seq 0: a fresh 6-token prompt whose state is kept at 4 (snapshot slot 7); seq 1: a decode token at 8, its state
    # kept (slot 6); seq 2: a decode token at 3; seq 3: a 2-token chunk resuming at 5 (no snapshot)
    step = HostStep(input_ids=[1] * 10, positions=[0] * 10, slot_mapping=[0] * 10, query_start_loc=[0, 6, 7, 8, 10],
                    seq_lens=[6, 8, 3, 7], block_tables=[[0, 1], [2, 3], [4], [5, 6]], sample_rows=[5, 6, 7, 9],
                    state_slots=[2, 0, 5, 1], snapshot_slots=[7, 6, -1, -1], snapshot_positions=[4, 8, 0, 0])
    staging = HostStaging(torch.device("cpu"))
    layout = StepLayout(10, 4, 2, 4)
    staging.write(layout, step)
    i64, i32 = DeviceBuffers(staging).reserve(layout)
    plan = step_inputs(layout, i64, i32, step, block_size=4).meta.recurrent
    got = {name: getattr(plan, name).tolist() for name in plan.__slots__ if name != "shape"}
    assert got == dict(fresh_slots=[2], decode_slots=[0, 5], decode_rows=[6, 7], decode_keep_src=[0],
                       decode_keep_dst=[6], prefill_slots=[2, 1], prefill_bounds=[[0, 4], [8, 10]],
                       prefill_keep_src=[2], prefill_keep_dst=[7], resume_slots=[2], resume_bounds=[[4, 6]],
                       verify_rows=[], verify_src=[], verify_dst=[])  # (verify steps: test_spec_decode_hybrid.py)
    assert not plan.shape.every_decode

    plain = HostStep(input_ids=[1], positions=[3], slot_mapping=[3], query_start_loc=[0, 1], seq_lens=[4],
                     block_tables=[[0]], sample_rows=[0], state_slots=[-1])
    layout = StepLayout(1, 1, 1, 1)
    staging.write(layout, plain)
    assert step_inputs(layout, *DeviceBuffers(staging).reserve(layout), plain, block_size=4).meta.recurrent is None
