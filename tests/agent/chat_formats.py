"""Small chat templates that write assistant turns as GLM-4.5 / 4.6's, MiniMax-M2's, DeepSeek-V3 / V3.1's and
Kimi-K2's published templates do (their
tokenizer files are not available offline): the reasoning block, the text, the tool calls in the family's format, and
the generation prompt. Rendered with transformers' own Jinja environment (`render`)."""
from __future__ import annotations

GLM45 = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = m.reasoning_content if m.reasoning_content is string else '' %}
{%- set content = m.content or '' %}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- if content.strip() %}
{{ '\\n' + content.strip() }}
{%- endif %}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""

MINIMAX_M2 = """{%- set toolcall_begin_token = '<minimax:tool_call>' -%}
{%- set toolcall_end_token = '</minimax:tool_call>' -%}
]~!b[]~b]system
You are a helpful assistant.
{%- if tools %}

# Tools
You may call one or more tools to assist with the user query.
Here are the tools available in JSONSchema format:

<tools>
{% for tool in tools %}
<tool>{{ tool.function | tojson(ensure_ascii=False) }}</tool>
{% endfor %}
</tools>

When making tool calls, use XML format to invoke tools and pass parameters:

{{ toolcall_begin_token }}
<invoke name="tool-name-1">
<parameter name="param-key-1">param-value-1</parameter>
<parameter name="param-key-2">param-value-2</parameter>
...
</invoke>
{{ toolcall_end_token }}
{%- endif %}
[e~[
{% for message in messages %}
{%- if message.role == 'user' %}
]~b]user
{{ message.content }}[e~[
{% elif message.role == 'assistant' %}
{{- ']~b]ai' ~ '\\n' }}
{%- if message.reasoning_content %}
{{- '<think>' ~ '\\n' ~ message.reasoning_content ~ '\\n' ~ '</think>' ~ '\\n\\n' }}
{%- endif %}
{%- if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}
{{ '\\n' ~ toolcall_begin_token ~ '\\n' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<invoke name="' + tool_call.name + '">' }}
{% set _args = tool_call.arguments %}
{%- for k, v in _args.items() %}
{{- '<parameter name="' + k + '">' }}{{- v | tojson(ensure_ascii=False) if v is not string else v }}{{- '</parameter>' }}
{% endfor %}
{{- '</invoke>' ~ '\\n' }}
{%- endfor %}
{{- toolcall_end_token }}
{%- endif %}[e~[
{% elif message.role == 'tool' %}
]~b]tool
<response>{{ message.content }}</response>[e~[
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
]~b]ai
<think>
{% endif %}"""

