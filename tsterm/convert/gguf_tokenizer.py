"""A GGUF's vocabulary -> tokenizer.json and tokenizer_config.json: the embedded HF tokenizer if the file has one, else
rebuilt as transformers' GGUF converter rebuilds it (byte-level BPE for `gpt2` vocabularies, SentencePiece-style BPE
for `llama` ones), with the split regex and digit handling llama.cpp uses for the vocabulary's pre-tokenizer.
"""
from __future__ import annotations

from typing import Any

from tsterm.convert.gguf_reader import GgufFile
from tsterm.errors import ModelLoadError


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# `tokenizer.ggml.pre` -> the split regex the vocabulary was trained with (None: GPT-2's own byte-level regex)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, MiniMax-M2): cased letter runs with their contractions, digits by three
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3: three splits in turn (digits by three, CJK runs, then the rest)
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi-K2 (tiktoken's pattern): Han runs on their own, kept out of the letter runs by class intersection
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_SPLIT = (r"[\p{Han}]+"
                  rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, str | tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "smaug-bpe", "dbrx", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "glm4", "chatglm-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,  # Mistral NeMo
    **dict.fromkeys(("gpt-4o", "minimax-m2"), _O200K_SPLIT),
    "deepseek-v3": _DEEPSEEK3_SPLITS,
    "kimi-k2": _KIMI_K2_SPLIT,
}
# llama.cpp isolates every \p{N} character before the GPT-2 regex for these (their HF tokenizer.json: Digits)
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


def build_tokenizer_json(gf: GgufFile) -> str:
    """tokenizer.json for the file's vocabulary: the embedded one if any, else rebuilt as transformers' GGUF
    converter rebuilds it (byte-level BPE for `gpt2`, SentencePiece-style BPE for `llama`)."""
    from tokenizers import AddedToken

    if (embedded := gf.get("tokenizer.huggingface.json")) is not None:
        return embedded
    kind = gf.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"{gf.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2 = "
                             "byte-level BPE as in Llama 3, Qwen, SmolLM; llama = SentencePiece BPE as in Mistral)")
    tokens, types = gf.require("tokenizer.ggml.tokens"), gf.get("tokenizer.ggml.token_type") or []
    tokenizer, spelled = _byte_level_model(gf, tokens) if kind == "gpt2" else _sentencepiece_model(gf, tokens)
    # Control tokens are special (matched whole, skipped on decode); user-defined ones are matched whole but kept.
    # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel: adding it
    # would grow the vocabulary past the embedding, so it is skipped.
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types)
                                  if kind == 3 and (spelled is None or set(tok) <= spelled)])
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)
                          for tok, kind in zip(tokens, types) if kind == 4 and tok in vocab])
    named = [tokens[i] for key in ("bos", "eos", "unknown", "padding")
             if (i := gf.get(f"tokenizer.ggml.{key}_token_id")) is not None and i < len(tokens)]
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)
                                  if t not in added])
    _set_post_processor(tokenizer, gf, tokens)
    return tokenizer.to_str()


def _byte_level_model(gf: GgufFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(gf), dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    pre = gf.get("tokenizer.ggml.pre")
    if (splits := PRE_TOKENIZER_SPLITS.get(pre)) is not None:
        splits = (splits,) if isinstance(splits, str) else splits
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGIT_SPLIT_PRE:  # transformers' converter omits this split; llama.cpp and the HF original have it
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spelled


def _sentencepiece_model(gf: GgufFile, tokens: list[str]):
    """Llama-2/Mistral style: pieces spelled with U+2581 for spaces, unknown bytes as <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _merges(gf) if gf.get("tokenizer.ggml.merges") else _merges_from_scores(
        tokens, gf.require("tokenizer.ggml.scores"))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    return tokenizer, None


def _merges(gf: GgufFile) -> list[tuple[str, str]]:
    merges = [tuple(m.split(" ")) for m in gf.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"{gf.path}: malformed tokenizer.ggml.merges entry (expected 'left right')")
    return merges


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a piece into two known pieces is a merge, ranked by the
    merged piece's score (best first), then by the lengths of its halves; ties keep vocabulary order."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    candidates = []
    for piece, score in score_of.items():
        halves = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        halves.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates += [(score, len(left), len(right), left, right) for left, right in halves]
    # one descending sort on the key only: stable, so equal keys keep the order built above
    candidates.sort(key=lambda c: c[:3], reverse=True)
    return [(left, right) for *_, left, right in candidates]


def _adds(gf: GgufFile, which: str) -> bool:
    """Whether encoding adds bos/eos. Old SentencePiece files lack the flag, and llama.cpp then adds BOS."""
    default = which == "bos" and gf.get("tokenizer.ggml.model") == "llama"
    return bool(gf.get(f"tokenizer.ggml.add_{which}_token", default))


def _set_post_processor(tokenizer, gf: GgufFile, tokens: list[str]) -> None:
    from tokenizers import processors

    ends = []
    for key in ("bos", "eos"):
        token_id = gf.get(f"tokenizer.ggml.{key}_token_id")
        ends.append((tokens[token_id], token_id) if _adds(gf, key) and token_id is not None else None)
    bos, eos = ends
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])])
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                             special_tokens=[e for e in ends if e])


def build_tokenizer_config(gf: GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    tokens = gf.require("tokenizer.ggml.tokens")
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                           "model_max_length": config["max_position_embeddings"],
                           "add_bos_token": _adds(gf, "bos"), "add_eos_token": _adds(gf, "eos")}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        if (token_id := gf.get(f"tokenizer.ggml.{key}_token_id")) is not None and token_id < len(tokens):
            out[name] = tokens[token_id]
    default = gf.get("tokenizer.chat_template")
    named = {n: t for n in gf.get("tokenizer.chat_templates") or []
             if (t := gf.get(f"tokenizer.chat_template.{n}")) is not None}
    if named:
        out["chat_template"] = ([{"name": "default", "template": default}] if default else []) + \
            [{"name": n, "template": t} for n, t in named.items()]
    elif default:
        out["chat_template"] = default
    return out
