"""Structured outputs (SamplingParams.structured_outputs) on a real engine: the default profile's model (SmolLM2-135M,
its GGUF blocks, the CPU kernels) constrained by llguidance to a JSON schema, any JSON object, a choice, a regex.

The mask is the sampler's first stage (tsterm/engine/structured.py): constrained and free rows share a batch, a free
request's output is the same as alone, a constrained one is valid whatever it samples, and where the free greedy
output already satisfies the grammar the constrained greedy output is that output (the mask never removed its argmax).
"""
from __future__ import annotations

import json
import math
import re
from enum import Enum

import jsonschema
import pydantic
import pytest
import torch

from tsterm.config import SamplingParams, StructuredOutputs
from tsterm.engine.sampler import Sampler, SamplingRow
from tsterm.engine.structured import GrammarCompiler
from tsterm.errors import ConfigError, RequestError
from tsterm.llm import LLM
from tsterm.profiles import SHIPPED_DIR


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(pydantic.BaseModel):
    name: str
    age: int
    colour: Colour
    tricks: list[str] = pydantic.Field(max_length=3)


SCHEMA = Pet.model_json_schema()
# few-shot: the model's own greedy continuation is a JSON line that satisfies SCHEMA, then more text
FEW_SHOT = ('Pet: Tom, a blue cat of 3 who can sit and purr\nJSON:\n'
            '{"name": "Tom", "age": 3, "colour": "blue", "tricks": ["sit", "purr"]}\n'
            'Pet: Polly, a green parrot of 7 who can talk\nJSON:\n'
            '{"name": "Polly", "age": 7, "colour": "green", "tricks": ["talk"]}\n'
            'Pet: Rex, a red dog of 4 who can fetch and roll over\nJSON:\n')


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_profile(str(SHIPPED_DIR / "default.yaml"), kv_cache_memory=None, num_kv_blocks=512,
                            max_model_len=2048)


def _chat(llm: LLM, question: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True)


def _pet(text: str) -> Pet:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return Pet.model_validate(value)


def test_schema_greedy_and_seeded_batched_with_a_free_request(llm):
    """A pydantic model's schema, greedy and seeded, in one batch with a free request: both constrained replies parse
    and validate and end with "stop" (the grammar's end or eos where it accepts); the free reply is the one it gets
    alone (the mask touched only the constrained rows)."""
    prompt = _chat(llm, "Describe a pet as JSON with a name, an age, a colour (red, green or blue) and its tricks.")
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputs(json=SCHEMA))
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=120, structured_outputs={"json": json.dumps(SCHEMA)})
    free_prompt = _chat(llm, "Name three colours.")
    free = SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True)
    outs = llm.generate([prompt, prompt, free_prompt], [greedy, seeded, free])
    for out in outs[:2]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        _pet(completion.text)
    alone = llm.generate([free_prompt], [free])[0].outputs[0]
    assert outs[2].outputs[0].token_ids == alone.token_ids
    assert len(alone.token_ids) == 24


def test_greedy_constrained_equals_greedy_free_where_the_free_one_satisfies_the_schema(llm):
    """The free greedy reply starts with a JSON line that satisfies the schema (then writes on): constrained, the
    reply is exactly those tokens, and stops at the closing brace (the grammar's end) with "stop"."""
    free = llm.generate([FEW_SHOT], [SamplingParams(temperature=0, max_tokens=40)])[0].outputs[0]
    value, end = json.JSONDecoder().raw_decode(free.text)
    jsonschema.validate(value, SCHEMA)  # the premise: the free reply satisfies the grammar up to `end`
    for spec in ({"json": SCHEMA}, {"json_object": True}):
        out = llm.generate([FEW_SHOT], [SamplingParams(temperature=0, max_tokens=40,
                                                       structured_outputs=spec)])[0].outputs[0]
        assert out.finish_reason == "stop"
        assert out.text == free.text[:end]
        assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_json_object_without_free_whitespace(llm):
    """Any JSON object; with disable_any_whitespace it is written as json.dumps writes it (", " and ": ", nothing
    else), where the free-whitespace grammar lets this model write newlines and indents."""
    prompt = _chat(llm, "Give me a JSON object with a person's name and age.")
    texts = []
    for compact in (True, False):
        out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=200, structured_outputs={
            "json_object": True, "disable_any_whitespace": compact})])[0].outputs[0]
        texts.append(out.text)
        if compact:
            assert out.finish_reason == "stop"
            value = json.loads(out.text)
            assert isinstance(value, dict) and out.text == json.dumps(value)
    assert texts[1].startswith("{\n")


