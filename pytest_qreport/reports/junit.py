"""The dedicated JUnit XML file (one testsuite per model), written atomically through pytest_qreport_report."""
from __future__ import annotations

import os
import tempfile

import pytest
from junit_xml import TestCase, TestSuite, to_xml_report_string

from .findings import Finding, RunOutcome
from .summary import format_value

__all__ = ["build_suites", "keep_previous_file", "pytest_qreport_report", "write_atomically", "write_junit"]

_PROPERTIES = ("model", "check", "layer", "metric", "value", "threshold", "verdict")


def _clean(text: str) -> str:
    """Text that XML can carry: lone surrogates become '?' (junit-xml drops control characters itself)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def build_suites(rows: list[Finding]) -> list[TestSuite]:
    """One TestSuite per model, one TestCase per (check, layer)."""
    by_model: dict[str, list[TestCase]] = {}
    for row in rows:
        row = row.replace(message=_clean(row.message), waiver=_clean(row.waiver), layer=_clean(row.layer))
        lines = [f"{k}={getattr(row, k)}" for k in _PROPERTIES] + ([f"waiver={row.waiver}"] if row.waiver else [])
        lines += [f"{k}={getattr(row, k)}" for k in ("baseline", "delta", "baseline_status") if getattr(row, k) not in
                  (None, "")]
        lines += [f"capture_{k}={_clean(str(v))}" for k, v in (row.details.get("capture") or {}).items()]
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
    return [TestSuite(f"qreport.{model}", cases) for model, cases in by_model.items()]


def write_atomically(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".qreport-", suffix=".tmp", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; a report or baseline is an ordinary file
        # errors="replace": a lone surrogate (from a non-UTF-8 file name, say) must not lose the whole file
        with os.fdopen(handle, "w", encoding="utf-8", errors="replace") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_junit(path: str, rows: list[Finding]) -> None:
    """Write the dedicated JUnit XML report for `rows`."""
    write_atomically(path, to_xml_report_string(build_suites(rows), prettyprint=True))


def keep_previous_file(config: pytest.Config, option: str, path: str, outcome: RunOutcome) -> bool:
    """After an interrupted run, leave the last complete report file in place and say so."""
    if not outcome.interrupted:
        return False
    from .items import STATE_KEY

    config.stash[STATE_KEY].messages.append(
        f"qreport: the run stopped early ({outcome.interrupted}), so {option} {path} was not written"
        f"{'; the previous file is unchanged' if os.path.exists(path) else ''}")
    return True


def pytest_qreport_report(rows: list[Finding], config: pytest.Config, outcome: RunOutcome) -> None:
    """Write --qreport-junitxml when it is given; a failed write is one error line and a failing exit status."""
    path = config.getoption("qreport_junitxml", default=None)
    if path and not keep_previous_file(config, "--qreport-junitxml", path, outcome):
        try:
            write_junit(path, rows)
        except OSError as error:
            from .items import STATE_KEY

            config.stash[STATE_KEY].report_errors.append(f"qreport: could not write --qreport-junitxml {path}: {error}")
