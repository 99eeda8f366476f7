"""Where an analysis stands, and how long each of its stages took.

qcore names its stages (`capture`, `calibration`, `comparison`, `trials`) and counts the batches of each pass;
a caller that wants to know sets a listener with `tracked()`. Without one, `stage()` and `batch_done()` cost a
context-variable read. Time goes to the outermost stage: a trial's calibration and comparison passes are the
trial's time.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["STAGES", "Listener", "StageTimes", "batch_done", "stage", "tracked"]

STAGES = ("capture", "calibration", "comparison", "trials")

# listener(stages, batches done, batches in all or None): stages is the path of open stages, outermost first
Listener = Callable[[tuple[str, ...], int, "int | None"], None]


@dataclass
class StageTimes:
    """Seconds per stage of one tracked analysis, and the stages open now."""

    seconds: dict[str, float] = field(default_factory=dict)
    listener: Listener | None = None
    open: list[str] = field(default_factory=list)

    def total(self) -> float:
        """Seconds in all stages."""
        return sum(self.seconds.values())


_CURRENT: contextvars.ContextVar[StageTimes | None] = contextvars.ContextVar("qcore_progress", default=None)


@contextlib.contextmanager
def tracked(listener: Listener | None = None, times: StageTimes | None = None) -> Iterator[StageTimes]:
    """Within the block, stages are timed into the StageTimes yielded (`times` to go on adding to one) and
    reported to `listener` as they open and as their batches finish."""
    current = times if times is not None else StageTimes()
    current.listener = listener
    token = _CURRENT.set(current)
    try:
        yield current
    finally:
        _CURRENT.reset(token)
        current.listener = None


@contextlib.contextmanager
def stage(name: str, batches: int | None = None) -> Iterator[None]:
    """Time the block as stage `name` (unless an outer stage is open) and tell the listener it started."""
    current = _CURRENT.get()
    if current is None:
        yield
        return
    current.open.append(name)
    if current.listener is not None:
        current.listener(tuple(current.open), 0, batches)
    start = time.perf_counter()
    try:
        yield
    except Exception as error:
        if not hasattr(error, "qcore_stage"):  # the innermost stage open where it was raised, for its message
            error.qcore_stage = "/".join(current.open)  # type: ignore[attr-defined]
        raise
    finally:
        current.open.pop()
        if not current.open:
            current.seconds[name] = current.seconds.get(name, 0.0) + time.perf_counter() - start


def batch_done(done: int, total: int | None = None) -> None:
    """Tell the listener that `done` batches of the innermost open stage have finished."""
    current = _CURRENT.get()
    if current is not None and current.listener is not None and current.open:
        current.listener(tuple(current.open), done, total)
