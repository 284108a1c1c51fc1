"""Scrape an engine as `GET /metrics` does: the server's EngineCollector in its ServerMetrics registry, rendered by
prometheus_client and read back by prometheus_client's parser (no HTTP server)."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tsterm.server.metrics import EngineCollector, ServerMetrics


def scrape(engine) -> dict[str, float]:
    """Every sample the app's /metrics shows for `engine` (a sync Engine, read on this thread), keyed as the text
    format writes it: `name` or `name{label="value",...}` (labels sorted), counters with their `_total` suffix."""
    registry = ServerMetrics(EngineCollector(lambda: (engine.stats(), engine.metrics))).registry
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples
