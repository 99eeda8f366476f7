"""GitHub Actions output: the summary table as Markdown in the job's step summary (when GITHUB_STEP_SUMMARY is set),
and one `::error` annotation per failing row at the line that declares its model (when GITHUB_ACTIONS is set).
GitLab and Jenkins read the JUnit XML (--qreport-junitxml) instead."""
from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from ..core.findings import Finding
from ..core.nodeids import parse_item_nodeid
from ..core.results import ModelFacts, RunResults
from ..core.settings import table_mode
from .terminal import counts_line, summary_rows

__all__ = ["error_annotations", "github_output", "pytest_qreport_report", "step_summary"]


def _escaped(text: str, property_value: bool = False) -> str:
    """Text as a workflow command carries it: '%', CR and LF escaped (and ':' and ',' in a property)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_value else text


def step_summary(rows: list[Finding], mode: str = "failures", title: str = "qreport") -> str:
    """The summary table as GitHub-flavoured Markdown, with the counts line."""
    headers, table = summary_rows(rows, mode)
    lines = [f"### {title}", "", counts_line(rows, mode=mode), ""]
    if table:
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table]
    else:
        lines.append("All qreport checks passed.")
    return "\n".join(lines) + "\n"


def error_annotations(rows: list[Finding], models: Mapping[str, ModelFacts]) -> list[str]:
    """`::error file=...,line=...,title=...::message` for each failing or erroring row, at its model's declaration
    (the test's file for a row of the `qreport` fixture)."""
    found = []
    for row in rows:
        if not row.failed:
            continue
        parsed = parse_item_nodeid(row.nodeid)
        file = (parsed[0] if parsed else row.nodeid.split("::")[0]) or ""
        facts = models.get(row.model)
        where = [f"file={_escaped(file, True)}"] if file else []
        if facts is not None and facts.line and parsed:
            where.append(f"line={facts.line}")
        title = f"qreport {row.model} {row.check} {row.layer}".strip()
        where.append(f"title={_escaped(title, True)}")
        message = row.message or f"{row.check} {row.layer}: {row.verdict}"
        found.append(f"::error {','.join(where)}::{_escaped(message)}")
    return found


def github_output(rows: list[Finding], models: Mapping[str, ModelFacts], mode: str = "failures",
                  environ: Mapping[str, str] = os.environ) -> list[str]:
    """Append the step summary where GITHUB_STEP_SUMMARY names a file; the annotations to print under GitHub
    Actions (GITHUB_ACTIONS=true), else []."""
    summary = environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as file:  # the runner's own protocol: every step appends
            file.write(step_summary(rows, mode))
    return error_annotations(rows, models) if environ.get("GITHUB_ACTIONS") == "true" else []


def pytest_qreport_report(results: RunResults, config: pytest.Config) -> list[str]:
    """Under GitHub Actions: the step summary, and the annotations as lines to print."""
    return github_output(list(results.rows), results.models, table_mode(config))
