"""Sampler: one next token per row of a logits batch, with penalties, truncation, seeds and logprobs.

Order of the stages (what vLLM / OpenAI users expect):
  0. the grammar mask of constrained rows (structured outputs, `tsterm.engine.structured`): every token the row's
     grammar cannot take next is set to -inf, so the stages below (and the logprobs) see only the allowed tokens;
     free rows in the same batch are untouched;
  0b. logit_bias (OpenAI's): each biased row's (token id, bias) pairs are added to its logits, as one scatter for the
     whole batch (the pairs go up as host tensors without waiting); what the grammar masked stays -inf;
  1. penalties on the raw logits: repetition (HF-style, over prompt + output tokens), then presence and
     frequency (OpenAI-style, over output tokens only);
  2. logprobs: log_softmax of the *penalised* logits, before temperature and truncation, so a request's
     logprobs do not change with its temperature / top-k / top-p / min-p;
  3. greedy rows (temperature 0) take argmax of the penalised logits (ties -> lowest id);
  4. sampled rows: temperature, top-k, top-p (nucleus, keeps at least one token), min-p (relative to
     the most likely token), then an exponential race: argmax(probs / Exponential(1) noise).

Everything stays a tensor op on the logits' device. On CUDA, host lists reach the device through pinned memory
without waiting (`_to_device`), and `_read_back` is the one place that waits: for the sampled ids (and requested
logprobs), through pinned memory and an event. The grammar masks are computed on the host from the matchers' states
(which the device never holds) while the queued forward runs, and go up as one bitmask per step.

The penalties read a sequence's history through its `PenaltyState`, kept on the device and updated in place with each
sampled token, so a step costs O(V) per penalised row and uploads no ids, however long the context.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tsterm.config import SamplingParams
from tsterm.engine.structured import Grammar, GrammarCompiler, apply_bitmask, bitmask_words


@dataclass(slots=True, weakref_slot=True)
class PenaltyState:
    """A sequence's token history as its penalties read it, on the logits' device.

    Built once from the ids (`from_ids`: O(context), at the sequence's first sampling), then updated in place by the
    Sampler with each token it samples for the sequence: a step reads and uploads no ids. After a step the tensors
    are views of that step's [B, V] batch tensors (see `Sampler._record`), so the update is one op for the batch.
    """

    seen: Tensor | None  # [V] bool: in the prompt or the output; None when the repetition penalty is off
    counts: Tensor | None  # [V] float32: occurrences in the output; None when presence and frequency are off

    @classmethod
    def from_ids(cls, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
                 vocab_size: int, device: torch.device | str = "cpu") -> PenaltyState | None:
        """The state of a sequence with these ids, or None when `params` have no penalty (its row needs none)."""
        repetition, occurrence = params.repetition_penalty != 1.0, _counts_output(params)
        if not (repetition or occurrence):
            return None
        device = torch.device(device)
        ids = _to_device(torch.tensor(prompt_token_ids + output_token_ids if repetition else output_token_ids,
                                      dtype=torch.long), device)  # [P + O] or [O]
        seen = None
        if repetition:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        counts = None
        if occurrence:
            output_ids = ids[len(prompt_token_ids):] if repetition else ids  # [O]
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, output_ids, torch.ones(output_ids.shape, device=device))
        return cls(seen, counts)

    def clone(self) -> PenaltyState:
        """An independent copy: a forked sequence goes on from its parent's history without sharing its updates."""
        return PenaltyState(*(None if t is None else t.clone() for t in (self.seen, self.counts)))

    def own(self) -> None:
        """Hold copies of its rows instead of views of a batch tensor (which the views would keep alive)."""
        copy = self.clone()
        self.seen, self.counts = copy.seen, copy.counts


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch: the request's params, its penalty state and its generator.

    `penalty` is required when `params` have a penalty (`PenaltyState.from_ids`), and the Sampler adds the row's
    sampled token to it. `generator` is the request's own RNG, set by the engine when `params.seed` is given (see
    `seeded_generator`; it must live on the logits' device). Seeded once, it is advanced by exactly one [V] noise
    draw per sampled token, so a seeded request draws the same tokens wherever it sits in whichever batch. None: the
    row draws from the Sampler's shared generator. `grammar`: the row's structured-output state (params'
    `structured_outputs`), which the Sampler reads and never advances (the engine does, with the token it appends).
    `keep_generator_state`: record the generator's state right after this row's draw (`SamplerOutput`), so a
    speculative verify can rewind a seeded request's generator to just after its last accepted position.
    """

    params: SamplingParams
    penalty: PenaltyState | None = None
    generator: torch.Generator | None = None
    grammar: Grammar | None = None
    keep_generator_state: bool = False


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row, on the host
    # per row: None, or {"token_id": int, "logprob": float, "top": [(token_id, logprob), ...]} with
    # len(top) == params.logprobs (fewer where a grammar allows fewer tokens), sorted by logprob, highest first
    logprobs: list[dict | None]
    # row -> its generator's state right after its draw, for the rows that asked (`keep_generator_state`)
    generator_states: dict[int, Tensor] = field(default_factory=dict)


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator: create once per request, keep it for the request's lifetime."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


class Sampler:
    def __init__(self, seed: int = 0, grammars: GrammarCompiler | None = None) -> None:
        """grammars: the engine's, whose thread pool computes the masks of several constrained rows at once (without
        it they are computed one after the other)."""
        self.seed = seed
        self.grammars = grammars
        self._shared: dict[torch.device, torch.Generator] = {}  # one per device, made on first use
        self.last_stages: tuple[str, ...] = ()  # stages the last call ran (tests and stats read it)
        # the states whose tensors are views of the last call's batch tensors (weak: a finished one is just dropped)
        self._adopted: list[weakref.ref[PenaltyState]] = []

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = seeded_generator(self.seed, device)
        return self._shared[device]

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        sample_rows = [i for i, g in enumerate(greedy) if not g]
        stages: list[str] = []
        if self._adopted:
            self._release_absent(rows)
        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
        if constrained:
            stages.append("grammar")
            logits = self._constrain(logits, rows, constrained)
        if any(p.logit_bias for p in params):
            stages.append("logit_bias")
            logits = _add_logit_bias(logits, params)
        if not sample_rows and not logprob_rows and not any(has_penalty(p) for p in params):
            # the common case: all greedy, nothing to penalise -> one argmax, no copies, no extra tensors
            self.last_stages = (*stages, "argmax")
            return _to_host(_argmax(logits), None, [], params)

        scores, seen, counts = self._penalise(logits, rows, stages)  # [B, V] float32, the stacked histories
        generator_states: dict[int, Tensor] = {}
        if sample_rows:
            stages.append("sample")
            sampled = self._sample(scores, rows, sample_rows, generator_states)  # [S]
            if len(sample_rows) == len(rows):
                token_ids = sampled
            else:
                index = _to_device(torch.tensor(sample_rows), logits.device)
                token_ids = scores.argmax(dim=-1).index_copy(0, index, sampled)  # [B]
        else:
            stages.append("argmax")
            token_ids = scores.argmax(dim=-1)  # [B]
        if seen is not None or counts is not None:
            self._record(rows, seen, counts, token_ids)

        logprobs = None
        if logprob_rows:
            stages.append("logprobs")
            logprobs = self._logprobs(scores, token_ids, logprob_rows, params)
        self.last_stages = tuple(stages)
        out = _to_host(token_ids, logprobs, logprob_rows, params)
        out.generator_states = generator_states
        return out

    # ---- grammar -----------------------------------------------------------------------------------

    def _constrain(self, logits: Tensor, rows: list[SamplingRow], constrained: list[int]) -> Tensor:
        """`logits` with what the constrained rows' grammars do not allow next at -inf (a new tensor).

        The bitmask ([R, V / 32] int32) is filled on the host, in pinned memory on CUDA, and uploaded without waiting:
        no host sync (on CUDA the forward is still running while the host computes it)."""
        grammars = [rows[i].grammar for i in constrained]
        bitmask = torch.empty(len(grammars), bitmask_words(logits.shape[1]), dtype=torch.int32,
                              pin_memory=logits.device.type == "cuda")
        if self.grammars is not None:
            self.grammars.fill_bitmask(grammars, bitmask)
        else:
            for i, grammar in enumerate(grammars):
                GrammarCompiler.fill_one(grammar, bitmask[i])
        if logits.device.type == "cuda":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        return apply_bitmask(logits, constrained, bitmask)

    # ---- penalties ---------------------------------------------------------------------------------

    def apply_penalties(self, logits: Tensor, rows: list[SamplingRow],
                        stages: list[str] | None = None) -> Tensor:
        """Penalised logits, float32 [B, V]; neither the input nor the rows' states are modified.

        With no penalty in the batch this is `logits.float()` (the input itself when already float32).
        """
        return self._penalise(logits, rows, [] if stages is None else stages)[0]

    def _penalise(self, logits: Tensor, rows: list[SamplingRow],
                  stages: list[str]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The penalised logits and the stacked states they read: `seen` [B, V] bool and `counts` [B, V] float32,
        None for a stage no row uses. Stacking copies O(V) per row, whatever the context."""
        params = [row.params for row in rows]
        for row in rows:
            state = row.penalty
            assert (state is not None and state.seen is not None) == (row.params.repetition_penalty != 1.0) and \
                (state is not None and state.counts is not None) == _counts_output(row.params), \
                f"the row's PenaltyState does not match its params {row.params} (see PenaltyState.from_ids)"
        vocab_size, device = logits.shape[1], logits.device
        scores = logits.float()
        seen = counts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            stages.append("repetition_penalty")
            seen = _stack([None if row.penalty is None else row.penalty.seen for row in rows],
                          torch.bool, vocab_size, device)  # [B, V]
            penalty = _column([p.repetition_penalty for p in params], device)  # [B, 1]
            penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
            scores = torch.where(seen, penalised, scores)
        if any(_counts_output(p) for p in params):
            stages.append("presence_frequency_penalty")
            counts = _stack([None if row.penalty is None else row.penalty.counts for row in rows],
                            torch.float32, vocab_size, device)  # [B, V]
            frequency = _column([p.frequency_penalty for p in params], device)  # [B, 1]
            presence = _column([p.presence_penalty for p in params], device)  # [B, 1]
            scores = scores - counts * frequency - (counts > 0).float() * presence
        return scores, seen, counts

    def _record(self, rows: list[SamplingRow], seen: Tensor | None, counts: Tensor | None, token_ids: Tensor) -> None:
        """Add each row's sampled token to its state, on the device: one op per stacked tensor for the whole batch.
        The stacked tensors then become the states (each state's tensors are views of its rows): nothing is copied
        back, and the next step stacks the views."""
        vocab_size = (seen if seen is not None else counts).shape[1]
        flat = torch.arange(len(rows), device=token_ids.device) * vocab_size + token_ids  # [B] row b's new token
        if seen is not None:
            seen.view(-1).index_fill_(0, flat, True)
        if counts is not None:
            counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, device=flat.device))
        for b, row in enumerate(rows):
            if row.penalty is not None:
                if row.penalty.seen is not None:
                    row.penalty.seen = seen[b]  # [V]
                if row.penalty.counts is not None:
                    row.penalty.counts = counts[b]  # [V]
                self._adopted.append(weakref.ref(row.penalty))

    def _release_absent(self, rows: list[SamplingRow]) -> None:
        """A state that views the last batch's tensors but has no row now (its sequence was preempted) copies its rows
        out, so that it does not keep that whole [B, V] batch alive; a finished sequence's state is already gone."""
        present = {id(row.penalty) for row in rows}
        for ref in self._adopted:
            state = ref()
            if state is not None and id(state) not in present:
                state.own()
        self._adopted = []

    # ---- sampling ----------------------------------------------------------------------------------

    def _sample(self, scores: Tensor, rows: list[SamplingRow], sample_rows: list[int],
                generator_states: dict[int, Tensor]) -> Tensor:
        device, vocab_size = scores.device, scores.shape[1]
        params = [rows[i].params for i in sample_rows]
        if len(sample_rows) < len(rows):
            scores = scores.index_select(0, _to_device(torch.tensor(sample_rows), device))  # [S, V]
        scores = scores / _column([p.temperature for p in params], device)  # [S, V]

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        # top_p == 1 is "off"; inf keeps float rounding in the cumulative sum from dropping tail tokens
        top_p = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
        use_top_p = any(p < 1.0 for p in top_p)
        if use_top_p or any(k < vocab_size for k in top_k):
            scores = _top_k_top_p(scores, _column(top_k, device, torch.long), _column(top_p, device), use_top_p)
        if any(p.min_p > 0.0 for p in params):
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); min_p = 0 -> -inf, keeps all
            floor = scores.amax(dim=-1, keepdim=True) + _column([p.min_p for p in params], device).log()
            scores = scores.masked_fill(scores < floor, -math.inf)
        probs = scores.softmax(dim=-1)  # [S, V]

        # exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws token i with probability p_i
        unseeded = [j for j, i in enumerate(sample_rows) if rows[i].generator is None]
        shared = self.shared_generator(device) if unseeded else None
        if len(unseeded) == len(sample_rows):
            noise = torch.empty_like(probs).exponential_(generator=shared)  # [S, V]
        else:
            noise = torch.empty_like(probs)
            if unseeded:
                draws = torch.empty(len(unseeded), vocab_size, device=device).exponential_(generator=shared)
                noise[_to_device(torch.tensor(unseeded), device)] = draws
            for j, i in enumerate(sample_rows):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)  # exactly V draws, any batch
                    if rows[i].keep_generator_state:
                        generator_states[i] = rows[i].generator.get_state()
        # a zero draw would make 0/0 = nan on an excluded token; tiny keeps excluded tokens at score 0
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)  # [S]

    # ---- logprobs ----------------------------------------------------------------------------------

    @staticmethod
    def _logprobs(scores: Tensor, token_ids: Tensor, logprob_rows: list[int],
                  params: list[SamplingParams]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        index = _to_device(torch.tensor(logprob_rows), scores.device)
        logprobs = scores.index_select(0, index).log_softmax(dim=-1)  # [N, V]
        chosen = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)  # [N]
        num_top = max(params[i].logprobs for i in logprob_rows)
        if num_top == 0:
            return chosen, None, None
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [N, K] sorted
        return chosen, top_values, top_ids


