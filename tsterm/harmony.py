"""gpt-oss's harmony format, below the agent: a conversation rendered as a harmony prompt, the model's turn split into
its messages and channels, and the choice of which models write it. The offline API (`tsterm.llm.LLM.chat`) renders
and reads harmony with this module; the agent loop, the server and the chat paths do too, through
`tsterm.agent.harmony` (which adds the tool-call checking, the turn grammar and the chat views' reader on top).

A turn (what the model writes after the prompt's `<|start|>assistant`) is one or more messages:

    [<|start|>assistant]HEADER<|message|>CONTENT(<|end|> | <|call|> | <|return|>)

The header holds the channel (`<|channel|>analysis`, `commentary` or `final`), a recipient (`to=functions.NAME`, before
or after the channel) and the content type of a call (`<|constrain|>json`, or a bare `json`). The first message of a
turn has no `<|start|>assistant` (the prompt wrote it). What each message is:

- `analysis`: reasoning;
- `commentary` to `functions.NAME`: a tool call, its content the JSON arguments, ended by `<|call|>`;
- `final`, or `commentary` with no recipient (a preamble the user may see): the answer's text;
- a message to another recipient (a built-in tool): not shown.

`HarmonyStream.feed(delta)` returns the pieces the delta completes: `Content` (a message's content, streamed; its
`header`), `Ended` (a message's end marker, or None where `finish()` cut it, with the message's `raw` text and whole
`content`) and `Loose` (text that never reached a `<|message|>`: a reply that is not harmony at all, released by
`finish()`). A marker split across deltas is held back until it is whole. `read_reply` reads a whole reply's ids
into its reasoning and its answer (`HarmonyText`).

Which models write harmony is `is_harmony`'s choice (the model type `gpt_oss`, or a vocabulary that holds harmony's
markers `<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|call|>` and `<|return|>`), the one choice every path
makes. A harmony turn's markers are special tokens, which the engine's text leaves out: `TurnText` decodes the turn's
ids with them.

Prompts are rendered by tsterm (`render`, or `HarmonyChat`: a tokenizer whose `apply_chat_template` is `render`), as
the `openai-harmony` package renders a conversation (vLLM renders gpt-oss prompts with that package too), not through
the checkpoint's Jinja template, which departs from the format in two places: it writes a call's header without
`<|constrain|>` and JSON-encodes every tool result (a string result arrives quoted). What `render` writes:

- a system message (`model_identity`, knowledge cutoff 2024-06, `conversation_start_date` (default: today, as the
  checkpoint's template writes it; "" leaves the line out), `Reasoning: {reasoning_effort}` (low / medium / high,
  default medium), the valid channels, and the `functions` channel rule when tools are offered);
- a developer message with the first system or developer message as `# Instructions` and the tools as the
  `functions` namespace of TypeScript types (harmony's own rendering of a JSON schema: descriptions, defaults,
  enums, examples, nested objects); a later system or developer message is a developer message where it stands;
- an assistant message as its messages: its reasoning (`reasoning_content`, `thinking` or `reasoning`) on the
  analysis channel, then either its content on the final channel, or its content as a commentary preamble and each
  tool call as a commentary message `to=functions.NAME <|constrain|>json` ended by `<|call|>` (arguments given as text
  are written verbatim, an object as compact JSON);
- a tool result as a message from `functions.NAME` (its `name`, else the name of the call its `tool_call_id` names)
  to the assistant on the commentary channel.

Reasoning is dropped as the checkpoint's template drops it: a final answer's always, a tool call's once a final
answer follows it; so a tool loop in progress keeps its reasoning, and a new user turn after an answer finds none.
(openai-harmony 0.0.8 drops analysis only before the conversation's first final message, and only when the last
assistant message is final; the two agree but in multi-turn conversations with reasoning in a later turn.)
A final answer ends `<|end|>` once it is history (the model wrote `<|return|>`), which is what
`tsterm.chat.history`'s `preserve` policy rewrites in the kept ids; everything else the model wrote is kept as its ids.

`shown_reply` writes a reply with its reasoning in the one form every chat view and `LLM.chat` give a reasoning
model's reply in (`<think>` reasoning `</think>`, then the answer); `split_shown` reads that form back.
"""
from __future__ import annotations

