"""In-house chat templates of the reasoning-model families, and a small tokenizer for each, for the history-policy
tests (tsterm/chat/history.py). Written here from each family's documented prompt format, trimmed to what the tests
use (no tool schemas, no vision); what matters is kept faithfully: the role and end markers, how a reply's reasoning
is kept or dropped once it is history, tool calls and tool results, and the generation prompt.

- qwen3: ChatML. `<think>` kept only for replies after the last user message; reasoning from `reasoning_content` or
  parsed out of the content; consecutive tool messages grouped into one user turn of `<tool_response>` blocks.
- deepseek-r1: every earlier reply loses its reasoning (content after `</think>`); the generation prompt opens
  `<think>\\n`; tool calls and outputs in DeepSeek's `<｜tool▁…｜>` markers.
- glm-4.5: `<|assistant|>\\n<think>…</think>` only for replies after the last user message (or for all with
  `clear_thinking=false`), else an empty `<think></think>`; the model stops by writing the next role token
  (`<|observation|>` before tool results, `<|user|>` after an answer).
- gpt-oss: harmony. The analysis channel is kept only after the last user message; a tool call is its own
  `commentary to=functions.NAME` message ending `<|call|>`; a final answer generated with `<|return|>` is history as
  `<|end|>`.
- minimax-m2: interleaved thinking: `<think>` kept for every reply after the last user message (across tool calls),
  dropped before it; the generation prompt opens `<think>\\n`; `]~b]role … [e~[` framing.

`FAMILIES[name].reply(reasoning, content, calls)` gives the assistant message an API client would send back and the
text the model generated for it (after the generation prompt, through its stop token).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.helpers.tokenizers import CORPUS
from tsterm.tokenizer import Tokenizer

QWEN3_AGENT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}
{{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if messages[0].role == 'system' else '') }}
{{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
    {%- elif m.role == 'user' %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content | default('', true) %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
{{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
{{- content }}
        {%- for call in m.tool_calls | default([]) %}
            {%- if not loop.first or content %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
{{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

DEEPSEEK_R1_TEMPLATE = """\
{{- bos_token }}
{%- for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% endif %}{% endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
{{- '<｜User｜>' + m.content }}
    {%- elif m.role == 'assistant' %}
{{- '<｜Assistant｜>' + (m.content | default('', true)).split('</think>')[-1].lstrip('\\n') }}
        {%- if m.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
            {%- for call in m.tool_calls %}
{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' }}
{{- (call.function.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' }}
            {%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
    {%- elif m.role == 'tool' %}
        {%- if messages[loop.index0 - 1].role != 'tool' %}{{ '<｜tool▁outputs▁begin｜>' }}{% endif %}
{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}
"""

GLM45_TEMPLATE = """\
{{- '[gMASK]<sop>' }}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- set keep_all = clear_thinking is defined and clear_thinking is false %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
{{- '<|system|>\\n' + m.content }}
    {%- elif m.role == 'user' %}
{{- '<|user|>\\n' + m.content }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content | default('', true) %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
{{- '<|assistant|>' }}
        {%- if (keep_all or loop.index0 > ns.last_user) and reasoning %}
{{- '\\n<think>' + reasoning.strip() + '</think>' }}
        {%- else %}
{{- '\\n<think></think>' }}
        {%- endif %}
        {%- if content.strip() %}{{ '\\n' + content.strip() }}{% endif %}
        {%- for call in m.tool_calls | default([]) %}
{{- '\\n<tool_call>' + call.function.name }}
            {%- for key, value in call.function.arguments.items() %}
{{- '\\n<arg_key>' + key + '</arg_key>\\n<arg_value>' }}
{{- (value if value is string else value | tojson) + '</arg_value>' }}
            {%- endfor %}
{{- '\\n</tool_call>' }}
        {%- endfor %}
    {%- elif m.role == 'tool' %}
        {%- if messages[loop.index0 - 1].role != 'tool' %}{{ '<|observation|>' }}{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}
"""

HARMONY_TEMPLATE = """\
{%- set ns = namespace(last_user=-1, system='You are a helpful assistant.') %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}
{%- endfor %}
{{- '<|start|>system<|message|>' + ns.system + '<|end|>' }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
    {%- elif m.role == 'assistant' %}
        {%- set recent = loop.index0 > ns.last_user %}
        {%- if m.tool_calls %}
            {%- if m.thinking and m.content %}
{{- raise_exception('a tool call carries its analysis in content or thinking, not both') }}
            {%- endif %}
            {%- set analysis = m.thinking or m.content %}
            {%- if recent and analysis %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' }}
            {%- endif %}
            {%- for call in m.tool_calls %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name + ' <|constrain|>json<|message|>' }}
{{- (call.function.arguments | tojson) + '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {%- if recent and m.thinking %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}
            {%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
        {%- endif %}
    {%- elif m.role == 'tool' %}
{{- '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}
"""

MINIMAX_M2_TEMPLATE = """\
{%- set ns = namespace(last_user=-1, system='You are a helpful assistant.') %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}
{%- endfor %}
{{- ']~!b[]~b]system\\n' + ns.system + '[e~[\\n' }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
{{- ']~b]user\\n' + m.content + '[e~[\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content | default('', true) %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
{{- ']~b]ai\\n' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
        {%- endif %}
{{- content }}
        {%- if m.tool_calls %}
{{- '\\n<minimax:tool_call>\\n' }}
            {%- for call in m.tool_calls %}
{{- '<invoke name="' + call.function.name + '">\\n' }}
                {%- for key, value in call.function.arguments.items() %}
{{- '<parameter name="' + key + '">' + (value if value is string else value | tojson) + '</parameter>\\n' }}
                {%- endfor %}
{{- '</invoke>\\n' }}
            {%- endfor %}
{{- '</minimax:tool_call>' }}
        {%- endif %}
{{- '[e~[\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if messages[loop.index0 - 1].role != 'tool' %}{{ ']~b]tool' }}{% endif %}
{{- '\\n<response>' + m.content + '</response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '[e~[\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ ']~b]ai\\n<think>\\n' }}{% endif %}
"""

Call = tuple[str, dict]  # (function name, arguments)


def _calls(calls: list[Call]) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]


def _message(reasoning: str, content: str, calls: list[Call]) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return {**message, "tool_calls": _calls(calls)} if calls else message


def _qwen3_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    tags = "".join(("\n" if i or content else "") + '<tool_call>\n{"name": "' + name + '", "arguments": '
                   + json.dumps(args, ensure_ascii=False) + "}\n</tool_call>" for i, (name, args) in enumerate(calls))
    return _message(reasoning, content, calls), f"<think>\n{reasoning}\n</think>\n\n{content}{tags}<|im_end|>"


def _qwen3_raw_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    """How tsterm's own agent sessions keep a reply: the model's raw text (reasoning and tool-call tags included)."""
    _, generated = _qwen3_reply(reasoning, content, calls)
    return {"role": "assistant", "content": generated.removesuffix("<|im_end|>")}, generated


def _r1_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    tags = "".join("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name + "\n```json\n"
                   + json.dumps(args, ensure_ascii=False) + "\n```<｜tool▁call▁end｜>" for name, args in calls)
    tags = f"<｜tool▁calls▁begin｜>{tags}<｜tool▁calls▁end｜>" if calls else ""
    return _message(reasoning, content, calls), f"{reasoning}\n</think>\n\n{content}{tags}<｜end▁of▁sentence｜>"


def _glm_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    tags = "".join("\n<tool_call>" + name + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>"
                                                   for k, v in args.items()) + "\n</tool_call>" for name, args in calls)
    text = f"\n<think>{reasoning}</think>" + (f"\n{content}" if content else "") + tags
    return _message(reasoning, content, calls), text + ("<|observation|>" if calls else "<|user|>")


def _harmony_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    message = {"role": "assistant", "content": content, "thinking": reasoning}
    text = f"<|channel|>analysis<|message|>{reasoning}<|end|>"
    if calls:
        (name, args), = calls  # harmony: one call per message, and <|call|> stops the generation
        text += (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                 f"{json.dumps(args, ensure_ascii=False)}<|call|>")
        return {**message, "tool_calls": _calls(calls)}, text
    return message, text + f"<|start|>assistant<|channel|>final<|message|>{content}<|return|>"


def _minimax_reply(reasoning: str, content: str, calls: list[Call]) -> tuple[dict, str]:
    tags = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n'
                                                          for k, v in args.items()) + "</invoke>\n"
                   for name, args in calls)
    tags = f"\n<minimax:tool_call>\n{tags}</minimax:tool_call>" if calls else ""
    return _message(reasoning, content, calls), f"{reasoning}\n</think>\n\n{content}{tags}[e~["


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special: tuple[str, ...]  # special tokens (the first of `stops` is the eos token)
    added: tuple[str, ...]  # added, not special (decode keeps them, like Qwen's <think>)
    stops: tuple[str, ...]  # tokens that end a reply (generation_config's eos_token_id)
    reply: Callable[[str, str, list[Call]], tuple[dict, str]]
    bos: str | None = None
    calls_per_message: int = 8


THINK = ("<think>", "</think>")
FAMILIES = {f.name: f for f in [
    Family("qwen3", QWEN3_AGENT_TEMPLATE, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
           (*THINK, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
           ("<|im_end|>", "<|endoftext|>"), _qwen3_reply),
    Family("qwen3-raw", QWEN3_AGENT_TEMPLATE, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
           (*THINK, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
           ("<|im_end|>", "<|endoftext|>"), _qwen3_raw_reply),
    Family("deepseek-r1", DEEPSEEK_R1_TEMPLATE,
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
           THINK, ("<｜end▁of▁sentence｜>",), _r1_reply, bos="<｜begin▁of▁sentence｜>"),
    Family("glm-4.5", GLM45_TEMPLATE,
           ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
           (*THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
            "<tool_response>", "</tool_response>"),
           ("<|endoftext|>", "<|user|>", "<|observation|>"), _glm_reply),
    Family("gpt-oss", HARMONY_TEMPLATE,
           ("<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
            "<|endoftext|>"),
           (), ("<|return|>", "<|call|>", "<|endoftext|>"), _harmony_reply, calls_per_message=1),
    Family("minimax-m2", MINIMAX_M2_TEMPLATE, ("[e~[", "]~!b[", "]~b]"),
           (*THINK, "<minimax:tool_call>", "</minimax:tool_call>"), ("[e~[",), _minimax_reply),
]}


def family_tokenizer(family: Family, vocab_size: int = 420) -> Tokenizer:
    """A byte-level BPE trained on the helpers' corpus, with the family's special and added tokens, its template and
    its stop tokens as tsterm loads them."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(family.added), special_tokens=list(family.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    backend.train_from_iterator(CORPUS.splitlines() * 3, trainer)
    if family.added:
        backend.add_tokens(list(family.added))
    config = {"eos_token": family.stops[0], **({"bos_token": family.bos} if family.bos else {})}
    generation_config = {"eos_token_id": [backend.token_to_id(t) for t in family.stops]}
    return Tokenizer(backend, config, generation_config=generation_config,
                     chat_templates={"default": family.template}, model_dir=f"<{family.name}>")
