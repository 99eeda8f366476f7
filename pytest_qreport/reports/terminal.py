"""The terminal summary table, written through the pytest_qreport_report hook."""
from __future__ import annotations

import os
from collections.abc import Mapping

import pytest
from tabulate import tabulate

from ..core.findings import VERDICTS, Finding, RunOutcome
from ..core.numbers import (
    METRIC_MEANINGS,
    distinguishing_decimals,
    format_delta,
    format_value,
    printable,
    stage_times,
    unit,
)
from ..core.results import ModelFacts, RunResults
from ..core.settings import table_mode

__all__ = ["baseline_lines", "budget_use_text", "counts_line", "fallback_notes", "metric_legend", "note",
           "pytest_qreport_report", "render_summary", "sensitivity_lines", "shared_fix_lines", "summary_rows",
           "timing_lines"]


def note(row: Finding) -> str:
    """What the table says beside the verdict: a waiver, or the row's standing against its baseline."""
    if row.waiver:
        return f"waived: {row.waiver}"
    if row.baseline_status == "new":
        return "new: not in the baseline"
    if row.baseline_status == "regressed":
        return "regressed against the baseline"
    if row.baseline_status == "improved" and row.delta is not None:
        return f"improved by {format_delta(abs(row.delta), row.metric).lstrip('+')}: update the baseline to lock it in"
    if row.check == "baseline" and row.details.get("stale"):
        return "stale: " + ", ".join(row.details["stale"])
    return ""


def summary_rows(rows: list[Finding], mode: str) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: failures, errors and rows with a baseline note or a waiver; every row when mode is
    "all". Warnings are counted, not listed, unless mode is "all"."""
    shown = [r for r in rows if mode == "all" or r.failed or note(r)]
    headers = ["model", "check", "layer", "value", "threshold"]
    with_baseline = any(r.baseline_status for r in shown)

    def noted(row: Finding) -> str:
        return note(row) or (row.note if mode == "all" else "")

    with_notes = any(noted(r) for r in shown)
    headers += (["baseline", "delta"] if with_baseline else []) + ["verdict"] + (["note"] if with_notes else [])
    # one number of decimals per metric, the most any of its rows needs: a column never mixes 36.0 and 36.00
    decimals: dict[str, int | None] = {}
    for r in shown:
        needed = distinguishing_decimals(r.metric, r.value, r.threshold, r.baseline, r.delta)  # None: 4 digits
        decimals[r.metric] = needed if needed is None else max(needed, decimals.get(r.metric) or 0)
    table = []
    for r in shown:
        places = decimals[r.metric]
        cells = [printable(r.model), r.check, printable(r.layer), format_value(r.value, r.metric, places),
                 format_value(r.threshold, r.metric, places)]
        if with_baseline:
            cells += [format_value(r.baseline, r.metric, places), format_delta(r.delta, r.metric, places)]
        table.append(cells + [r.verdict.upper()] + ([printable(noted(r))] if with_notes else []))
    return headers, table


def render_summary(rows: list[Finding], mode: str) -> str:
    """The summary as text (empty if nothing to show), with what its values without a unit mean."""
    headers, table = summary_rows(rows, mode)
    if not table:
        return ""
    return "\n".join([tabulate(table, headers=headers, disable_numparse=True), *metric_legend(rows, mode),
                      *shared_fix_lines(rows)])


def shared_fix_lines(rows: list[Finding]) -> list[str]:
    """'fix for m's 18 failing outlier items: qmodel(..., layer_overrides={...})': a fix that several failing
    items of one model and check share, printed once."""
    shared: dict[tuple[str, str, str], int] = {}
    for row in rows:
        fix = row.details.get("fix") if row.failed else None
        if isinstance(fix, str):
            shared[(row.model, row.check, fix)] = shared.get((row.model, row.check, fix), 0) + 1
    return [printable(f"fix for {model}'s {count} failing {check} items: {fix}")
            for (model, check, fix), count in shared.items() if count > 1]


def metric_legend(rows: list[Finding], mode: str) -> list[str]:
    """'per_channel: per_channel_used, 1 = per-channel weights, 0 = per-tensor' for each shown check whose values
    have no unit."""
    shown = {(r.check, r.metric) for r in rows if (mode == "all" or r.failed or note(r)) and not unit(r.metric)}
    return [f"{check}: {metric}, {METRIC_MEANINGS[metric]}" for check, metric in sorted(shown)
            if metric in METRIC_MEANINGS]


def counts_line(rows: list[Finding], outcome: RunOutcome | None = None, mode: str = "all") -> str:
    """'36 pass, 9 fail, 2 warn', with the items that did not run when the run stopped early; under the failures
    table, a pointer to the warnings it leaves out."""
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in VERDICTS}
    line = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no qreport items ran"
    if mode == "failures" and counts["warn"]:
        line += f" ({counts['warn']} warning(s) not listed: --qreport-table=all lists them)"
    declined = sum(1 for r in rows if r.note and not r.failed)
    if mode == "failures" and declined:
        line += (f"; {declined} heuristic recommendation(s) measured not to help, so not advised "
                 "(--qreport-table=all shows why)")
    if outcome is not None and outcome.interrupted and outcome.collected:
        line += f"; {outcome.not_run} of {outcome.collected} qreport items did not run"
    return line


@pytest.hookimpl(tryfirst=True)
def pytest_qreport_report(results: RunResults, config: pytest.Config) -> None:
    """Print the qreport summary section in the terminal."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    rows, outcome, mode = list(results.rows), results.outcome, table_mode(config)
    terminal.section("qreport summary")
    text = render_summary(rows, mode)
    if outcome.interrupted:
        terminal.write_line(f"the run stopped early ({outcome.interrupted}): these results are incomplete", red=True)
    terminal.write_line(text if text else "all qreport checks passed" if not outcome.interrupted else
                        "no qreport item failed before the run stopped")
    terminal.write_line(counts_line(rows, outcome, mode))
    if mode == "all":
        for line in sensitivity_lines(rows):
            terminal.write_line(line)
    for line in baseline_lines(rows, results.models):
        terminal.write_line(line)
    for line in timing_lines(results.models, verbose=mode == "all" or config.get_verbosity() > 0):
        terminal.write_line(line)
    for line in fallback_notes(results.models):
        terminal.write_line(line, yellow=True)


