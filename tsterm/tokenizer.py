"""Tokenizer: `tokenizer.json` + the model's chat template + a streaming detokenizer.

The chat template is rendered the way transformers 5 renders it (same jinja environment, globals, filters and
template variables), so the prompt ids we build are the ids the model was trained and evaluated with. Any drift
here silently changes earlier tokens of a conversation and destroys prefix-cache reuse (DESIGN.md rule 7).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from tsterm.errors import ConfigError, ModelLoadError, RequestError

# Used only when no file configures an eos token: end-of-turn markers of the common chat formats.
FALLBACK_EOS_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")
# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss ones read `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e}); re-save the tokenizer files") from e


def _token_content(value: Any) -> str | None:
    """Special tokens are stored as plain strings or as serialised AddedToken dicts with a `content` key."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> AddedToken:
    flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip") if isinstance(value, Mapping) and k in value}
    return AddedToken(_token_content(value), special=True, normalized=False, **flags)


class Tokenizer:
    """Encode/decode with the model's `tokenizer.json`; render chats with its template."""

    def __init__(self, backend: BackendTokenizer, config: dict, special_tokens_map: dict | None = None,
                 generation_config: dict | None = None, chat_templates: dict[str, str] | None = None,
                 model_dir: Path | str = "<memory>"):
        self.model_dir = Path(model_dir)
        self._backend = backend
        # transformers disables truncation/padding stored in tokenizer.json unless a call asks for them
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        # Template variables: every `*_token` of tokenizer_config (model-specific ones like `image_token` too);
        # the legacy special_tokens_map.json wins only when the config has no added_tokens_decoder (transformers 5).
        raw = {k: v for k, v in config.items() if k.endswith("_token")}
        if isinstance(config.get("extra_special_tokens"), Mapping):
            raw.update(config["extra_special_tokens"])
        if "added_tokens_decoder" not in config:
            raw.update({k: v for k, v in (special_tokens_map or {}).items() if k.endswith("_token")})
        raw = {k: v for k, v in raw.items() if _token_content(v) is not None}
        self.special_tokens: dict[str, str] = {k: _token_content(v) for k, v in raw.items()}

        # transformers adds every configured special token that is not an added token yet (a no-op normally)
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extras = [v for v in (extras if isinstance(extras, list) else []) if _token_content(v) is not None]
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = {_token_content(v): v for v in (*raw.values(), *extras) if _token_content(v) not in added}
        if missing:
            backend.add_special_tokens([_added_token(v) for v in missing.values()])

        generation_config = generation_config or {}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of("bos_token", generation_config)
        self.pad_token_id = self._id_of("pad_token", generation_config)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(generation_config)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: tokenizer.json not found; copy the model's tokenizer files "
                                 "(tokenizer.json, tokenizer_config.json) into this directory")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON / unknown models
            raise ModelLoadError(f"{path}: cannot load tokenizer.json ({e})") from e
        config = _read_json(model_dir / "tokenizer_config.json")
        return cls(backend, config, _read_json(model_dir / "special_tokens_map.json"),
                   _read_json(model_dir / "generation_config.json"), _load_chat_templates(model_dir, config),
                   model_dir)

    def _id_of(self, name: str, generation_config: dict) -> int | None:
        token_id = self._backend.token_to_id(self.special_tokens.get(name, ""))
        fallback = generation_config.get(f"{name}_id")
        return token_id if token_id is not None else (fallback if isinstance(fallback, int) else None)

    def _eos_ids(self, generation_config: dict) -> tuple[int, ...]:
        configured = generation_config.get("eos_token_id")
        ids = list(configured) if isinstance(configured, list) else [configured] if isinstance(configured, int) else []
        if (eos := self.special_tokens.get("eos_token")) and (eos_id := self._backend.token_to_id(eos)) is not None:
            ids.append(eos_id)
        if not ids:
            ids = [i for t in FALLBACK_EOS_TOKENS if (i := self._backend.token_to_id(t)) is not None]
        return tuple(dict.fromkeys(ids))

    # ---- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Chat-templated text already holds its special tokens, hence the default (as apply_chat_template)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def to_json_str(self) -> str:
        """The tokenizer as tokenizer.json text (with the added tokens this class registered), for libraries that
        rebuild it themselves (llguidance's tokenizer: tsterm.engine.structured)."""
        return self._backend.to_str()

    # ---- chat template
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **extra: Any) -> str | list[int]:
        """Render like transformers' `apply_chat_template`; `extra` (e.g. enable_thinking) reaches the template."""
        if not messages:
            raise RequestError("cannot apply the chat template to an empty conversation; add at least one message")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ConfigError("tools must be JSON-schema dicts like {'type': 'function', 'function': {...}}")
        source = self._select_template(tools is not None)
        try:
            template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{self.model_dir}: chat template line {e.lineno}: {e.message}") from e
        documents = extra.pop("documents", None)
        variables = _plain({**self.special_tokens, **extra})  # caller kwargs override special tokens
        chat = _chat_messages(messages)
        render = partial(template.render, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        try:
            try:
                text = render(messages=chat)
            except TypeError:
                # some templates (DeepSeek-V3 / V3.1) join a past call's arguments as text: give them JSON text
                stringified = _arguments_as_text(chat)
                if stringified is None:
                    raise
                text = render(messages=stringified)
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, or a bad template
            raise ConfigError(f"chat template of {self.model_dir} rejected the conversation: {e.message or e}") from e
        except TypeError as e:  # the template did arithmetic on a value of the wrong type
            raise ConfigError(f"chat template of {self.model_dir} cannot render the conversation: {e}") from e
        return self.encode(text) if tokenize else text

    def default_system_prompt(self) -> str | None:
        """The system prompt the chat template writes itself into a conversation that has none (SmolLM2's: "You
        are a helpful AI assistant named SmolLM, trained by Hugging Face"), or None: the text a conversation
        without a system message shows where one with a system message shows that message."""
        user = [{"role": "user", "content": "\x00user\x00"}]
        try:
            bare = self.apply_chat_template(user, add_generation_prompt=False)
            framed = self.apply_chat_template([{"role": "system", "content": "\x00system\x00"}, *user],
                                              add_generation_prompt=False)
        except (ConfigError, ModelLoadError, RequestError):
            return None
        bare, framed = bare.partition("\x00user\x00")[0], framed.partition("\x00user\x00")[0]
        before, found, after = framed.partition("\x00system\x00")
        if not found or len(bare) <= len(before) + len(after) or not bare.startswith(before) \
                or not bare.endswith(after):
            return None
        return bare[len(before):len(bare) - len(after)]

    def _select_template(self, with_tools: bool) -> str:
        templates = self.chat_templates
        if with_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ModelLoadError(f"{self.model_dir}: several chat templates {sorted(templates)} but none named "
                                 "'default'; add chat_template.jinja")
        raise ModelLoadError(f"{self.model_dir}: no chat template (neither chat_template.jinja nor a "
                             "'chat_template' entry in tokenizer_config.json); add one or send token ids")


def _load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """transformers 5: any .jinja file replaces every template stored in tokenizer_config.json."""
    files = {}
    if (default := model_dir / "chat_template.jinja").is_file():
        files["default"] = default.read_text(encoding="utf-8")
    for path in sorted((model_dir / "chat_templates").glob("*.jinja")):
        files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files
    stored = config.get("chat_template")
    if isinstance(stored, str):
        return {"default": stored}
    if isinstance(stored, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in stored}
    return {}


# ---- the jinja environment (mirrors transformers/utils/chat_template_utils.py)
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant spans for training masks; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _check_attribute(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _Namespace(jinja2.utils.Namespace):
    """namespace() refusing underscore names: templates come from the Hub and are untrusted code."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so `namespace(self=...)` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _DictFactory:
    """`dict(...)` in templates without handing the dict type itself to the sandbox."""

    __call__ = staticmethod(dict)
    fromkeys = staticmethod(dict.fromkeys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes `<>&'`, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictFactory(), namespace=_Namespace)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A fresh copy in plain JSON types: the sandbox cannot vet methods of rich objects (as transformers)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, convert in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # enums and other subclasses: the bare value, without their methods
            return convert(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (OpenAI SDK)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _arguments_as_text(chat: list[dict]) -> list[dict] | None:
    """`chat` with each tool call's `arguments` object as JSON text (what the OpenAI API carries and some templates
    concatenate), or None when no call has an object to turn into text."""
    changed, out = False, []
    for message in chat:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                           and not isinstance(c["function"].get("arguments"), str) for c in calls):
            changed = True
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"],
                                   "arguments": json.dumps(c["function"].get("arguments"), ensure_ascii=False)}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
                and not isinstance(c["function"].get("arguments"), str) else c
                for c in calls]}
        out.append(message)
    return out if changed else None


def _chat_messages(messages: Sequence[Any]) -> list[dict]:
    chat = []
    for message in map(_plain, messages):
        if not isinstance(message, dict):
            raise RequestError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        # OpenAI-style `content=None` / `tool_calls=None` render as "None" in many templates: drop them
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


class AppendOnlyText:
    """Text that only grows, kept as the list of its appended pieces: appending costs O(len(piece)), not a copy of
    everything before it (`str += str` on an attribute copies the whole string every time).

    What is already there never changes, so a prefix `[:end]` names the same text forever: a streamed output can
    keep just `end` and join the text only if someone reads it. Joined text is cached for the next read. Reading
    from another thread while the owner appends is safe: a read joins only pieces that existed before it began.
    """

    __slots__ = ("_pieces", "_length", "_joined")

    def __init__(self) -> None:
        self._pieces: list[str] = []  # only append() changes it, and only by appending
        self._length = 0
        self._joined: tuple[str, int] = ("", 0)  # ("".join(_pieces[:k]), k), replaced whole, never edited

    def __len__(self) -> int:
        return self._length

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)

    def __getitem__(self, key: slice) -> str:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("AppendOnlyText supports only [start:end] slices")
        start, end, _ = key.indices(self._length)
        joined, k = self._joined
        if len(joined) < end:
            num_pieces = len(self._pieces)
            joined = joined + "".join(self._pieces[k:num_pieces])
            self._joined = (joined, num_pieces)
        return joined[start:end] if (start, end) != (0, len(joined)) else joined


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas with O(1) decode work per step.

    Window over `_ids`: [prefix_offset, read_offset) was already emitted and is decoded again only as left context
    (decoders such as SentencePiece's render a token differently at the start of text); [read_offset, end) is
    pending. Byte-level BPE splits multibyte characters across tokens and an incomplete tail decodes to U+FFFD, so
    pending tokens are released only once their text no longer ends in U+FFFD. At `flush()` (the reply ended) the
    bytes of a character it was cut inside are dropped, never released as U+FFFD: the text is what the ids decode
    to up to the last whole character (as vLLM's detokenizer leaves it; a tokenizer cannot tell a genuine trailing
    U+FFFD from that, so a reply that really ends in one loses it too).
    For byte-level tokenizers the deltas concatenate to `tokenizer.decode(output_ids)`, but for such a cut.
    """

    PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first delta
    TRIM_AT = 4096  # drop emitted ids past this many: they are never decoded again

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids or [])[-self.PROMPT_CONTEXT:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.output = AppendOnlyText()  # every delta returned so far

    @property
    def text(self) -> str:
        """All text released so far (joined on access: O(len(text)); streaming code reads `output` or deltas)."""
        return self.output[:len(self.output)]

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated ids; return only the newly completed text (possibly "")."""
        deltas = []
        for token_id in token_ids:  # one at a time: a chunk may end mid-character at every chunk boundary
            self._ids.append(token_id)
            deltas.append(self._step(final=False))
        return "".join(deltas)

    def flush(self) -> str:
        """End of generation: release what is pending but for the bytes of an incomplete last character, which are
        dropped (the U+FFFD a decoder writes for them: one, or one per byte for byte-fallback decoders)."""
        return self._step(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not final and (len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd")):
            return ""  # nothing visible yet (skipped special token) or a character still missing bytes
        if final:  # a reply cut inside a character: its bytes are not text
            new_text = new_text[:max(len(self._prefix_text), len(new_text.rstrip("\ufffd")))]
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        if self._prefix_offset > self.TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._prefix_offset, self._read_offset = 0, self._read_offset - self._prefix_offset
        self.output.append(delta)
        return delta


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Earliest index where a stop string begins in `text`, searching from where a stop could still start.

    `start` is the length of text already checked: a stop found now may begin up to len(stop) - 1 characters
    before it (it spans the previous delta and this one).
    """
    stops = [s for s in stops if s]
    if not stops:
        return None
    lo = max(0, start - max(map(len, stops)) + 1)
    hits = [i for stop in stops if (i := text.find(stop, lo)) != -1]
    return min(hits, default=None)
