"""MoE expert load as a heatmap: one row per MoE layer, one column per expert (grouped when they do not fit), expert
numbers above the columns and a legend of the shades below.

Each row is shaded relative to its own busiest column, so a layer whose router favours a few experts shows hot
cells among cold ones whatever the absolute token count; the line under it gives the imbalance as a number.
"""
from __future__ import annotations

import itertools
import math

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

SHADES = (("·", "$foreground-muted"), ("░", "$accent"), ("▒", "$accent"), ("▓", "$warning"), ("█", "$warning"))
MAX_ROWS = 16  # deeper models show groups of consecutive layers (their mean)
MAX_CELL = 3  # columns per expert when few experts leave room


def group_means(values: list[float], groups: int) -> list[float]:
    """`values` cut into `groups` consecutive runs of (almost) equal length, each replaced by its mean."""
    bounds = [round(i * len(values) / groups) for i in range(groups + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(bounds) if b > a]


def imbalance(layer: list[int]) -> float:
    """max / mean tokens per expert: 1.0 is perfectly balanced, E means one expert takes everything."""
    total = sum(layer)
    return max(layer) * len(layer) / total if total else 0.0


class ExpertHeatmap(Widget):
    DEFAULT_CSS = "ExpertHeatmap { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.load: list[list[int]] = []

    def set_load(self, load: list[list[int]]) -> None:
        changed_shape = [len(r) for r in load] != [len(r) for r in self.load]
        self.load = load
        self.refresh(layout=changed_shape)

    def rows(self) -> list[tuple[str, list[float]]]:
        """(label, per-column mean load) per drawn row."""
        num_layers = len(self.load)
        if not num_layers:
            return []
        per_row = math.ceil(num_layers / MAX_ROWS)
        rows = []
        for start in range(0, num_layers, per_row):
            layers = self.load[start:start + per_row]
            summed = [sum(col) / len(layers) for col in zip(*layers)]
            end = start + len(layers) - 1
            rows.append((f"L{start}" if end == start else f"L{start}-{end}", summed))
        return rows

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        rows = len(self.rows())
        return rows + 3 if rows else 1  # expert numbers, the rows, the legend, the summary

    def render(self) -> Content:
        rows = self.rows()
        if not rows:
            return Content("no MoE layers")
        num_experts = len(rows[0][1])
        total = sum(map(sum, self.load))
        label_width = max(len(label) for label, _ in rows) + 1
        room = max(1, self.size.width - label_width)
        columns = min(num_experts, room)
        cell = max(1, min(MAX_CELL, room // columns))
        lines = [Content.styled(" " * label_width + expert_ticks(num_experts, columns, cell), "$text-muted")]
        for label, values in rows:
            values = group_means(values, columns) if columns < num_experts else values
            peak = max(values)
            parts: list[tuple[str, str] | str] = [label.ljust(label_width)]
            for value in values:
                level = 0 if not peak or not value else 1 + min(3, int(4 * value / peak - 1e-9))
                char, style = SHADES[level]
                parts.append((char * cell, style))
            lines.append(Content.assemble(*parts))
        per_column = "" if columns == num_experts else f" · {math.ceil(num_experts / columns)} per col"
        if total:
            mean = sum(imbalance(layer) for layer in self.load) / len(self.load)
            worst = max(imbalance(layer) for layer in self.load)
            summary = f"max/mean {mean:.2f}, worst {worst:.2f}"
        else:
            summary = "no tokens routed yet"
        if len(summary + per_column) <= self.size.width:
            summary += per_column
        legend: list[tuple[str, str] | str] = ["tokens: "]
        for (char, style), what in zip(SHADES, ("none ", "", "", "", " most in the row")):
            legend += [(char, style), what]
        lines.append(Content.assemble(*legend))
        lines.append(Content.styled(summary, "$text-muted"))
        return Content("\n").join(lines)


def expert_ticks(num_experts: int, columns: int, cell: int) -> str:
    """Expert numbers over the columns: the first expert of a column, where the number fits before the next."""
    width = columns * cell
    line = [" "] * width
    free = 0  # the first position a number may start at
    for column in range(columns):
        at = column * cell
        number = str(column * num_experts // columns)
        if at >= free and at + len(number) <= width:
            line[at:at + len(number)] = number
            free = at + len(number) + 1
    return "".join(line).rstrip()
