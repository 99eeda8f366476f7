"""One spelling for every number the reports show: values with their unit, deltas rounded like values."""
from __future__ import annotations

import math

__all__ = ["format_delta", "format_value", "normalized", "unit"]


def normalized(value: float) -> float:
    """Values of 1e30 or more are infinities that nan_to_num turned into FLT_MAX: show them as such."""
    return math.copysign(math.inf, value) if abs(value) >= 1e30 else value


def unit(metric: str) -> str:
    """The unit of a metric's values: ' dB' for the '_db' metrics, '' for ratios and counts."""
    return " dB" if metric.endswith("_db") else ""


def format_value(value: float | None, metric: str) -> str:
    """A metric value for people: '-' when absent, 'inf' for infinities, dB values with one decimal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = normalized(float(value))
    if math.isinf(value):
        return f"{'-' if value < 0 else ''}inf{unit(metric)}"
    return f"{value:.1f} dB" if metric.endswith("_db") else f"{value:.4g}"


def format_delta(delta: float | None, metric: str = "") -> str:
    """A baseline delta with its sign, rounded like the values of its metric ('0' for a change that rounds away)."""
    if delta is None or math.isnan(delta):
        return "-"
    delta = normalized(delta)
    if math.isinf(delta):
        return f"{'-' if delta < 0 else '+'}inf{unit(metric)}"
    text = f"{delta:+.1f}" if metric.endswith("_db") else f"{delta:+.3g}"
    if float(text) == 0:
        return f"0{unit(metric)}"
    return text + unit(metric)
