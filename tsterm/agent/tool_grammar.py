"""Grammars of tool calls as the model's chat template writes them: Lark text the engine's llguidance masks by
(`SamplingParams.structured_outputs.grammar`), shared by the server (tsterm/server/tool_choice.py: tool_choice
required / named, strict functions under "auto") and agent sessions (`agent_grammar`, tsterm/agent/loop.py).

The call form is read off the template (`call_form`): the reply of one call and of two, rendered after a probe, gives
the open tag and what precedes the call's body, what follows it up to the close tag, the separator between two calls,
and the body: the JSON object `{"name", "arguments"}` (keys in the template's order, spaced as it spaces them), the
Qwen3-Coder XML form `<function=NAME><parameter=P>value</parameter></function>` (its layout), GLM-4.5's
`NAME<arg_key>P</arg_key><arg_value>value</arg_value>`, or MiniMax-M2's `<minimax:tool_call>` block of
`<invoke name="NAME"><parameter name="P">value</parameter></invoke>` (one invoke per block as the grammar writes it),
or a section of special-token calls whose name is written apart from its JSON arguments object (DeepSeek-V3's
`function<｜tool▁sep｜>NAME` + fenced JSON, V3.1's `NAME<｜tool▁sep｜>{...}`, Kimi-K2's
`functions.NAME:IDX<|tool_call_argument_begin|>{...}`; one call per section as the grammar writes it, the index any
digits). `call_rules` writes a `call` rule that allows, per tool, its name and arguments held to its JSON schema (llguidance's JSON schema support:
required keys, types, enums, bounds). Special tokens are named as llguidance's token references (`<[id]>`): a string
literal would never match one.

`agent_grammar` is the "auto" grammar of an agent turn: an optional reasoning block, free text, then any number of
well-formed calls of the offered tools only, each call's arguments valid against that tool's schema, in the
template's form. The reply may be text only; it may end (the engine's end-of-turn tokens, and the request's own stop
token ids) after its text or after a whole call, never inside one. Text can never spell the open tag (neither as the
tag's token nor piecewise in text), so everything the agent's parser reads as a call is a call the grammar wrote.

No Textual, no engine, no server here: this package sits below the server (tests/test_layers.py).
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from tsterm.agent.tool_calls import (_JSON_TYPES, CLOSE_TAG, DEEPSEEK_SEP, KIMI_ARGUMENTS, MINIMAX_OPEN, OPEN_TAG,
                                     SECTIONS, TAGS, TextDelta, ToolCall, ToolCallParser)
from tsterm.errors import TstermError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = [{"role": "user", "content": "?"}]


class TemplateTokens(Protocol):
    """What the builder reads: a tokenizer (its chat template, encode, decode) and which ids llguidance reads as
    special tokens (the server's ServerState has both; `ChatTokens` wraps a tokenizer)."""

    tokenizer: Any

    def special_token(self, token_id: int) -> bool: ...


class ChatTokens:
    """`TemplateTokens` over a tokenizer: `lltokenizer` is llguidance's view of it, given (an engine's, so it is built
    once per engine) or built from the tokenizer's tokenizer.json on first use (a fraction of a second)."""

    def __init__(self, tokenizer: Any, lltokenizer: Any = None):
        self.tokenizer = tokenizer
        self._lltokenizer = lltokenizer

    @property
    def lltokenizer(self) -> Any:
        if self._lltokenizer is None:
            import llguidance
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.to_json_str())
        return self._lltokenizer

    def special_token(self, token_id: int) -> bool:
        return self.lltokenizer.is_special_token(token_id)


class CallFormError(ValueError):
    """The chat template writes no tool call in a form the grammar follows; the message says why."""


