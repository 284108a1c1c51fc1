"""Build a small byte-level BPE tokenizer directory, as `save_pretrained` writes it, without any download.

`make_tokenizer_dir(path, template="chatml", vocab_size=320)` trains on the built-in corpus below and saves
tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json. The total vocabulary
(special and added tokens included) is exactly `vocab_size`, so a tiny random checkpoint can use the same size.
Token layout: ids 0..6 are SPECIAL_TOKENS, then the 256 byte symbols and merges (padded with special
`<|reserved_N|>` tokens past ~930, where the corpus runs out of merges), and the last 4 ids are ADDED_TOKENS (added, not special: decode keeps them, like Qwen's <think>).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>",
                  "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
A language model predicts the next token from the tokens that came before it.
Mixture of experts layers route every token to a few experts chosen by a small router.
The scheduler batches prefill chunks and decode steps so the accelerator stays busy.
Blocks of key and value cache are shared between requests that start with the same prompt.
What is the weather in Paris today? It is sunny, with a light breeze from the west.
Please call the search tool and summarise the three most relevant results for me.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
Numbers like 1234, 3.14159 and 2024-07-26 appear in logs, tables and reports.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Un café au lait, une crème brûlée et une tarte tatin, s'il vous plaît.
The naïve résumé of the coöperative façade was déjà vu for the señor.
日本語のテキストも少し含めます。東京は日本の首都です。
Emoji also show up in chats: 🙂 👍 🚀 🎉 and sometimes ❤️ or 🤖.
Привет, как дела? Всё хорошо, спасибо. Ελληνικά: καλημέρα κόσμε.
Tokens per second and memory bandwidth are the numbers that matter for decoding speed.
The terminal user interface shows live counters for prefix hits and copied bytes.
Agents call tools, read the results, and continue the conversation with more context.
In the beginning the engine loads weights by memory mapping the safetensors files.
"""

CHATML_TEMPLATE = """\
{%- set ns = namespace(last_user=-1, system=none) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
    {%- if ns.system is not none %}{{- ns.system + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou can call these functions, described in <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
    {%- endfor %}
{{- '\\n</tools>\\n\\nAnswer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif ns.system is not none %}
{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('system message must come first') }}{% endif %}
        {%- continue %}
    {%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
{{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
{{- message.content | default('', true) }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson(sort_keys=true)) + '}\\n</tool_call>' }}
        {%- endfor %}
{{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}
    {%- else %}
{{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
{%- endif %}
{%- if not date_string is defined %}{% set date_string = '26 Jul 2024' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
{{- 'You have access to the following functions:\\n\\n' }}
    {%- for t in tools %}
{{- t | tojson(indent=4) }}
{{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
{{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
    {%- if message.tool_calls is defined %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}
        {%- endfor %}
{{- '<|eot_id|>' }}
    {%- else %}
        {%- set role = 'ipython' if message.role == 'tool' else message.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen3's handling of a reply's reasoning (its template, tools left out): the model writes `<think>...</think>` into
# its reply; the template keeps that block only for replies after the last user message, so rendering the next turn
# drops it from every earlier reply and changes text that earlier prompts were built from.
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_query_index = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
{{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
{{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "qwen3": QWEN3_TEMPLATE}


def train_backend(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE (GPT-2/Qwen style) whose total vocabulary is exactly `vocab_size`."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is below the {MIN_VOCAB_SIZE} fixed symbols")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 3, trainer)
    # the corpus runs out of merges near 930 tokens: pad with reserved special tokens, as real vocabularies do
    missing = vocab_size - len(ADDED_TOKENS) - tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tok.add_tokens(list(ADDED_TOKENS))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def make_tokenizer_dir(path: str | Path, template: str = "chatml", vocab_size: int = 320) -> Path:
    """Save a tokenizer (chat template in chat_template.jinja) plus generation_config.json into `path`."""
    from transformers import PreTrainedTokenizerFast  # test-only dependency

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = train_backend(vocab_size)
    if template in ("chatml", "qwen3"):
        tokens = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
        eos_ids = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    elif template == "llama3":
        tokens = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        eos_ids = [backend.token_to_id("<|eot_id|>"), backend.token_to_id("<|endoftext|>")]
    else:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    hf.chat_template = TEMPLATES[template]
    hf.save_pretrained(path)
    generation_config = {"eos_token_id": eos_ids, "bos_token_id": backend.token_to_id(SPECIAL_TOKENS[3])}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2), encoding="utf-8")
    return path


def tokenizer_vocab_size(path: str | Path) -> int:
    """Total vocabulary (added tokens included) of a directory written by `make_tokenizer_dir`."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
