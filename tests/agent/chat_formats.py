"""Small chat templates that write assistant turns as GLM-4.5 / 4.6's and MiniMax-M2's published templates do (their
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

TEMPLATES = {"glm4_moe": GLM45, "minimax_m2": MINIMAX_M2}


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
    assert whole.startswith(prompt_end), (head, whole)
    reply = whole[len(prompt_end):]
    for marker in ("<|assistant|>", "]~b]ai\n"):
        reply = reply[len(marker):] if reply.startswith(marker) else reply
    return reply.split("[e~[")[0]
