"""A one-line map of the KV block pool: shared | used | cached | free, proportional to the pool size."""
from __future__ import annotations

from textual.content import Content
from textual.widget import Widget

SEGMENTS = (("shared", "█", "$secondary"), ("used", "█", "$warning"), ("cached", "▓", "$accent"),
            ("free", "░", "$foreground-muted"))


class KVBar(Widget):
    DEFAULT_CSS = "KVBar { height: 1; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counts = {"shared": 0, "used": 0, "cached": 0, "free": 1}

    def set_counts(self, stats: dict) -> None:
        shared = stats.get("shared", 0)
        self.counts = {"shared": shared, "used": max(0, stats.get("used", 0) - shared),
                       "cached": stats.get("cached", 0), "free": stats.get("free", 0)}
        self.refresh()

    def render(self) -> Content:
        width = max(1, self.size.width)
        counts = [self.counts[name] for name, _, _ in SEGMENTS]
        total = max(1, sum(counts))
        # Cumulative rounding fills the width exactly; any non-empty class then gets at least one cell (taken
        # from the widest), so a single shared block stays visible in a pool of thousands.
        bounds = [round(sum(counts[:i + 1]) * width / total) for i in range(len(counts))]
        cells = [b - a for a, b in zip([0, *bounds], bounds)]
        for i, count in enumerate(counts):
            if count and not cells[i]:
                widest = max(range(len(cells)), key=cells.__getitem__)
                if cells[widest] > 1:
                    cells[widest] -= 1
                    cells[i] = 1
        return Content.assemble(*((char * n, style) for (_, char, style), n in zip(SEGMENTS, cells)))
