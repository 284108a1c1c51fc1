"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice, a Lark / GBNF grammar)
as a token mask the sampler applies, on llguidance.

Why llguidance (and not xgrammar): both compute the mask far below the issue's budget (10% of a default-model decode
step). On this project's 2-core Xeon (AVX-512, AMX), SmolLM2's 49,152-token vocabulary and a six-field pydantic
schema, llguidance fills a row's mask in 30-40 us a token on average, xgrammar in 6 us, against a 17 ms decode step
on one thread (5 ms on two, quiet): BENCHMARKS.md "Structured outputs". What decides is the install: llguidance is one
wheel with no dependencies, while xgrammar 0.2.9 requires torch, transformers and triton (897 MB, which the default
CPU install never pulls in) and apache-tvm-ffi. llguidance also builds its tokenizer from tokenizer.json's own text (no
transformers tokenizer), compiles a schema lazily (about 1.5 ms, no per-schema precompute), and reads Lark grammars
(with inline JSON schemas: what a tool call's format needs) and GBNF as well as JSON schemas and regexes.

The pieces, none of them module-level state:
- `GrammarCompiler`: one per engine. It holds the llguidance tokenizer built from the engine's `Tokenizer` (once, on
  the first constrained request: about 0.25 s) and a thread pool for batched masks; `compile` turns a request's
  `StructuredOutputs` into a `Grammar` or raises a RequestError naming the field and what llguidance said.
- `Grammar`: one per sample. Its matcher state follows the sample's output: `accept` advances it by the token the
  sample appended (the engine, in its postprocess), `fork` copies it (a request's n samples), `done` says the grammar
  has ended.
- `GrammarCompiler.fill_bitmask` / `apply_bitmask`: the sampler's first stage. The constrained rows' allowed tokens,
  computed on the host into one int32 [R, ceil(V / 32)] tensor (in parallel over the rows), then unpacked and applied
  to the logits on their device.
"""
from __future__ import annotations

import json
import math

import llguidance
import torch
from torch import Tensor

from tsterm.config import StructuredOutputs
from tsterm.errors import RequestError
from tsterm.tokenizer import Tokenizer

# JSON without free whitespace: the separators json.dumps writes, so what a model learned reads the same
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """A sample's grammar state: an llguidance matcher advanced with each token the sample appends (no rollback: the
    engine does not speculate)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fork(self) -> Grammar:
        """An independent copy in the same state."""
        return Grammar(self.matcher.deep_copy())

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token. The mask allowed only tokens the grammar takes, so a refusal is a bug or a
        token the mask did not cover: a RuntimeError that fails this request alone."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar has ended: no token can follow (its eos was taken, or the grammar allows nothing more)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """An engine's bridge to llguidance: the tokenizer it masks over, built once, and the grammars of its requests."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        """vocab_size: the logits' width (the embedding's rows; tokens past the tokenizer's are never allowed).
        eos_token_ids: the tokens the engine stops at, allowed only where the grammar accepts."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:  # ~0.25 s for a 49K vocabulary: only engines that see a constrained request pay
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.to_json_str(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos)
        return self._lltokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(torch.get_num_threads(), 8)))
        return self._executor

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """The grammar of `spec`, ready for a sample's first token; a RequestError naming the field when llguidance
        cannot compile it (its message says which construct)."""
        kind = spec.kind
        param = f"structured_outputs.{kind}"
        try:
            source = grammar_source(spec)
        except ValueError as e:
            raise RequestError(f"{param}: {e}", param=param) from None
        matcher = llguidance.LLMatcher(self.lltokenizer, source, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{param} cannot be compiled: {_readable(matcher.get_error())}", param=param)
        return Grammar(matcher)

    def fill_bitmask(self, grammars: list[Grammar], bitmask: Tensor) -> None:
        """Row i of `bitmask` (host int32 [R, words], contiguous) := the tokens grammars[i] allows now."""
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
        row_bytes = bitmask.shape[1] * 4
        if len(grammars) == 1:  # no thread hand-off for the common single-row case
            self.fill_one(grammars[0], bitmask[0])
            return
        self.executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)], bitmask.data_ptr(),
                                              row_bytes, bitmask.shape[0])

    @staticmethod
    def fill_one(grammar: Grammar, row: Tensor) -> None:
        """`row` (host int32 [words], contiguous) := the tokens `grammar` allows now."""
        assert row.dtype == torch.int32 and row.device.type == "cpu" and row.is_contiguous()
        grammar.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> Tensor:
    """`logits` [B, V] with the tokens that row rows[i]'s mask (bitmask [len(rows), words] int32, on the logits'
    device) does not allow set to -inf; a new tensor, the input is not modified. Rows not in `rows` are unchanged."""
    batch, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
    if len(rows) == batch and rows == list(range(batch)):
        return logits.masked_fill(~allowed, -math.inf)
    index = torch.tensor(rows)
    if logits.device.type == "cuda":  # through pinned memory: a pageable upload would wait for the queued forward
        index = index.pin_memory().to(logits.device, non_blocking=True)
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    banned.index_copy_(0, index, ~allowed)
    return logits.masked_fill(banned, -math.inf)


def grammar_source(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for `spec` (a ValueError when its JSON does not parse)."""
    options = _COMPACT_JSON if spec.disable_any_whitespace else None
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true / false), got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


def _readable(error: str) -> str:
    """llguidance's error without its backtrace lines."""
    lines = [line for line in error.strip().splitlines() if line.strip() and not line.startswith("  ")]
    return " ".join(lines) or error.strip()
