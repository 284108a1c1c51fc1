"""Engine metrics: counters, rolling throughput windows and latency histograms, updated by the engine.

The dashboard reads them through `snapshot()`; the server's `GET /metrics` exposes them with `stats()` through
prometheus_client (`tsterm.server.metrics.EngineCollector`), under vLLM's names with a `tsterm:` prefix
(`tsterm:prefix_cache_queries`, `tsterm:time_to_first_token_seconds`, ...), so existing dashboards can read them.

Speculative decoding's counters (`SpecDecodeMetrics`) reach every front through `Engine.stats()` (`spec_*` keys: plain
data, so they cross to a front in another process like the other counters): per draft source and per draft position,
as vLLM counts them (`vllm/v1/spec_decode/metrics.py`: drafts, draft tokens, accepted tokens, accepted per position),
plus how many verifies reached each position, which per-position acceptance rates are taken over.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tsterm.outputs import RequestMetrics

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last bucket is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


class RateWindow:
    """Tokens per second over the last `seconds`, from (timestamp, count) events."""

    def __init__(self, seconds: float = 5.0):
        self.seconds = seconds
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, count: int, now: float) -> None:
        if count:
            self.events.append((now, count))
            self.total += count
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.seconds:
            self.total -= self.events.popleft()[1]

    def rate(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        self._expire(now)
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1e-3)
        return self.total / span if len(self.events) > 1 else self.total / self.seconds


@dataclass
class DraftCounters:
    """One draft source's verifies: a verify is one sequence's drafts checked in one step."""

    num_drafts: int = 0  # verifies
    num_draft_tokens: int = 0  # tokens drafted (and verified)
    num_accepted_tokens: int = 0  # of them, accepted (the token each verify adds of its own is not counted)
    drafted_per_pos: list[int] = field(default_factory=list)  # [i]: verifies with a draft token at position i
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: verifies that accepted position i

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"a verify accepted {num_accepted} of {num_drafted} draft tokens")
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        grow = num_drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(num_drafted):  # (K <= 64: a few adds per verifying sequence and step)
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self, positions: int = 0) -> dict:
        """Plain data (new lists), the per-position lists at least `positions` long."""
        pad = [0] * max(0, positions - len(self.drafted_per_pos))
        return {"num_drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "drafted_per_pos": self.drafted_per_pos + pad,
                "accepted_per_pos": self.accepted_per_pos + pad}


class SpecDecodeMetrics:
    """Speculative decoding's counters, per draft source (its `name`: "ngram", "suffix", ...), since start."""

    def __init__(self, method: str = "off", num_tokens: int = 0):
        self.method = method  # the configured source ("off": no speculation)
        self.num_tokens = num_tokens if method != "off" else 0  # K: the most a verify drafts
        self.sources: dict[str, DraftCounters] = {}

    def on_verify(self, source: str, num_drafted: int, num_accepted: int) -> None:
        counters = self.sources.get(source)
        if counters is None:
            counters = self.sources[source] = DraftCounters()
        counters.observe(num_drafted, num_accepted)

    def stats(self) -> dict:
        """The `spec_*` keys of `Engine.stats()`: the totals over every source, the per-position lists (K long at
        least, zeros included), and `spec_sources`: each source's own, by name. Only new lists and dicts."""
        total = DraftCounters()
        for counters in self.sources.values():
            total.num_drafts += counters.num_drafts
            total.num_draft_tokens += counters.num_draft_tokens
            total.num_accepted_tokens += counters.num_accepted_tokens
            for name in ("drafted_per_pos", "accepted_per_pos"):
                mine, theirs = getattr(total, name), getattr(counters, name)
                mine += [0] * (len(theirs) - len(mine))
                for i, count in enumerate(theirs):
                    mine[i] += count
        out = total.as_dict(self.num_tokens)
        return {"spec_method": self.method, "spec_num_tokens": self.num_tokens,
                "spec_num_drafts": out["num_drafts"], "spec_draft_tokens": out["draft_tokens"],
                "spec_accepted_tokens": out["accepted_tokens"], "spec_drafted_per_pos": out["drafted_per_pos"],
                "spec_accepted_per_pos": out["accepted_per_pos"],
                "spec_sources": {name: c.as_dict(self.num_tokens) for name, c in sorted(self.sources.items())}}


class EngineMetrics:
    """Everything the dashboard and `/metrics` read. Updated by the engine once per step and per finished request."""

    def __init__(self, window_seconds: float = 5.0, spec_method: str = "off", num_speculative_tokens: int = 0):
        self.prefill_window = RateWindow(window_seconds)
        self.decode_window = RateWindow(window_seconds)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(TTFT_BUCKETS)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.spec = SpecDecodeMetrics(spec_method, num_speculative_tokens)

    def on_step(self, prefill_tokens: int, decode_tokens: int, now: float) -> None:
        self.prefill_window.add(prefill_tokens, now)
        self.decode_window.add(decode_tokens, now)
        self.generation_tokens += decode_tokens

    def on_verify(self, source: str, num_drafted: int, num_accepted: int) -> None:
        """A sequence verified `num_drafted` tokens of draft source `source` in a step and accepted `num_accepted`."""
        self.spec.on_verify(source, num_drafted, num_accepted)

    def on_token_latency(self, itl: float) -> None:
        self.itl.observe(itl)

    def on_finished(self, m: RequestMetrics, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
        self.prompt_tokens += m.num_prompt_tokens
        self.cached_prompt_tokens += m.num_cached_tokens
        for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)

    def snapshot(self) -> dict[str, float]:
        now = time.time()
        return {"prefill_tokens_per_s": self.prefill_window.rate(now), "decode_tokens_per_s": self.decode_window.rate(now),
                "ttft_mean_s": self.ttft.total / self.ttft.count if self.ttft.count else 0.0,
                "itl_mean_s": self.itl.total / self.itl.count if self.itl.count else 0.0}
