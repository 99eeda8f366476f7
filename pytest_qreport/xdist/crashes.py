"""A model whose analysis kills its pytest-xdist worker costs one worker restart, not one per item.

Each worker holds an exclusive lock on a marker file while it analyses a model, and deletes the marker
when the analysis ends. The kernel drops the lock when a process dies, so a marker that still exists and
can be locked tells the next worker that a previous one died inside this model's analysis.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.nodeids import model_scope, parse_item_nodeid
from .durations import UnitDurations

__all__ = ["CRASH_DIR_KEY", "XdistController", "analysis_guard", "capture_dir", "crashed_message", "previous_crash"]

CRASH_DIR_KEY = "qreport_crash_dir"

try:
    import fcntl
except ImportError:  # Windows: no guard, xdist's own restarts apply
    fcntl = None  # type: ignore[assignment]


def _prefix(model_key: tuple[str, str]) -> str:
    return hashlib.sha1("::".join(model_key).encode()).hexdigest()[:16]


def capture_dir(workerinput: dict) -> str | None:
    """The run directory of capture_share's protocol, inside the crash directory the controller made."""
    crash_dir = workerinput.get(CRASH_DIR_KEY)
    return os.path.join(crash_dir, "captures") if crash_dir else None


def crashed_message(model: str, worker: str) -> str:
    """What the items of a model say when its analysis killed a worker process."""
    return (f"model {model!r}: the process analysing it ({worker}) died before the analysis finished: a "
            "segmentation fault, os._exit() or the out-of-memory killer, in the model's forward or in its "
            f"calibration fixture. Every item of {model!r} is an error; other models run on. To see where it "
            f"dies, run it alone without xdist: pytest --qreport -p no:xdist -k {model}")


def previous_crash(crash_dir: str, model_key: tuple[str, str]) -> str | None:
    """The worker id of a process that died while analysing this model, or None."""
    if fcntl is None:
        return None
    for marker in sorted(Path(crash_dir).glob(_prefix(model_key) + "-*.lock")):
        try:
            handle = os.open(marker, os.O_RDONLY)
        except FileNotFoundError:
            continue  # its analysis just ended
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live worker is analysing the same model (--dist load spreads its items)
        else:
            try:
                still_there = os.stat(marker).st_ino == os.fstat(handle).st_ino
            except FileNotFoundError:
                still_there = False  # deleted between our open and our lock: ended normally
            if still_there:
                worker, pid = marker.name.split("-", 1)[1].split(".")[:2]
                return f"worker {worker}, pid {pid}"
        finally:
            os.close(handle)
    return None


@contextlib.contextmanager
def analysis_guard(crash_dir: str | None, model_key: tuple[str, str], worker: str) -> Iterator[None]:
    """Hold this model's marker for the duration of the block (no-op without a crash directory)."""
    if crash_dir is None or fcntl is None:
        yield
        return
    marker = Path(crash_dir) / f"{_prefix(model_key)}-{worker}.{os.getpid()}.lock"
    handle = os.open(marker, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.unlink(marker)  # before unlocking: a reader that locks it later finds it gone
        os.close(handle)


class XdistController:
    """Controller-side pytest-xdist hooks: hand the workers a run directory (crash markers, who captured which
    model), learn what they collected, and schedule each model's items together under --dist load and
    loadgroup, on the worker that captured it."""

    def __init__(self, collected: Callable[[list[str]], None],
                 shard_seen: Callable[[dict[str, Any]], None] = lambda info: None) -> None:
        """`collected` hears each worker's collection; `shard_seen` what a worker's shard runs (--qreport-shard)."""
        self.crash_dir = tempfile.mkdtemp(prefix="pytest-qreport-")
        os.mkdir(os.path.join(self.crash_dir, "captures"))
        self.collected = collected
        self.shard_seen = shard_seen
        self.durations = UnitDurations()

    def pytest_configure_node(self, node) -> None:
        """Tell every worker (restarted ones too) where the markers live."""
        node.workerinput[CRASH_DIR_KEY] = self.crash_dir

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """Remember the collected node ids, in order, to find items that never reported."""
        self.collected(list(ids))

    def pytest_xdist_make_scheduler(self, config, log):
        """Under --dist load (-n's default) and loadgroup, keep each model's items together (see scheduling.py)."""
        if config.getvalue("dist") not in ("load", "loadgroup"):
            return None
        from .scheduling import ModelGroupScheduling

        return ModelGroupScheduling(config, log, capture_dir({CRASH_DIR_KEY: self.crash_dir}))

    def pytest_testnodedown(self, node, error) -> None:
        """A worker's shard (every worker computes the same one), from what it sent back."""
        info = getattr(node, "workeroutput", {}).get("qreport_shard")
        if isinstance(info, dict):
            self.shard_seen(info)

    def pytest_runtest_logreport(self, report) -> None:
        """Time each model's unit, for the next run's scheduling."""
        parsed = parse_item_nodeid(report.nodeid)
        if parsed is not None:
            self.durations.add(model_scope(parsed[0], parsed[1]), report.duration)

    def pytest_sessionfinish(self, session) -> None:
        self.durations.save(session.config)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.crash_dir, ignore_errors=True)
