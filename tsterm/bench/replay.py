"""Replays an agent trace through tsterm's engine (P sessions in parallel), through transformers `generate` (from
scratch each turn, or keeping its cache across turns), or through llama.cpp (`tsterm.bench.llama_cpp`)."""
from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tsterm.bench.trace import Trace, theoretical_cached
from tsterm.config import SamplingParams
from tsterm.errors import ConfigError
from tsterm.engine.engine import Engine
from tsterm.engine.spec_decode import DraftSource, make_draft_source

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
    output_token_ids: list[int] = field(default_factory=list)
    state_copy_bytes: int = 0  # recurrent state copied from a snapshot into the turn's slot (hybrid models)
    state_snapshot_bytes: int = 0  # recurrent state copied into snapshots while the turn ran (hybrid models)
    # process CPU seconds (all threads) from the turn's submission to its first token / its last (a replay that runs
    # sessions one after another records them: `serial_phases`)
    ttft_cpu: float = 0.0
    e2e_cpu: float = 0.0


PHASES = ("prefill", "decode", "other")


@dataclass
class ReplayResult:
    name: str
    wall_s: float
    turns: list[TurnRecord] = field(default_factory=list)
    # Where the replay's time went: "<phase>_s" wall and "<phase>_cpu_s" process CPU seconds (all threads: on a
    # machine other processes share, what the replay itself computed, not the time it waited for a core) for each
    # of PHASES, "cpu_s" in all; tsterm's also counts its engine steps ("prefill_steps": steps that computed prompt
    # tokens, "decode_steps" the others, "batched_decode_steps": decode steps that sampled several sessions,
    # "decode_rows": the sessions its decode steps sampled, summed). Empty where the replay does not measure it.
    phases: dict[str, float] = field(default_factory=dict)

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

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        """(session, turn) -> the ids that turn generated: what two replays of one trace must agree on."""
        return {(r.session, r.turn): r.output_token_ids for r in self.turns}

    def serial_phases(self, cpu_s: float) -> None:
        """`phases` of a replay that runs one turn at a time (the baselines): prefill is each turn's time to its
        first token, decode the rest of the turn, other what passed between turns; `cpu_s` the replay's process CPU
        seconds."""
        prefill = (sum(r.ttft for r in self.turns), sum(r.ttft_cpu for r in self.turns))
        decode = (sum(r.e2e - r.ttft for r in self.turns), sum(r.e2e_cpu - r.ttft_cpu for r in self.turns))
        self.phases = {"prefill_s": prefill[0], "decode_s": decode[0],
                       "other_s": self.wall_s - prefill[0] - decode[0], "cpu_s": cpu_s,
                       "prefill_cpu_s": prefill[1], "decode_cpu_s": decode[1],
                       "other_cpu_s": cpu_s - prefill[1] - decode[1]}

    def decode_tokens_per_s(self) -> float:
        """Tokens decoded after each turn's first over the time from its first token to its last, summed over the
        turns (the prefill of each turn left out: what a draft source speeds up)."""
        seconds = sum(r.e2e - r.ttft for r in self.turns)
        return sum(max(r.generated_tokens - 1, 0) for r in self.turns) / seconds if seconds > 0 else 0.0


def first_divergence(ours: ReplayResult, other: ReplayResult) -> dict | None:
    """Where `other`'s greedy tokens first differ from `ours`' (session, turn, index into that reply), or None when
    every turn generated the same ids. After a divergence each side's conversation holds its own reply, so later
    turns are not compared."""
    theirs = other.outputs()
    for (session, turn), ids in sorted(ours.outputs().items()):
        other_ids = theirs.get((session, turn))
        if other_ids is None:
            return {"session": session, "turn": turn, "index": 0, "missing": True}
        if other_ids != ids:
            index = next((i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b), min(len(ids), len(other_ids)))
            return {"session": session, "turn": turn, "index": index}
    return None


