"""Hooks of a --qreport session: options checked up front, collection of declared models, rows, and reports."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from .capture_cache import LayerCache
from .capture_share import CaptureRendezvous
from .findings import Finding, RunOutcome
from .fixture import FIXTURE_RESULTS
from .items import STATE_KEY, parse_item_nodeid
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
    model_info: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # controller: by (file, model)
    messages: list[str] = field(default_factory=list)  # controller: lines for the end of the summary
    report_errors: list[str] = field(default_factory=list)  # controller: outputs that could not be written
    collected: dict[str, int] = field(default_factory=dict)  # controller: qreport item node ids, in order
    reported: set[str] = field(default_factory=set)  # controller: node ids that came back with a row
    one_shot: dict[int, tuple[Any, list]] = field(default_factory=dict)  # id(iterator): (iterator, its batches)
    layer_cache: LayerCache = field(default_factory=lambda: LayerCache(None))
    capture_rendezvous: CaptureRendezvous | None = None  # xdist worker: who captures which model at collection
    declared_models: int = 0  # models declared in the conftest files collected so far

    def refresh_registry(self) -> CheckRegistry:
        """Ask every plugin and conftest.py loaded so far to register its checks (idempotent)."""
        self.config.hook.pytest_qreport_register_checks(registry=self.registry)
        return self.registry

    def replayable(self, source: Any) -> Any:
        """`source`, or for a one-shot iterator (a generator, say) the list of its batches, read once per
        session: collection's example batch and every model sharing the iterator then see all of them."""
        from .runner import is_single_batch

        if is_single_batch(source) or isinstance(source, (list, tuple)):
            return source
        try:
            if iter(source) is not source:
                return source  # re-iterable: a Dataset, a DataLoader, a range
        except TypeError:
            return source  # not iterable at all: as_batches says so
        if id(source) not in self.one_shot:
            self.one_shot[id(source)] = (source, list(source))  # keeping `source` keeps its id unique
        return self.one_shot[id(source)][1]

    def ordered_rows(self) -> list[Finding]:
        """Rows in collection order, whatever order the workers finished in (rows of items whose result
        never came back sit among their model's rows)."""
        models = {(p[0], r.model): p[1] for p, r in self.rows if p[1] is not None}
        checks = {name: index for index, name in enumerate(self.registry.names())}

        def position(pair: tuple[list, Finding]) -> list:
            place, row = pair
            if place[1] is not None:
                return place
            return [place[0], models.get((place[0], row.model), 1 << 29), checks.get(row.check, len(checks)),
                    *place[3:]]

        labels = self.labels()
        return [row.replace(model=labels.get((place[0], row.model), row.model))
                for place, row in sorted(self.rows, key=position)]

    def labels(self) -> dict[tuple[str, str], str]:
        """How rows name each (file, model): the bare name, or "file::name" where two files use the name."""
        files: dict[str, set[str]] = {}
        for file, model in self.model_info:
            files.setdefault(model, set()).add(file)
        return {(file, model): model if len(files[model]) == 1 else f"{file}::{model}"
                for file, model in self.model_info}

    def models_by_label(self) -> dict[str, dict[str, Any]]:
        """What is known of each model (name, baseline file, fingerprint), by the name its rows carry."""
        labels = self.labels()
        return {labels[key]: info for key, info in self.model_info.items()}


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
        if self.config.getoption("qreport_html", default=None) and not self.is_worker:
            from .html import html_extra_missing

            missing = html_extra_missing()
            if missing:
                raise pytest.UsageError(f"qreport: {missing}")
        cache = getattr(self.config, "cache", None)  # absent with -p no:cacheprovider: every run captures
        if cache is not None:
            self.state.layer_cache = LayerCache(str(cache.mkdir("qreport-layers")))
        if self.is_worker:
            share_cores(self.config.workerinput.get("workercount", 1))
            self._share_captures()
        elif getattr(self.config.option, "dist", "no") != "no":
            from .crashes import XdistController

            self.config.pluginmanager.register(XdistController(self.state.collected), "qreport-xdist")

    def _share_captures(self) -> None:
        """Join the controller's capture rendezvous (none without a layer cache, or on a remote host)."""
        from .crashes import capture_dir

        worker = self.config.workerinput
        directory = capture_dir(worker)
        if self.state.layer_cache.directory is None or directory is None or not os.path.isdir(directory):
            return
        self.state.capture_rendezvous = CaptureRendezvous(directory, worker["workerid"], worker["workercount"])
        self.state.capture_rendezvous.register()

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

    def pytest_collection_finish(self, session) -> None:
        from .items import QReportItem

        for item in session.items:
            if isinstance(item, QReportItem):
                self.state.collected.setdefault(item.nodeid, len(self.state.collected))

    def pytest_runtest_logreport(self, report) -> None:
        for payload in [getattr(report, "qreport", None), *getattr(report, "qreport_fixture", [])]:
            if payload:
                self._add_row(payload)
        if report.failed and report.nodeid not in self.state.reported and not hasattr(report, "qreport"):
            self._add_lost_row(report.nodeid, str(report.longrepr))  # a crashed xdist worker reports no row

    def _add_row(self, payload: dict) -> None:
        self.state.rows.append((list(payload["position"]), Finding.from_dict(payload["row"])))
        self.state.reported.add(payload["row"]["nodeid"])
        info = payload["model"]
        known = self.state.model_info.setdefault((payload["position"][0], info["model"]), dict(info))
        for key, value in info.items():
            known[key] = known.get(key) or value

    def _add_lost_row(self, nodeid: str, why: str) -> None:
        """An error row for a qreport item whose result never came back."""
        parsed = parse_item_nodeid(nodeid)
        if parsed is None:
            return
        file, model, check, layer = parsed
        message = f"model {model!r}: {why}"
        if "crashed" in why:
            from .crashes import crashed_message

            message = f"{why}.\n{crashed_message(model, 'its worker')}"
        row = Finding(model=model, check=check, layer=layer, metric="", value=float("nan"), threshold=float("nan"),
                      verdict="error", message=message, nodeid=nodeid)
        self._add_row({"position": [file, None, None, self.state.collected.get(nodeid, 0), nodeid],
                       "row": row.to_dict(), "model": {"model": model, "baseline_path": None, "fingerprint": None}})

    def outcome(self) -> RunOutcome:
        """How complete the rows are; on a completed run, items that never reported get an error row first."""
        session = self.session
        stopped = session.shouldstop or session.shouldfail
        interrupted = ("interrupted" if session.exitstatus == pytest.ExitCode.INTERRUPTED and not stopped
                       else str(stopped) if stopped else "")
        missing = [nodeid for nodeid in self.state.collected if nodeid not in self.state.reported]
        if not interrupted:
            for nodeid in missing:
                self._add_lost_row(nodeid, "this item was collected but its result never came back: the process "
                                           "running it died, or pytest-xdist stopped after too many crashed workers")
        reported = sum(1 for nodeid in self.state.collected if nodeid in self.state.reported)
        return RunOutcome(collected=len(self.state.collected), reported=reported, interrupted=interrupted)

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

            news, failed = update_baselines(self.state.ordered_rows(), self.state.models_by_label())
            self.state.messages += news
            if failed and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if not self.config.pluginmanager.has_plugin("terminalreporter"):
            self._report()  # with -p no:terminal there is no terminal summary to report from

    def _report(self) -> None:
        """Call pytest_qreport_report once, on the controller, unless only collecting."""
        if self.is_worker or self.config.option.collectonly:
            return
        outcome = self.outcome()
        self.config.hook.pytest_qreport_report(rows=self.state.ordered_rows(), config=self.config, outcome=outcome)
        if self.state.report_errors and self.session.exitstatus == pytest.ExitCode.OK:
            self.session.exitstatus = pytest.ExitCode.TESTS_FAILED
