"""--qreport-html PATH: one self-contained HTML file (a Jinja2 template, charts as inline SVG, nothing fetched),
written atomically by the controller.

Per model: the verdict counts, a sortable and filterable table of every row (failures first, with baseline
and delta), a per-layer chart in graph order (propagated and shadow SQNR, threshold, baseline; hover a layer for
its values; long models scroll sideways), the sensitivity ranking, equalization gains, and the fingerprint and
versions. Needs `pip install 'pytest-qreport[html]'` (Jinja2).
"""
from __future__ import annotations

import math
import os
from html import escape
from typing import Any

import pytest

from ..core.numbers import format_delta, format_value, printable
from ..core.results import RunResults
from .charts import Series, bar_chart, heat_map, line_chart
from .outputs import write_report

__all__ = ["HTML_EXTRA", "build_html", "html_extra_missing", "pytest_qreport_report"]

HTML_EXTRA = "pip install 'pytest-qreport[html]'"
_VERDICT_ORDER = {"error": 0, "fail": 1, "warn": 2, "waived": 3, "skip": 4, "pass": 5}


def html_extra_missing() -> str:
    """'' when Jinja2 imports; else the one line that names the extra to install."""
    try:
        import jinja2  # noqa: F401
    except ImportError as error:
        return f"--qreport-html needs the html extra ({error.name} is missing): {HTML_EXTRA}"
    return ""


def _number(value: Any) -> float:
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf" in the JSON form
    return float(value) if isinstance(value, (int, float)) else math.nan


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _layer_chart(rows: list[dict[str, Any]]) -> str | None:
    sqnr = [r for r in rows if r["check"] == "sqnr"]
    if not sqnr:
        return None
    series = [Series("propagated SQNR", [_number(r["value"]) for r in sqnr]),
              Series("shadow SQNR (float inputs)", [_number(r["details"].get("shadow_sqnr_db")) for r in sqnr]),
              Series("threshold", [_number(r["threshold"]) for r in sqnr], style="lines")]
    baseline = [_number(r.get("baseline")) for r in sqnr]
    if any(math.isfinite(v) for v in baseline):
        series.append(Series("baseline", baseline, style="markers"))
    return line_chart("per-layer SQNR in graph order (dB)", [r["layer"] for r in sqnr], series)


def _sensitivity_chart(rows: list[dict[str, Any]]) -> str | None:
    ranking = next((r["details"].get("ranking") for r in rows if r["check"] == "sensitivity"
                    and r["details"].get("ranking")), None)
    if not ranking:
        return None
    top = ranking[:30]
    # the ranking measures its best estimates on every batch and keeps the others' one-batch screen
    hover = [f"{e['layer']}: {_number(e['gain_db']):+.2f} dB on {e['batches']} batch(es)" if "batches" in e
             else e["layer"] for e in top]
    return bar_chart("sensitivity: output SQNR gained by keeping one layer in float (dB)", [e["layer"] for e in top],
                     [_number(e["gain_db"]) for e in top], horizontal=True, hover=hover)


def _equalization_chart(rows: list[dict[str, Any]]) -> str | None:
    gains = [r for r in rows if r["check"] == "equalization" and math.isfinite(_number(r["value"]))]
    if not gains:
        return None
    methods = sorted({str(r["details"].get("method", "")).split(" into ")[0] for r in gains} - {""})
    return bar_chart(f"equalization: SQNR gain per layer of the best method ({', '.join(methods)}) (dB)",
                     [r["layer"] for r in gains], [_number(r["value"]) for r in gains],
                     hover=[str(r["details"].get("method", "")) for r in gains])


def _expert_label_key(label: str) -> tuple[int, str]:
    expert, _, half = label.partition(".")
    return (int(expert) if expert.isdigit() else -1, half)


def _why_unmeasured(details: dict[str, Any], label: str) -> str:
    """What a grey cell of the expert heat map says: an expert in error, one no calibration token reached, or else
    not measured (the item's message says why)."""
    expert = _expert_label_key(label)[0]
    if expert in details.get("error_experts", ()):
        return "error (see the item)"
    if expert in details.get("unmeasured_experts", ()):
        return "no calibration token reached it"
    return "not measured"


