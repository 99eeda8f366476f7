"""The lines a reporter returns to the terminal: what it wrote, or why it kept the previous file."""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from ..core.errors import ReportError
from ..core.files import write_atomically
from ..core.findings import RunOutcome
from ..core.results import RunResults

__all__ = ["skipped_after_interrupt", "write_report", "written"]


def written(what: str, path: str) -> str:
    """'qreport: JUnit XML written to <path>'."""
    return f"qreport: {what} written to {path}"


def skipped_after_interrupt(option: str, path: str, outcome: RunOutcome) -> str:
    """After an interrupted run a report keeps its last complete file: the line that says so."""
    return (f"qreport: the run stopped early ({outcome.interrupted}), so {option} {path} was not written"
            f"{'; the previous file is unchanged' if os.path.exists(path) else ''}")


def write_report(config: pytest.Config, results: RunResults, flag: str, what: str,
                 render: Callable[[], str]) -> str | None:
    """Write the file that `flag` names (if given and the run completed) with `render()`, atomically; the line
    that says what happened, or ReportError when it cannot be written."""
    path = config.getoption(flag.lstrip("-").replace("-", "_"), default=None)
    if not path:
        return None
    if results.outcome.interrupted:
        return skipped_after_interrupt(flag, path, results.outcome)
    try:
        write_atomically(path, render())
    except OSError as error:
        raise ReportError(f"qreport: could not write {flag} {path}: {error}") from error
    return written(what, path)
