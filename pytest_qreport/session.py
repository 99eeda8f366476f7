"""Hooks of a --qreport session: options checked up front, collection of declared models, rows, and reports."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from .findings import Finding
from .fixture import FIXTURE_RESULTS
from .items import STATE_KEY
from .options import session_settings
from .quantizers import resolve_quantizer
from .registry import CheckRegistry
from .runner import QReportError

__all__ = ["QReportSession", "SessionState", "share_cores"]


def share_cores(workers: int) -> None:
    """Give each xdist worker its share of the cores (torch's default uses all of them in every worker, and
    oversubscribed OpenMP threads can make a run several times slower). OMP_NUM_THREADS, if set, wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(workers))))


@dataclass
class SessionState:
    """What one pytest process keeps for the plugin."""

    config: Any
    registry: CheckRegistry = field(default_factory=CheckRegistry)
    settings: dict[str, Any] = field(default_factory=dict)
    models: dict = field(default_factory=dict)
    rows: list[tuple[list, Finding]] = field(default_factory=list)
    model_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # controller: by model name
    messages: list[str] = field(default_factory=list)  # controller: lines for the end of the summary
    report_errors: list[str] = field(default_factory=list)  # controller: outputs that could not be written

    def refresh_registry(self) -> CheckRegistry:
        """Ask every plugin and conftest.py loaded so far to register its checks (idempotent)."""
        self.config.hook.pytest_qreport_register_checks(registry=self.registry)
        return self.registry

    def ordered_rows(self) -> list[Finding]:
        """Rows in collection order, whatever order the workers finished in."""
        return [row for _, row in sorted(self.rows, key=lambda pair: pair[0])]


class QReportSession:
    """Registered by plugin.pytest_configure when --qreport is on."""

    def __init__(self, config) -> None:
        self.config = config
        self.state = SessionState(config)
        config.stash[STATE_KEY] = self.state

    def start(self) -> None:
        """Parse and check the session's options once; a bad value is one UsageError before collection."""
        known = self.state.refresh_registry().names()
        try:
            self.state.settings = session_settings(self.config, known)
            for source in ("cli", "ini"):
                quantizer = self.state.settings[source]["quantizer"]
                if quantizer is not None:
                    resolve_quantizer(quantizer, self.config.hook)
        except ValueError as error:
            raise pytest.UsageError(f"qreport: {error}") from None
        if self.is_worker:
            share_cores(self.config.workerinput.get("workercount", 1))

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
        if call.excinfo is not None and isinstance(call.excinfo.value, QReportError) and call.when != "call":
            report.longrepr = str(call.excinfo.value)  # the message is the whole report, also for setup errors
        results = item.stash.get(FIXTURE_RESULTS, None)
        if results and call.when == "call":
            file = item.nodeid.split("::")[0]
            report.qreport_fixture = [{"position": [file, 1 << 30, index, 0, item.nodeid], "row": row.to_dict(),
                                       "model": {"model": result.name, "baseline_path": result.baseline_path,
                                                 "fingerprint": result.fingerprint}}
                                      for result in results for index, row in enumerate(result.rows())]
        row = getattr(item, "qreport_row", None)
        if row is not None and (call.when == "call" or (call.when == "setup" and report.failed)):
            row = row.replace(nodeid=item.nodeid, duration=float(report.duration))
            report.qreport = {"position": [item.nodeid.split("::")[0], *item.position, item.nodeid],
                              "row": row.to_dict(), "model": item.qreport_model_info}
        return report

    def pytest_runtest_logreport(self, report) -> None:
        for payload in [getattr(report, "qreport", None), *getattr(report, "qreport_fixture", [])]:
            if payload:
                self._add_row(payload)

    def _add_row(self, payload: dict) -> None:
        self.state.rows.append((list(payload["position"]), Finding.from_dict(payload["row"])))
        info = payload["model"]
        known = self.state.model_info.setdefault(info["model"], dict(info))
        known["fingerprint"] = known.get("fingerprint") or info.get("fingerprint")

    def pytest_sessionstart(self, session) -> None:
        self.session = session

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self._report()
        for line in self.state.messages:
            terminalreporter.write_line(line)
        for line in self.state.report_errors:
            terminalreporter.write_line(line, red=True)

    def pytest_sessionfinish(self, session) -> None:
        if self.is_worker or self.config.option.collectonly:
            return
        if self.state.settings["baseline"]["update"]:
            from .updates import update_baselines

            news, failed = update_baselines(self.state.ordered_rows(), self.state.model_info)
            self.state.messages += news
            if failed and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if not self.config.pluginmanager.has_plugin("terminalreporter"):
            self._report()  # with -p no:terminal there is no terminal summary to report from

    def _report(self) -> None:
        """Call pytest_qreport_report once, on the controller, unless only collecting."""
        if self.is_worker or self.config.option.collectonly:
            return
        self.config.hook.pytest_qreport_report(rows=self.state.ordered_rows(), config=self.config)
        if self.state.report_errors and self.session.exitstatus == pytest.ExitCode.OK:
            self.session.exitstatus = pytest.ExitCode.TESTS_FAILED