@dataclasses.dataclass(frozen=True)
class CallForm:
    """How the chat template writes an assistant's tool calls, as Lark pieces: `open` (the open tag and what precedes
    the JSON), `close` (what follows it, up to the close tag), `separator` (between two calls), `keys` (the JSON
    object's keys in the template's order), `separators` (the JSON's item and key separators where the template
    writes them as json.dumps does, spaced or compact; None: any whitespace); `xml`: where the template writes the
    Qwen3-Coder XML form instead of JSON, its layout (`open` then ends before `<function=`, `close` starts at
    `</function>`; `keys` and `separators` are unused). `after_tag`: the text `open` holds after the open tag (what
    a grammar writes once the tag itself is out)."""

    open: str
    close: str
    separator: str
    keys: tuple[str, ...]
    separators: tuple[str, str] | None
    xml: XmlForm | None = None
    after_tag: str = ""
    open_tag: str = OPEN_TAG  # the text of the call block's open tag (MiniMax-M2's: <minimax:tool_call>)
    named: NamedForm | None = None  # a section of special-token calls: the name apart from the arguments


@dataclasses.dataclass(frozen=True)
class NamedForm:
    """A call whose name is written apart from its arguments object (DeepSeek's and Kimi's sections): Lark of what
    follows the name up to the object (`between`, Kimi's call index as any digits), and of what follows the object
    (`after`, before the call's end marker)."""

    between: str
    after: str


@dataclasses.dataclass(frozen=True)
class XmlForm:
    """The whitespace the template writes around the XML form's pieces: after `<function=NAME>`, after
    `<parameter=P>` (before the value), after the value (before `</parameter>`), after `</parameter>`; and how the
    form spells its pieces: the Qwen3-Coder form by default, GLM-4.5's (`NAME<arg_key>P</arg_key><arg_value>value
    </arg_value>`, `glm_form`) where its template writes that. `parameter_head` holds `{key}`, `function_head`
    `{name}`; `any_parameter` is the Lark of a parameter head of any name (a tool whose schema names none)."""

    after_name: str
    value_open: str
    value_close: str
    after_parameter: str
    function_head: str = "<function={name}>"
    parameter_head: str = "<parameter={key}>"
    parameter_close: str = "</parameter>"
    any_parameter: str = '"<parameter=" /[^>\\n]+/ ">"'


def glm_form(after_name: str, between: str, value_open: str, value_close: str, after_parameter: str) -> XmlForm:
    """GLM-4.5's spelling of the XML form; `between`: what its template writes between `</arg_key>` and
    `<arg_value>`."""
    return XmlForm(after_name, value_open, value_close, after_parameter, "{name}",
                   "<arg_key>{key}</arg_key>" + between + "<arg_value>", "</arg_value>",
                   '"<arg_key>" /[^<\\n]+/ ' + json.dumps("</arg_key>" + between + "<arg_value>"))


# the probe's call `a(a="x")` in the XML form, each layout gap captured
_XML_PROBE = re.compile(r"(\s*)<function=a>(\s*)<parameter=a>(\s*)x(\s*)</parameter>(\s*)(</function>\s*)")
# ... in MiniMax-M2's block (one <invoke> per block as the grammar writes it; the parser reads several)
_MINIMAX_PROBE = re.compile(r'(\s*)<invoke name="a">(\s*)<parameter name="a">(\s*)x(\s*)</parameter>(\s*)'
                            r'(</invoke>\s*)')
MINIMAX_SPELLING = dict(function_head='<invoke name="{name}">', parameter_head='<parameter name="{key}">',
                        any_parameter='"<parameter name=\\"" /[^"\\n]+/ "\\">"')
# ... and in GLM-4.5's form
_GLM_PROBE = re.compile(r"(\s*)a(\s*)<arg_key>a</arg_key>(\s*)<arg_value>(\s*)x(\s*)</arg_value>(\s*)")
# ... and in the sections of special-token calls: (what precedes the name, the name, what follows up to the JSON, the
# JSON, what follows it)
_SECTION_PROBES = (
    re.compile(r"(function" + re.escape(DEEPSEEK_SEP) + r")a(\s*```json\s*)(\{.*\})(\s*```\s*)", re.S),  # V3
    re.compile(r"(\s*)a(\s*" + re.escape(DEEPSEEK_SEP) + r"\s*)(\{.*\})(\s*)", re.S),  # V3.1
    re.compile(r"(\s*functions\.)a(:0" + re.escape(KIMI_ARGUMENTS) + r"\s*)(\{.*\})(\s*)", re.S))  # Kimi-K2
_EMPTY_THINK = re.compile(r"\A\s*<think>\s*</think>")  # GLM renders a past turn's empty reasoning before its calls


