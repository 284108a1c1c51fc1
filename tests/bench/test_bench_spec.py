"""`tsterm bench` and speculative decoding (issue 33): the copy-heavy trace, the prompt-lookup baselines, tsterm with
and without its drafts in one run, and the --speculative flags of `tsterm agent` and `tsterm bench`."""
from __future__ import annotations

import statistics
import sys
import types

import pytest
import torch

from tsterm import LLM
from tsterm.bench import NO_SPEC, run_bench
from tsterm.bench.copy_trace import NAME, SOURCE_FILE, TEST_FAILURE, TEST_RUN, copy_heavy_trace
from tsterm.bench.llama_cpp import open_llama
from tsterm.bench.replay import (
    RecordedDrafts,
    first_divergence,
    load_transformers,
    replay_transformers,
    replay_transformers_lookup,
)
from tsterm.bench.report import format_table
from tsterm.bench.trace import TraceSpec, TraceTurn
from tsterm.engine.spec_decode import make_draft_source
from tsterm.tokenizer import Tokenizer

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.tokenizers import make_tokenizer_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("spec-bench") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                   max_position_embeddings=4096))
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint)


def _ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def _copied_share(reply: list[int], before: list[int], n: int = 6) -> float:
    """Share of the reply's tokens that end an n-gram whose first n-1 tokens and the token itself occurred earlier in
    the conversation: what a prompt-lookup draft of the conversation could have proposed."""
    seen = _ngrams(before, n)
    hits = sum(tuple(reply[i - n + 1:i + 1]) in seen for i in range(n - 1, len(reply)))
    return hits / max(len(reply) - n + 1, 1)


def test_copy_heavy_trace_is_deterministic_and_its_replies_copy_the_conversation(tmp_path, tokenizer):
    trace, turns = copy_heavy_trace(tokenizer, sessions=2)
    again, _ = copy_heavy_trace(Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "t")), sessions=2)
    assert [[(t.new_ids, t.output_tokens, t.keep) for t in s] for s in trace] == \
        [[(t.new_ids, t.output_tokens, t.keep) for t in s] for s in again]  # same text, same tokenizer: same ids
    assert len(trace) == 2 and len(trace[0]) == len(turns[0]) == 5
    # session 2 differs (its file name) but shares the system prompt's tokens
    first, other = trace[0][0].new_ids, trace[1][0].new_ids
    assert first != other and first[:50] == other[:50]
    conversation, texts = [], []
    for step, turn in zip(trace[0], turns[0]):
        text = tokenizer.decode(step.new_ids, skip_special_tokens=False)
        texts.append(text)
        reply = tokenizer.encode(turn.expected)
        assert step.output_tokens >= len(reply)  # room for the whole copy
        conversation += step.new_ids
        if turn.expected.startswith("```python"):  # a rewrite: nearly all of it is in the conversation already
            assert _copied_share(reply, conversation) > 0.9, turn.message[:40]
        conversation += reply
    # the file is a tool result; the test run's output is one too, and the turn asks for it to be quoted back
    assert SOURCE_FILE in texts[1] and TEST_RUN in texts[2] and "Quote the failure section" in texts[2]
    assert _copied_share(tokenizer.encode(TEST_FAILURE), trace[0][2].new_ids) == 1.0
    # each turn's text starts by closing the previous reply and ends with the generation prompt (chatml here)
    assert all(t.startswith("<|im_end|>") and t.endswith("<|im_start|>assistant\n") for t in texts[1:])
    assert texts[0].endswith("<|im_start|>assistant\n")


def test_recorded_drafts_count_acceptance_by_position():
    recorded = RecordedDrafts(make_draft_source("ngram", 3))
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (1, 1)):
        recorded.observe(0, drafted, accepted)
    assert recorded.drafted == [4, 3, 2] and recorded.accepted == [3, 1, 1]
    assert recorded.propose(0, [5, 6, 7, 5, 6], 3) == [7, 5, 6]  # the inner source's draft
    recorded.release(0, [5, 6, 7, 5, 6], 2)