def _add_logit_bias(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """float32 [B, V]: `logits` with each row's `logit_bias` added (a new tensor; the input is not modified). The
    (row, id) pairs and their biases reach the device as two small host tensors (pinned, not waited for), and one
    scatter adds them: host work O(biased ids) a step, no sync."""
    rows, ids, values = [], [], []
    for b, p in enumerate(params):
        if p.logit_bias:
            rows += [b] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    index = _to_device(torch.tensor([rows, ids], dtype=torch.long), logits.device)  # [2, N]
    bias = _to_device(torch.tensor(values, dtype=torch.float32), logits.device)  # [N]
    scores = logits.to(torch.float32, copy=True)
    # the ids of one row are a dict's keys: no (row, id) pair repeats, so each element gets its one bias added
    return scores.index_put_((index[0], index[1]), bias, accumulate=True)


_NUCLEUS_CANDIDATES = 64  # top-p first looks for its nucleus among this many most likely tokens
_NUCLEUS_ROUNDING = 1e-4  # a cumulative mass this close to top_p is left to the sort (float32 sums differ ~1e-6)


def _top_k_top_p(scores: Tensor, top_k: Tensor, top_p: Tensor, use_top_p: bool) -> Tensor:
    """Mask to -inf what top-k ([S, 1] long) and then top-p ([S, 1], inf = off) exclude.

    Works in sorted order (stable: among equal logits the lower id ranks first), so top_k = 1 keeps
    exactly the argmax token, and the most likely token always survives top-p.
    """
    if use_top_p:
        kept = _nucleus_among_candidates(scores, top_k, top_p)
        if kept is not None:
            return kept
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)  # [S, V]
    rank = torch.arange(scores.shape[1], device=scores.device)  # [V]
    keep = rank < top_k  # [S, V]
    if use_top_p:
        probs = sorted_scores.masked_fill(~keep, -math.inf).softmax(dim=-1)  # [S, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [S, V]; 0 at rank 0
        keep &= mass_before < top_p
    keep_vocab = torch.empty_like(keep).scatter_(1, order, keep)  # back to vocab order
    return scores.masked_fill(~keep_vocab, -math.inf)


