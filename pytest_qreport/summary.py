"""The terminal summary table."""
from __future__ import annotations

import math

from tabulate import tabulate


def format_value(value: float, metric: str) -> str:
    """A metric value for people: dB values with one decimal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and (math.isinf(value) or abs(value) >= 1e30):  # nan_to_num'd infinities too
        sign = "-" if value < 0 else ""
        return f"{sign}inf dB" if metric.endswith("_db") else f"{sign}inf"
    return f"{value:.1f} dB" if metric.endswith("_db") else f"{value:.4g}"


def summary_rows(rows: list[dict], mode: str) -> list[list[str]]:
    """Table rows: failures, errors and warnings always; every row when mode is 'all'."""
    shown = [r for r in rows if mode == "all" or r["verdict"] != "pass"]
    return [[r["model"], r["check"], r["layer"], format_value(r["value"], r["metric"]),
             format_value(r["threshold"], r["metric"]), r["verdict"].upper()] for r in shown]


def render_summary(rows: list[dict], mode: str) -> str:
    """The summary as text (empty if nothing to show)."""
    table = summary_rows(rows, mode)
    if not table:
        return ""
    return tabulate(table, headers=["model", "check", "layer", "value", "threshold", "verdict"])
