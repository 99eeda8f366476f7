"""The HTML report's charts as inline SVG, drawn here: no chart library, no script, nothing fetched, a few KB a chart.

A line chart puts a value per layer in graph order (series with gaps where a value is not finite); a bar chart a
value per name. Hovering a layer's column shows every series' value at it (an SVG <title>, the browser's own
tooltip). Long models get a wider chart in a scrolling box, so each layer keeps about 10 px.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Series", "bar_chart", "heat_map", "line_chart", "nice_ticks"]

COLORS = ("#1f77b4", "#ff7f0e", "#7f7f7f", "#2ca02c", "#d62728", "#9467bd")
_FONT = 'font-family="system-ui, sans-serif" font-size="12"'


@dataclass(frozen=True)
class Series:
    """One line of a chart: a value per label (None or a non-finite value leaves a gap)."""

    name: str
    values: Sequence[float | None]
    style: str = "lines+markers"  # "lines+markers", "lines" (dashed) or "markers"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2 or 5 times a power of ten) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        low, high = low - 1.0, high + 1.0
    raw = (high - low) / max(count - 1, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


def _number(value: float) -> str:
    return f"{value:g}"


def _rotated_label_room(labels: Sequence[str]) -> int:
    """The pixels a label drawn at -45 degrees (10 px font, about 6 px a character) reaches left of its anchor and
    below the axis: the chart's left and bottom margins make room for the longest, so that none is clipped."""
    return int(0.71 * 6 * max((len(label) for label in labels), default=0)) + 14


def _frame(width: int, height: int, title: str, body: list[str], legend: list[tuple[str, str, str]]) -> str:
    """The <svg> with its title at the top and a legend under it ((name, color, style) per entry)."""
    parts = [f'<svg class="chart-svg" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="8" y="18" {_FONT} font-size="14" font-weight="600">{escape(title)}</text>']
    x = 8
    for name, color, style in legend:
        dash = ' stroke-dasharray="6 4"' if style == "lines" else ""
        if style == "markers":
            parts.append(f'<circle cx="{x + 10}" cy="36" r="4" fill="{color}"/>')
        else:
            parts.append(f'<line x1="{x}" y1="36" x2="{x + 20}" y2="36" stroke="{color}" stroke-width="2"{dash}/>')
        parts.append(f'<text x="{x + 26}" y="40" {_FONT}>{escape(name)}</text>')
        x += 34 + 7 * len(name)
    return "\n".join(parts + body + ["</svg>"])