def call_form(tokens: TemplateTokens) -> CallForm:
    """Read off the template: the reply of one call and of two, rendered after a probe. A CallFormError says why
    when the template renders no call tsterm's parser reads."""
    tokenizer = tokens.tokenizer

    def reply(message: dict) -> str:
        try:
            return render(message)
        except TypeError:  # DeepSeek's templates concatenate the arguments as a JSON string
            for i, tool_call in enumerate(message["tool_calls"]):
                function = tool_call["function"]
                message["tool_calls"][i] = {**tool_call, "function": {**function,
                                                                      "arguments": json.dumps(function["arguments"])}}
            return render(message)

    def render(message: dict) -> str:
        head = list(tokenizer.apply_chat_template(_PROBE, tools=[], add_generation_prompt=True, tokenize=True))
        # a generation prompt that opens the reasoning (MiniMax-M2's) is continued by a reply with reasoning
        opened = prompt_opens_reasoning(tokens, head)
        reasoning = {"reasoning_content": "r"} if opened else {}
        ids = list(tokenizer.apply_chat_template(_PROBE + [{"role": "assistant", "content": "", **reasoning,
                                                            **message}], tools=[], add_generation_prompt=False,
                                                 tokenize=True))
        if ids[:len(head)] != head:
            raise CallFormError("the chat template renders an assistant reply that does not continue its generation "
                                "prompt")
        text = tokenizer.decode(ids[len(head):], skip_special_tokens=False)
        return text.split(THINK_CLOSE, 1)[1].lstrip() if opened and THINK_CLOSE in text else text

    def call(name: str, index: int) -> dict:  # Kimi-K2's template writes the id, its form functions.NAME:IDX
        return {"id": f"functions.{name}:{index}", "type": "function",
                "function": {"name": name, "arguments": {"a": "x"}}}

    try:
        one, two = reply({"tool_calls": [call("a", 0)]}), reply({"tool_calls": [call("a", 0), call("b", 1)]})
    except TstermError as e:
        raise CallFormError(f"the chat template failed to render a tool call ({e})") from e
    one, two = _EMPTY_THINK.sub("", one), _EMPTY_THINK.sub("", two)  # (a reply's own reasoning: `think_rules`)
    if not _renders_call(one, "a", {"a": "x"}):
        raise CallFormError("the chat template does not render an assistant tool call as a reply that begins with a "
                            "<tool_call> tsterm's parser reads")
    section = next((tag for tag in SECTIONS if tag in one), None)
    if section is not None:
        return _section_form(tokens, one, section)
    open_tag, close_tag = next((tags for tags in TAGS if tags[0] in one), (OPEN_TAG, CLOSE_TAG))
    start = one.index(open_tag)
    stop = one.index(close_tag, start)
    inner = one[start + len(open_tag):stop]
    block = one[start:stop + len(close_tag)]
    separator = "\n"
    if two.count(open_tag) == 2:
        after = two.index(block) + len(block)
        separator = two[after:two.index(open_tag, after)]
    separator_lark = lark(tokens, separator) if separator else '""'
    if open_tag == MINIMAX_OPEN:  # MiniMax-M2's block: the XML form with its own spelling, one <invoke> per block
        minimax = _MINIMAX_PROBE.fullmatch(inner)
        if minimax is None:
            raise CallFormError(f"the chat template writes a {MINIMAX_OPEN} block the call grammar does not follow "
                                '(it follows <invoke name="NAME"><parameter name="P">value</parameter></invoke>)')
        return CallForm(lark(tokens, open_tag + minimax.group(1)), lark(tokens, minimax.group(6) + close_tag),
                        separator_lark, (), None, XmlForm(*minimax.group(2, 3, 4, 5), **MINIMAX_SPELLING),
                        minimax.group(1), open_tag)
    glm = _GLM_PROBE.fullmatch(inner)
    if glm is not None:  # GLM-4.5's form: the name, then <arg_key>/<arg_value> pairs, no closing tag of its own
        return CallForm(lark(tokens, OPEN_TAG + glm.group(1)), lark(tokens, CLOSE_TAG), separator_lark, (), None,
                        glm_form(*glm.group(2, 3, 4, 5, 6)), glm.group(1))
    xml = _XML_PROBE.fullmatch(inner)
    if xml is not None:  # the Qwen3-Coder XML form
        return CallForm(lark(tokens, OPEN_TAG + xml.group(1)), lark(tokens, xml.group(6) + CLOSE_TAG), separator_lark,
                        (), None, XmlForm(*xml.group(2, 3, 4, 5)), xml.group(1))
    first, last = inner.find("{"), inner.rfind("}") + 1
    try:
        written = json.loads(inner[first:last])
    except ValueError:
        written = {}
    keys = tuple(written)
    separators = next((pair for pair in ((", ", ": "), (",", ":"))
                       if json.dumps(written, separators=pair) == inner[first:last]), None)
    if first < 0 or set(keys) != {"name", "arguments"}:
        raise CallFormError("the chat template writes a call neither as the JSON object {\"name\", \"arguments\"} "
                            "nor in the XML form <function=NAME><parameter=P>")
    head, tail = one[start:start + len(OPEN_TAG) + first], inner[last:] + CLOSE_TAG
    return CallForm(lark(tokens, head), lark(tokens, tail), separator_lark, keys, separators,
                    after_tag=head[len(OPEN_TAG):])


