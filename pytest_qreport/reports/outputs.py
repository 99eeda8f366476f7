"""The lines a reporter returns to the terminal: what it wrote, or why it kept the previous file."""
from __future__ import annotations

import os

from ..core.findings import RunOutcome

__all__ = ["skipped_after_interrupt", "written"]


def written(what: str, path: str) -> str:
    """'qreport: JUnit XML written to <path>'."""
    return f"qreport: {what} written to {path}"


def skipped_after_interrupt(option: str, path: str, outcome: RunOutcome) -> str:
    """After an interrupted run a report keeps its last complete file: the line that says so."""
    return (f"qreport: the run stopped early ({outcome.interrupted}), so {option} {path} was not written"
            f"{'; the previous file is unchanged' if os.path.exists(path) else ''}")
