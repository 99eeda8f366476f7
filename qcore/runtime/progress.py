"""Where an analysis stands, and how long each of its stages took.

qcore names its stages (`capture`, `calibration`, `comparison`, `trials`) and counts the batches of each pass;
a caller that wants to know sets a listener with `tracked()`. Without one, `stage()` and `batch_done()` cost a
context-variable read. Time goes to the outermost stage: a trial's calibration and comparison passes are the
trial's time.

The fix budget is counted in graph runs, not seconds, so that a search stops at the same step on every run, serial
or under xdist: each run of a model graph on one batch (`graph_run`, a share of one when a search resumes a graph
part way) counts towards the outermost open stage. The verdict pass is the calibration and comparison stages' runs;
`trials_allowed()` says whether the trials have run fewer than `fix_budget` times as many; asked before a
whole-model trial (`trial_step`) or a search step that one must follow, whether the budget left holds one (the
costliest so far, at least two runs per batch), so that a trial begun near the end of the budget does not overrun it
by a whole pass.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["STAGES", "VERDICT_STAGES", "FixBudgetUse", "Listener", "StageTimes", "batch_done", "fix_budget_use",
           "graph_run", "stage", "tracked", "trial_step", "trials_allowed"]

STAGES = ("capture", "calibration", "comparison", "trials")
VERDICT_STAGES = ("calibration", "comparison")  # the verdict pass: every item's verdict comes from these

# listener(stages, batches done, batches in all or None): stages is the path of open stages, outermost first
Listener = Callable[[tuple[str, ...], int, "int | None"], None]


@dataclass
class StageTimes:
    """Seconds per stage of one tracked analysis, and the stages open now."""

    seconds: dict[str, float] = field(default_factory=dict)
    listener: Listener | None = None
    open: list[str] = field(default_factory=list)
    runs: dict[str, float] = field(default_factory=dict)  # graph runs on one batch, per outermost stage
    fix_budget: float | None = None  # trial runs allowed per verdict-pass run; None: no limit
    budget_refusals: int = 0  # searches or search steps the budget stopped
    largest_trial: float = 0.0  # graph runs of the costliest whole-model trial so far (trial_step)

    def total(self) -> float:
        """Seconds in all stages."""
        return sum(self.seconds.values())

    def verdict_runs(self) -> float:
        """Graph runs of the verdict pass (calibration and comparison) so far."""
        return sum(self.runs.get(name, 0.0) for name in VERDICT_STAGES)

    def allowed_runs(self) -> float:
        """Trial runs the fix budget allows (inf without a budget)."""
        return float("inf") if self.fix_budget is None else self.fix_budget * self.verdict_runs()

    def whole_trial_runs(self) -> float:
        """The graph runs a whole-model trial is expected to cost: the costliest so far, and at least two runs per
        batch (the calibration pass's runs): a trial calibrates its quantized copy and runs it on every batch."""
        return max(self.largest_trial, 2 * self.runs.get("calibration", 0.0))

    def budget_use(self) -> FixBudgetUse:
        """What the fix searches spent of the budget."""
        return FixBudgetUse(self.fix_budget, self.verdict_runs(), self.runs.get("trials", 0.0),
                            self.seconds.get("trials", 0.0), sum(self.seconds.get(n, 0.0) for n in VERDICT_STAGES),
                            self.budget_refusals)


@dataclass(frozen=True)
class FixBudgetUse:
    """A model's fix budget and what its searches spent: graph runs (one graph on one batch) and seconds."""

    fix_budget: float | None  # trial runs allowed per verdict-pass run; None: no limit
    verdict_runs: float
    trial_runs: float
    trial_seconds: float
    verdict_seconds: float
    refusals: int  # searches or search steps the budget stopped

    @property
    def share(self) -> float | None:
        """The share of the budget the trials used (None without a budget or without a verdict pass; 0 for a budget
        of 0 that nothing exceeded)."""
        if self.fix_budget is None or not self.verdict_runs:
            return None
        allowed = self.fix_budget * self.verdict_runs
        return self.trial_runs / allowed if allowed else (0.0 if not self.trial_runs else math.inf)

    def as_dict(self) -> dict[str, float | int | None]:
        """Builtins, for the reports."""
        share = self.share
        return {"fix_budget": self.fix_budget, "verdict_runs": round(self.verdict_runs, 3),
                "trial_runs": round(self.trial_runs, 3), "share": None if share is None else round(share, 4),
                "verdict_seconds": round(self.verdict_seconds, 4), "trial_seconds": round(self.trial_seconds, 4),
                "stopped_searches": self.refusals}


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


def graph_run(share: float = 1.0) -> None:
    """Count one run of a model graph on one batch (`share` of one for a part of the graph) towards the outermost
    open stage."""
    current = _CURRENT.get()
    if current is not None and current.open:
        name = current.open[0]
        current.runs[name] = current.runs.get(name, 0.0) + share


def trials_allowed(refuse: bool = True, whole: bool = False) -> bool:
    """Whether the fix searches may run another trial: they have run fewer graph runs than the fix budget allows
    (always without a tracked budget); whole=True, for a whole-model trial or a step that one must follow: the
    budget left also holds such a trial (StageTimes.whole_trial_runs). A refusal is counted unless `refuse` is
    False (a question, not a stop)."""
    current = _CURRENT.get()
    if current is None or current.fix_budget is None:
        return True
    spent, limit = current.runs.get("trials", 0.0), current.allowed_runs()
    allowed = spent < limit and (not whole or spent + current.whole_trial_runs() <= limit)
    if not allowed and refuse:
        current.budget_refusals += 1
    return allowed


@contextlib.contextmanager
def trial_step() -> Iterator[None]:
    """Count the block's trial graph runs as one whole-model trial: the costliest so far is what trials_allowed(
    whole=True) keeps in hand."""
    current = _CURRENT.get()
    if current is None:
        yield
        return
    before = current.runs.get("trials", 0.0)
    try:
        yield
    finally:
        current.largest_trial = max(current.largest_trial, current.runs.get("trials", 0.0) - before)


def fix_budget_use() -> FixBudgetUse | None:
    """What the tracked analysis's fix searches spent of its budget (None when untracked)."""
    current = _CURRENT.get()
    return None if current is None else current.budget_use()
