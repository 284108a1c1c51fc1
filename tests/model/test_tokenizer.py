"""Tokenizer: chat template rendering and ids against transformers, eos discovery, streaming detokenizer, stops."""
from __future__ import annotations

import datetime
import json
import shutil

import jinja2
import pytest

from tests.helpers.tokenizers import ADDED_TOKENS, SPECIAL_TOKENS, make_tokenizer_dir, tokenizer_vocab_size
from tsterm.errors import ConfigError, ModelLoadError
from tsterm.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Météo actuelle d'une ville (°C) <b>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web & summarise",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]
CHATS = {
    "single": [{"role": "user", "content": "Hello there!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "日本語で答えて 🙂"}],
    "multi_turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "  simple arithmetic  "},
        {"role": "user", "content": "And café × 2?"},
        {"role": "assistant", "content": "Two cafés.", "reasoning": "old field name"},
        {"role": "user", "content": "Thanks"},
    ],
    "reasoning_after_user": [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "hidden: before the last user"},
        {"role": "user", "content": "Look it up"},
        {"role": "assistant", "content": "", "thinking": " need a search ",
         "tool_calls": [{"function": {"name": "search", "arguments": {"q": "it"}}}]},
        {"role": "tool", "content": "found it"},
        {"role": "assistant", "content": "Here it is.", "reasoning": "old field name"},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and news?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Zürich"}}},
            {"type": "function", "function": {"name": "search", "arguments": {"q": "news <today>"}}}]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": "Nothing happened."},
        {"role": "assistant", "content": "21 °C and a quiet day."},
        {"role": "user", "content": "ok"},
    ],
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {name: make_tokenizer_dir(tmp_path_factory.mktemp(name), template=name, vocab_size=600)
            for name in ("chatml", "llama3")}