def test_transformers_lookup_keeps_its_cache_drafts_and_matches_plain_greedy(checkpoint, tokenizer):
    """On the copy-heavy trace's first two turns: the same tokens as transformers generate with its cache kept,
    the kept cache serving each later turn, and fewer forward passes than tokens (drafts were accepted)."""
    model = load_transformers(str(checkpoint), torch.float32)
    trace, _ = copy_heavy_trace(tokenizer)
    trace = [[trace[0][0], TraceTurn(trace[0][1].new_ids, 40)]]  # the file read, 40 tokens of its rewrite
    plain = replay_transformers(model, trace, keep_cache=True)
    calls = []
    hook = model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        lookup = replay_transformers_lookup(model, trace, num_tokens=4)
    finally:
        hook.remove()
    assert first_divergence(plain, lookup) is None
    assert [t.generated_tokens for t in lookup.turns] == [step.output_tokens for step in trace[0]]
    first = trace[0][0]
    assert [t.cached_tokens for t in lookup.turns] == [0, len(first.new_ids) + first.output_tokens - 1]
    assert len(calls) < sum(t.generated_tokens for t in lookup.turns)


def test_bench_replays_with_and_without_drafts_and_the_lookup_baseline(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=512,
              speculative_method="suffix", num_speculative_tokens=4)
    spec = TraceSpec(sessions=1, turns=3, system_tokens=30, task_tokens=5, turn_tokens=9, output_tokens=24)
    r = run_bench(llm, spec, baseline=["transformers-lookup", "transformers-cache"], micro_context=16, parallel=2,
                  rounds=2)
    replays = r["replays"]
    assert set(replays) == {"tsterm", NO_SPEC, "transformers-lookup", "transformers-cache"}
    assert all(len(rep["rounds_wall_s"]) == 2 for rep in replays.values())
    # greedy is lossless: with drafts, without, and both transformers replays generate the same ids
    assert r["divergence_from_tsterm"] == {NO_SPEC: None, "transformers-lookup": None, "transformers-cache": None}
    s = r["speculation"]
    assert s["method"] == "suffix" and s["num_speculative_tokens"] == 4
    assert s["no_spec_draft_tokens"] == 0  # the replay without drafts verified none
    # the engine's per-position counters, the bench's own count of them and the engine's totals agree (two rounds
    # of the replay with drafts)
    assert s["by_position_from"] == "engine"
    assert s["drafted_by_position"] == s["recorded_drafted_by_position"]
    assert s["accepted_by_position"] == s["recorded_accepted_by_position"]
    assert s["num_drafts"] == s["drafted_by_position"][0] > 0
    assert sum(s["drafted_by_position"]) == s["draft_tokens"] and sum(s["accepted_by_position"]) == s["accepted_tokens"]
    assert all(a <= d for a, d in zip(s["accepted_by_position"], s["drafted_by_position"]))
    assert s["mean_accepted_length"] == pytest.approx(s["accepted_tokens"] / s["num_drafts"])
    assert s["acceptance_by_position"][0] == pytest.approx(s["accepted_by_position"][0] / s["drafted_by_position"][0])
    # each ratio from the same rounds; the replay without drafts decoded one token a step
    rounds = {name: rep["rounds_decode_only_tokens_per_s"] for name, rep in replays.items()}
    assert r["decode_speedup_vs"][NO_SPEC] == pytest.approx(s["decode_speedup_vs_off"])
    assert s["decode_speedup_vs_off"] == pytest.approx(
        statistics.median(a / b for a, b in zip(rounds["tsterm"], rounds[NO_SPEC])))
    table = format_table(r)
    assert "speculation suffix K=4" in table and "greedy tokens of transformers-lookup: the same" in table
    assert "speedup_vs_transformers-lookup" in table
    # random ids repeat nothing: the target there is "never a loss"
    assert next(line for line in table.splitlines() if line.startswith("spec_decode_speedup_vs_off")).split()[2:4] \
        == [">=", "0.95"]
    # the engine's own draft source is back after the bench (the replays used fresh ones)
    assert llm.engine.drafter is not None and not isinstance(llm.engine.drafter, RecordedDrafts)
    assert llm.engine.scheduler.proposer is not None


