"""The llama.cpp baseline's own logic, with what CI has: prompt-prefix reuse as llama-cpp-python's `Llama.generate`
does it (a stand-in with its interface, since CI does not install the `bench` extra), the GGUF file of an imported
model, and the errors a user meets. The comparison itself is measured by `tsterm bench --baseline llama.cpp`
and `benchmarks/decode_batch1.py --llama-cpp` (BENCHMARKS.md)."""
from __future__ import annotations

import json
import sys

import pytest

from tsterm.bench.llama_cpp import common_prefix, context_needed, gguf_source, open_llama, replay_llama_cpp
from tsterm.bench.trace import TraceSpec, TraceTurn, make_trace
from tsterm.errors import ConfigError
from tsterm.convert.gguf import INFO_FILE
from tsterm.convert.shipped import SMOLLM2_FILE


class PrefixReusingLlama:
    """llama-cpp-python's `Llama` as the adapter uses it: `input_ids[:n_tokens]` is what its context holds;
    `generate` keeps the longest common prefix with the new prompt (at least one token is evaluated again),
    evaluates the rest, then yields a token and evaluates it when asked for the next. Next token: a hash of the
    whole context, so a wrong context gives other tokens."""

    def __init__(self, vocab: int = 300):
        self.vocab, self.input_ids, self.n_tokens, self.evaluated, self.calls = vocab, [], 0, 0, []

    def _eval(self, tokens: list[int]) -> None:
        self.input_ids = self.input_ids[:self.n_tokens] + list(tokens)
        self.n_tokens += len(tokens)
        self.evaluated += len(tokens)

    def _next(self) -> int:
        return (sum((i + 1) * t for i, t in enumerate(self.input_ids[:self.n_tokens])) * 7919) % self.vocab

    def generate(self, tokens, **sampling):
        self.calls.append(sampling)
        self.n_tokens = common_prefix(self.input_ids[:self.n_tokens], list(tokens))
        self._eval(tokens[self.n_tokens:])
        while True:
            token = self._next()
            yield token
            self._eval([token])


def reference_outputs(trace, vocab=300):
    """What each turn generates when every prompt is evaluated from an empty context."""
    outputs, model = [], PrefixReusingLlama(vocab)
    for turns in trace:
        history = []
        for step in turns:
            ids = (history if step.keep is None else history[:step.keep]) + step.new_ids
            model.input_ids, model.n_tokens = [], 0
            model._eval(ids)
            generated = []
            for _ in range(step.output_tokens):
                generated.append(model._next())
                model._eval(generated[-1:])
            outputs.append(generated)
            history = ids + generated
    return outputs


def test_replay_reuses_the_held_prefix_and_generates_what_a_fresh_context_would():
    spec = TraceSpec(sessions=2, turns=3, system_tokens=20, task_tokens=5, turn_tokens=6, output_tokens=3)
    trace = make_trace(spec, vocab_size=300)
    llama = PrefixReusingLlama()
    result = replay_llama_cpp(llama, trace)
    assert [t.output_token_ids for t in result.turns] == reference_outputs(trace)
    first = [t for t in result.turns if t.session == 0]
    # session 0: nothing held, then all of the previous prompt + reply but the reply's last token
    assert [t.cached_tokens for t in first] == [0, 25 + 3 - 1, 25 + 3 + 6 + 3 - 1]
    # session 1 opens on the shared system prompt still held from session 0's conversation
    assert result.turns[3].session == 1 and result.turns[3].cached_tokens == 20
    assert llama.evaluated == sum(t.prompt_tokens - t.cached_tokens + t.generated_tokens - 1 for t in result.turns)
    assert all(call["temp"] == 0.0 and call["top_k"] == 1 and call["repeat_penalty"] == 1.0 for call in llama.calls)
    assert all(t.generated_tokens == 3 for t in result.turns) and result.wall_s > 0


def test_a_template_miss_keeps_only_the_shared_prefix():
    trace = [[TraceTurn(list(range(20, 40)), 2), TraceTurn([50, 51], 2, keep=10)]]
    result = replay_llama_cpp(PrefixReusingLlama(), trace)
    assert [t.cached_tokens for t in result.turns] == [0, 10]
    assert [t.output_token_ids for t in result.turns] == reference_outputs(trace)
    assert context_needed(trace) == 22 and context_needed(make_trace(TraceSpec(turns=2, system_tokens=8,
                                                                                task_tokens=2, turn_tokens=3,
                                                                                output_tokens=4), 100)) == 21


def test_missing_llama_cpp_python_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the bench extra were not installed
    with pytest.raises(ConfigError, match=r"needs llama-cpp-python, which is not installed: pip install -e '\.\[bench\]'"):
        open_llama(tmp_path / "m.gguf", 64, 2)


def test_the_gguf_file_is_the_one_the_model_was_imported_from(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match="was not imported from one .* pass --gguf FILE"):
        gguf_source(model)
    source = tmp_path / "m.Q4_1.gguf"
    (model / INFO_FILE).write_text(json.dumps({"source": source.name, "source_path": str(source)}))
    with pytest.raises(ConfigError, match="which is not there any more"):
        gguf_source(model)
    source.write_bytes(b"GGUF")
    assert gguf_source(model) == source
    (model / INFO_FILE).write_text(json.dumps({"source": source.name}))  # an older import: the name only
    with pytest.raises(ConfigError, match="names the GGUF file 'm.Q4_1.gguf' but not where it is"):
        gguf_source(model)
    shipped = tmp_path / "pkg" / SMOLLM2_FILE
    shipped.parent.mkdir()
    shipped.write_bytes(b"GGUF")
    monkeypatch.setattr("tsterm.convert.shipped.shipped_smollm2_gguf", lambda: shipped)
    (model / INFO_FILE).write_text(json.dumps({"source": SMOLLM2_FILE}))  # the default model's older import
    assert gguf_source(model) == shipped


def test_a_prompt_the_context_already_holds_still_evaluates_its_last_token():
    llama, first = PrefixReusingLlama(), list(range(20, 40))
    [turn] = replay_llama_cpp(llama, [[TraceTurn(first, 2)]]).turns
    again = first + turn.output_token_ids[:1]  # all of it held: the prompt and the reply's first token
    [retry] = replay_llama_cpp(llama, [[TraceTurn(again, 2)]]).turns
    assert retry.cached_tokens == 20 and llama.evaluated == 20 + 1 + 1 + 1
    assert retry.output_token_ids == reference_outputs([[TraceTurn(again, 2)]])[0]