def _section_form(tokens: TemplateTokens, one: str, section: str) -> CallForm:
    """The form of a section of special-token calls (DeepSeek-V3 / V3.1, Kimi-K2), read off the reply of one call;
    the grammar writes one call per section, sections one after another as the parser reads them."""
    section_close, call_open, call_close = SECTIONS[section]
    start = one.index(section)
    head = one[start:].split(call_close, 1)[0]
    if not head.startswith(section) or call_open not in head or section_close not in one[start:]:
        raise CallFormError(f"the chat template writes a {section} section the call grammar does not follow (it "
                            f"follows {section}{call_open}...{call_close}{section_close})")
    gap, body = head[len(section):].split(call_open, 1)
    probe = next((m for m in (p.fullmatch(body) for p in _SECTION_PROBES) if m is not None), None)
    if probe is None or gap.strip():
        raise CallFormError(f"the chat template writes a {section} call the call grammar does not follow (it follows "
                            f"DeepSeek's function{DEEPSEEK_SEP}NAME + fenced JSON or NAME{DEEPSEEK_SEP}{{...}}, and "
                            f"Kimi-K2's functions.NAME:IDX{KIMI_ARGUMENTS}{{...}})")
    before, between, written, after = probe.group(1, 2, 3, 4)
    tail = one[start:].split(call_close, 1)[1]
    closing = tail[:tail.index(section_close) + len(section_close)] if section_close in tail else ""
    if closing.strip() != section_close:
        raise CallFormError(f"the chat template writes text between a call's {call_close} and {section_close}")
    if between.startswith(":0"):  # Kimi's index: any digits
        between_lark = '":" /[0-9]+/ ' + lark(tokens, between[2:])
    else:
        between_lark = lark(tokens, between) if between else ""
    separators = next((pair for pair in ((", ", ": "), (",", ":"))
                       if json.dumps(json.loads(written), separators=pair) == written), None)
    separator = "\n"  # sections one after another, as the parser reads them
    opening = section + gap + call_open + before
    return CallForm(lark(tokens, opening), lark(tokens, after + call_close + closing), lark(tokens, separator),
                    ("arguments",), separators, None, opening[len(section):], section,
                    NamedForm(between_lark, ""))


def call_rules(form: CallForm, parameters: Mapping[str, dict]) -> list[str]:
    """Lark rules of `call` (the body between `form.open` and `form.close`): per tool named in `parameters`, its name
    and its arguments held to the schema given for it."""
    if form.named is not None:
        return _named_call_rules(form, parameters)
    return _xml_call_rules(form.xml, parameters) if form.xml else _json_call_rules(form, parameters)


def _named_call_rules(form: CallForm, parameters: Mapping[str, dict]) -> list[str]:
    """Lark rules of `call` where the name is written apart from the arguments: per allowed tool, its name, what the
    template writes between, and the arguments object held to the tool's schema."""
    rules = ["call: " + " | ".join(f"fn_{i}" for i in range(len(parameters)))]
    for i, (name, schema) in enumerate(parameters.items()):
        schema = dict(schema)
        if form.separators is not None:
            schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": form.separators[0],
                                    "key_separator": form.separators[1]}
        rules.append(f"fn_{i}: {json.dumps(name)} {form.named.between} args_{i}".replace("  ", " "))
        rules.append(f"args_{i}: %json " + json.dumps(schema))
    return rules


