"""What a bench run needs of the engine, checked before anything is measured: a trace or a measurement that cannot
fit the model's context or the KV pool is refused naming the option that fixes it, instead of failing after a
replay that took minutes."""
from __future__ import annotations

from tsterm.bench.trace import Trace
from tsterm.errors import ConfigError

AUDIT_STEPS = 8  # decode steps the copy audit counts (measure.copy_bytes_per_token)
DECODE_STEPS = 16  # timed decode steps of a rate (measure.decode_rate), after one warm-up step
LONG_FACTOR = 8  # the copy audit's long context is this many times --micro-context
DEFAULT_MICRO_CONTEXT = 256


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def audit_tokens(context: int) -> int:
    """Tokens one copy-audit request holds at its end: the prompt and every step's token."""
    return context + AUDIT_STEPS + 1


def decode_tokens(context: int) -> int:
    """Tokens one decode-rate request holds at its end: the prompt, the warm-up step and the timed ones."""
    return context + DECODE_STEPS + 2


def trace_tokens(trace: Trace) -> tuple[int, int, int]:
    """(the most tokens one request of the trace holds, its session, its turn): kept history + new ids + reply."""
    most = (0, 0, 0)
    for session, turns in enumerate(trace):
        history = 0
        for turn, step in enumerate(turns):
            prompt = (history if step.keep is None else step.keep) + len(step.new_ids)
            most = max(most, (prompt + step.output_tokens, session, turn))
            history = prompt + step.output_tokens
    return most


def fitting_micro_context(max_model_len: int, num_blocks: int, block_size: int, parallel: int) -> int:
    """The default --micro-context: 256, or the most that fits the context (the long audit) and the pool (the
    parallel decode) of a smaller model."""
    longest = (max_model_len - AUDIT_STEPS - 1) // LONG_FACTOR
    per_request = num_blocks // max(parallel, 1) * block_size - DECODE_STEPS - 2
    return max(min(DEFAULT_MICRO_CONTEXT, longest, per_request), 0)


def check_fit(engine, trace: Trace, micro_context: int, parallel: int, recorded: bool) -> None:
    """ConfigError naming the option to change when the run would not fit `engine`."""
    context, pool = engine.max_model_len, engine.kv.pool
    block_size, num_blocks = engine.config.block_size, pool.num_blocks
    need, session, turn = trace_tokens(trace)
    if need > context:
        fix = ("replay it with a model of a longer context (--model, --profile)" if recorded else
               "lower --system-tokens, --turns, --turn-tokens or --output-tokens")
        raise ConfigError(f"the trace's session {session + 1} turn {turn + 1} needs {need} tokens (prompt and reply) "
                          f"but the model's context holds {context}: {fix}")
    longest = (context - AUDIT_STEPS - 1) // LONG_FACTOR
    if micro_context > longest:
        raise ConfigError(f"--micro-context {micro_context}: the copy audit's long context ({LONG_FACTOR} x "
                          f"{micro_context} + {AUDIT_STEPS + 1} tokens = {audit_tokens(LONG_FACTOR * micro_context)}) "
                          f"is more than the model's context holds ({context}); give --micro-context {longest} "
                          "or less")
    if parallel > engine.config.max_num_seqs:
        raise ConfigError(f"--parallel {parallel} is more requests than the engine runs at once (max_num_seqs "
                          f"{engine.config.max_num_seqs}); give --parallel {engine.config.max_num_seqs} or less")
    blocks = parallel * _blocks(decode_tokens(micro_context), block_size)
    if blocks > num_blocks:
        raise ConfigError(f"--parallel {parallel} at --micro-context {micro_context} needs {blocks} KV blocks at once "
                          f"but the pool has {num_blocks}; lower --parallel or --micro-context (or raise the "
                          "profile's kv_cache_memory)")
