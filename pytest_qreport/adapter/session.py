"""Hooks of a --qreport session: options checked up front, collection of declared models, rows, and reports."""
from __future__ import annotations

import os
import types
from typing import Any

import pytest

from ..core.errors import QReportError, ReportError
from ..core.explain import error_finding
from ..core.findings import Finding, RunOutcome
from ..core.layer_cache import LayerCache
from ..core.memory import available_memory
from ..core.nodeids import parse_item_nodeid
from ..core.numbers import printable
from ..core.quantizers import resolve_quantizer
from ..core.results import ModelFacts, RowKey, RunResults
from ..core.settings import session_settings
from ..xdist.durations import UnitDurations, work_unit
from ..xdist.rendezvous import CaptureRendezvous
from .fixture import FIXTURE_RESULTS
from .state import STATE_KEY, SessionState

__all__ = ["QReportSession", "RowCollector", "share_cores"]


def share_cores(workers: int) -> None:
    """Give each xdist worker its share of the cores (torch's default uses all of them in every worker, and
    oversubscribed OpenMP threads can make a run several times slower). OMP_NUM_THREADS, if set, wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(workers))))


class RowCollector:
    """The controller's side: rows as the reports come back, whichever worker sent them, and the facts of
    each model; then one RunResults in collection order."""

    def __init__(self) -> None:
        self.order: dict[str, int] = {}  # every collected test's node id -> its place in collection order
        self.expected: set[str] = set()  # node ids of the collected qreport items
        self.reported: set[str] = set()  # node ids that came back with a row
        self.rows: list[tuple[RowKey, str, Finding]] = []  # (key, conftest file, row)
        self.facts: dict[tuple[str, str], ModelFacts] = {}  # (conftest file, model) -> facts

    def collected(self, nodeids: list[str]) -> None:
        """Learn collected node ids, in order (serially from the session, under xdist from each worker)."""
        for nodeid in nodeids:
            self.order.setdefault(nodeid, len(self.order))
            if parse_item_nodeid(nodeid) is not None:
                self.expected.add(nodeid)

    def add(self, nodeid: str, payload: dict[str, Any]) -> None:
        """The rows one test reported: {"file": conftest or test file, "rows": [{"row": ..., "model": ...}]};
        "model" is None where the process sent the same facts with an earlier row."""
        item = self.order.get(nodeid, len(self.order))
        for index, entry in enumerate(payload["rows"]):
            row = Finding.from_dict(entry["row"])
            self.rows.append((RowKey(item, index), payload["file"], row))
            facts = ModelFacts.from_dict(entry["model"]) if entry.get("model") else ModelFacts(row.model)
            key = (payload["file"], facts.name)
            self.facts[key] = self.facts[key].merged(facts) if key in self.facts else facts
        self.reported.add(nodeid)

    def add_lost(self, nodeid: str, why: str) -> None:
        """An error row for a qreport item whose result never came back."""
        parsed = parse_item_nodeid(nodeid)
        if parsed is None or nodeid in self.reported:
            return
        file, model, check, layer = parsed
        message = f"model {model!r}: {why}"
        if "crashed" in why:
            from ..xdist.crashes import crashed_message

            message = f"{why}.\n{crashed_message(model, 'its worker')}"
        row = error_finding(model, check, layer, message).replace(nodeid=nodeid)
        self.add(nodeid, {"file": file, "rows": [{"row": row.to_dict(), "model": ModelFacts(model).to_dict()}]})

    def missing(self) -> list[str]:
        """Collected qreport items that never reported, in collection order."""
        return sorted(self.expected - self.reported, key=lambda nodeid: self.order[nodeid])

    def labels(self) -> dict[tuple[str, str], str]:
        """How rows name each (file, model): the bare name, or "file::name" where two files use the name."""
        files: dict[str, set[str]] = {}
        for file, model in self.facts:
            files.setdefault(model, set()).add(file)
        return {(file, model): model if len(files[model]) == 1 else f"{file}::{model}" for file, model in self.facts}

    def results(self, outcome: RunOutcome, shard: dict[str, Any] | None = None) -> RunResults:
        """Every row in collection order, named by its model's label, with the facts of each model (and the
        shard's models under --qreport-shard)."""
        labels = self.labels()
        rows = [row.replace(model=labels.get((file, row.model), row.model))
                for _key, file, row in sorted(self.rows, key=lambda entry: entry[0])]
        return RunResults(rows=tuple(rows), models={labels[key]: facts for key, facts in self.facts.items()},
                          outcome=outcome, shard=shard)


