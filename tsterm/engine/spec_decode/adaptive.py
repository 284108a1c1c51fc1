"""How many of a source's drafts a sequence verifies: the length that pays for its verify, learnt as the engine runs.

A verify step of k drafts costs more than a decode step (k more rows through the model and the sampler; on the CPU's
decode stack and on an MoE that touches more experts, measurably more), and it pays only by the drafts accepted.
`DraftLength` keeps two estimates and picks, for each sequence and step, the k that maximises tokens per second:

- the cost: `StepCost`, the engine's measured wall time of a decode step by its number of rows (steps without prefill
  chunks; an exponential average per row count, linear between measured counts, and beyond the last one a cautious
  prior slope until a step of that size is measured);
- the acceptance: each sequence's chance `p` that the target's next token equals the draft's, from every draft the
  source proposed for it, verified or not: a draft that is not verified is still scored against the tokens the
  sequence goes on to produce ("shadow" scoring; for a sampled request the chance that its token equals the draft is
  the speculative-sampling acceptance p(d) itself), so a sequence whose text stops or starts repeating is seen at no
  cost. Counts decay, so a sequence moving from free text into a copy is followed within a few tokens; a prior
  from all sequences stands in for a new one's.

With B sequences decoding, verifying k drafts of one makes the step produce B - 1 + E(k) tokens, E(k) = 1 + p + ...
+ p^k (acceptance stops at the first mismatch), in time T(B + k) instead of B tokens in T(B); the k with the best
rate wins, and 0 (no verify) unless it beats plain decode by `margin`. On text that does not repeat p falls and the
length falls to 0: speculation then costs only the source's lookup and this arithmetic (microseconds a step).

The choice depends on measured time, so it differs between runs; the output does not: greedy verification is
lossless and a seeded request's generator is rewound to its last kept row (`Engine._accept`), so which drafts were
verified never shows in the tokens.
"""
from __future__ import annotations

from collections.abc import Sequence


class StepCost:
    """Measured seconds of a decode step by its number of rows (a sequence's token plus its drafts, summed)."""

    def __init__(self, weight: float = 0.2, prior_row_cost: float = 0.5, max_rows: int = 4096):
        """weight: of a new measurement in the average. prior_row_cost: the cost of a row beyond the largest measured
        step, as a fraction of that step's cost per row, until such a step is measured (cautious: drafts must then
        be likely to pay)."""
        self.weight, self.prior_row_cost, self.max_rows = weight, prior_row_cost, max_rows
        self.seconds: dict[int, float] = {}  # rows -> average seconds
        self._sorted: list[int] = []

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or rows > self.max_rows or not seconds > 0:
            return
        old = self.seconds.get(rows)
        if old is None:
            self.seconds[rows] = seconds
            self._sorted = sorted(self.seconds)
        else:
            self.seconds[rows] = old + self.weight * (seconds - old)

    def time(self, rows: int) -> float | None:
        """The estimated seconds of a step of `rows` rows (None before any step was measured)."""
        known = self._sorted
        if not known:
            return None
        if rows in self.seconds:
            return self.seconds[rows]
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self.seconds[lo], self.seconds[hi]
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        if above:  # (smaller than any measured step: no cheaper than the smallest)
            return self.seconds[above[0]]
        lo = below[-1]
        slope = self.prior_row_cost * self.seconds[lo] / lo
        if len(below) >= 2:  # the measured slope between the two largest, if steeper
            prev = below[-2]
            slope = max(slope, (self.seconds[lo] - self.seconds[prev]) / (lo - prev))
        return self.seconds[lo] + slope * (rows - lo)


class _Acceptance:
    """Decayed counts of a sequence's draft positions accepted and rejected, and its pending (unscored) draft."""

    __slots__ = ("accepted", "rejected", "draft", "start")

    def __init__(self) -> None:
        self.accepted = self.rejected = 0.0
        self.draft: list[int] = []  # the last draft proposed (verified or not), scored against what follows
        self.start = 0  # the position of its first token


