"""Cold-cache collection under pytest-xdist: each model is captured by one worker, the others read its layers.

Every worker collects the same models in the same order. Within each conftest.py a worker goes through the
models and claims each one (one file created exclusively: the first worker to get there owns it), before it
builds it: the owner builds the model, and captures it unless the layer cache has its entry; when another worker
claimed it first, the model is left for later, unbuilt. Workers thus share the builds and captures by how long
each takes, not by a fixed rule, and each model is built once at collection, not once per worker (with or
without a layer cache). Then a worker waits for the entries of the models it left. The owner marks each claimed
model done with its entry (its layer-cache key, items, capture and parameter bytes; none when the build or
capture failed), so a waiter whose entry never comes collects the model itself, to report the same error; it
does the same when the owner's process has died, or after `WAIT_LIMIT`.

Each worker also records which models it captured; ModelGroupScheduling gives a model's items to that worker,
so the process that captured a model at collection is the one that analyses it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..core.files import write_atomically

__all__ = ["CaptureRendezvous", "captured_by"]

WAIT_LIMIT = 900.0  # seconds; only a run whose workers disagree on what they collect gets this far

try:
    import fcntl
except ImportError:  # Windows: a dead owner is noticed by WAIT_LIMIT only
    fcntl = None  # type: ignore[assignment]


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def captured_by(run_dir: str) -> dict[str, str]:
    """{model scope: worker id} of the models captured at collection (read by the controller's scheduler)."""
    found: dict[str, str] = {}
    for path in Path(run_dir).glob("captured-*"):
        try:
            worker, scope = path.read_text(encoding="utf-8").split("\n", 1)
        except (OSError, ValueError):
            continue
        found[scope] = worker
    return found


class CaptureRendezvous:
    """One worker's side of the protocol, in the run directory the controller hands every worker."""

    def __init__(self, run_dir: str, worker_id: str) -> None:
        self.run_dir, self.worker_id = Path(run_dir), worker_id
        self._alive_handle: int | None = None

    def register(self) -> None:
        """Hold a lock on this worker's file while the process lives (the kernel drops it when the process dies)."""
        path = self.run_dir / f"worker-{self.worker_id}"
        self._alive_handle = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        if fcntl is not None:
            fcntl.flock(self._alive_handle, fcntl.LOCK_EX)

    def claim(self, index: int) -> bool:
        """Claim the session's `index`-th declared model for this worker to capture; False when another worker
        claimed it first (True again for a model this worker holds)."""
        path = self.run_dir / f"claim-{index}"
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return self.owner(index) == self.worker_id
        try:
            os.write(handle, self.worker_id.encode())
        finally:
            os.close(handle)
        return True

    def owner(self, index: int) -> str | None:
        """The worker that claimed the `index`-th model (None before anyone has, or while its id is written)."""
        try:
            return (self.run_dir / f"claim-{index}").read_text(encoding="utf-8") or None
        except OSError:
            return None

    def mark_done(self, index: int, entry: dict[str, Any] | None) -> None:
        """The owner has finished with the `index`-th model: `entry` is what the others need of it (its layer-cache
        key, items, capture and parameter bytes), or None when its build or capture failed."""
        write_atomically(self.run_dir / f"done-{index}", json.dumps(entry) if entry is not None else "")

    def mark_captured(self, scope: str) -> None:
        """Record that this worker holds the capture of `scope`'s model."""
        write_atomically(self.run_dir / f"captured-{_digest(scope)}", f"{self.worker_id}\n{scope}")

    def wait(self, index: int, poll: float = 0.02) -> dict[str, Any] | None:
        """The entry the owner of the `index`-th model marked it done with, or None once none will come (then
        collect the model yourself)."""
        deadline = time.monotonic() + WAIT_LIMIT
        done = self.run_dir / f"done-{index}"
        while True:
            try:
                text = done.read_text(encoding="utf-8")
            except OSError:
                owner = self.owner(index)
                if (owner is not None and not self._alive(owner)) or time.monotonic() > deadline:
                    return None
                time.sleep(poll)
                continue
            try:
                entry = json.loads(text) if text else None
            except ValueError:
                return None
            return entry if isinstance(entry, dict) and isinstance(entry.get("items"), dict) else None

    def _alive(self, worker: str) -> bool:
        path = self.run_dir / f"worker-{worker}"
        if fcntl is None:
            return True
        try:
            handle = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True  # not started yet
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            return False  # nobody holds it: the owner's process is gone
        finally:
            os.close(handle)