class RecordedDrafts(DraftSource):
    """A draft source that passes every call to `inner` and counts its verifies by position: `drafted[i]` verifies
    drafted an i+1-th token, `accepted[i]` of those accepted it (the engine reports each verify's drafted and
    accepted counts through `observe`; acceptance keeps a prefix, so position i is accepted iff more than i were)."""

    def __init__(self, inner: DraftSource):
        super().__init__(inner.num_tokens)
        self.inner, self.name = inner, inner.name
        self.drafted = [0] * inner.num_tokens
        self.accepted = [0] * inner.num_tokens

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return self.inner.propose(seq_id, token_ids, max_tokens)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        for i in range(num_drafted):
            self.drafted[i] += 1
            self.accepted[i] += i < num_accepted
        self.inner.observe(seq_id, num_drafted, num_accepted)

    def release(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.inner.release(seq_id, token_ids, num_prompt_tokens)


@contextmanager
def drafting(engine: Engine, on: bool) -> Iterator[RecordedDrafts | None]:
    """For one replay on an engine built with speculative decoding: `on`, a fresh draft source of the engine's
    method and K (nothing learnt from an earlier replay's outputs), recorded per position; off, the scheduler asks
    for no drafts (the engine decodes one token a step, as without speculation). Restored afterwards."""
    config = engine.config
    if engine.drafter is None:
        raise ValueError("drafting() needs an engine built with a speculative_method")
    drafter, proposer = engine.drafter, engine.scheduler.proposer
    # An MTP head's source (wants_hidden) is fed the executor's hidden states by the engine after each step and keeps
    # nothing of earlier outputs: the engine's own is wrapped. A model-free one starts afresh.
    fresh = drafter if getattr(drafter, "wants_hidden", False) else \
        make_draft_source(config.speculative_method, config.num_speculative_tokens)
    recorded = RecordedDrafts(fresh) if on else None
    try:
        if on:
            engine.drafter = recorded
        else:
            engine.scheduler.proposer = None
        yield recorded
    finally:
        engine.drafter, engine.scheduler.proposer = drafter, proposer


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


def replay_tsterm(engine: Engine, trace: Trace, name: str, progress: Progress | None = None,
                  cache_salt: str | None = None) -> ReplayResult:
    """All sessions run at once; each submits its next turn as soon as its previous reply is complete. `cache_salt`:
    the replay's prompts share cached blocks only with prompts of the same salt (another replay of the same trace
    on this engine starts cold under another salt)."""
    # a hybrid resumes at its kept state snapshots, block boundaries; attention-only models at any token
    unit = engine.config.block_size if engine.kv.num_state_slots else 1
    histories: list[list[int]] = [[] for _ in trace]
    pending: dict[str, tuple[int, int, list[int], float]] = {}
    result = ReplayResult(name, 0.0)
    stats = engine.stats()
    state_copied, snapshotted = stats.get("state_copy_bytes", 0), stats.get("state_snapshot_bytes", 0)

    def submit(session: int, turn: int) -> None:
        prompt = _prompt(histories[session], trace[session][turn])
        params = SamplingParams(temperature=0, max_tokens=trace[session][turn].output_tokens, ignore_eos=True)
        rid = engine.add_request(prompt, params, request_id=f"{name}-s{session}-t{turn}", cache_salt=cache_salt)
        pending[rid] = (session, turn, prompt, time.perf_counter())

    # each engine step's wall and CPU seconds, as a prefill step (it computed prompt tokens) or a decode step
    phases = dict.fromkeys(("prefill_s", "decode_s", "prefill_cpu_s", "decode_cpu_s", "prefill_steps",
                            "decode_steps", "batched_decode_steps", "decode_rows"), 0)
    start, start_cpu = time.perf_counter(), time.process_time()
    for session in range(len(trace)):
        submit(session, 0)
    while pending:
        prompt_tokens = engine.scheduler.num_prefill_tokens
        step_start, step_cpu = time.perf_counter(), time.process_time()
        outputs = engine.step()
        kind = "prefill" if engine.scheduler.num_prefill_tokens > prompt_tokens else "decode"
        phases[f"{kind}_s"] += time.perf_counter() - step_start
        phases[f"{kind}_cpu_s"] += time.process_time() - step_cpu
        phases[f"{kind}_steps"] += 1
        if kind == "decode":  # (each session a decode step advances samples a token: one output each)
            phases["decode_rows"] += len(outputs)
            phases["batched_decode_steps"] += len(outputs) > 1
        for out in outputs:
            if not out.finished:
                continue
            session, turn, prompt, submitted = pending.pop(out.request_id)
            theoretical = theoretical_cached(histories[session], prompt, unit) if turn else 0
            # Snapshot bytes restored since the previous finished turn: exact with one session, shared out by
            # finishing order with several.
            stats = engine.stats()
            copied, state_copied = state_copied, stats.get("state_copy_bytes", 0)
            kept, snapshotted = snapshotted, stats.get("state_snapshot_bytes", 0)
            result.turns.append(TurnRecord(session, turn, len(prompt), out.num_cached_tokens, theoretical,
                                           out.metrics.ttft or 0.0, time.perf_counter() - submitted,
                                           len(out.token_ids), list(out.token_ids), state_copied - copied,
                                           snapshotted - kept))
            histories[session] = prompt + out.token_ids
            if progress:
                progress(f"{name}: session {session + 1}/{len(trace)} turn {turn + 1}/{len(trace[session])} "
                         f"({len(prompt)} prompt tokens, {out.num_cached_tokens} cached)")
            if turn + 1 < len(trace[session]):
                submit(session, turn + 1)
    result.wall_s = time.perf_counter() - start
    cpu_s = time.process_time() - start_cpu
    result.phases = dict(phases, other_s=result.wall_s - phases["prefill_s"] - phases["decode_s"], cpu_s=cpu_s,
                         other_cpu_s=cpu_s - phases["prefill_cpu_s"] - phases["decode_cpu_s"])
    return result


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None
        self.first_token_cpu: float | None = None  # process CPU time then

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_time, self.first_token_cpu = time.perf_counter(), time.process_time()

    def end(self) -> None:
        pass


def transformers_model_dir(model_dir: str) -> str:
    """The directory transformers loads for `model_dir`: itself, or for the default model's import (its Q4_1 blocks
    kept as tsterm's own quantized tensors, which transformers cannot read) the float32 import of the same GGUF file
    (the weights those blocks hold, dequantized)."""
    from tsterm.convert.gguf import INFO_FILE
    from tsterm.convert.shipped import SMOLLM2_FILE, ensure_default_model

    try:
        info = json.loads((Path(model_dir) / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return model_dir
    if info.get("dequantize") is False and info.get("source") == SMOLLM2_FILE:
        return str(ensure_default_model(dequantize=True))
    return model_dir


def load_transformers(model_dir: str, dtype: torch.dtype):
    """The transformers model of `model_dir`, warmed up as tsterm's engine is."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # transformers is a test/bench extra, not a runtime dependency
        raise RuntimeError("--baseline transformers needs transformers: pip install -e '.[test]'") from e
    model_dir = transformers_model_dir(model_dir)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    model.eval()
    if info.get("missing_keys"):  # transformers would run them as freshly initialised random weights
        missing = sorted(info["missing_keys"])
        raise ConfigError(f"transformers cannot load every weight of {model_dir} ({len(missing)} missing, e.g. "
                          f"{missing[0]}): a baseline on it would run random weights; give the bench an HF-format "
                          "model of float weights (--model), e.g. a GGUF imported with `tsterm import-gguf "
                          "--dequantize`")
    # Fixed reply lengths as tsterm's ignore_eos gives them: an end-of-turn token is generated like any other and
    # the reply goes on. With the model's EOS ids set, `min_new_tokens` would instead forbid them (another greedy
    # token where the model wants to end its turn, as on the copy-heavy trace's replies).
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        model.generate(torch.arange(16, 80)[None], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    return model


def _crop_to(cache, length: int) -> None:
    """Cut a transformers cache to its first `length` tokens. A negative count removes that many from the end in
    every transformers version since 4.38 (5.24 refuses the older positive "length to keep")."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _has_recurrent_layers(model) -> bool:
    config = getattr(model.config, "text_config", None) or model.config
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def replay_transformers(model, trace: Trace, progress: Progress | None = None,
                        keep_cache: bool = False) -> ReplayResult:
    """The two ways transformers users run an agent. `keep_cache=False`: each turn re-encodes the whole
    conversation with `generate`. `keep_cache=True`: the cache `generate` returns is passed back with the next
    turn's whole conversation (`past_key_values`), so only the new tokens are encoded, as transformers' docs show
    for multi-turn chat. A turn that keeps less than the whole conversation (a recorded template miss) crops the
    cache to what it keeps; a hybrid's recurrent state cannot be cropped, so there it starts afresh."""
    name = "transformers-cache" if keep_cache else "transformers"
    result = ReplayResult(name, 0.0)
    start, start_cpu = time.perf_counter(), time.process_time()
    for session, turns in enumerate(trace):
        history: list[int] = []
        cache = None
        for turn, step in enumerate(turns):
            ids = _prompt(history, step)
            if cache is not None and step.keep is not None:
                if _has_recurrent_layers(model):
                    cache = None
                else:
                    _crop_to(cache, step.keep)
            cached = min(cache.get_seq_length(), len(ids) - 1) if cache is not None else 0
            timer = _FirstTokenTimer()
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode(), warnings.catch_warnings():
                # `past_key_values` is the name from transformers 4.x through the GPU machine's 5.17; 5.24 also
                # takes it (as `cache`) and warns
                warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
                # the mask given: inferred from pad_token_id it would hide the prompt's tokens of that id (a
                # chat template's <|im_start|> where it is id 0)
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=step.output_tokens,
                                     min_new_tokens=step.output_tokens, do_sample=False, streamer=timer,
                                     pad_token_id=0, past_key_values=cache if keep_cache else None,
                                     return_dict_in_generate=True)
            e2e, e2e_cpu = time.perf_counter() - t0, time.process_time() - c0
            if keep_cache:
                cache = out.past_key_values
            generated = out.sequences[0, len(ids):].tolist()
            history = ids + generated
            result.turns.append(TurnRecord(session, turn, len(ids), cached, 0, (timer.first_token_time or t0) - t0,
                                           e2e, len(generated), generated, ttft_cpu=(timer.first_token_cpu or c0) - c0,
                                           e2e_cpu=e2e_cpu))
            if progress:
                progress(f"{name}: session {session + 1}/{len(trace)} turn {turn + 1}/{len(turns)} "
                         f"({len(ids)} prompt tokens, {cached} cached)")
    result.wall_s = time.perf_counter() - start
    result.serial_phases(time.process_time() - start_cpu)
    return result


def replay_transformers_lookup(model, trace: Trace, num_tokens: int, progress: Progress | None = None) -> ReplayResult:
    """transformers' prompt-lookup decoding (`generate(prompt_lookup_num_tokens=K)`: its PromptLookupCandidateGenerator
    drafts up to K tokens from the conversation's own ids, one forward pass verifies them, the longest greedy run is
    kept plus the model's next token, the cache is cropped to it) with the cache kept across turns as the
    transformers-cache baseline keeps it. The verify loop is written here over the model's forward and its
    DynamicCache because `generate`'s assisted path does not take a filled cache: given one (transformers 5.24) its
    first step encodes the whole prompt again on top of it. Greedy; every reply has its turn's fixed length."""
    try:
        from transformers import DynamicCache
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    except ImportError as e:  # transformers is a test/bench extra, not a runtime dependency
        raise RuntimeError("--baseline transformers-lookup needs transformers: pip install -e '.[test]'") from e
    if _has_recurrent_layers(model):
        raise RuntimeError("--baseline transformers-lookup: a hybrid model's recurrent state cannot be cropped after "
                           "a rejected draft (transformers refuses assisted decoding there too)")
    name = "transformers-lookup"
    result = ReplayResult(name, 0.0)
    start, start_cpu = time.perf_counter(), time.process_time()
    for session, turns in enumerate(trace):
        history: list[int] = []
        cache = DynamicCache(config=model.config)
        for turn, step in enumerate(turns):
            ids = _prompt(history, step)
            if step.keep is not None:
                _crop_to(cache, step.keep)
            cached = min(cache.get_seq_length(), len(ids) - 1)
            _crop_to(cache, cached)
            lookup = PromptLookupCandidateGenerator(num_output_tokens=num_tokens,
                                                    max_length=len(ids) + step.output_tokens)
            t0, c0 = time.perf_counter(), time.process_time()
            first = first_cpu = None
            sequence = torch.tensor([ids])
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
                while sequence.shape[1] - len(ids) < step.output_tokens:
                    room = step.output_tokens - (sequence.shape[1] - len(ids)) - 1  # drafts; the model adds one
                    drafts = lookup.get_candidates(sequence)[0][0, sequence.shape[1]:][:room] if room > 0 else \
                        sequence[0, :0]
                    fed = torch.cat([sequence[0, cache.get_seq_length():], drafts])[None]
                    logits = model(input_ids=fed, past_key_values=cache, use_cache=True,
                                   logits_to_keep=len(drafts) + 1).logits[0]
                    greedy = logits.argmax(dim=-1)
                    accepted = 0
                    while accepted < len(drafts) and int(drafts[accepted]) == int(greedy[accepted]):
                        accepted += 1
                    new = torch.cat([drafts[:accepted], greedy[accepted:accepted + 1]])
                    sequence = torch.cat([sequence, new[None]], dim=1)
                    _crop_to(cache, sequence.shape[1] - 1)  # the rejected drafts' KV goes; the last token is never fed
                    if first is None:
                        first, first_cpu = time.perf_counter(), time.process_time()
            e2e, e2e_cpu = time.perf_counter() - t0, time.process_time() - c0
            generated = sequence[0, len(ids):].tolist()
            history = ids + generated
            result.turns.append(TurnRecord(session, turn, len(ids), cached, 0, (first or t0) - t0, e2e,
                                           len(generated), generated, ttft_cpu=(first_cpu or c0) - c0,
                                           e2e_cpu=e2e_cpu))
            if progress:
                progress(f"{name}: session {session + 1}/{len(trace)} turn {turn + 1}/{len(turns)} "
                         f"({len(ids)} prompt tokens, {cached} cached)")
    result.wall_s = time.perf_counter() - start
    result.serial_phases(time.process_time() - start_cpu)
    return result