def line_chart(title: str, labels: Sequence[str], series: Sequence[Series], unit: str = "dB",
               height: int = 380) -> str | None:
    """A line chart of `series` over `labels` (graph order); None when no series has a finite value."""
    drawn = [s for s in series if any(_finite(v) for v in s.values)]
    if not labels or not drawn:
        return None
    values = [float(v) for s in drawn for v in s.values if v is not None and math.isfinite(v)]
    ticks = nice_ticks(min(values), max(values))
    low, high = ticks[0], ticks[-1]
    show_labels = len(labels) <= 80
    step = max(10.0, 820.0 / len(labels))
    room = _rotated_label_room(labels) if show_labels else 0
    left, right, top, bottom = max(56, int(room - step / 2)), 16, 56, (max(96, room) if show_labels else 28)
    height += bottom - (96 if show_labels else 28)  # the plot keeps its height
    width = int(left + right + step * len(labels))
    plot_height = height - top - bottom

    def x_at(index: int) -> float:
        return left + step * (index + 0.5)

    def y_at(value: float) -> float:
        return top + plot_height * (1.0 - (value - low) / (high - low))

    body = []
    for tick in ticks:  # grid and y labels
        y = y_at(tick)
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        body.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" {_FONT}>{_number(tick)}</text>')
    body.append(f'<text x="14" y="{top + plot_height / 2:.0f}" {_FONT} text-anchor="middle" '
                f'transform="rotate(-90 14 {top + plot_height / 2:.0f})">{escape(unit)}</text>')
    if show_labels:
        for index, label in enumerate(labels):
            x, y = x_at(index), top + plot_height + 10
            body.append(f'<text x="{x:.1f}" y="{y:.1f}" {_FONT} font-size="10" text-anchor="end" '
                        f'transform="rotate(-45 {x:.1f} {y:.1f})">{escape(label)}</text>')
    legend = []
    for number, entry in enumerate(drawn):
        color = COLORS[number % len(COLORS)]
        legend.append((entry.name, color, entry.style))
        points = [(x_at(i), y_at(v)) for i, v in enumerate(entry.values) if v is not None and math.isfinite(v)]
        if entry.style != "markers":
            segments, current = [], []
            for index, value in enumerate(entry.values):
                if value is not None and math.isfinite(value):
                    current.append(f"{x_at(index):.1f},{y_at(value):.1f}")
                elif current:
                    segments.append(current)
                    current = []
            if current:
                segments.append(current)
            dash = ' stroke-dasharray="6 4"' if entry.style == "lines" else ""
            path = " ".join("M" + " L".join(segment) for segment in segments)
            body.append(f'<path class="trace" d="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        if entry.style != "lines":
            marks = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3"/>' for x, y in points)
            body.append(f'<g class="trace" fill="{color}">{marks}</g>')
    for index, label in enumerate(labels):  # a column per layer: hover shows every series' value there
        shown = "; ".join(f"{s.name} {s.values[index]:.2f} {unit}" if _finite(s.values[index])
                          else f"{s.name} {s.values[index]}" for s in drawn if s.values[index] is not None)
        body.append(f'<rect class="column" x="{x_at(index) - step / 2:.1f}" y="{top}" width="{step:.1f}" '
                    f'height="{plot_height}" fill="transparent"><title>{escape(label)}: {escape(shown)}</title>'
                    "</rect>")
    return _frame(width, height, title, body, legend)


def bar_chart(title: str, labels: Sequence[str], values: Sequence[float], hover: Sequence[str] = (),
              unit: str = "dB", horizontal: bool = False) -> str | None:
    """A bar per label (horizontal: one row each, longest labels at the left); None without a finite value."""
    kept = [(label, value, hover[i] if i < len(hover) else "") for i, (label, value) in enumerate(zip(labels, values))
            if _finite(value)]
    if not kept:
        return None
    ticks = nice_ticks(min(0.0, *(v for _, v, _ in kept)), max(0.0, *(v for _, v, _ in kept)))
    low, high = ticks[0], ticks[-1]
    body: list[str] = []
    if horizontal:
        longest = max(len(label) for label, _, _ in kept)
        left, right, top, row = min(12 + 7 * longest, 320), 24, 56, 22
        width, height = 820, top + row * len(kept) + 30
        span = width - left - right

        def at(value: float) -> float:
            return left + span * (value - low) / (high - low)

        for tick in ticks:
            body.append(f'<line x1="{at(tick):.1f}" y1="{top}" x2="{at(tick):.1f}" y2="{height - 26}" '
                        'stroke="#e5e5e5"/>')
            body.append(f'<text x="{at(tick):.1f}" y="{height - 10}" text-anchor="middle" {_FONT}>'
                        f"{_number(tick)}</text>")
        bars = []
        for index, (label, value, note) in enumerate(kept):
            y = top + row * index
            x0, x1 = sorted((at(0.0), at(value)))
            body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" {_FONT}>{escape(label)}</text>')
            bars.append(f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1.0):.1f}" height="{row - 6}">'
                        f"<title>{escape(label)}: {value:.2f} {escape(unit)}{escape(' ' + note if note else '')}"
                        "</title></rect>")
    else:
        step = max(14.0, 820.0 / len(kept))
        room = _rotated_label_room([label for label, _, _ in kept])
        left, right, top, bottom = max(56, int(room - step / 2)), 16, 56, max(96, room)
        bar = min(step * 0.7, 48.0)
        width, height = int(left + right + step * len(kept)), 340 + bottom - 96
        plot_height = height - top - bottom

        def at(value: float) -> float:
            return top + plot_height * (1.0 - (value - low) / (high - low))

        for tick in ticks:
            body.append(f'<line x1="{left}" y1="{at(tick):.1f}" x2="{width - right}" y2="{at(tick):.1f}" '
                        'stroke="#e5e5e5"/>')
            body.append(f'<text x="{left - 6}" y="{at(tick) + 4:.1f}" text-anchor="end" {_FONT}>'
                        f"{_number(tick)}</text>")
        bars = []
        for index, (label, value, note) in enumerate(kept):
            x = left + step * index
            y0, y1 = sorted((at(0.0), at(value)))
            lx, ly = x + step / 2, top + plot_height + 10
            body.append(f'<text x="{lx:.1f}" y="{ly:.1f}" {_FONT} font-size="10" text-anchor="end" '
                        f'transform="rotate(-45 {lx:.1f} {ly:.1f})">{escape(label)}</text>')
            bars.append(f'<rect x="{x + (step - bar) / 2:.1f}" y="{y0:.1f}" width="{bar:.1f}" '
                        f'height="{max(y1 - y0, 1.0):.1f}"><title>{escape(label)}: {value:.2f} {escape(unit)}'
                        f"{escape(' (' + note + ')' if note else '')}</title></rect>")
    body.append(f'<g class="trace" fill="{COLORS[0]}">{"".join(bars)}</g>')
    return _frame(width, height, title, body, [])


