"""The terminal summary table, written through the pytest_qreport_report hook."""
from __future__ import annotations

import math

import pytest
from tabulate import tabulate

from .findings import VERDICTS, Finding, RunOutcome
from .options import table_mode

__all__ = ["counts_line", "fallback_notes", "format_delta", "format_value", "note", "pytest_qreport_report",
           "render_summary", "sensitivity_lines", "summary_rows"]


def format_value(value: float | None, metric: str) -> str:
    """A metric value for people: dB values with one decimal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and (math.isinf(value) or abs(value) >= 1e30):  # nan_to_num'd infinities too
        sign = "-" if value < 0 else ""
        return f"{sign}inf dB" if metric.endswith("_db") else f"{sign}inf"
    return f"{value:.1f} dB" if metric.endswith("_db") else f"{value:.4g}"


def format_delta(delta: float | None) -> str:
    """A baseline delta with its sign, two decimals ('0.00' for a change that rounds away)."""
    if delta is None:
        return "-"
    return "0.00" if abs(delta) < 0.005 else f"{delta:+.2f}"


def note(row: Finding) -> str:
    """What the table says beside the verdict: a waiver, or the row's standing against its baseline."""
    if row.waiver:
        return f"waived: {row.waiver}"
    if row.baseline_status == "new":
        return "new: not in the baseline"
    if row.baseline_status == "regressed":
        return "regressed against the baseline"
    if row.baseline_status == "improved" and row.delta is not None:
        unit = " dB" if row.metric.endswith("_db") else ""
        return f"improved by {abs(row.delta):.2f}{unit}: update the baseline to lock it in"
    if row.check == "baseline" and row.details.get("stale"):
        return "stale: " + ", ".join(row.details["stale"])
    return ""


def summary_rows(rows: list[Finding], mode: str) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: failures, errors, warnings and noted rows always; every row when mode is 'all'."""
    shown = [r for r in rows if mode == "all" or r.verdict != "pass" or note(r)]
    headers = ["model", "check", "layer", "value", "threshold"]
    with_baseline = any(r.baseline_status for r in shown)
    with_notes = any(note(r) for r in shown)
    headers += (["baseline", "delta"] if with_baseline else []) + ["verdict"] + (["note"] if with_notes else [])
    table = []
    for r in shown:
        cells = [r.model, r.check, r.layer, format_value(r.value, r.metric), format_value(r.threshold, r.metric)]
        if with_baseline:
            cells += [format_value(r.baseline, r.metric), format_delta(r.delta)]
        table.append(cells + [r.verdict.upper()] + ([note(r)] if with_notes else []))
    return headers, table


def render_summary(rows: list[Finding], mode: str) -> str:
    """The summary as text (empty if nothing to show)."""
    headers, table = summary_rows(rows, mode)
    return tabulate(table, headers=headers, disable_numparse=True) if table else ""


def counts_line(rows: list[Finding], outcome: RunOutcome | None = None) -> str:
    """'36 pass, 9 fail', with the items that did not run when the run stopped early."""
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in VERDICTS}
    line = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no qreport items ran"
    if outcome is not None and outcome.interrupted and outcome.collected:
        line += f"; {outcome.not_run} of {outcome.collected} qreport items did not run"
    return line


@pytest.hookimpl(tryfirst=True)
def pytest_qreport_report(rows: list[Finding], config: pytest.Config, outcome: RunOutcome) -> None:
    """Print the qreport summary section in the terminal."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    terminal.section("qreport summary")
    text = render_summary(rows, table_mode(config))
    if outcome.interrupted:
        terminal.write_line(f"the run stopped early ({outcome.interrupted}): these results are incomplete", red=True)
    terminal.write_line(text if text else "all qreport checks passed" if not outcome.interrupted else
                        "no qreport item failed before the run stopped")
    terminal.write_line(counts_line(rows, outcome))
    if table_mode(config) == "all":
        for line in sensitivity_lines(rows):
            terminal.write_line(line)
    for line in fallback_notes(rows):
        terminal.write_line(line, yellow=True)


def sensitivity_lines(rows: list[Finding], top: int = 5) -> list[str]:
    """Per model whose sensitivity ranking ran: 'sensitivity of m (38.2 dB quantized): fc2 +6.1, fc1 +0.4 dB'."""
    lines = []
    for row in rows:
        ranking = row.details.get("ranking") if row.check == "sensitivity" else None
        if ranking:
            listed = ", ".join(f"{entry['layer']} {entry['gain_db']:+.1f}" for entry in ranking[:top])
            lines.append(f"sensitivity of {row.model} ({row.details['all_quantized_db']:.1f} dB quantized; dB gained "
                         f"by keeping one layer in float): {listed}")
    return lines


def fallback_notes(rows: list[Finding]) -> list[str]:
    """One line per model that torch.export could not capture, so that FX captured it instead."""
    notes: dict[str, str] = {}
    for row in rows:
        capture = row.details.get("capture") or {}
        if capture.get("method") == "fx" and capture.get("export_error") and row.model not in notes:
            notes[row.model] = (f"qreport: model {row.model!r} was captured with torch.fx.symbolic_trace, because "
                                f"torch.export failed: {capture['export_error']}")
    return list(notes.values())
