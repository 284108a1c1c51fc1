"""Engine metrics: counters, rolling throughput windows, latency histograms, and Prometheus text exposition.

Names follow vLLM's under a `tsterm:` prefix (`tsterm:prefix_cache_queries`, `tsterm:kv_cache_usage_perc`,
`tsterm:time_to_first_token_seconds`, ...), so existing dashboards can read them.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tsterm.engine.sequence import RequestMetrics

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

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {self.count}"]


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

    def prometheus(self, engine_stats: dict) -> str:
        """Prometheus text exposition (format 0.0.4) of the metrics plus the engine's KV/prefix counters."""
        s = engine_stats
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float | None = None, body: list[str] | None = None):
            full = f"tsterm:{name}"
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            lines.extend(body if body is not None else [f"{full} {value}"])

        metric("num_requests_running", "gauge", "Requests in the running batch.", s["running"])
        metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s["waiting"])
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV blocks referenced by requests (0-1).",
               s["used"] / max(s["num_blocks"], 1))
        metric("kv_cache_blocks_shared", "gauge", "KV blocks referenced by more than one request.", s["shared"])
        metric("kv_cache_blocks_cached", "gauge", "Unreferenced KV blocks kept for prefix reuse.", s["cached"])
        metric("kv_cache_blocks_pinned", "gauge", "KV blocks pinned for sessions waiting on tools or users (not evictable).",
               s.get("pinned_blocks", 0))
        metric("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", s["prefix_query_tokens"])
        metric("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.", s["prefix_hit_tokens"])
        metric("num_preemptions", "counter", "Requests preempted for lack of KV blocks.", s["preemptions"])
        metric("kv_cow_copies", "counter", "Partial KV blocks copied on write after a fork.", s["cow_copies"])
        metric("kv_cow_bytes", "counter", "Bytes copied by KV copy-on-write.", s["cow_bytes"])
        metric("kv_reused_bytes", "counter", "KV bytes reused by reference (cached tokens x KV bytes per token).",
               s.get("kv_reused_bytes", 0))
        if s.get("state_slots"):  # a hybrid model's recurrent-state pool and its snapshots
            metric("state_pool_bytes", "gauge", "Bytes of the recurrent-state slots (linear-attention layers).",
                   s["state_bytes"])
            metric("state_snapshots", "gauge", "Recurrent-state snapshots kept with cached blocks for prefix reuse.",
                   s["state_snapshots"])
            metric("state_snapshot_bytes", "counter", "Recurrent-state bytes copied into snapshot slots.",
                   s["state_snapshot_bytes"])
            metric("state_copy_bytes", "counter", "Recurrent-state bytes copied into a sequence's slot (a cached "
                   "prefix resumed, a sample forked).", s["state_copy_bytes"])
        if "cpu_threads" in s:
            metric("cpu_threads", "gauge", "Threads a CPU step runs on (the cores other processes leave free).",
                   s["cpu_threads"])
        metric("prompt_tokens", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("generation_tokens", "counter", "Generated tokens.", self.generation_tokens)
        snap = self.snapshot()
        metric("avg_prompt_throughput_toks_per_s", "gauge", "Prefill tokens/s over the rolling window.",
               snap["prefill_tokens_per_s"])
        metric("avg_generation_throughput_toks_per_s", "gauge", "Decode tokens/s over the rolling window.",
               snap["decode_tokens_per_s"])
        body = [f'tsterm:request_success{{finished_reason="{r}"}} {n}' for r, n in sorted(self.requests_finished.items())]
        metric("request_success", "counter", "Finished requests by finish reason.", body=body)
        for name, hist, help_text in (("time_to_first_token_seconds", self.ttft, "Time to first token."),
                                      ("inter_token_latency_seconds", self.itl, "Time between generated tokens."),
                                      ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
                                      ("request_queue_time_seconds", self.queue, "Time from arrival to first schedule.")):
            metric(name, "histogram", help_text, body=hist.lines(f"tsterm:{name}"))
        return "\n".join(lines) + "\n"
