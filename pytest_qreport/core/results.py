"""What a finished run hands its reporters: one immutable `RunResults` of rows, per-model facts and the outcome."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .findings import Finding, RunOutcome, to_builtins

__all__ = ["ModelFacts", "RowKey", "RunResults"]


@dataclass(frozen=True)
class ModelFacts:
    """What is known of one model, sent once rather than copied onto every row: where its baseline lives, what its
    numbers depend on (fingerprint), how it was captured, why it failed before its checks ran ("" if not), and
    the seconds its analysis took per stage (`seconds`: capture, calibration, comparison, trials, other), and the
    line of its declaration in its conftest (0 when unknown: a model of the `qreport` fixture)."""

    name: str
    baseline_path: str | None = None
    fingerprint: Mapping[str, Any] | None = None
    capture: Mapping[str, str] = field(default_factory=dict)
    error: str = ""
    seconds: Mapping[str, float] = field(default_factory=dict)
    line: int = 0
    # what the fix searches spent of the model's budget (qcore.runtime.progress.FixBudgetUse.as_dict); {} if unknown
    fix_budget: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", None if self.fingerprint is None else to_builtins(self.fingerprint))
        object.__setattr__(self, "capture", {str(k): str(v) for k, v in self.capture.items()})
        object.__setattr__(self, "seconds", {str(k): round(float(v), 4) for k, v in self.seconds.items()})
        object.__setattr__(self, "fix_budget", to_builtins(dict(self.fix_budget)))

    @property
    def fix_budget_share(self) -> float | None:
        """The share of its fix budget the model's searches used (None without a budget, or unknown)."""
        share = self.fix_budget.get("share")
        return None if share is None else float(share)

    @property
    def analysis_seconds(self) -> float:
        """The model's whole analysis time, capture included."""
        return sum(self.seconds.values())

    def to_dict(self) -> dict[str, Any]:
        """The facts as builtins (survive xdist and JSON)."""
        return {"name": self.name, "baseline_path": self.baseline_path, "fingerprint": self.fingerprint,
                "capture": dict(self.capture), "error": self.error, "seconds": dict(self.seconds), "line": self.line,
                "fix_budget": dict(self.fix_budget)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelFacts:
        """The facts back from `to_dict()`."""
        return cls(name=str(data["name"]), baseline_path=data.get("baseline_path"),
                   fingerprint=data.get("fingerprint"), capture=dict(data.get("capture") or {}),
                   error=str(data.get("error") or ""), seconds=dict(data.get("seconds") or {}),
                   line=int(data.get("line") or 0), fix_budget=dict(data.get("fix_budget") or {}))

    def merged(self, other: ModelFacts) -> ModelFacts:
        """These facts with the gaps filled from `other` (items of one model report what each of them knows)."""
        return ModelFacts(name=self.name, baseline_path=self.baseline_path or other.baseline_path,
                          fingerprint=self.fingerprint or other.fingerprint, capture=self.capture or other.capture,
                          error=self.error or other.error, seconds=self.seconds or other.seconds,
                          line=self.line or other.line, fix_budget=self.fix_budget or other.fix_budget)


@dataclass(frozen=True)
class RunResults:
    """Every qreport row of a session in collection order, the facts of each model by the name its rows carry,
    and how complete the run was. Reporters read this and nothing else of the session."""

    rows: tuple[Finding, ...]
    models: Mapping[str, ModelFacts]
    outcome: RunOutcome
    # under --qreport-shard: {"index", "count", "units": every model's unit in collection order, "run": this shard's}
    shard: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def model_rows(self, model: str) -> list[Finding]:
        """The rows of one model, in order."""
        return [row for row in self.rows if row.model == model]


@dataclass(frozen=True, order=True)
class RowKey:
    """Where a row sits in the report: its test's place in collection order, then its place among that test's
    rows (a test using the `qreport` fixture may report several)."""

    item: int
    index: int = 0
