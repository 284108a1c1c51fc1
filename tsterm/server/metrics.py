"""`GET /metrics`: a per-app prometheus_client registry.

The engine's own counters and histograms (`engine.metrics`, `engine.stats()`, vLLM-style `tsterm:` names) are read at
scrape time by a custom collector; the server adds what only it sees: requests by endpoint and status, and the
prompt, cached and generated tokens of the requests it served.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    """Reads the engine at each scrape: `read` (AsyncEngine.stats_and_metrics) is a blocking call answered on the
    engine thread (scrape from a worker thread) with `stats()` and a copy of the engine's EngineMetrics."""

    def __init__(self, read: Callable[[], tuple[dict, Any]]):
        self.read = read

    def collect(self) -> Iterator[Metric]:
        s, m = self.read()
        gauges = (("num_requests_running", "Requests in the running batch.", s["running"]),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"]),
                  ("kv_cache_usage_perc", "Fraction of KV blocks referenced by requests (0-1).",
                   s["used"] / max(s["num_blocks"], 1)),
                  ("kv_cache_blocks_used", "KV blocks referenced by requests.", s["used"]),
                  ("kv_cache_blocks_cached", "Unreferenced KV blocks kept for prefix reuse.", s["cached"]),
                  ("kv_cache_blocks_pinned", "KV blocks pinned for waiting sessions.", s.get("pinned_blocks", 0)),
                  ("kv_cache_blocks_shared", "KV blocks referenced by more than one request.", s["shared"]))
        if "cpu_threads" in s:
            gauges += (("cpu_threads", "Threads a CPU step runs on (the cores other processes leave free).",
                        s["cpu_threads"]),)
        if s.get("state_slots"):  # a hybrid model's recurrent-state pool and its snapshots
            gauges += (("state_pool_bytes", "Bytes of the recurrent-state slots (linear-attention layers).",
                        s["state_bytes"]),
                       ("state_snapshots", "Recurrent-state snapshots kept with cached blocks for prefix reuse.",
                        s["state_snapshots"]))
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(f"tsterm:{name}", help_text, value=value)
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_query_tokens"]),
                    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s["prefix_hit_tokens"]),
                    ("num_preemptions", "Requests preempted for lack of KV blocks.", s["preemptions"]),
                    ("kv_cow_copies", "Partial KV blocks copied on write after a fork.", s["cow_copies"]),
                    ("kv_cow_bytes", "Bytes copied by KV copy-on-write.", s["cow_bytes"]),
                    ("kv_reused_bytes", "KV bytes taken by reference from the prefix cache instead of computed.",
                     s["kv_reused_bytes"]),
                    ("prompt_tokens", "Prompt tokens of finished requests.", m.prompt_tokens),
                    ("generation_tokens", "Generated tokens.", m.generation_tokens))
        if s.get("state_slots"):
            counters += (("state_snapshot_bytes", "Recurrent-state bytes copied into snapshot slots.",
                          s["state_snapshot_bytes"]),
                         ("state_copy_bytes", "Recurrent-state bytes copied into a sequence's slot (a cached prefix "
                          "resumed, a sample forked).", s["state_copy_bytes"]))
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"tsterm:{name}", help_text, value=value)
        if s.get("spec_num_tokens"):  # speculative decoding on: vLLM's four families, named and labelled as its
            yield from _spec_decode(s)  # vllm/v1/spec_decode/metrics.py names them (its `position` label too)
        success = CounterMetricFamily("tsterm:request_success", "Finished requests by finish reason.",
                                      labels=["finished_reason"])
        for reason, count in sorted(dict(m.requests_finished).items()):
            success.add_metric([reason], count)
        yield success
        for name, hist, help_text in (("time_to_first_token_seconds", m.ttft, "Time to first token."),
                                      ("inter_token_latency_seconds", m.itl, "Time between generated tokens."),
                                      ("e2e_request_latency_seconds", m.e2e, "End-to-end request latency."),
                                      ("request_queue_time_seconds", m.queue, "Time from arrival to first schedule.")):
            counts, cumulative, buckets = list(hist.counts), 0, []
            for bound, count in zip((*hist.buckets, float("inf")), counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            yield HistogramMetricFamily(f"tsterm:{name}", help_text, buckets=buckets, sum_value=hist.total)
        if "kv_tier_loads" in s:  # the KV cache's lower tiers (kv_host_bytes, kv_disk): hits, traffic, size, loads
            yield from _kv_tiers(s)


def _kv_tiers(s: dict) -> Iterator[Metric]:
    """The host and disk tiers' counters: prompt tokens served by each tier (the device pool's by reference, the
    others' copied back), the bytes written to and read from each, each one's size and bound, and the loads."""
    hits = CounterMetricFamily("tsterm:prefix_cache_hits_by_tier", "Prompt tokens served from the prefix cache by "
                               "tier: device (by reference), host and disk (read back: a copy).", labels=["tier"])
    hits.add_metric(["device"], s["prefix_hit_tokens"] - s["kv_tier_hit_tokens"])
    hits.add_metric(["host"], s["kv_host_hit_tokens"])
    hits.add_metric(["disk"], s["kv_disk_hit_tokens"])
    yield hits
    tiers = [tier for tier in ("host", "disk") if f"kv_{tier}_max_bytes" in s]
    for name, help_text in (("bytes", "Bytes of KV blocks the tier holds."),
                            ("max_bytes", "The tier's bound (kv_host_bytes, kv_disk.max_bytes).")):
        gauge = GaugeMetricFamily(f"tsterm:kv_tier_{name}", help_text, labels=["tier"])
        for tier in tiers:
            gauge.add_metric([tier], s[f"kv_{tier}_{name}"])
        yield gauge
    for name, help_text in (("written_bytes", "KV bytes copied into the tier (host: out of the pool; disk: written "
                             "through, or spilled by the host tier)."),
                            ("read_bytes", "KV bytes read back from the tier."),
                            ("evicted_blocks", "KV blocks the tier evicted to stay under its bound.")):
        counter = CounterMetricFamily(f"tsterm:kv_tier_{name}", help_text, labels=["tier"])
        for tier in tiers:
            counter.add_metric([tier], s[f"kv_{tier}_{name}"])
        yield counter
    hit_blocks = CounterMetricFamily("tsterm:kv_tier_hit_blocks", "KV blocks read back, by the tier that served them "
                                     "(host: host memory, the host tier or the disk writer's queue).", labels=["tier"])
    hit_blocks.add_metric(["host"], s["kv_host_hit_blocks"])
    if "kv_disk_hit_blocks" in s:
        hit_blocks.add_metric(["disk"], s["kv_disk_hit_blocks"])
    yield hit_blocks
    counters = [("kv_tier_loads", "Prompts that read blocks back from the host or disk tier."),
                ("kv_tier_load_seconds", "Time prompts waited for blocks from the host and disk tiers (reads, checks, "
                 "the copy into the pool); per turn: over kv_tier_loads.")]
    if "kv_host_max_bytes" in s:
        counters.append(("kv_host_spilled_blocks", "KV blocks the host tier evicted to the disk store."))
    if "kv_disk_max_bytes" in s:
        counters.append(("kv_disk_refused_blocks", "Stored KV blocks refused (checksum, model fingerprint, header) "
                         "and computed instead."))
    for name, help_text in counters:
        yield CounterMetricFamily(f"tsterm:{name}", help_text, value=s[name])


def _spec_decode(s: dict) -> Iterator[Metric]:
    """Speculative decoding's counters (the engine's `spec_*` stats, over every draft source), as vLLM exposes them.
    The acceptance rate is rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total), the mean accepted
    length (with the verify's own token) 1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total), and
    position i's acceptance rate ..._num_accepted_tokens_per_pos_total{position="i"} / ..._num_drafts_total. Every
    position below the configured draft length is shown from the start, at 0 until a verify accepts it."""
    for name, help_text, key in (("num_drafts", "Number of spec decoding drafts (one sequence's drafts verified in "
                                  "one step).", "spec_num_drafts"),
                                 ("num_draft_tokens", "Number of draft tokens.", "spec_draft_tokens"),
                                 ("num_accepted_tokens", "Number of accepted tokens.", "spec_accepted_tokens")):
        yield CounterMetricFamily(f"tsterm:spec_decode_{name}", help_text, value=s[key])
    per_pos = CounterMetricFamily("tsterm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["position"])
    for position, count in enumerate(s["spec_accepted_per_pos"]):
        per_pos.add_metric([str(position)], count)
    yield per_pos


class ServerMetrics:
    """The server's own metrics, in `registry` (one per app: two apps in one process never share counters)."""

    def __init__(self, engine_collector: Collector | None = None):
        self.registry = CollectorRegistry(auto_describe=False)  # a scrape, not registration, reads the engine
        self.requests = Counter("tsterm:server_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("tsterm:server_prompt_tokens", "Prompt tokens of the server's requests.",
                                     registry=self.registry)
        self.cached_tokens = Counter("tsterm:server_cached_prompt_tokens",
                                     "Prompt tokens of the server's requests served from the prefix cache.",
                                     registry=self.registry)
        self.generation_tokens = Counter("tsterm:server_generation_tokens",
                                         "Tokens generated for the server's requests.", registry=self.registry)
        self.disconnects = Counter("tsterm:server_client_disconnects",
                                   "Requests aborted because their client went away.", registry=self.registry)
        self.in_flight = Gauge("tsterm:server_requests_in_flight", "Generation requests admitted and not finished.",
                               registry=self.registry)
        # chat requests that continued a stored API conversation, by the history policy that planned their prompt
        # (tsterm/chat/history.py), the `preserve` ones planned as `template` by why, and those that continued none
        self.history_policy = Counter("tsterm:server_history_policy",
                                      "Chat requests continuing a stored conversation, by the history policy applied.",
                                      ["policy"], registry=self.registry)
        self.history_fallbacks = Counter("tsterm:server_history_fallbacks",
                                         "Chat requests asking for the 'preserve' history policy that were planned "
                                         "as 'template', by reason.", ["reason"], registry=self.registry)
        self.history_unmatched = Counter("tsterm:server_history_unmatched",
                                         "Chat requests that continued no stored conversation (rendered as sent).",
                                         registry=self.registry)
        self.conversations = Gauge("tsterm:server_conversations", "API conversations stored for their next request.",
                                   registry=self.registry)
        if engine_collector is not None:
            self.registry.register(engine_collector)

    def on_usage(self, prompt: int, cached: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
