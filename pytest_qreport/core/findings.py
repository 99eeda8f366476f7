"""`Finding`: the typed, frozen record of one check of one layer, convertible to builtins and back."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BASELINE_STATUSES", "VERDICTS", "Finding", "RunOutcome", "to_builtins"]

VERDICTS = ("pass", "fail", "warn", "waived", "error", "skip")
BASELINE_STATUSES = ("", "ok", "new", "regressed", "improved")


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


def to_builtins(value: Any) -> Any:
    """`value` as JSON-like builtins: tensors and numpy values become lists or numbers, tuples lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_builtins(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        if _PLAIN_TYPES.issuperset(map(type, value)):  # a list of numbers (an MoE's per-expert values) as it is
            return list(value)
        return [to_builtins(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_builtins(value.tolist())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_builtins(dataclasses.asdict(value))
    return str(value)


@dataclass(frozen=True)
class Finding:
    """One check of one layer of one model: what was measured, against what, and the verdict.

    verdict: pass, fail, warn (a failure whose check is set to warn), waived (a failure a
    pytest_qreport_modify_findings hook accepted, with `waiver` saying why), error, or skip.
    baseline, delta and baseline_status (ok, new, regressed, improved) are set when a baseline file was compared.
    `message` says what to change (kept on failures); `note` says why an item passes although a heuristic
    recommends a change (the change was measured and does not help), and is kept whatever the verdict.
    """

    model: str
    check: str
    layer: str
    metric: str
    value: float
    threshold: float
    verdict: str
    message: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    waiver: str = ""
    nodeid: str = ""
    duration: float = 0.0
    baseline: float | None = None
    delta: float | None = None
    baseline_status: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, not {self.verdict!r}")
        for name in ("value", "threshold", "duration"):
            raw = getattr(self, name)
            object.__setattr__(self, name, math.nan if raw is None else float(raw))
        for name in ("baseline", "delta"):
            raw = getattr(self, name)
            object.__setattr__(self, name, None if raw is None else float(raw))
        if self.baseline_status not in BASELINE_STATUSES:
            raise ValueError(f"baseline_status must be one of {BASELINE_STATUSES}, not {self.baseline_status!r}")
        object.__setattr__(self, "details", to_builtins(dict(self.details)))

    @property
    def failed(self) -> bool:
        """True when the item of this finding fails (a fail or an error verdict)."""
        return self.verdict in ("fail", "error")

    def to_dict(self) -> dict[str, Any]:
        """The finding as a dict of builtins (survives xdist, JSON and JUnit)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """The finding back from `to_dict()`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown finding field(s) {unknown}; known: {sorted(names)}")
        return cls(**dict(data))

    def replace(self, **changes: Any) -> Finding:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def waive(self, reason: str) -> Finding:
        """A failed or warned finding accepted for `reason` (shown in the summary and both XML files)."""
        if not reason or not str(reason).strip():
            raise ValueError(f"a waiver of {self.model}/{self.check}/{self.layer} needs a reason")
        if self.verdict not in ("fail", "warn"):
            return self.replace(waiver=str(reason))
        return self.replace(verdict="waived", waiver=str(reason))

    def with_severity(self, severity: str) -> Finding:
        """'warn' turns a failure into a warning; 'fail' keeps it."""
        if severity == "warn" and self.verdict == "fail":
            return self.replace(verdict="warn")
        return self


@dataclass(frozen=True)
class RunOutcome:
    """How complete a session's rows are: qreport items collected and reported, and why the run stopped early
    ("" when it ran to the end)."""

    collected: int
    reported: int
    interrupted: str = ""

    @property
    def not_run(self) -> int:
        """Collected items that never reported a result."""
        return max(0, self.collected - self.reported)