def _json_call_rules(form: CallForm, parameters: Mapping[str, dict]) -> list[str]:
    """Lark rules of `call` in the JSON form: one object {"name", "arguments"} per allowed tool, its arguments held to
    the tool's `parameters`."""
    schemas = []
    for name, schema in parameters.items():
        properties = {"name": {"const": name}, "arguments": schema}
        schemas.append({"type": "object", "properties": {k: properties[k] for k in form.keys},
                        "required": list(form.keys), "additionalProperties": False})
    whole = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if form.separators is not None:  # the JSON spaced as the template writes it (what the model learned)
        whole["x-guidance"] = {"whitespace_flexible": False, "item_separator": form.separators[0],
                               "key_separator": form.separators[1]}
    return ["call: %json " + json.dumps(whole)]


def _xml_call_rules(xml: XmlForm, parameters: Mapping[str, dict]) -> list[str]:
    """Lark rules of `call` in the XML form: per allowed tool, `<function=NAME>` then its parameters in the schema's
    order (the required ones required), each `<parameter=P>` + its value + `</parameter>`, laid out as the template
    writes them. A string parameter's value is any text without `</parameter>` (the parser ends it at the first);
    another type's is JSON of its schema (the parser reads such values as JSON). A tool whose schema declares no
    properties takes any parameters, each a free value."""
    close = xml.parameter_close
    free = "/(?s:.*)" + _regex(xml.value_close + close) + "/ & ~/(?s:.*)" + _regex(close) + "(?s:.+)/"
    rules = ["call: " + " | ".join(f"fn_{i}" for i in range(len(parameters))),
             f"FREE_VALUE: {free}"]
    for i, (name, schema) in enumerate(parameters.items()):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, sub) in enumerate(properties.items()):
            head = json.dumps(xml.parameter_head.format(key=key) + xml.value_open)
            after = json.dumps(xml.after_parameter)
            if _free_text(sub):
                rules.append(f"p_{i}_{j}: {head} FREE_VALUE {after}")
            else:
                rules.append(f"p_{i}_{j}: {head} v_{i}_{j} " + json.dumps(xml.value_close + close)
                             + f" {after}")
                rules.append(f"v_{i}_{j}: %json " + json.dumps(sub))
            parts.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
        if not properties:
            parts.append(f"({xml.any_parameter} {json.dumps(xml.value_open)} FREE_VALUE "
                         f"{json.dumps(xml.after_parameter)})*")
        rules.append(f"fn_{i}: " + json.dumps(xml.function_head.format(name=name) + xml.after_name) + " "
                     + " ".join(parts))
    return rules