def baseline_lines(rows: list[Finding], models: Mapping[str, ModelFacts]) -> list[str]:
    """'baselines: 232 items of 5 model(s) compared with examples/__qreport__ (232 within tolerance, ...)': what the
    comparison with the committed baselines found, and which declared baselines do not exist yet."""
    compared = [row for row in rows if row.baseline_status]
    with_file = sorted({name for row in compared if (facts := models.get(row.model)) is not None
                        and (name := facts.baseline_path)})
    lines = []
    if compared:
        folders = sorted({os.path.relpath(os.path.dirname(path)) for path in with_file})
        where = ", ".join(folders) if len(folders) <= 3 else f"{len(folders)} folders"
        counts = {status: sum(1 for row in compared if row.baseline_status == status)
                  for status in ("ok", "regressed", "improved", "new")}
        named = {"ok": "within tolerance", "regressed": "regressed", "improved": "improved", "new": "new"}
        found = ", ".join(f"{count} {named[status]}" for status, count in counts.items() if count)
        lines.append(f"baselines: {len(compared)} items of {len({row.model for row in compared})} model(s) compared "
                     f"with {where} ({found})")
    missing = [name for name, facts in models.items() if facts.baseline_path and name not in
               {row.model for row in compared} and any(row.model == name for row in rows)]
    if missing and compared:
        lines.append(f"baselines: none yet for {', '.join(missing)} (--qreport-update-baseline writes them)")
    return [printable(line) for line in lines]


def timing_lines(models: Mapping[str, ModelFacts], top: int = 3, verbose: bool = False) -> list[str]:
    """'analysis time: 14.2 s in all; slowest: gpt2 9.1 s (capture 1.0, calibration ...), ...': where the time
    went, per model (every model when verbose, else the slowest `top`); then what the fix searches of every model
    whose searches ran spent of its fix budget, by model name."""
    timed = sorted(((facts.analysis_seconds, name, facts) for name, facts in models.items() if facts.seconds),
                   key=lambda entry: -entry[0])
    if not timed:
        return []
    total = sum(seconds for seconds, _, _ in timed)
    shown = timed if verbose else timed[:top]
    which = "per model" if len(shown) == len(timed) else "slowest"
    listed = "; ".join(f"{printable(name)} {stage_times(facts.seconds)}" for _, name, facts in shown)
    lines = [f"analysis time: {total:.1f} s for {len(timed)} model(s); {which}: {listed}"]
    # every model whose searches ran or stopped, by name: the budget's use is not only the slowest models', and the
    # line reads the same however the run's times fell (serially or under xdist)
    budgets = [f"{printable(name)} {text}" for _, name, facts in sorted(timed, key=lambda entry: entry[1])
               if (text := budget_use_text(facts))]
    if budgets:
        lines.append("fix budget used: " + "; ".join(budgets))
    return lines


def budget_use_text(facts: ModelFacts) -> str:
    """'62% of fix_budget=1 (12.4 of 20 graph runs; 2 search step(s) stopped by it)': what a model's fix searches
    spent of its budget, in graph runs, which do not depend on the machine ('' when no search ran and none was
    stopped; the seconds are in the JSON report)."""
    use = facts.fix_budget
    runs, budget = float(use.get("trial_runs") or 0.0), use.get("fix_budget")
    stopped = int(use.get("stopped_searches") or 0)
    if not runs and not stopped:
        return ""
    stops = f"; {stopped} search step(s) stopped by it" if stopped else ""
    if budget is None:
        return f"{runs:.3g} graph runs in fix searches (fix_budget=unlimited)"
    allowed = float(budget) * float(use.get("verdict_runs") or 0.0)
    share = facts.fix_budget_share
    used = f"{share:.0%} of " if share is not None else ""
    return f"{used}fix_budget={float(budget):g} ({runs:.3g} of {allowed:.3g} graph runs{stops})"


def sensitivity_lines(rows: list[Finding], top: int = 5) -> list[str]:
    """Per model whose sensitivity ranking ran: 'sensitivity of m (38.2 dB quantized): fc2 +6.1, fc1 +0.4 dB'."""
    lines = []
    for row in rows:
        ranking = row.details.get("ranking") if row.check == "sensitivity" else None
        if ranking:
            listed = ", ".join(f"{entry['layer']} {entry['gain_db']:+.1f}" for entry in ranking[:top])
            lines.append(printable(f"sensitivity of {row.model} ({row.details['all_quantized_db']:.1f} dB quantized; "
                                   f"dB gained by keeping one layer in float): {listed}"))
    return lines


def fallback_notes(models: Mapping[str, ModelFacts]) -> list[str]:
    """One line per model that torch.export could not capture, so that FX captured it instead."""
    return [f"qreport: model {name!r} was captured with torch.fx.symbolic_trace, because torch.export failed: "
            f"{facts.capture['export_error']}" for name, facts in models.items()
            if facts.capture.get("method") == "fx" and facts.capture.get("export_error")]