def _expert_charts(rows: list[dict[str, Any]]) -> list[str]:
    """A block x expert heat map per check and expert projection of a mixture-of-experts model."""
    charts = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["check"] in ("sqnr", "weight_sqnr") and isinstance(row["details"].get("experts"), dict):
            groups.setdefault((row["check"], row["layer"].rsplit(".", 1)[-1]), []).append(row)
    for (check, projection), members in groups.items():
        columns = sorted({label for row in members for label in row["details"]["experts"]}, key=_expert_label_key)
        values = [[_number(row["details"]["experts"].get(label)) if label in row["details"]["experts"] else None
                   for label in columns] for row in members]
        missing = [[_why_unmeasured(row["details"], label) for label in columns] for row in members]
        chart = heat_map(f"{check} of each expert's {projection} (dB)", [row["layer"].rsplit(".", 1)[0]
                                                                         for row in members], columns, values,
                         missing=missing)
        if chart:
            charts.append(chart)
    return charts


def _cell(value: Any, metric: str, delta: bool = False) -> str:
    if value is None:
        return ""
    number = _number(value)
    return format_delta(number, metric) if delta else format_value(number, metric)


def _breakable_name(name: str) -> Any:
    """A layer or check name that a narrow cell wraps after its dots and underscores, never inside a part of it."""
    from markupsafe import Markup

    return Markup(escape(printable(name)).replace(".", ".<wbr>").replace("_", "_<wbr>"))


def build_html(report: dict[str, Any]) -> str:
    """The page for a JSON-form report (jsonreport.build_report): one section per model."""
    import jinja2
    from markupsafe import Markup

    environment = jinja2.Environment(loader=jinja2.PackageLoader("pytest_qreport", "templates"),
                                     autoescape=jinja2.select_autoescape(["html", "j2"]))
    # text is made printable (\x07, \ud800); markup marked safe (the charts) stays markup, or it would be escaped
    environment.finalize = lambda value: printable(value) if isinstance(value, str) and not isinstance(
        value, Markup) else value
    report = {**report, "rows": [{**row, "model": printable(row["model"]), "layer": printable(row["layer"])}
                                 for row in report["rows"]]}  # the charts' labels too
    models = []
    names = list(dict.fromkeys(row["model"] for row in report["rows"]))
    worst = {name: min(_VERDICT_ORDER.get(r["verdict"], 9) for r in report["rows"] if r["model"] == name)
             for name in names}
    for name in sorted(names, key=lambda n: worst[n]):  # failing models first, then in collection order
        rows = [row for row in report["rows"] if row["model"] == name]
        counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in _VERDICT_ORDER if any(
            r["verdict"] == v for r in rows)}
        ordered = sorted(rows, key=lambda r: _VERDICT_ORDER.get(r["verdict"], 9))
        charts = [chart for chart in (_layer_chart(rows), _sensitivity_chart(rows), _equalization_chart(rows),
                                      *_expert_charts(rows)) if chart]
        table = [{"check": r["check"], "check_breakable": _breakable_name(r["check"]),
                  "layer": r["layer"], "layer_breakable": _breakable_name(r["layer"]),
                  "value": _cell(r["value"], r["metric"]),
                  "threshold": _cell(r["threshold"], r["metric"]), "baseline": _cell(r.get("baseline"), r["metric"]),
                  "delta": _cell(r.get("delta"), r["metric"], delta=True), "verdict": r["verdict"],
                  "message": r["message"] or r.get("note", "")} for r in ordered]
        recipe = next((r["details"]["recipe"] for r in rows if r["check"] == "model_sqnr"
                        and isinstance(r["details"].get("recipe"), dict) and "default" in r["details"]["recipe"]),
                      None)
        float_fixes = [{"check": r["check"], **r["details"]["recipe"]} for r in rows
                       if isinstance(r["details"].get("recipe"), dict) and "float_layers" in r["details"]["recipe"]]
        info = report["models"].get(name, {})
        formats: dict[str, int] = {}
        for r in rows:  # the format each quantized layer was quantized in (an artifact's as its tool wrote it)
            if r["check"] == "sqnr" and r["details"].get("format"):
                formats[str(r["details"]["format"])] = formats.get(str(r["details"]["format"]), 0) + 1
        models.append({"name": name, "counts": counts, "rows": table, "charts": charts, "info": info,
                       "recipe": recipe, "float_fixes": float_fixes, "formats": formats,
                       "baseline_exists": bool(info.get("baseline_path")) and os.path.exists(info["baseline_path"])})
    return environment.get_template("report.html.j2").render(
        models=models, versions=report["versions"], created=report["created"])


def pytest_qreport_report(results: RunResults, config: pytest.Config) -> str | None:
    """Write --qreport-html when it is given (and the run completed); ReportError when it cannot be written."""
    from .jsonfile import build_report

    return write_report(config, results, "--qreport-html", "HTML report",
                        lambda: build_html(build_report(list(results.rows), results.models)))