def _free_text(schema: Any) -> bool:
    """A parameter whose value the parser takes as text (tsterm/agent/tool_calls.py `_convert`): a string, or no
    single JSON type."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    return not types or "string" in types or not set(types) <= _JSON_TYPES


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in text)


def think_rules(tokens: TemplateTokens, opened: bool) -> tuple[str, ...]:
    """Lark rules of `think`: a reasoning block before the calls; where the prompt `opened` it, its rest (required),
    otherwise an optional `<think>...</think>`."""
    opening = "" if opened else lark(tokens, THINK_OPEN) + " "
    closing = lark(tokens, THINK_CLOSE)
    optional = "" if opened else "?"
    if closing.startswith("<[") and " " not in closing:  # one special token: no text holds it, any text precedes it
        return (f"think: ({opening}/(?s:.*)/ {closing} /\\n{{0,2}}/){optional}",)
    # text: the reasoning ends at the close tag's first occurrence (llguidance's stop, which consumes it)
    return (f"think: ({opening}think_text /\\n{{0,2}}/){optional}",
            f"think_text[stop={json.dumps(THINK_CLOSE)}]: /(?s:.*)/")


def prompt_opens_reasoning(tokens: TemplateTokens, prompt_ids: Sequence[int]) -> bool:
    """Whether the generation prompt leaves a `<think>` block open (the reply then finishes it first)."""
    tail = tokens.tokenizer.decode(list(prompt_ids[-32:]), skip_special_tokens=False)
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def lark(tokens: TemplateTokens, text: str) -> str:
    """`text` as a Lark sequence: its special tokens as llguidance's token references (`<[id]>`; a literal would
    never match them), the rest as string literals."""
    tokenizer, special = tokens.tokenizer, tokens.special_token
    pieces, run = [], []
    for token_id in tokenizer.encode(text):
        if special(token_id):
            if run:
                pieces.append(json.dumps(tokenizer.decode(run, skip_special_tokens=False)))
                run = []
            pieces.append(f"<[{token_id}]>")
        else:
            run.append(token_id)
    if run:
        pieces.append(json.dumps(tokenizer.decode(run, skip_special_tokens=False)))
    return " ".join(pieces) or '""'


def _renders_call(reply: str, name: str, arguments: dict) -> bool:
    parser = ToolCallParser(None)
    events = parser.feed(reply) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    before = events[:events.index(calls[0])] if calls else []
    return bool(calls) and calls[0].ok and calls[0].name == name and calls[0].arguments == arguments and \
        not "".join(e.text for e in before if isinstance(e, TextDelta)).strip()


# ---- agent turns


def tool_parameters(specs: Iterable[Mapping[str, Any]]) -> dict[str, dict]:
    """Each offered tool's name -> its parameters schema (OpenAI-style specs, `{"type": "function", "function":
    {...}}` or the inner dict; a tool without one takes any object)."""
    parameters = {}
    for spec in specs:
        function = spec.get("function", spec)
        schema = function.get("parameters")
        parameters[function["name"]] = dict(schema) if isinstance(schema, Mapping) else {"type": "object"}
    return parameters


def agent_grammar(tokens: TemplateTokens, form: CallForm, parameters: Mapping[str, dict], *, opened: bool = False,
                  stop_token_ids: Iterable[int] = ()) -> str:
    """The Lark grammar of an agent turn (see the module's docstring): `parameters`, each offered tool's schema;
    `opened`: the generation prompt left a reasoning block open (the reply finishes it first; otherwise it may open
    with one); `stop_token_ids`: the request's own stop tokens, allowed wherever the reply may end (the engine's eos
    tokens are, by the engine)."""
    no_tag = _regex(form.open_tag)
    text = f"/(?s:.*)/ & ~/(?s:.*){no_tag}(?s:.*)/"  # any text that does not spell the open tag
    open_tag = lark(tokens, form.open_tag)
    special_tag = open_tag.startswith("<[") and " " not in open_tag
    lines = [f"TEXT: {text}", f"tc: {form.open} call {form.close}", *call_rules(form, parameters)]
    calls = f"tc ({form.separator} tc)*"
    if special_tag:  # the tag is a token text cannot hold: text, then the calls
        body = f"TEXT | TEXT {calls}"
    else:  # a text tag: the text before the first call ends where the tag is written (llguidance's stop consumes it)
        after = lark(tokens, form.after_tag) if form.after_tag else ""
        body = f"TEXT | text_to_tag {after} call {form.close} ({form.separator} tc)*".replace("  ", " ")
        lines.append(f"text_to_tag[stop={json.dumps(form.open_tag)}]: /(?s:.*)/")
    opening = "" if opened else lark(tokens, THINK_OPEN) + " "
    closing = lark(tokens, THINK_CLOSE)
    if closing.startswith("<[") and " " not in closing:  # one special token: the reasoning is any text before it
        lines.append(f"think: {opening}TEXT {closing}")
    else:  # a text close tag: the reasoning ends at its first occurrence
        lines += [f"think: {opening}think_text", f"think_text[stop={json.dumps(THINK_CLOSE)}]: {text}"]
    stops = sorted(set(stop_token_ids))
    end = " end?" if stops else ""
    if stops:
        lines.append("end: " + " | ".join(f"<[{i}]>" for i in stops))
    lines.insert(0, f"start: think body{end}" if opened else f"start: think? body{end}")
    lines.insert(1, f"body: {body}")
    return "\n".join(lines)