# DeepSeek-V3 (0324) / R1-0528: calls as `function<｜tool▁sep｜>NAME` and a fenced JSON block, in one
# <｜tool▁calls▁begin｜> section; the arguments are concatenated as a JSON string, as the published template does
DEEPSEEK_V3 = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='') %}
{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}\
{%- endif %}{%- endfor %}
{{- bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}
{%- endif %}
{%- if message['role'] == 'assistant' and 'tool_calls' in message %}
{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}
{%- for tool in message['tool_calls'] %}
{%- if not ns.is_first %}
{%- if message['content'] is none %}
{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + \
tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + \
'<｜tool▁call▁end｜>'}}
{%- else %}
{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + \
'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + \
'```' + '<｜tool▁call▁end｜>'}}
{%- endif %}
{%- set ns.is_first = true -%}
{%- else %}
{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + \
'\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}
{%- endif %}
{%- endfor %}
{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
{%- endif %}
{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}
{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}\
{%- set ns.is_tool = false -%}
{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}
{%- endif %}
{%- if message['role'] == 'tool' %}
{%- set ns.is_tool = true -%}
{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
{%- endif %}
{%- endfor -%}
{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}
{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"""

# DeepSeek-V3.1: `NAME<｜tool▁sep｜>{...}` with no type and no fence; the generation prompt opens the reasoning
# (`thinking=True`) or closes it; a past turn's reasoning is not kept
DEEPSEEK_V31 = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% if not thinking is defined %}{% set thinking = false %}{% endif %}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_last_user=false) %}
{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}\
{%- endif %}{%- endfor %}
{{- bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}\
{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}
{%- endif %}
{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}
{%- if ns.is_last_user %}{{'<｜Assistant｜></think>'}}{%- endif %}
{%- set ns.is_last_user = false -%}{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}
{%- for tool in message['tool_calls'] %}
{%- if not ns.is_first %}
{%- if message['content'] is none %}
{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + \
tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
{%- else %}
{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + \
tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
{%- endif %}
{%- set ns.is_first = true -%}
{%- else %}
{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + \
'<｜tool▁call▁end｜>'}}
{%- endif %}
{%- endfor %}
{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
{%- endif %}
{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) %}
{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}{{'</think>'}}{%- endif %}
{%- set ns.is_last_user = false -%}
{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}
{%- else %}{% set content = message['content'] %}{%- if '</think>' in content %}\
{%- set content = content.split('</think>', 1)[1] -%}{%- endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}
{%- endif %}
{%- if message['role'] == 'tool' %}
{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}
{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
{%- endif %}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool %}
{%- if not thinking %}{{'<｜Assistant｜></think>'}}{%- else %}{{'<｜Assistant｜><think>'}}{%- endif %}
{% endif %}"""

# Kimi-K2-Instruct: calls as `<|tool_call_begin|>ID<|tool_call_argument_begin|>{...}<|tool_call_end|>` where ID is the
# call's id, which Kimi writes functions.NAME:IDX; the arguments as given (a string) or tojson
KIMI_K2 = """{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}
  {%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>
  {%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
  {%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] \
is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}\
{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}\n{{ message['content'] }}
  {%- elif message['content'] is string -%}
    {{ message['content'] }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

TEMPLATES = {"glm4_moe": GLM45, "minimax_m2": MINIMAX_M2, "deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31,
             "kimi_k2": KIMI_K2}


def render(template: str, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template, **kwargs)
    return rendered[0]


def assistant_reply(template: str, message: dict, tools: list[dict] | None = None) -> str:
    """What the model writes for `message` (the rendered conversation after its generation prompt), as the family's
    template renders it, up to its end-of-turn marker."""
    user = [{"role": "user", "content": "?"}]
    head = render(template, user, tools, add_generation_prompt=True)
    whole = render(template, user + [{"role": "assistant", **message}], tools)
    prompt_end = head.rsplit("<think>", 1)[0] if head.rstrip().endswith("<think>") else head  # MiniMax opens it
    prompt_end = prompt_end.removesuffix("<｜Assistant｜></think>")  # DeepSeek-V3.1 writes them with the reply
    prompt_end = prompt_end.removesuffix("<｜Assistant｜>")
    assert whole.startswith(prompt_end), (head, whole)
    reply = whole[len(prompt_end):]
    for marker in ("<|assistant|>", "]~b]ai\n", "<｜Assistant｜></think>", "<｜Assistant｜>",
                   "<|im_assistant|>assistant<|im_middle|>"):
        reply = reply[len(marker):] if reply.startswith(marker) else reply
    for end in ("[e~[", "<｜end▁of▁sentence｜>", "<|im_end|>"):
        reply = reply.split(end)[0]
    return reply


# ---- the tools the format tests offer, and reading a reply with tsterm's parser

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"], "additionalProperties": False}}}
EDIT = {"type": "function", "function": {
    "name": "edit", "description": "Edit a file.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}, "dry_run": {"type": "boolean"},
        "options": {"type": "object"}, "ranges": {"type": "array", "items": {"type": "integer"}}},
        "required": ["path"]}}}
TOOLS = [READ_FILE, EDIT]


def parse(text: str, tools=TOOLS, chunks: list[int] | None = None) -> list:
    """`text` fed to a ToolCallParser in pieces of `chunks` characters (the rest in one), then finished."""
    from tsterm.agent.tool_calls import ToolCallParser

    parser = ToolCallParser(tools)
    events, position = [], 0
    for size in chunks or [len(text)]:
        events += parser.feed(text[position:position + size])
        position += size
    events += parser.feed(text[position:]) + parser.finish()
    return events


def calls_of(events) -> list:
    from tsterm.agent.tool_calls import ToolCall

    return [e for e in events if isinstance(e, ToolCall)]


def rebuilt(events) -> str:
    """The reply again from its events: the text deltas and the calls' raw text."""
    from tsterm.agent.tool_calls import TextDelta

    return "".join(e.text if isinstance(e, TextDelta) else e.raw for e in events)
