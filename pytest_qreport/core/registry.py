"""The check registry: every check, built-in or third-party, is a `Check` subclass registered here.

A check declares its name, its order among checks, its default severity, which layers it applies to (from
the captured graph, at collection, without data), what it needs measured, and how measurements become
findings. The plugin makes one item per (model, check, layer) from it.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .findings import Finding
from .schema import SEVERITIES, Setting

if TYPE_CHECKING:
    from qcore.analysis import ArtifactAnalysis, ModelAnalysis

    from .settings import ModelSettings

__all__ = ["MEASUREMENTS", "SEVERITIES", "Check", "CheckRegistry", "ModelContext", "Setting"]

MEASUREMENTS = frozenset({"sqnr", "detectors", "equalization", "equivalence", "logits"})


class ModelContext:
    """What a check sees of one model: its name, settings, checks and qcore analysis."""

    def __init__(self, name: str, settings: ModelSettings, analysis: ModelAnalysis | ArtifactAnalysis,
                 checks: Mapping[str, Check] | None = None) -> None:
        self.name = name
        self.settings = settings
        # a ModelAnalysis of qcore's simulation, or an ArtifactAnalysis of the model the user ships (quantized=):
        # the checks that measure artifacts read what both answer
        self.analysis: Any = analysis
        self.checks: dict[str, Check] = dict(checks or {})
        self._detector_reports: dict[str, Any] | None = None
        # turns a batch setting (fixture name, callable or batches) into a list of batches; set by the pipeline
        self.resolve: Callable[[Any], list[Any]] = lambda source: list(source() if callable(source) else source)
        self._eval_batches: list[Any] | None = None

    def eval_batches(self) -> list[Any]:
        """The model's evaluation batches: its eval_batches setting resolved once, else the calibration batches."""
        if self.settings.eval_batches is None:
            return self.analysis.batches
        if self._eval_batches is None:
            self._eval_batches = list(self.resolve(self.settings.eval_batches))
            if not self._eval_batches:
                raise ValueError(f"model {self.name!r}: eval_batches gave no batches")
        return self._eval_batches

    def logits(self) -> Any:
        """qcore's LogitsMeasurement of the model on its evaluation batches (from the comparison pass when they
        are the calibration batches)."""
        if self.settings.eval_batches is None:
            return self.analysis.logits
        return self.analysis.logits_on(self.eval_batches())

    def detector_report(self, check: str) -> dict[str, Any]:
        """{layer: raw detector entry} for one detector check; all of the model's detectors run in one pass."""
        if self._detector_reports is None:
            self._detector_reports = self.analysis.detector_reports(self.detectors())
        return self._detector_reports.get(check, {})

    def detectors(self) -> dict[str, Any]:
        """{check name: detector} of the model's detector checks."""
        return {name: detector for name, c in self.checks.items()
                if (detector := getattr(c, "detector", None)) is not None}