import datetime
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tsterm.errors import RequestError

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the analysis channel (the model's reasoning)."""

    text: str



@dataclass(frozen=True)
class Header:
    """One message's header: its channel ("" when it names none), recipient (None: the user) and content type."""

    channel: str
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        rest = text[channel.end():] if channel else ""
        constrained = text.split(CONSTRAIN, 1)[1].split() if CONSTRAIN in text else []
        content_type = constrained[0] if constrained else ("json" if "json" in _RECIPIENT.sub("", rest).split()
                                                           else None)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else None, content_type)

    @property
    def is_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith(FUNCTIONS)


@dataclass(frozen=True)
class Content:
    """A piece of a message's content, as it streams."""

    header: Header
    text: str


@dataclass(frozen=True)
class Ended:
    """A message ended: by `tag` (one of `ENDS`), or cut by `finish()` (None). `raw`: the message as written (its
    header, markers and content); `content`: its whole content."""

    header: Header
    tag: str | None
    raw: str
    content: str


@dataclass(frozen=True)
class Loose:
    """Text that never reached a `<|message|>` (not harmony, or a cut header), released by `finish()`."""

    text: str


Piece = Content | Ended | Loose


class HarmonyStream:
    """Splits one assistant turn in harmony into its messages (see the module docstring). `header` is the message
    being read (None between messages), `content` its content so far."""

    def __init__(self) -> None:
        self._buffer = ""  # the header so far, or the content not yet released
        self.header: Header | None = None  # in a message's content: its header
        self._raw = ""  # the current message's text so far
        self.content = ""  # the current message's content so far
        self.finished = False

    def feed(self, delta: str) -> list[Piece]:
        if self.finished:
            raise RuntimeError("HarmonyStream.feed after finish(): use one stream per turn")
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            if self.header is None:  # reading a header: up to <|message|>
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    return pieces
                self._raw = self._buffer[:at + len(MESSAGE)]
                self.header = Header.parse(self._buffer[:at])
                self._buffer, self.content = self._buffer[at + len(MESSAGE):], ""
                continue
            ends = [(at, tag) for at, tag in ((self._buffer.find(tag), tag) for tag in ENDS) if at >= 0]
            if not ends:  # release all but what may be the start of an end marker
                held = _partial_marker_length(self._buffer)
                self._content(pieces, self._buffer[:len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held:]
                return pieces
            at, tag = min(ends)
            self._content(pieces, self._buffer[:at])
            self._raw += tag
            pieces.append(Ended(self.header, tag, self._raw, self.content))
            self._buffer = self._buffer[at + len(tag):]  # the next message: <|start|>assistant, its header
            self.header = None

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if not self.finished:
            self.finished = True
            if self.header is None:
                if self._buffer.strip():
                    pieces.append(Loose(self._buffer))
            else:
                self._content(pieces, self._buffer)
                pieces.append(Ended(self.header, None, self._raw, self.content))
            self._buffer = ""
        return pieces

    def _content(self, pieces: list[Piece], text: str) -> None:
        if text:
            self._raw += text
            self.content += text
            pieces.append(Content(self.header, text))

def _partial_marker_length(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of an end marker."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in ENDS):
            return n
    return 0


# ---- which format a model writes


HARMONY_TOKENS = (START, CHANNEL, MESSAGE, END, CALL, RETURN)


def is_harmony(tokenizer: Any, model_type: str | None = None) -> bool:
    """Whether the model writes harmony: gpt-oss (`model_type` gpt_oss), or a tokenizer whose vocabulary holds every
    one of harmony's markers."""
    if model_type == "gpt_oss":
        return True
    token_to_id = getattr(tokenizer, "token_to_id", None)
    return token_to_id is not None and all(token_to_id(token) is not None for token in HARMONY_TOKENS)


class TurnText:
    """A turn's text with its special tokens, from its growing ids (`CompletionOutput.token_ids`): what a harmony
    parser reads (and a parser of special-token call markers), where the engine's own text leaves them out.
    `keep_stop`: the stop token that ended the turn is text too (harmony's `<|call|>` ends a call); otherwise it is
    left out, as the engine's text leaves it."""

    def __init__(self, tokenizer: Any, keep_stop: bool = True):
        from tsterm.tokenizer import IncrementalDetokenizer

        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self._keep_stop = keep_stop
        self._seen = 0
        self.text = ""

    def feed(self, token_ids: Sequence[int], final: bool = False, stops: Collection[int] = ()) -> str:
        """The text the ids after those already fed add (all of it once `final`; `stops`: the ids that end a turn,
        one of which, last, is not text unless `keep_stop`)."""
        if final and not self._keep_stop and token_ids and token_ids[-1] in stops and len(token_ids) > self._seen:
            token_ids = token_ids[:-1]
        delta = self._detokenizer.add(token_ids[self._seen:])
        self._seen = len(token_ids)
        if final:
            delta += self._detokenizer.flush()
        self.text += delta
        return delta


# ---- rendering a conversation


MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
FUNCTIONS_RULE = "Calls to these tools must go to the commentary channel: 'functions'."
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
           add_generation_prompt: bool = True, *, reasoning_effort: str = "medium", model_identity: str | None = None,
           conversation_start_date: str | None = None, **_template_kwargs: Any) -> str:
    """The conversation as a harmony prompt (see the module docstring); a RequestError names a message it cannot
    take. Other keyword arguments (a chat template's variables) are not harmony's and are ignored, as a template
    ignores a variable it does not read."""
    if not messages:
        raise RequestError("cannot render an empty conversation; add at least one message")
    if reasoning_effort not in EFFORTS:
        raise RequestError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
    functions = _functions(tools)
    if conversation_start_date is None:
        conversation_start_date = datetime.date.today().isoformat()
    top = [model_identity or MODEL_IDENTITY, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"]
    if conversation_start_date:
        top.append(f"Current date: {conversation_start_date}")
    channels = CHANNELS + ("\n" + FUNCTIONS_RULE if functions else "")
    out = [_message("system", "\n\n".join(["\n".join(top), f"Reasoning: {reasoning_effort}", channels]))]
    messages = [dict(m) for m in messages]
    instructions = None
    if messages[0].get("role") in ("system", "developer"):
        instructions = _text(messages[0], 0)
        messages = messages[1:]
        first = 1
    else:
        first = 0
    if instructions or functions:
        sections = (["# Instructions", instructions] if instructions else []) + ([_tools_section(functions)]
                                                                               if functions else [])
        out.append(_message("developer", "\n\n".join(sections)))
    names: dict[str, str] = {}  # a call's id -> its tool's name
    last_call: str | None = None
    for offset, message in enumerate(messages):
        index = offset + first
        role = message.get("role")
        if role in ("system", "developer"):
            out.append(_message("developer", "# Instructions\n\n" + _text(message, index)))
        elif role == "user":
            out.append(_message("user", _text(message, index)))
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            later_final = any(m.get("role") == "assistant" and not m.get("tool_calls") for m in messages[offset + 1:])
            reasoning = _reasoning(message, index)
            if calls and reasoning and not later_final:
                out.append(_message("assistant", reasoning, channel="analysis"))
            content = _text(message, index)
            if not calls:
                out.append(_message("assistant", content, channel="final"))
                continue
            if content:
                out.append(_message("assistant", content, channel="commentary"))
            for n, call in enumerate(calls):
                name, arguments = _call(call, f"messages[{index}].tool_calls[{n}]")
                if isinstance(call.get("id"), str):
                    names[call["id"]] = name
                last_call = name
                out.append(f"{START}assistant to={FUNCTIONS}{name}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"
                           f"{arguments}{CALL}")
        elif role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id")) or last_call
            if not name:
                raise RequestError(f"messages[{index}]: a tool result with no earlier tool call to answer (harmony "
                                   "names the tool a result comes from)")
            out.append(f"{START}{FUNCTIONS}{name} to=assistant{CHANNEL}commentary{MESSAGE}{_text(message, index)}{END}")
        else:
            raise RequestError(f"messages[{index}].role: {role!r} is not a role harmony renders (system, developer, "
                               "user, assistant, tool)")
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


def _message(role: str, content: str, channel: str | None = None) -> str:
    header = role + (f"{CHANNEL}{channel}" if channel else "")
    return f"{START}{header}{MESSAGE}{content}{END}"


def _text(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"messages[{index}].content: expected text or text parts, got {type(content).__name__}")


def _reasoning(message: Mapping[str, Any], index: int) -> str:
    for key in REASONING_KEYS:
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise RequestError(f"messages[{index}].{key}: expected text, got {type(value).__name__}")
            return value
    return ""


def _call(call: Mapping[str, Any], where: str) -> tuple[str, str]:
    function = call.get("function", call) if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: a tool call needs a function name")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return name, arguments


def _functions(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    functions = []
    for index, tool in enumerate(tools or []):
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise RequestError(f"tools[{index}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        functions.append(spec)
    return functions


def _tools_section(functions: list[Mapping[str, Any]]) -> str:
    lines = ["## functions\n", "namespace functions {\n"]
    for spec in functions:
        lines += [f"// {line}" for line in str(spec.get("description") or "").splitlines()]
        parameters = spec.get("parameters")
        if parameters is None:
            lines.append(f"type {spec['name']} = () => any;\n")
        else:
            lines.append(f"type {spec['name']} = (_: {typescript(parameters)}) => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def typescript(schema: Any, indent: str = "") -> str:
    """A JSON schema as the TypeScript type harmony's renderer writes for it (openai-harmony's own rules: its
    descriptions, titles, examples and defaults as comments, `?` for an optional property, enums as unions)."""
    if not isinstance(schema, Mapping):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return "".join(f"\n{indent} | " + _variant(v, indent) for v in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if kind == "object":
        out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
        out += "{\n"
        properties = schema.get("properties")
        required = {r for r in schema.get("required") or [] if isinstance(r, str)}
        for key, value in (properties.items() if isinstance(properties, Mapping) else ()):
            value = value if isinstance(value, Mapping) else {}
            optional = "" if key in required else "?"
            if isinstance(value.get("title"), str):
                out += f"{indent}// {value['title']}\n{indent}//\n"
            one_of = value.get("oneOf") if isinstance(value.get("oneOf"), list) else None
            if one_of is None and isinstance(value.get("description"), str):
                out += f"{indent}// {value['description']}\n"
            examples = value.get("examples")
            if isinstance(examples, list) and examples:
                out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples
                                                           if isinstance(e, str))
            if one_of is not None:
                out += _one_of_property(key, optional, value, one_of, indent)
                continue
            type_text = typescript(value, indent + "    ")
            if value.get("nullable") is True and "null" not in type_text:
                type_text += " | null"
            out += f"{indent}{key}{optional}: {type_text},"
            if "default" in value:
                out += f" // default: {_default(value)}"
            out += "\n"
        return out + f"{indent}}}"
    if kind == "string":
        enum = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(enum) if enum else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return typescript(schema["items"], indent) + "[]" if "items" in schema else "Array<any>"
    return "any"


def _default(schema: Mapping[str, Any]) -> str:
    value = schema["default"]
    if isinstance(value, str):
        return value if schema.get("enum") else f'"{value}"'
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _variant(variant: Any, indent: str, skip_description: bool = False, property_description: str | None = None) -> str:
    """One `oneOf` variant: its type, `| null` where nullable, its description and default as a trailing comment."""
    variant = variant if isinstance(variant, Mapping) else {}
    text = typescript(variant, indent + "   ")
    if variant.get("nullable") is True and "null" not in text:
        text += " | null"
    comments = []
    description = variant.get("description")
    if not skip_description and isinstance(description, str) and description != property_description:
        comments.append(description)
    if "default" in variant:
        comments.append(f"default: {_default(variant)}")
    return text + (f" // {' '.join(comments)}" if comments else "")


def _one_of_property(key: str, optional: str, value: Mapping[str, Any], variants: list, indent: str) -> str:
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], Mapping) else {}
    above = description is not None and first.get("description") != description
    out = f"{indent}// {description}\n" if above else ""
    if "default" in value:
        out += f"{indent}// default: {_default(value)}\n"
    out += f"{indent}{key}{optional}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _variant(variant, indent, i == 0 and above, description) + "\n"
    return out + f"{indent},\n"


class HarmonyChat:
    """A tokenizer whose `apply_chat_template` renders harmony (`render`), everything else its own: what the agent
    loop and the server render a harmony model's prompts with."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["tokenizer"], name)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        text = render(messages, tools, add_generation_prompt, **kwargs)
        return list(self.tokenizer.encode(text)) if tokenize else text


def chat_tokenizer(tokenizer: Any, model_type: str | None = None) -> Any:
    """The tokenizer that renders this model's prompts: a `HarmonyChat` over it for harmony, else itself."""
    if isinstance(tokenizer, HarmonyChat) or not is_harmony(tokenizer, model_type):
        return tokenizer
    return HarmonyChat(tokenizer)


# ---- a reply read whole (LLM.chat)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def shown_reply(reasoning: str, text: str, thinking_done: bool = True) -> str:
    """A reply with its reasoning as the chat views show a reasoning family's reply: `<think>` reasoning `</think>`,
    then the text (the block left open while the model still thinks). No reasoning: the text alone."""
    if not reasoning:
        return text
    return f"{THINK_OPEN}\n{reasoning}" + (f"\n{THINK_CLOSE}\n\n{text}" if thinking_done or text else "")


def split_shown(text: str) -> tuple[str, str]:
    """`shown_reply`'s text read back: (reasoning, answer); text without a leading `<think>` block is all answer."""
    if not text.startswith(THINK_OPEN + "\n"):
        return "", text
    reasoning, sep, answer = text[len(THINK_OPEN) + 1:].partition(f"\n{THINK_CLOSE}")
    if not sep:
        return reasoning, ""
    return reasoning, answer.removeprefix("\n\n")


@dataclass(frozen=True)
class HarmonyText:
    """A harmony reply read whole: its analysis channel (`reasoning`) and its `answer`: the final channel and
    commentary preambles, with each tool call (a message to `functions.NAME`) as the model wrote it, markers included
    (as a template family's reply holds its calls in its text); messages to a built-in tool are left out."""

    reasoning: str
    answer: str

    @property
    def shown(self) -> str:
        return shown_reply(self.reasoning, self.answer)


def read_reply(tokenizer: Any, token_ids: Sequence[int]) -> HarmonyText:
    """A reply's ids (its stop token included or not) read as harmony: decoded with their markers (`TurnText`), split
    into messages by `HarmonyStream`."""
    stream = HarmonyStream()
    text = TurnText(tokenizer).feed(list(token_ids), final=True)
    reasoning, answer = [], []
    for piece in stream.feed(text) + stream.finish():
        if isinstance(piece, Loose):
            answer.append(piece.text)
        elif isinstance(piece, Ended):
            if piece.header.is_call:
                answer.append(piece.raw if piece.raw.startswith(START) else START + "assistant" + piece.raw)
        elif piece.header.is_call or piece.header.recipient is not None:
            continue
        elif piece.header.channel == "analysis":
            reasoning.append(piece.text)
        else:
            answer.append(piece.text)
    return HarmonyText("".join(reasoning), "".join(answer))