class QReportSession:
    """Registered by plugin.pytest_configure when --qreport is on."""

    def __init__(self, config) -> None:
        self.config = config
        self.state = SessionState(config)
        self.rows = RowCollector()
        self._reported = False  # reports are written once, from the terminal summary or at session finish
        self._facts_sent: dict[tuple[str, str], dict[str, Any]] = {}  # model key -> the facts its rows last sent
        self.shard_info: dict[str, Any] | None = None  # under --qreport-shard: what this shard runs, of which units
        self.unit_seconds = UnitDurations()  # each model's seconds in this run, for --qreport-store-durations
        config.stash[STATE_KEY] = self.state

    def start(self) -> None:
        """Parse and check the session's options once; a bad value is one UsageError before collection."""
        registry = self.state.refresh_registry()
        self.state.memory_available = available_memory()
        try:
            self.state.settings = session_settings(self.config, registry)
            for source in ("cli", "ini"):
                quantizer = self.state.settings[source]["quantizer"]
                if quantizer is not None:
                    resolve_quantizer(quantizer, self.config.hook)
        except ValueError as error:
            raise pytest.UsageError(f"qreport: {error}") from None
        if self.config.getoption("qreport_html", default=None) and not self.is_worker:
            from ..reports.html import html_extra_missing

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
            from ..xdist.crashes import XdistController

            self.config.pluginmanager.register(XdistController(self.rows.collected, self._shard_seen),
                                               "qreport-xdist")

    def _share_captures(self) -> None:
        """Join the controller's capture rendezvous (none on a remote host)."""
        from ..xdist.crashes import capture_dir

        worker = self.config.workerinput
        directory = capture_dir(worker)
        if directory is None or not os.path.isdir(directory):
            return
        self.state.capture_rendezvous = CaptureRendezvous(directory, worker["workerid"])
        self.state.capture_rendezvous.register()

    @property
    def is_worker(self) -> bool:
        """True inside a pytest-xdist worker."""
        return hasattr(self.config, "workerinput")

    def pytest_collect_file(self, file_path, parent):
        if file_path.name != "conftest.py":
            return None
        from ..core.declare import declarations_in

        module = conftest_module(self.config, file_path)
        if not declarations_in(module):
            return None
        from .items import QReportFile

        return QReportFile.from_parent(parent, path=file_path, module=module)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if call.excinfo is not None and call.when != "call":  # the message is the whole report, setup too
            if getattr(item, "qreport_setup_error", ""):
                report.longrepr = item.qreport_setup_error
            elif isinstance(call.excinfo.value, QReportError):
                report.longrepr = printable(str(call.excinfo.value))
        file = item.nodeid.split("::")[0]
        results = item.stash.get(FIXTURE_RESULTS, None)
        if results and call.when == "call":
            report.qreport = {"file": file, "rows": [{"row": row.to_dict(), "model": result.facts().to_dict()}
                                                     for result in results for row in result.rows()]}
        row = getattr(item, "qreport_row", None)
        if row is not None and (call.when == "call" or (call.when == "setup" and report.failed)):
            row = row.replace(nodeid=item.nodeid, duration=float(report.duration))
            facts = item.model_facts().to_dict()
            if self._facts_sent.get(item.model_key) == facts:
                facts = None  # the controller has them from an earlier row of this process: 7,000 rows, 19 models
            else:
                self._facts_sent[item.model_key] = facts
            report.qreport = {"file": file, "rows": [{"row": row.to_dict(), "model": facts}]}
        return report

    def pytest_collection_finish(self, session) -> None:
        if not self.is_worker:
            self.rows.collected([item.nodeid for item in session.items])

    @pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs: shards split what is left
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        """Under --qreport-shard=I/N keep shard I's models (every item of each) and the tests that are not qreport
        items; deselect the other models' items before anything is analysed."""
        shard = self.state.settings["shard"]
        if shard is None:
            return
        from ..core.shards import assign_shards, read_durations

        units = [work_unit(item.nodeid) if parse_item_nodeid(item.nodeid) is not None else None for item in items]
        counts: dict[str, int] = {}
        for unit in units:
            if unit is not None:
                counts[unit] = counts.get(unit, 0) + 1
        try:
            known = read_durations(self.state.settings["durations"]) or UnitDurations.recorded(config)
        except ValueError as error:
            raise pytest.UsageError(f"qreport: {error}") from None
        assigned = assign_shards(counts, shard.count, known)
        mine = [unit is None or assigned[unit] == shard.index for unit in units]  # other tests stay
        kept = [item for item, keep in zip(items, mine) if keep]
        dropped = [item for item, keep in zip(items, mine) if not keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        self._shard_seen({**shard.to_dict(), "units": list(counts),
                          "run": [unit for unit in counts if assigned[unit] == shard.index]})
        if self.is_worker:
            self.config.workeroutput["qreport_shard"] = self.shard_info

    def _shard_seen(self, info: dict[str, Any]) -> None:
        """What this shard runs (from this process's collection, or from an xdist worker's)."""
        self.shard_info = dict(info)

    def pytest_runtest_logreport(self, report) -> None:
        if not self.is_worker and parse_item_nodeid(report.nodeid) is not None:
            self.unit_seconds.add(work_unit(report.nodeid), report.duration)
        payload = getattr(report, "qreport", None)
        if payload:
            self.rows.add(report.nodeid, payload)
        elif report.failed:
            self.rows.add_lost(report.nodeid, str(report.longrepr))  # a crashed xdist worker reports no row

    def outcome(self) -> RunOutcome:
        """How complete the rows are; on a completed run, items that never reported get an error row first."""
        session = self.session
        stopped = session.shouldstop or session.shouldfail
        interrupted = ("interrupted" if session.exitstatus == pytest.ExitCode.INTERRUPTED and not stopped
                       else str(stopped) if stopped else "")
        if not interrupted:
            for nodeid in self.rows.missing():
                self.rows.add_lost(nodeid, "this item was collected but its result never came back: the process "
                                           "running it died, or pytest-xdist stopped after too many crashed workers")
        collected = len(self.rows.expected)
        return RunOutcome(collected=collected, reported=collected - len(self.rows.missing()), interrupted=interrupted)

    def pytest_sessionstart(self, session) -> None:
        self.session = session

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line, failed in self._report():
            terminalreporter.write_line(printable(line), red=failed)

    def pytest_sessionfinish(self, session) -> None:
        if self.is_worker or self.config.option.collectonly:
            return
        settings = self.state.settings
        if settings["shard"] is not None and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK  # a shard with no model is a shard that passed
        if settings["store_durations"] and self.unit_seconds.seconds:
            from ..core.shards import write_durations

            write_durations(settings["durations"], self.unit_seconds.seconds)
        if not self.config.pluginmanager.has_plugin("terminalreporter"):
            self._report()  # with -p no:terminal there is no terminal summary to report from

    def _report(self) -> list[tuple[str, bool]]:
        """Once, on the controller unless only collecting: update baselines, then call every pytest_qreport_report
        implementation on the run's results. Returns the lines to print, each with whether it is a failure."""
        if self.is_worker or self.config.option.collectonly or self._reported:
            return []
        self._reported = True
        results = self.rows.results(self.outcome(), self.shard_info)
        lines: list[tuple[str, bool]] = []
        if self.shard_info is not None:
            lines.append((shard_line(self.shard_info), False))
        if self.state.settings["baseline"]["update"]:
            from ..reports.baselines import update_baselines

            news, failed = update_baselines(list(results.rows), results.models)
            lines += [(line, "could not" in line) for line in news]
            if failed:
                self._fail_session()
        lines += call_reporters(self.config, results)
        if any(failed for _line, failed in lines):
            self._fail_session()
        return lines

    def _fail_session(self) -> None:
        if self.session.exitstatus == pytest.ExitCode.OK:
            self.session.exitstatus = pytest.ExitCode.TESTS_FAILED


def shard_line(info: dict[str, Any]) -> str:
    """'qreport shard 2/3: 2 of 5 models' (or that the shard has none)."""
    shard, run, units = f"{info['index']}/{info['count']}", len(info["run"]), len(info["units"])
    if not run:
        return (f"qreport shard {shard}: no model in this shard ({units} model(s) in all); its report is empty and "
                "the merge accepts it")
    return f"qreport shard {shard}: {run} of {units} model(s)"


def conftest_module(config: pytest.Config, path: Any) -> Any:
    """The imported module of a conftest.py, among the plugins pytest registered (None if it is not one)."""
    real = os.path.realpath(path)
    for plugin in config.pluginmanager.get_plugins():
        file = getattr(plugin, "__file__", None) if isinstance(plugin, types.ModuleType) else None
        if file and os.path.realpath(file) == real:
            return plugin
    return None


def call_reporters(config: pytest.Config, results: RunResults) -> list[tuple[str, bool]]:
    """Call each pytest_qreport_report implementation on its own, so that one reporter's ReportError neither
    hides the others nor the run's outcome: (line, failed) for each line a reporter returned or raised."""
    hook = config.hook.pytest_qreport_report
    arguments = {"rows": list(results.rows), "config": config, "outcome": results.outcome, "results": results}
    lines: list[tuple[str, bool]] = []
    for implementation in reversed(hook.get_hookimpls()):  # pluggy's own call order: tryfirst first
        if implementation.hookwrapper or implementation.wrapper:
            continue
        try:
            said: Any = implementation.function(*[arguments[name] for name in implementation.argnames])
        except ReportError as error:
            lines.append((str(error), True))
            continue
        said_lines: list[str] = [said] if isinstance(said, str) else list(said or [])
        lines += [(line, False) for line in said_lines]
    return lines