class Check(ABC):
    """Base class of a quality check. Subclass it, set the class attributes, and implement `findings`.

    name: the check's name in node ids, options and tables. order: position among checks (built-ins use
    10-90). default_severity: "fail", "warn" or "off". needs: what the check measures (a subset of
    MEASUREMENTS: the union over a model's checks is the AnalysisPlan its qcore analysis is built with, so
    that one calibration and one comparison pass measure it all). metric: the unit of its values ("_db"
    suffix for decibels). higher_is_better: the direction in which values improve. settings: the check's own
    settings (its threshold, say), declared once: they become qmodel() keywords, and, for checks registered
    before pytest parses its options (the built-in ones), command-line options and ini keys; read them as
    `model.settings.<name>`; the first is the threshold of its values unless threshold_is_setting is False (a
    baseline failure then names it). `options` holds the model's qmodel(check_options={name: {...}}) for this check.
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 100
    default_severity: ClassVar[str] = "fail"
    needs: ClassVar[frozenset[str]] = frozenset()
    metric: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    settings: ClassVar[tuple[Setting, ...]] = ()
    threshold_is_setting: ClassVar[bool] = True  # the first of `settings` is the threshold values are judged by
    baseline_tolerance: ClassVar[float | None] = None  # its default baseline tolerance, in its metric's unit
    # artifact mode (qmodel(quantized=...)): whether the check judges a quantized model the user gives (False: its
    # items skip, as checks that concern choosing a quantizer do), and its default severity there (None: as usual)
    measures_artifacts: ClassVar[bool] = False
    artifact_severity: ClassVar[str | None] = None
    # why its items skip in artifact mode, where not because it concerns choosing a quantizer (ARTIFACT_SKIP)
    artifact_skip: ClassVar[str] = ""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def bind(self, model: ModelContext) -> None:
        """Prepare per-model state once, at collection, before `applies` and `layers` (default: nothing)."""

    def applies(self, model: ModelContext) -> bool:
        """Whether the check makes items for this model at all (for example only when it is equalized)."""
        return True

    def layers(self, model: ModelContext) -> list[str]:
        """The layers the check makes items for, in graph order, from the captured graph alone."""
        return [entry.layer for entry in model.analysis.layers]

    def screen(self, model: ModelContext, layers: list[str]) -> Any | None:
        """A qcore.measure.screens.Screen whose fix the comparison pass measures on the layers the check's detector
        names among its items `layers`, so that its advice needs no trial of the whole list (default: None)."""
        return None

    @abstractmethod
    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        """One finding per layer in `layers`, from measurements on the model's calibration batches."""

    def finding(self, model: ModelContext, layer: str, value: float, threshold: float, passed: bool | None = None,
                message: str = "", details: Mapping[str, Any] | None = None, note: str = "") -> Finding:
        """A finding of this check; `passed` defaults to comparing value and threshold in the check's direction.

        `message` is kept only when the finding does not pass: it should say what to change. `note` is kept
        either way (why a recommended change is not advised, say).
        """
        if passed is None:
            passed = not math.isnan(value) and (value >= threshold if self.higher_is_better else value <= threshold)
        return Finding(model=model.name, check=self.name, layer=layer, metric=self.metric, value=value,
                       threshold=threshold, verdict="pass" if passed else "fail", message="" if passed else message,
                       details=dict(details or {}), note=note)


class CheckRegistry:
    """The checks of a session, by name, in their declared order."""

    def __init__(self) -> None:
        self._checks: dict[str, type[Check]] = {}

    def register(self, check: type[Check]) -> type[Check]:
        """Add a Check subclass (usable as a class decorator); registering the same class again is a no-op."""
        if not (isinstance(check, type) and issubclass(check, Check)):
            raise TypeError(f"register() takes a Check subclass, not {check!r}")
        if not check.name or not check.name.isidentifier():
            raise ValueError(f"{check.__qualname__}.name must be an identifier, got {check.name!r}")
        if check.default_severity not in SEVERITIES:
            raise ValueError(f"{check.__qualname__}.default_severity must be one of {SEVERITIES}")
        unknown = set(check.needs) - MEASUREMENTS
        if unknown:
            raise ValueError(f"{check.__qualname__}.needs has unknown measurement(s) {sorted(unknown)}; "
                             f"known: {sorted(MEASUREMENTS)}")
        for setting in check.settings:
            if not isinstance(setting, Setting) or setting.scope != "model":
                raise ValueError(f"{check.__qualname__}.settings must hold per-model Setting declarations")
            owner = next((c for c in self._checks.values() if c is not check and c.name != check.name
                          and any(s.name == setting.name for s in c.settings)), None)
            if owner is not None:
                raise ValueError(f"{check.__qualname__} declares setting {setting.name!r}, which {owner.__qualname__} "
                                 "declares already")
        existing = self._checks.get(check.name)
        if existing is not None and existing is not check and existing.__qualname__ != check.__qualname__:
            raise ValueError(f"check name {check.name!r} is taken by {existing.__module__}.{existing.__qualname__}")
        self._checks[check.name] = check
        return check

    def __contains__(self, name: object) -> bool:
        return name in self._checks

    def __iter__(self) -> Iterator[type[Check]]:
        return iter(self.checks())

    def get(self, name: str) -> type[Check]:
        """The check class registered under `name`."""
        return self._checks[name]

    def checks(self) -> list[type[Check]]:
        """Every registered check, by order, then registration."""
        position = {name: index for index, name in enumerate(self._checks)}
        return sorted(self._checks.values(), key=lambda c: (c.order, position[c.name]))

    def names(self) -> list[str]:
        """Every check name, in check order."""
        return [check.name for check in self.checks()]
