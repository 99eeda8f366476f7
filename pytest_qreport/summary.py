"""The terminal summary table, written through the pytest_qreport_report hook."""
from __future__ import annotations

import math

import pytest
from tabulate import tabulate

from .findings import VERDICTS, Finding
from .options import table_mode

__all__ = ["format_value", "pytest_qreport_report", "render_summary", "summary_rows"]


def format_value(value: float, metric: str) -> str:
    """A metric value for people: dB values with one decimal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and (math.isinf(value) or abs(value) >= 1e30):  # nan_to_num'd infinities too
        sign = "-" if value < 0 else ""
        return f"{sign}inf dB" if metric.endswith("_db") else f"{sign}inf"
    return f"{value:.1f} dB" if metric.endswith("_db") else f"{value:.4g}"


def summary_rows(rows: list[Finding], mode: str) -> list[list[str]]:
    """Table rows: failures, errors, warnings and waivers always; every row when mode is 'all'."""
    shown = [r for r in rows if mode == "all" or r.verdict != "pass"]
    with_notes = any(r.waiver for r in shown)
    return [[r.model, r.check, r.layer, format_value(r.value, r.metric), format_value(r.threshold, r.metric),
             r.verdict.upper()] + ([r.waiver] if with_notes else []) for r in shown]


def render_summary(rows: list[Finding], mode: str) -> str:
    """The summary as text (empty if nothing to show)."""
    table = summary_rows(rows, mode)
    if not table:
        return ""
    headers = ["model", "check", "layer", "value", "threshold", "verdict"]
    return tabulate(table, headers=headers + (["waiver"] if len(table[0]) > len(headers) else []))


@pytest.hookimpl(tryfirst=True)
def pytest_qreport_report(rows: list[Finding], config: pytest.Config) -> None:
    """Print the qreport summary section in the terminal."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    terminal.section("qreport summary")
    text = render_summary(rows, table_mode(config))
    terminal.write_line(text if text else "all qreport checks passed")
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in VERDICTS}
    terminal.write_line(", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no qreport items ran")