def _heat(value: float, low: float, high: float) -> str:
    """A colour from red (low) through yellow to green (high)."""
    share = 0.5 if high <= low else min(max((value - low) / (high - low), 0.0), 1.0)
    red, green = (255, int(80 + 175 * share * 2)) if share < 0.5 else (int(255 - 175 * (share - 0.5) * 2), 235)
    return f"#{red:02x}{min(green, 255):02x}50"


def heat_map(title: str, rows: Sequence[str], columns: Sequence[str], values: Sequence[Sequence[float | None]],
             unit: str = "dB", missing: Sequence[Sequence[str]] | None = None) -> str | None:
    """A cell per (row, column), coloured from the lowest value (red) to the highest (green); a cell without a finite
    value is grey. Hovering a cell shows its row, column and value, or for a grey one why it has none (`missing`,
    per cell; default "not measured"). None without a finite value."""
    finite = [float(v) for row in values for v in row if v is not None and math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    left = min(12 + 7 * max((len(r) for r in rows), default=0), 360)
    cell = max(4.0, min(24.0, 760.0 / max(len(columns), 1)))
    room = _rotated_label_room(columns) if cell >= 12 else 24
    top = 48 + (room if cell >= 12 else 0)
    width = int(max(left + cell * len(columns) + (room if cell >= 12 else 0) // 2 + 16, 8 + 7.5 * len(title), 420))
    height = int(top + 22 * len(rows) + 40)
    body = [f'<text x="8" y="40" {_FONT}>red {low:.2f} {escape(unit)} to green {high:.2f} {escape(unit)}; grey: not '
            "measured</text>"]
    if cell >= 12:
        for index, column in enumerate(columns):
            x = left + cell * (index + 0.5)
            body.append(f'<text x="{x:.1f}" y="{top - 6}" transform="rotate(-45 {x:.1f} {top - 6})" '
                        f'font-family="system-ui, sans-serif" font-size="10">{escape(column)}</text>')
    for row_index, (row, row_values) in enumerate(zip(rows, values)):
        y = top + 22 * row_index
        body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" {_FONT}>{escape(row)}</text>')
        for index, value in enumerate(row_values):
            measured = value is not None and math.isfinite(value)
            colour = _heat(float(value), low, high) if measured else "#cccccc"  # type: ignore[arg-type]
            shown = f"{value:.2f} {unit}" if measured else (missing[row_index][index] if missing else "not measured")
            body.append(f'<rect x="{left + cell * index:.1f}" y="{y + 2}" width="{cell - 1:.1f}" height="18" '
                        f'fill="{colour}"><title>{escape(row)}, expert {escape(columns[index])}: {escape(shown)}'
                        "</title></rect>")
    return _frame(width, height, title, body, [])
