"""The dedicated JUnit XML file (one testsuite per model), written atomically through pytest_qreport_report."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from junit_xml import TestCase, TestSuite, to_xml_report_string

from ..core.files import write_atomically
from ..core.findings import Finding
from ..core.numbers import format_value, printable
from ..core.results import ModelFacts, RunResults
from .outputs import write_report

__all__ = ["ModelSuite", "build_suites", "junit_text", "pytest_qreport_report", "write_junit"]

_PROPERTIES = ("model", "check", "layer", "metric", "value", "threshold", "verdict")


def _clean(text: str) -> str:
    """Text that XML can carry: control characters and lone surrogates written as escapes (junit-xml would emit
    character references such as &#7;, which no XML parser accepts)."""
    return printable(text)


def build_suites(rows: list[Finding], models: Mapping[str, ModelFacts] | None = None) -> list[TestSuite]:
    """One TestSuite per model, one TestCase per (check, layer)."""
    by_model: dict[str, list[TestCase]] = {}
    models = models or {}
    for row in rows:
        facts = models.get(row.model)
        row = row.replace(message=_clean(row.message), waiver=_clean(row.waiver), layer=_clean(row.layer),
                          model=_clean(row.model), note=_clean(row.note))
        lines = [f"{k}={getattr(row, k)}" for k in _PROPERTIES] + ([f"waiver={row.waiver}"] if row.waiver else [])
        lines += [f"note={row.note}"] if row.note else []
        lines += [f"{k}={getattr(row, k)}" for k in ("baseline", "delta", "baseline_status") if getattr(row, k) not in
                  (None, "")]
        lines += [f"capture_{k}={_clean(v)}" for k, v in (facts.capture if facts else {}).items()]
        case = TestCase(name=f"{row.check}/{row.layer}" if row.layer else row.check,
                        classname=f"qreport.{row.model}.{row.check}", elapsed_sec=row.duration, stdout="\n".join(lines),
                        status=row.verdict)
        text = f"{format_value(row.value, row.metric)} (threshold {format_value(row.threshold, row.metric)})"
        if row.verdict == "fail":
            case.add_failure_info(message=text, output=row.message)
        elif row.verdict == "error":
            case.add_error_info(message="model could not be analysed", output=row.message)
        elif row.verdict == "skip":
            case.add_skipped_info(message=row.message or "skipped")
        by_model.setdefault(row.model, []).append(case)
    suites = []
    for model, cases in by_model.items():
        facts = models.get(model)
        seconds = dict(facts.seconds) if facts is not None else {}
        properties = {f"analysis_{stage}_seconds": f"{value:.3f}" for stage, value in seconds.items()}
        suites.append(ModelSuite(f"qreport.{model}", cases, properties=properties or None,
                                 analysis_seconds=sum(seconds.values())))
    return suites


class ModelSuite(TestSuite):
    """A model's testsuite, whose `time` includes its analysis (run before its first item's checks): the
    test cases' own times are the checks' reads of the measured results."""

    def __init__(self, name: str, cases: list[TestCase], properties: dict[str, str] | None = None,
                 analysis_seconds: float = 0.0) -> None:
        super().__init__(name, cases, properties=properties)
        self.analysis_seconds = analysis_seconds

    def build_xml_doc(self, encoding: str | None = None) -> Any:
        """The testsuite element, its time the analysis plus the test cases."""
        element = super().build_xml_doc(encoding)
        cases = sum(float(case.elapsed_sec or 0.0) for case in self.test_cases)
        element.set("time", f"{self.analysis_seconds + cases:.3f}")
        return element


def junit_text(rows: list[Finding], models: Mapping[str, ModelFacts] | None = None) -> str:
    """The dedicated JUnit XML report for `rows`, as text."""
    return to_xml_report_string(build_suites(rows, models), prettyprint=True)


def write_junit(path: str, rows: list[Finding], models: Mapping[str, ModelFacts] | None = None) -> None:
    """Write the dedicated JUnit XML report for `rows`."""
    write_atomically(path, junit_text(rows, models))


def pytest_qreport_report(results: RunResults, config: pytest.Config) -> str | None:
    """Write --qreport-junitxml when it is given; ReportError when it cannot be written."""
    return write_report(config, results, "--qreport-junitxml", "JUnit XML",
                        lambda: junit_text(list(results.rows), results.models))