@pytest.fixture(scope="module")
def chatml(dirs):
    return Tokenizer.from_dir(dirs["chatml"])


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def hf_ids(out):
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True) (return_dict=True default)."""
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def assert_same_rendering(ours, hf, messages, tools=None, **kwargs):
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, tools=tools, **kwargs) == expected
    expected_ids = hf_ids(hf.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs))
    assert ours.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs) == expected_ids
    return expected


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_chat_template_matches_transformers(dirs, template, chat, with_tools):
    ours, hf = Tokenizer.from_dir(dirs[template]), hf_tokenizer(dirs[template])
    tools = TOOLS if with_tools else None
    for add_generation_prompt in (True, False):
        for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            assert_same_rendering(ours, hf, CHATS[chat], tools, add_generation_prompt=add_generation_prompt, **extra)


def test_rendering_details(chatml):
    text = chatml.apply_chat_template(CHATS["tool_calls"], tools=TOOLS, enable_thinking=False)
    assert '"Météo actuelle d\'une ville (°C) <b>"' in text  # tojson: no ASCII/HTML escaping
    assert '{"city": "Zürich", "unit": "c"}' in text  # tojson(sort_keys=true)
    assert "None" not in text  # content=None dropped before rendering
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    multi = chatml.apply_chat_template(CHATS["reasoning_after_user"], add_generation_prompt=False)
    assert "<think>\nold field name\n</think>" in multi and "<think>\nneed a search\n</think>" in multi
    assert "before the last user" not in multi


def test_template_sources_and_precedence(dirs, tmp_path):
    template = (dirs["chatml"] / "chat_template.jinja").read_text()
    # 1) template stored as a string in tokenizer_config.json
    as_string = tmp_path / "string"
    shutil.copytree(dirs["chatml"], as_string)
    (as_string / "chat_template.jinja").unlink()
    config = json.loads((as_string / "tokenizer_config.json").read_text())
    (as_string / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert_same_rendering(Tokenizer.from_dir(as_string), hf_tokenizer(as_string), CHATS["system"],
                          add_generation_prompt=True)
    # 2) named templates: tools select "tool_use"
    named = tmp_path / "named"
    shutil.copytree(as_string, named)
    tool_use = "TOOLS{{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    entries = [{"name": "default", "template": template}, {"name": "tool_use", "template": tool_use}]
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": entries}))
    ours, hf = Tokenizer.from_dir(named), hf_tokenizer(named)
    assert assert_same_rendering(ours, hf, CHATS["single"], TOOLS, add_generation_prompt=True) == "TOOLS2|Hello there!"
    assert_same_rendering(ours, hf, CHATS["single"], add_generation_prompt=True)
    # 3) chat_template.jinja wins over tokenizer_config.json
    both = tmp_path / "both"
    shutil.copytree(named, both)
    (both / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}")
    assert Tokenizer.from_dir(both).apply_chat_template(CHATS["single"], tools=TOOLS) == "JINJAHello there!"
    assert hf_tokenizer(both).apply_chat_template(CHATS["single"], tools=TOOLS, tokenize=False) == "JINJAHello there!"


def test_jinja_environment_extras(dirs, tmp_path):
    path = tmp_path / "extras"
    shutil.copytree(dirs["chatml"], path)
    (path / "chat_template.jinja").write_text(
        "{{ bos_token is defined }}{{ eos_token }}{% for m in messages %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{{ dict(a=1) | tojson }}{{ [1, 2] | tojson(indent=2) }}{{ {'b': 1, 'a': 2} | tojson(separators=(',', ':')) }}"
        "{{ strftime_now('%Y') }}")
    ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
    text = assert_same_rendering(ours, hf, CHATS["system"])
    assert text.startswith("False<|im_end|>You are terse.") and text.endswith(str(datetime.date.today().year))
    (path / "chat_template.jinja").write_text("{% set ns = namespace() %}{% set ns._private = 1 %}")
    with pytest.raises(ConfigError, match="_private"):
        Tokenizer.from_dir(path).apply_chat_template(CHATS["single"])


def test_raise_exception_is_config_error(dirs):
    bad = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role: narrator"):
        hf_tokenizer(dirs["chatml"]).apply_chat_template(bad, tokenize=False)
    for name in ("chatml", "llama3"):
        with pytest.raises(ConfigError, match="unknown role: narrator"):
            Tokenizer.from_dir(dirs[name]).apply_chat_template(bad)


def test_missing_files(dirs, tmp_path):
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(dirs["chatml"] / "tokenizer.json", tmp_path)
    bare = Tokenizer.from_dir(tmp_path)  # no config files at all: still encodes, eos from the fallback list
    assert bare.eos_token_ids == tuple(bare.token_to_id(t) for t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"))
    with pytest.raises(ModelLoadError, match="no chat template"):
        bare.apply_chat_template(CHATS["single"])


def test_encode_decode_match_transformers(dirs, chatml):
    hf = hf_tokenizer(dirs["chatml"])
    texts = ["Hello world", "  leading spaces and\ttabs\n\nnewlines ", "café naïve 日本語 emoji 🙂🚀 Привет",
             "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n<tool_call>{}</tool_call><|endoftext|>",
             "<|im_start without closing", ""]
    for text in texts:
        ids = chatml.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert chatml.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert chatml.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert chatml.decode(ids, skip_special_tokens=False) == text
    mixed = chatml.decode(chatml.encode("<|im_start|>a<think>b</think><|im_end|>"))
    assert mixed == "a<think>b</think>"  # added non-special tokens survive skip_special_tokens


def test_special_token_ids(dirs, chatml, tmp_path):
    ids = {t: chatml.token_to_id(t) for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)}
    assert chatml.vocab_size == 600 == tokenizer_vocab_size(dirs["chatml"])
    assert chatml.eos_token_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])  # generation_config.json list
    assert chatml.pad_token_id == ids["<|endoftext|>"]
    assert chatml.bos_token_id == ids["<|begin_of_text|>"]  # no bos_token: generation_config's bos_token_id
    llama = Tokenizer.from_dir(dirs["llama3"])
    assert llama.bos_token_id == ids["<|begin_of_text|>"] and llama.pad_token_id is None
    assert llama.eos_token_ids == (ids["<|eot_id|>"], ids["<|endoftext|>"])
    # an int eos in generation_config.json is merged with tokenizer_config's eos_token, in that order
    shutil.copytree(dirs["llama3"], tmp_path / "int", dirs_exist_ok=True)
    (tmp_path / "int" / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|endoftext|>"]}))
    assert Tokenizer.from_dir(tmp_path / "int").eos_token_ids == (ids["<|endoftext|>"], ids["<|eot_id|>"])
    # legacy special_tokens_map.json (dict form) fills tokens when tokenizer_config has no added_tokens_decoder
    (tmp_path / "int" / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "<|eot_id|>"}}))
    assert Tokenizer.from_dir(tmp_path / "int").pad_token_id == ids["<|eot_id|>"]
    assert hf_tokenizer(tmp_path / "int").pad_token_id == ids["<|eot_id|>"]


STREAM_TEXT = "Un café? 日本語のテキスト 🙂👍🚀 naïve Ελληνικά\n<think>ok</think> done ❤️"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_detokenizer_streams_whole_characters(chatml, skip_special_tokens, with_prompt):
    prompt = chatml.apply_chat_template(CHATS["single"], tokenize=True) if with_prompt else None
    ids = chatml.encode(STREAM_TEXT + "<|im_end|>")
    assert any("\ufffd" in chatml.decode(ids[:i]) for i in range(len(ids)))  # the text does split characters
    detok = IncrementalDetokenizer(chatml, prompt_ids=prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add([token_id]) for token_id in ids] + [detok.flush()]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == chatml.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "" in deltas[:-1]  # something was held back until its character was complete


def test_incremental_detokenizer_chunks_flush_and_window(chatml, monkeypatch):
    ids = chatml.encode(STREAM_TEXT * 20)
    window = []
    decode = chatml.decode
    monkeypatch.setattr(chatml, "decode", lambda xs, **kw: window.append(len(xs)) or decode(xs, **kw))
    monkeypatch.setattr(IncrementalDetokenizer, "TRIM_AT", 16)  # exercise dropping already-emitted ids
    detok = IncrementalDetokenizer(chatml)
    text = "".join(detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == decode(ids) and max(window) <= 12  # O(1) work per step, not O(output)
    assert len(detok._ids) < 32
    # an incomplete character at the very end is dropped by flush(): the text ends with the last whole character
    cut = next(i for i in range(1, len(ids)) if decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(chatml)
    head = detok.add(ids[:cut])
    assert "\ufffd" not in head and head + detok.flush() == decode(ids[:cut])[:-1]
    assert detok.flush() == ""


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    assert find_stop("abc STOP def STOP", ["STOP", "def"], 0) == 4  # earliest of all stops
    # a stop spanning the previous delta ("...ST") and the new one ("OP...")
    text = "answer: 42 ST"
    assert find_stop(text, ["STOP"], 0) is None
    text += "OP and more"
    assert find_stop(text, ["STOP"], len("answer: 42 ST")) == 11
    # already-checked text before start - len(stop) + 1 is not searched again
    assert find_stop("STOP then text", ["STOP"], 10) is None
    assert find_stop("xxSTOP", ["STOP", "<|im_end|>"], 3) == 2
    assert find_stop("abc", ["", "c"], 0) == 2  # empty stops are ignored