def test_choice_stops_at_the_grammars_end_even_with_ignore_eos(llm):
    """A choice: the reply is one of the strings exactly; the grammar's end finishes it ("stop") even where eos
    would not (ignore_eos)."""
    choices = ["positive", "negative", "neutral"]
    prompt = _chat(llm, "Is the sentiment of 'I love this film' positive, negative or neutral?")
    for params in (SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": choices}),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, logprobs=20,
                                  structured_outputs={"choice": choices})):
        out = llm.generate([prompt], [params])[0].outputs[0]
        assert out.finish_reason == "stop"
        assert out.text in choices
    # logprobs are the constrained distribution's: the first token's alternatives are the allowed tokens only (each
    # the start of a choice), fewer than the 20 asked for, none at -inf
    top = out.logprobs[0]["top"]
    assert 1 <= len(top) < 20
    assert all(math.isfinite(v) for _, v in top)
    assert all(any(c.startswith(llm.tokenizer.decode([t])) for c in choices) for t, _ in top)


def test_regex(llm):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    out = llm.generate([_chat(llm, "Write a US phone number.")],
                       [SamplingParams(temperature=0.9, seed=5, max_tokens=30,
                                       structured_outputs={"regex": pattern})])[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(pattern, out.text), out.text


def test_n2_with_a_schema(llm):
    """n=2: each sample has its own grammar state (a copy made at admission), both replies are valid."""
    out = llm.generate([_chat(llm, "Describe a pet as JSON.")],
                       [SamplingParams(temperature=1.0, seed=21, n=2, max_tokens=120,
                                       structured_outputs={"json": SCHEMA})])[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion
        _pet(completion.text)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids  # two samples, not one state shared


def test_max_tokens_cuts_a_constrained_reply(llm):
    """max_tokens ends a constrained reply like any other ("length"): its text is then a prefix of something the
    grammar accepts, not necessarily complete JSON (here it is not)."""
    out = llm.generate([_chat(llm, "Describe a pet as JSON.")],
                       [SamplingParams(temperature=0, max_tokens=6, structured_outputs={"json": SCHEMA})])[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 6
    assert completion.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


@pytest.mark.parametrize("spec, param, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "structured_outputs.json", "strng"),
    ({"json": {"type": "string", "pattern": "(?=a)b"}}, "structured_outputs.json", "look-around"),
    ({"json": '{"type": '}, "structured_outputs.json", "not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", "undefined_rule"),
])
def test_a_grammar_that_does_not_compile_is_a_request_error_naming_it(llm, spec, param, words):
    """Refused at admission: a RequestError (a server's 400) whose param is the field and whose message names the
    construct; nothing of the batch is queued."""
    with pytest.raises(RequestError) as info:
        llm.generate([_chat(llm, "hi"), _chat(llm, "hello")],
                     [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=spec)])
    assert info.value.param == param
    assert words in str(info.value)
    assert not llm.engine.has_unfinished()


def test_structured_outputs_fields_are_checked():
    with pytest.raises(ConfigError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ConfigError, match="no field 'schema'"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ConfigError, match="choice must be a non-empty list"):
        SamplingParams(structured_outputs={"choice": []})


def test_sampler_allows_eos_only_where_the_grammar_accepts(llm):
    """The sampler on a batch of a constrained row and a free row whose logits favour eos by far: the constrained row
    takes the grammar's tokens (greedy and sampled) until the grammar accepts (eos is refused at the start), then
    eos; the free row takes eos at every step."""
    tokenizer, vocab = llm.tokenizer, llm.engine.model_config.vocab_size
    eos = tokenizer.eos_token_ids[0]
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    sampler = Sampler(grammars=compiler)
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 100.0
    grammars = [compiler.compile(StructuredOutputs(regex="[ab]+")) for _ in range(2)]
    rows = [SamplingRow(SamplingParams(temperature=0), grammar=grammars[0]),
            SamplingRow(SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0),
                        grammar=grammars[1]),
            SamplingRow(SamplingParams(temperature=0))]
    taken: list[list[int]] = [[], [], []]
    while not all(g.done for g in grammars):
        out = sampler(logits, rows)
        assert out.token_ids[2] == eos
        for i, grammar in enumerate(grammars):
            if not grammar.done:
                token = out.token_ids[i]
                assert token != eos or grammar.accepting
                grammar.accept(token)
                taken[i].append(token)
                if grammar.done:
                    rows[i].grammar = None  # (as the engine drops a finished sample's grammar)
        assert len(taken[0]) <= 4
    assert "grammar" in sampler.last_stages
    for ids in taken[:2]:
        assert len(ids) >= 2 and ids[-1] == eos and re.fullmatch("[ab]+", tokenizer.decode(ids[:-1]))
