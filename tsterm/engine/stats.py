"""Engine metrics: counters, rolling throughput windows and latency histograms, updated by the engine.

The dashboard reads them through `snapshot()`; the server's `GET /metrics` exposes them with `stats()` through
prometheus_client (`tsterm.server.metrics.EngineCollector`), under vLLM's names with a `tsterm:` prefix
(`tsterm:prefix_cache_queries`, `tsterm:time_to_first_token_seconds`, ...), so existing dashboards can read them.
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


class EngineMetrics:
    """Everything the dashboard and `/metrics` read. Updated by the engine once per step and per finished request."""

    def __init__(self, window_seconds: float = 5.0):
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

    def on_step(self, prefill_tokens: int, decode_tokens: int, now: float) -> None:
        self.prefill_window.add(prefill_tokens, now)
        self.decode_window.add(decode_tokens, now)
        self.generation_tokens += decode_tokens

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
