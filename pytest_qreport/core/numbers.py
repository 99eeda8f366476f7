"""One spelling for every number the reports show (values with their unit, deltas rounded like values), and text a
terminal can show whatever a model or layer is called."""
from __future__ import annotations

import math

__all__ = ["format_delta", "format_value", "normalized", "printable", "unit"]


def normalized(value: float) -> float:
    """Values of 1e30 or more are infinities that nan_to_num turned into FLT_MAX: show them as such."""
    return math.copysign(math.inf, value) if abs(value) >= 1e30 else value


def unit(metric: str) -> str:
    """The unit of a metric's values: ' dB' for the '_db' metrics, '%' for '_pct', '' for ratios and counts."""
    return " dB" if metric.endswith("_db") else "%" if metric.endswith("_pct") else ""


def format_value(value: float | None, metric: str) -> str:
    """A metric value for people: '-' when absent, 'inf' for infinities, dB values with one decimal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = normalized(float(value))
    if math.isinf(value):
        return f"{'-' if value < 0 else ''}inf{unit(metric)}"
    if metric.endswith("_pct"):
        return f"{value:.2f}%"
    return f"{value:.1f} dB" if metric.endswith("_db") else f"{value:.4g}"


def format_delta(delta: float | None, metric: str = "") -> str:
    """A baseline delta with its sign, rounded like the values of its metric ('0' for a change that rounds away)."""
    if delta is None or math.isnan(delta):
        return "-"
    delta = normalized(delta)
    if math.isinf(delta):
        return f"{'-' if delta < 0 else '+'}inf{unit(metric)}"
    digits = ".1f" if metric.endswith("_db") else ".2f" if metric.endswith("_pct") else ".3g"
    text = f"{delta:+{digits}}"
    if float(text) == 0:
        return f"0{unit(metric)}"
    return text + unit(metric)


def printable(text: str) -> str:
    """`text` with control characters and lone surrogates written as escapes (\\x07, \\ud800): a layer or model
    name can hold anything, and a terminal must neither obey it nor fail to encode it. Newlines and tabs stay."""
    if text.isprintable():  # False for control characters and surrogates
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)
