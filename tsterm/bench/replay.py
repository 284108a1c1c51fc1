"""Replays an agent trace through tsterm's engine (P sessions in parallel) or through transformers `generate`."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tsterm.bench.trace import Trace, theoretical_cached
from tsterm.config import SamplingParams
from tsterm.engine.engine import Engine

Progress = Callable[[str], None]


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    theoretical_cached: int
    ttft: float
    e2e: float
    generated_tokens: int = 0


@dataclass
class ReplayResult:
    name: str
    wall_s: float
    turns: list[TurnRecord] = field(default_factory=list)

    def ttft_by_turn(self) -> list[float]:
        """Mean TTFT per turn over sessions."""
        num_turns = max(r.turn for r in self.turns) + 1
        return [sum(r.ttft for r in self.turns if r.turn == t) / max(1, sum(1 for r in self.turns if r.turn == t))
                for t in range(num_turns)]

    def hit_rate_vs_theoretical(self) -> float:
        later = [r for r in self.turns if r.turn > 0]
        theoretical = sum(r.theoretical_cached for r in later)
        return sum(min(r.cached_tokens, r.theoretical_cached) for r in later) / theoretical if theoretical else 0.0

    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.turns)


def warm_up(engine: Engine) -> None:
    """One short request first, so that neither side's first turn pays for page faults and allocator growth."""
    vocab = engine.model_config.vocab_size
    rid = engine.add_request([(7 + 13 * i) % (vocab - 16) + 16 for i in range(64)],
                             SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.abort(rid)


def _prompt(history: list[int], turn) -> list[int]:
    return (history if turn.keep is None else history[:turn.keep]) + turn.new_ids


def replay_tsterm(engine: Engine, trace: Trace, name: str, progress: Progress | None = None) -> ReplayResult:
    """All sessions run at once; each submits its next turn as soon as its previous reply is complete."""
    block_size = engine.config.block_size
    histories: list[list[int]] = [[] for _ in trace]
    pending: dict[str, tuple[int, int, list[int], float]] = {}
    result = ReplayResult(name, 0.0)

    def submit(session: int, turn: int) -> None:
        prompt = _prompt(histories[session], trace[session][turn])
        params = SamplingParams(temperature=0, max_tokens=trace[session][turn].output_tokens, ignore_eos=True)
        rid = engine.add_request(prompt, params, request_id=f"{name}-s{session}-t{turn}")
        pending[rid] = (session, turn, prompt, time.perf_counter())

    start = time.perf_counter()
    for session in range(len(trace)):
        submit(session, 0)
    while pending:
        for out in engine.step():
            if not out.finished:
                continue
            session, turn, prompt, submitted = pending.pop(out.request_id)
            theoretical = theoretical_cached(histories[session], prompt, block_size) if turn else 0
            result.turns.append(TurnRecord(session, turn, len(prompt), out.num_cached_tokens, theoretical,
                                           out.metrics.ttft or 0.0, time.perf_counter() - submitted,
                                           len(out.token_ids)))
            histories[session] = prompt + out.token_ids
            if progress:
                progress(f"{name}: session {session + 1}/{len(trace)} turn {turn + 1}/{len(trace[session])} "
                         f"({len(prompt)} prompt tokens, {out.num_cached_tokens} cached)")
            if turn + 1 < len(trace[session]):
                submit(session, turn + 1)
    result.wall_s = time.perf_counter() - start
    return result


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def replay_transformers(model_dir: str, dtype: torch.dtype, trace: Trace,
                        progress: Progress | None = None) -> ReplayResult:
    """The way transformers users run an agent: each turn re-encodes the whole conversation with `generate`."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # transformers is a test/bench extra, not a runtime dependency
        raise RuntimeError("--baseline transformers needs transformers: pip install -e '.[test]'") from e
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():  # warm-up, as for tsterm
        model.generate(torch.arange(16, 80)[None], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    result = ReplayResult("transformers", 0.0)
    start = time.perf_counter()
    for session, turns in enumerate(trace):
        history: list[int] = []
        for turn, step in enumerate(turns):
            ids = _prompt(history, step)
            timer = _FirstTokenTimer()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=step.output_tokens,
                                     min_new_tokens=step.output_tokens, do_sample=False, streamer=timer,
                                     pad_token_id=0)
            e2e = time.perf_counter() - t0
            history = ids + out[0, len(ids):].tolist()
            result.turns.append(TurnRecord(session, turn, len(ids), 0, 0, (timer.first_token_time or t0) - t0, e2e,
                                           len(history) - len(ids)))
            if progress:
                progress(f"transformers: session {session + 1}/{len(trace)} turn {turn + 1}/{len(turns)} "
                         f"({len(ids)} prompt tokens)")
    result.wall_s = time.perf_counter() - start
    return result