def _nucleus_among_candidates(scores: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor | None:
    """`_top_k_top_p` with top-p on, without sorting the vocabulary, or None where that cannot be exact.

    A nucleus is a prefix of the sorted order, usually a few tokens: the most likely `_NUCLEUS_CANDIDATES` (topk),
    ordered as the stable sort orders them, with their probabilities against the whole row's (the top-k's)
    normaliser, decide it whenever it ends among them (sorting a 49K vocabulary took 4.9 ms a token, the default
    model's whole forward 5 ms). None (the caller sorts) when a row's nucleus or top-k reaches past the candidates,
    or a token outside them ties the last kept one (the stable sort might rank it first).

    CPU tensors only: deciding reads flags on the host, which on a GPU would wait for the device (the sampler's one
    wait is `_read_back`), and a GPU sorts a vocabulary in microseconds. The flags are read through numpy: on the
    CPU that waits for nothing.
    """
    vocab = scores.shape[1]
    c = min(_NUCLEUS_CANDIDATES, vocab)
    if scores.device.type != "cpu" or c == vocab or ((top_k > c) & (top_k < vocab)).numpy().any():
        return None  # (a top-k past the candidates: sort)
    values, ids = scores.topk(c, dim=-1)  # [S, c]
    # the stable sort's order among them: by value, descending, the lower id first among equal ones
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    rank = torch.arange(c, device=scores.device)  # [c]
    keep = rank < top_k  # [S, c]
    within_k = top_k <= c  # [S, 1]: the top-k, if any, lies among the candidates
    norm = torch.where(within_k, values.masked_fill(~keep, -math.inf).logsumexp(dim=-1, keepdim=True),
                       scores.logsumexp(dim=-1, keepdim=True))  # [S, 1]
    probs = (values - norm).exp()  # [S, c]
    mass_before = probs.cumsum(dim=-1) - probs  # [S, c]
    keep &= mass_before < top_p
    last = keep.sum(dim=-1, keepdim=True) - 1  # [S, 1]: the last kept rank (rank 0 always is)
    # The sort computes the same masses by another float path (a softmax over the whole row): where the mass before
    # the last kept rank or the first dropped one is within rounding of top_p, the two may cut differently, and only
    # the sort's answer is the definition.
    edges = mass_before.gather(1, torch.cat([last, (last + 1).clamp(max=c - 1)], dim=1))  # [S, 2]
    if ((edges - top_p).abs() < _NUCLEUS_ROUNDING).numpy().any():
        return None
    # exact when every row's nucleus ends before the last candidate, and no token outside ties its last kept one
    if keep[:, -1].numpy().any() or (values.gather(1, last) <= values[:, -1:]).numpy().any():
        return None
    return torch.full_like(scores, -math.inf).scatter_(1, ids, scores.gather(1, ids).masked_fill(~keep, -math.inf))


def has_penalty(p: SamplingParams) -> bool:
    """Whether the params have a penalty, i.e. a row for them needs a `PenaltyState`."""
    return p.repetition_penalty != 1.0 or _counts_output(p)


def _counts_output(p: SamplingParams) -> bool:
    """Whether the presence / frequency penalties (over the output tokens) are on."""
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _stack(rows: list[Tensor | None], dtype: torch.dtype, vocab_size: int, device: torch.device) -> Tensor:
    """[B, V]: each row's [V] tensor, zeros for a row without one."""
    zeros = torch.zeros(vocab_size, dtype=dtype, device=device) if any(t is None for t in rows) else None
    return torch.stack([zeros if t is None else t for t in rows])


def _column(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device).unsqueeze(1)  # [B, 1]


def _argmax(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1): the first of a row's maxima (NaN counting as the largest). On the CPU through max(dim),
    the same index (both take the first maximum) in less than half the time (a [1, 49152] row: ~30 against ~80 us)."""
    return logits.max(dim=-1).indices if logits.is_cpu else logits.argmax(dim=-1)


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on `device`. On CUDA through pinned memory, copied in stream order without waiting
    (a pageable copy would block until the device has finished all queued work)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _read_back(*tensors: Tensor | None) -> list[list | None]:
    """The step's one wait for the device: `tensors` as host lists (None stays None).

    On CUDA every tensor is copied into pinned memory asynchronously and one event is waited for, so nothing
    queued before (the forward, the sampling) waits; only this final wait does.
    """
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda":
        return [None if t is None else t.tolist() for t in tensors]
    hosts = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(hosts, tensors):
        if t is not None:
            host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(present[0].device))
    done.synchronize()
    return [None if host is None else host.tolist() for host in hosts]


def _to_host(token_ids: Tensor, logprobs: tuple[Tensor, Tensor | None, Tensor | None] | None,
             logprob_rows: list[int], params: list[SamplingParams]) -> SamplerOutput:
    # ---- the one device -> host read of the step: sampled ids (and the requested logprobs) ----
    chosen, top_values, top_ids = logprobs if logprobs is not None else (None, None, None)
    ids, chosen_list, values, top_id_list = _read_back(token_ids, chosen, top_values, top_ids)
    per_row: list[dict | None] = [None] * len(ids)
    if logprobs is not None:
        for n, i in enumerate(logprob_rows):
            k = params[i].logprobs
            # a grammar may allow fewer than k tokens: the disallowed ones (-inf) are no alternatives
            top = [(t, v) for t, v in zip(top_id_list[n][:k], values[n][:k]) if v != -math.inf] if k else []
            per_row[i] = {"token_id": ids[i], "logprob": chosen_list[n], "top": top}
    return SamplerOutput(token_ids=ids, logprobs=per_row)
