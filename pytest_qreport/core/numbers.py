"""One spelling for every number the reports show (values with their unit, deltas rounded like values), and text a
terminal can show whatever a model or layer is called."""
from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["METRIC_MEANINGS", "distinguishing_decimals", "format_bound", "format_delta", "format_value", "normalized",
           "printable", "stage_times", "unit"]


def normalized(value: float) -> float:
    """Values of 1e30 or more are infinities that nan_to_num turned into FLT_MAX: show them as such."""
    return math.copysign(math.inf, value) if abs(value) >= 1e30 else value


def unit(metric: str) -> str:
    """The unit of a metric's values: ' dB' for the '_db' metrics, '%' for '_pct', '' for ratios and counts."""
    return " dB" if metric.endswith("_db") else "%" if metric.endswith("_pct") else ""


# what a value without a unit means, for the built-in metrics (the summary prints it under its table)
METRIC_MEANINGS = {
    "per_channel_used": "1 = per-channel weights, 0 = per-tensor",
    "output_batch_to_epoch_ratio": "mean batch range / whole-run range of the layer's output (low: dynamic helps)",
    "equalization_channel_fraction": "share of input channels where input-weight equalization is suggested",
    "max_percentile_ratio": "largest max / 97.5th-percentile ratio of an input channel",
    "cosine": "cosine similarity of the float and quantized values",
    "agreement": "share of positions where the float and quantized top-1 agree",
    "kl_nats": "mean KL divergence of the quantized from the float output distribution, in nats",
    "recovery": "the task metric quantized / the task metric in float",
    "max_relative_error": "largest |equalized - float| / largest |float| output",
}
_DEFAULT_DECIMALS = {"db": 1, "pct": 2}


def _decimals(metric: str) -> int | None:
    """The decimals a metric's values are shown with (None: 4 significant digits)."""
    return _DEFAULT_DECIMALS.get(metric.rsplit("_", 1)[-1]) if "_" in metric else None


def format_value(value: float | None, metric: str, decimals: int | None = None) -> str:
    """A metric value for people: '-' when absent, 'inf' for infinities, dB values with one decimal (or
    `decimals`), percentages with two."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = normalized(float(value))
    if math.isinf(value):
        return f"{'-' if value < 0 else ''}inf{unit(metric)}"
    places = decimals if decimals is not None else _decimals(metric)
    if places is None:
        return f"{value:.4g}"
    return f"{value:.{places}f}{unit(metric)}"


def format_bound(value: float, metric: str, up: bool) -> str:
    """`value` rounded away from itself (up, or down) at one decimal more than the metric shows: a threshold set past
    the printed bound is past the value itself, so a hint that names it holds."""
    places = (_decimals(metric) or 3) + 1
    scale = 10 ** places
    bound = (math.ceil if up else math.floor)(float(value) * scale) / scale
    return format_value(bound, metric, places)


def format_delta(delta: float | None, metric: str = "", decimals: int | None = None) -> str:
    """A baseline delta with its sign, rounded like the values of its metric ('0' for a change that rounds away)."""
    if delta is None or math.isnan(delta):
        return "-"
    delta = normalized(delta)
    if math.isinf(delta):
        return f"{'-' if delta < 0 else '+'}inf{unit(metric)}"
    places = decimals if decimals is not None else _decimals(metric)
    text = f"{delta:+.3g}" if places is None else f"{delta:+.{places}f}"
    if float(text) == 0:
        return f"0{unit(metric)}"
    return text + unit(metric)


def distinguishing_decimals(metric: str, value: float | None, threshold: float | None = None,
                            baseline: float | None = None, delta: float | None = None, most: int = 4) -> int | None:
    """The decimals a row's numbers are shown with: the metric's own, or more (up to `most`) where needed to show
    a value apart from a threshold it differs from, and to show a non-zero delta wherever the value and its
    baseline are shown apart (never '35.4 dB, baseline 35.5 dB, delta 0 dB')."""
    places = _decimals(metric)
    if places is None or value is None or not math.isfinite(value):
        return places

    def apart(other: float | None) -> bool:
        return other is not None and math.isfinite(other) and \
            format_value(value, metric, places) != format_value(other, metric, places)

    if threshold is not None and math.isfinite(threshold) and threshold != value:
        while places < most and not apart(threshold):
            places += 1
    if delta is not None and math.isfinite(delta) and delta != 0:
        while places < most and apart(baseline) and format_delta(delta, metric, places) == f"0{unit(metric)}":
            places += 1
    return places


def printable(text: str) -> str:
    """`text` with control characters and lone surrogates written as escapes (\\x07, \\ud800): a layer or model
    name can hold anything, and a terminal must neither obey it nor fail to encode it. Newlines and tabs stay."""
    if text.isprintable():  # False for control characters and surrogates
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


def stage_times(seconds: Mapping[str, float]) -> str:
    """'12.4 s (capture 1.0, calibration 2.1, comparison 3.3, trials 5.8, other 0.2)': a model's analysis time."""
    total = sum(seconds.values())
    parts = ", ".join(f"{stage} {value:.1f}" for stage, value in seconds.items() if value >= 0.05)
    return f"{total:.1f} s" + (f" ({parts})" if parts else "")