class DraftLength:
    """Chooses each sequence's verified draft length from the measured step cost and its estimated acceptance."""

    def __init__(self, decay: float = 0.9, prior: float = 0.5, prior_weight: float = 2.0, margin: float = 0.03):
        """decay: of a sequence's counts per scored position (how fast it follows a change of text). prior / its
        weight: the acceptance a sequence is assumed to have before its own counts, mixed with what all sequences
        had (`global_rate`). margin: how much better than plain decode a verify must be expected to be."""
        self.decay, self.prior, self.prior_weight, self.margin = decay, prior, prior_weight, margin
        self.cost = StepCost()
        self._seqs: dict[int, _Acceptance] = {}
        self.global_accepted = self.global_rejected = 0.0

    # ---- acceptance

    def _score(self, state: _Acceptance, token_ids: Sequence[int]) -> None:
        """Score the pending draft's positions that the sequence has produced tokens for since it was proposed."""
        draft, start = state.draft, state.start
        if not draft:
            return
        n = min(len(draft), len(token_ids) - start)
        if n <= 0:
            return
        decay = self.decay
        for j in range(n):
            hit = token_ids[start + j] == draft[j]
            state.accepted, state.rejected = state.accepted * decay + hit, state.rejected * decay + (not hit)
            self.global_accepted = self.global_accepted * 0.99 + hit
            self.global_rejected = self.global_rejected * 0.99 + (not hit)
            if not hit:  # (acceptance stops at the first mismatch: the positions after it were never reached)
                state.draft = []
                return
        state.draft, state.start = draft[n:], start + n

    def global_rate(self) -> float:
        total = self.global_accepted + self.global_rejected
        return self.prior if total < 1 else self.global_accepted / total

    def rate(self, seq_id: int) -> float:
        """The estimated chance that sequence `seq_id`'s next draft token is accepted."""
        state = self._seqs.get(seq_id)
        a, r = (state.accepted, state.rejected) if state is not None else (0.0, 0.0)
        w = self.prior_weight
        return (a + w * self.global_rate()) / (a + r + w)

    # ---- the choice

    def choose(self, seq_id: int, token_ids: Sequence[int], draft: list[int], decoding: int) -> list[int]:
        """The part of `draft` (proposed to follow `token_ids`) worth verifying in a step with `decoding` sequences
        decoding: its first k tokens, k maximising the expected tokens per second (0: plain decode)."""
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _Acceptance()
        self._score(state, token_ids)
        if draft:  # (scored from the next call on, whether it is verified or not)
            state.draft, state.start = list(draft), len(token_ids)
        return draft[:self.best_length(seq_id, len(draft), decoding)]

    def best_length(self, seq_id: int, max_length: int, decoding: int) -> int:
        """How many drafts of up to `max_length` are worth verifying for `seq_id` now, `decoding` sequences decoding
        (0: none; also 0 before any step was measured)."""
        base_rows = max(decoding, 1)
        t_base = self.cost.time(base_rows)
        if t_base is None or max_length <= 0:
            return 0
        p = self.rate(seq_id)
        best_k, best_rate = 0, base_rows / t_base * (1 + self.margin)
        expected, term = 1.0, 1.0  # E(k) = 1 + p + ... + p^k
        for k in range(1, max_length + 1):
            term *= p
            expected += term
            t = max(self.cost.time(base_rows + k), t_base)  # (more rows never cost less: noise aside)
            rate = (base_rows - 1 + expected) / t
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step (no prefill chunk) of `rows` rows took `seconds`, model to accepted tokens."""
        self.cost.observe(rows, seconds)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def stats(self) -> dict:
        return {"global_acceptance": round(self.global_rate(), 4),
                "step_seconds": {rows: round(t, 6) for rows, t in sorted(self.cost.seconds.items())}}
