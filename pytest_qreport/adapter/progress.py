"""A sign of life while a model is analysed: its stage and batch, on one updating line on a terminal, as plain
lines elsewhere (CI logs, pytest-xdist workers), and its time per stage once it is done."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Mapping

import pytest

from ..core.numbers import stage_times

__all__ = ["AnalysisProgress"]

_LIVE_AFTER, _LIVE_INTERVAL = 1.0, 0.1  # a fast analysis shows nothing; then a rewrite every 0.1 s at most
_PLAIN_AFTER, _PLAIN_INTERVAL = 5.0, 10.0  # plain lines (CI logs) for slow analyses only, and few of them
# seconds an analysis runs before it shows progress (both kinds): QREPORT_PROGRESS_AFTER=0 shows every analysis
AFTER_VARIABLE = "QREPORT_PROGRESS_AFTER"


def _after(default: float) -> float:
    try:
        return float(os.environ[AFTER_VARIABLE])
    except (KeyError, ValueError):
        return default


class AnalysisProgress:
    """The listener of one model's analysis (qcore.runtime.progress): `progress(stages, done, total)`, then
    `done(seconds)`."""

    def __init__(self, item: pytest.Item, model: str) -> None:
        config = item.config
        self.item, self.model = item, model
        self.terminal = config.pluginmanager.get_plugin("terminalreporter")
        self.capture = config.pluginmanager.get_plugin("capturemanager")
        self.worker = str(getattr(config, "workerinput", {}).get("workerid", ""))
        quiet = config.get_verbosity() < 0
        self.live = bool(self.terminal is not None and not self.worker and not quiet and self.terminal.isatty())
        self.plain = not self.live and not quiet
        self.live_after, self.plain_after = _after(_LIVE_AFTER), _after(_PLAIN_AFTER)
        self.start = time.perf_counter()
        self.shown = -1.0  # when a line was last shown (never yet)
        self.last_stage = ""

    def __call__(self, stages: tuple[str, ...], done: int, total: int | None) -> None:
        now = time.perf_counter()
        where = " > ".join(stages)
        if self.live:
            if now - self.start >= self.live_after and (self.shown < 0 or now - self.shown >= _LIVE_INTERVAL):
                batches = f", batch {done}/{total}" if total else f", batch {done}" if done else ""
                self._rewrite(f"qreport: {self.model}: {where}{batches} ({now - self.start:.1f} s)")
                self.shown = now
        elif self.plain and now - self.start >= self.plain_after and \
                (self.shown < 0 or (stages[0] != self.last_stage and now - self.shown >= _PLAIN_INTERVAL)):
            self._line(f"qreport: {self.model}: {where} ({now - self.start:.1f} s)")
            self.shown = now
        self.last_stage = stages[0]

    def done(self, seconds: Mapping[str, float]) -> None:
        """Say how long the analysis took, per stage (on the live line, or as a plain line)."""
        if self.live and self.shown > 0:
            self._rewrite(f"qreport: {self.model} analysed in {stage_times(seconds)}")
        elif self.plain and self.shown > 0:
            self._line(f"qreport: {self.model} analysed in {stage_times(seconds)}")
        if self.shown > 0 and not self.worker and self.terminal is not None:
            with self._uncaptured():  # the item's line again, where pytest writes its result
                self.terminal.currentfspath = None
                self.terminal.pytest_runtest_logstart(nodeid=self.item.nodeid, location=self.item.location)

    def _rewrite(self, text: str) -> None:
        assert self.terminal is not None  # live only with a terminal
        with self._uncaptured():  # an item's setup runs with output captured; this is the session's own
            if self.shown < 0:
                self.terminal.ensure_newline()
            self.terminal.rewrite(text, erase=True)

    def _line(self, text: str) -> None:
        with self._uncaptured():
            if self.worker:  # a worker's terminal output is not shown: its stderr reaches the controller's terminal
                print(f"[{self.worker}] {text}", file=sys.stderr, flush=True)
            elif self.terminal is not None:
                self.terminal.ensure_newline()
                self.terminal.write_line(text)

    def _uncaptured(self) -> contextlib.AbstractContextManager:
        if self.capture is None:
            return contextlib.nullcontext()
        return self.capture.global_and_fixture_disabled()
