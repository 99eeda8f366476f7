"""Hooks of a --qreport session: collection of declared models, rows, summary and the dedicated XML."""
from __future__ import annotations

import os

import pytest

from .items import STATE_KEY
from .options import table_mode
from .state import SessionState


def share_cores(workers: int) -> None:
    """Give each xdist worker its share of the cores (torch's default uses all of them in every worker, and
    oversubscribed OpenMP threads can make a run several times slower). OMP_NUM_THREADS, if set, wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(workers))))


class QReportSession:
    """Registered by plugin.pytest_configure when --qreport is on."""

    def __init__(self, config) -> None:
        self.config = config
        self.state = SessionState()
        config.stash[STATE_KEY] = self.state
        if self.is_worker:
            share_cores(config.workerinput.get("workercount", 1))

    @property
    def is_worker(self) -> bool:
        """True inside a pytest-xdist worker."""
        return hasattr(self.config, "workerinput")

    def pytest_collect_file(self, file_path, parent):
        if file_path.name != "conftest.py":
            return None
        from .declare import declarations_in

        if not declarations_in(file_path):
            return None
        from .items import QReportFile

        return QReportFile.from_parent(parent, path=file_path)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        row = getattr(item, "qreport_row", None)
        if row is not None and (call.when == "call" or (call.when == "setup" and report.failed)):
            report.qreport = {"position": [item.nodeid.split("::")[0], *item.position],
                              "row": dict(row, duration=float(report.duration))}
        return report

    def pytest_runtest_logreport(self, report) -> None:
        payload = getattr(report, "qreport", None)
        if payload:
            self.state.add_row(payload["position"], payload["row"])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.is_worker:
            return
        from .summary import render_summary

        rows = self.state.ordered_rows()
        terminalreporter.section("qreport summary")
        text = render_summary(rows, table_mode(self.config))
        terminalreporter.write_line(text if text else "all qreport checks passed")
        counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in ("pass", "fail", "warn", "error")}
        terminalreporter.write_line(", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no qreport items ran")

    def pytest_sessionfinish(self) -> None:
        path = self.config.getoption("qreport_junitxml", default=None)
        if path and not self.is_worker:
            from .junit import write_junit

            write_junit(path, self.state.ordered_rows())