def test_a_divergence_is_reported_where_it_starts():
    from tsterm.bench.replay import ReplayResult, TurnRecord

    def replay(*outputs):
        return ReplayResult("x", 1.0, [TurnRecord(0, t, 1, 0, 0, 0.0, 0.0, len(o), list(o)) for t, o in enumerate(outputs)])

    assert first_divergence(replay([1, 2], [3, 4]), replay([1, 2], [3, 4])) is None
    assert first_divergence(replay([1, 2], [3, 4]), replay([1, 2], [3, 5])) == {"session": 0, "turn": 1, "index": 1}
    r = {"model": "m", "dtype": "float32", "device": "cpu", "replays": {},
         "divergence_from_tsterm": {"llama.cpp-lookup": {"session": 0, "turn": 1, "index": 1}}}
    assert "greedy tokens of llama.cpp-lookup: differ from tsterm's at session 1 turn 2 token 2" in format_table(r)


def test_llama_cpp_lookup_opens_llama_with_the_prompt_lookup_draft(monkeypatch, tmp_path):
    opened = {}

    class Llama:
        def __init__(self, **kwargs):
            opened.update(kwargs)

    class LlamaPromptLookupDecoding:
        def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
            self.num_pred_tokens = num_pred_tokens

    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = LlamaPromptLookupDecoding
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama, llama_speculative=speculative))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    open_llama(gguf, 300, 1, lookup_tokens=6)
    # the context as llama.cpp pads it: the logits kept for drafts cover every position it may draft into
    assert opened["draft_model"].num_pred_tokens == 6 and opened["n_ctx"] == 512 and opened["logits_all"]
    open_llama(gguf, 64, 1)
    assert opened["draft_model"] is None and not opened["logits_all"]


@pytest.mark.parametrize("command", [["bench"], ["agent", "say hi"]])
def test_the_speculative_flags_reach_the_engine(checkpoint, command):
    from tsterm.cli import parse_args
    from tsterm.launch import llm_from_args

    _, args = parse_args([*command, "--model", str(checkpoint), "--dtype", "float32", "--device", "cpu",
                          "--speculative", "ngram", "--num-speculative-tokens", "3"])
    engine = llm_from_args(args).engine
    assert engine.config.speculative_method == "ngram" and engine.config.num_speculative_tokens == 3
    assert engine.drafter.name == "ngram" and engine.drafter.num_tokens == 3
    _, args = parse_args([*command, "--model", str(checkpoint)])
    assert args.speculative_method is None and args.num_speculative_tokens is None  # the profile's, else off


def test_copy_heavy_is_a_trace_name_of_the_bench_command():
    from tsterm.cli import parse_args

    _, args = parse_args(["bench", "--trace", NAME, "--rounds", "3", "--baseline", "llama.cpp-lookup",
                          "--baseline", "transformers-lookup", "--speculative", "suffix"])
    assert args.trace == NAME and args.rounds == 3 and args.speculative_method == "suffix"
    assert args.baseline == ["llama.cpp-lookup", "transformers-lookup"]


def test_a_transformers_baseline_refuses_weights_it_cannot_load(tmp_path):
    """A checkpoint whose weights transformers cannot read all of (tsterm's natively quantized import keeps its
    blocks as .qcodes / .qscales tensors) would run as random weights: refused, naming the directory."""
    from safetensors.torch import load_file, save_file

    from tsterm.errors import ConfigError

    path, _ = make_checkpoint(tmp_path / "m", "qwen3", dict(num_hidden_layers=1))
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name + ".qcodes"] = weights.pop(name)  # stored under a name transformers does not know
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"cannot load every weight of .*1 missing, e.g. " + name.replace(".", r"\.")):
        load_transformers(str(path), torch.float32)
