"""One model's life in a process: its checks and items at collection, its findings once, on first use.

Plain functions over qcore and the check registry; the pytest nodes in items.py only call these.
"""
from __future__ import annotations

import fnmatch
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .findings import Finding
from .options import ModelSettings
from .registry import Check, CheckRegistry, ModelContext

__all__ = ["ModelState", "QReportCheckFailed", "QReportError", "QReportModelError", "analyze", "collect_model",
           "explain", "select_layers"]


class QReportError(Exception):
    """A problem the plugin explains itself: the message is the whole report."""


class QReportModelError(QReportError):
    """The model could not be captured, calibrated or analysed."""


class QReportCheckFailed(QReportError):
    """A quality check is below its threshold."""


def select_layers(names: Iterable[str], layers: list[str] | None, skip_layers: list[str] | None) -> list[str]:
    """Keep names matching any `layers` glob (all if none) and no `skip_layers` glob, in order."""
    kept = []
    for name in names:
        if layers and not any(fnmatch.fnmatchcase(name, g) for g in layers):
            continue
        if skip_layers and any(fnmatch.fnmatchcase(name, g) for g in skip_layers):
            continue
        kept.append(name)
    return kept


@dataclass
class ModelState:
    """Everything one process knows about one declared model."""

    name: str
    settings: ModelSettings | None = None
    context: ModelContext | None = None
    items: dict[str, list[str]] = field(default_factory=dict)
    collect_error: str | None = None
    skip_reason: str | None = None
    findings: dict[tuple[str, str], Finding] | None = None
    analysis_error: str | None = None
    error_cause: BaseException | None = None

    def checks_and_layers(self) -> list[tuple[str, str]]:
        """(check, layer) pairs in item order."""
        return [(check, layer) for check in self.items for layer in self.items[check]]


def collect_model(name: str, settings: ModelSettings, registry: CheckRegistry, quantizer: Any, model: Any,
                  example_inputs: Any) -> ModelState:
    """Capture the model and list each check's layers (no calibration). Errors propagate to the caller."""
    import qcore
    from qcore.analysis import ModelAnalysis

    if not hasattr(model, "forward"):
        raise QReportModelError(f"model {name!r}: the qmodel function returned {type(model).__name__}, "
                                "not an nn.Module")
    float_gm = qcore.capture(model, example_inputs, name=name)
    analysis = ModelAnalysis(float_gm, quantizer, equalize=settings.equalize)
    checks: dict[str, Check] = {}
    for check_name in settings.checks:
        check_class = registry.get(check_name)
        check = check_class(settings.check_options.get(check_name))
        checks[check_name] = check
    context = ModelContext(name, settings, analysis, checks)
    state = ModelState(name, settings, context)
    for check_name, check in checks.items():
        check.bind(context)
        if not check.applies(context):
            continue
        state.items[check_name] = select_layers(check.layers(context), settings.layers, settings.skip_layers)
    context.checks = {n: c for n, c in checks.items() if n in state.items}
    return state


def analyze(state: ModelState, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None]) -> None:
    """Measure once and keep the findings of every item (or why the model could not be analysed)."""
    if state.findings is not None or state.analysis_error is not None:
        return
    assert state.context is not None and state.settings is not None
    try:
        state.context.analysis.attach_batches(batches())
        found: list[Finding] = []
        for check_name, layers in state.items.items():
            if layers:
                found += _check_findings(state, check_name, layers)
        modify(found)
        state.findings = {(f.check, f.layer): f for f in found}
    except Exception as error:  # noqa: BLE001 - reported on every item of the model
        state.analysis_error, state.error_cause = explain(state.name, "calibration/analysis", error), error


def _check_findings(state: ModelState, check_name: str, layers: list[str]) -> list[Finding]:
    """One check's findings with the model's severity; a check that raises errors its own items only."""
    assert state.context is not None and state.settings is not None
    check = state.context.checks[check_name]
    severity = state.settings.severity.get(check_name, check.default_severity)
    try:
        found = {f.layer: f.with_severity(severity) for f in check.findings(state.context, list(layers))
                 if f.check == check_name}
    except Exception as error:  # noqa: BLE001 - one check's failure must not hide the others
        if _is_measurement_error(error):
            raise
        message = explain(state.name, f"check {check_name!r}", error)
        return [_error_finding(state.name, check_name, layer, message) for layer in layers]
    return [found.get(layer) or _error_finding(state.name, check_name, layer,
                                               f"model {state.name!r}: check {check_name!r} returned no finding for "
                                               f"layer {layer}; its findings() must return one per layer it is given.")
            for layer in layers]


def _is_measurement_error(error: BaseException) -> bool:
    """Calibration failures concern the whole model, not one check."""
    import qcore

    return isinstance(error, (qcore.CalibrationError, QReportModelError))


def _error_finding(model: str, check: str, layer: str, message: str) -> Finding:
    return Finding(model=model, check=check, layer=layer, metric="", value=float("nan"), threshold=float("nan"),
                   verdict="error", message=message)


_PACKAGE_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + name
                      for name in ("qcore", "pytest_qreport"))


def _user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the traceback (innermost last) that are the user's code, not torch, qcore or pytest."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    cause = error.__cause__
    if cause is not None and cause.__traceback__ is not None:
        frames = frames + traceback.extract_tb(cause.__traceback__)
    return [f for f in frames if not f.filename.startswith(_PACKAGE_DIRS) and "site-packages" not in f.filename
            and "/torch/" not in f.filename and "<" not in f.filename[:1]]


def explain(model: str, stage: str, error: BaseException) -> str:
    """A message naming the model, the user's frame where it failed (first), the error and what to do."""
    import qcore

    if isinstance(error, (QReportError, qcore.CaptureError)):
        text = str(error)
        return text if f"'{model}'" in text else f"model '{model}': {text}"
    frames = _user_frames(error)
    where = f" in {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    trace = "".join(traceback.format_list(frames[-3:])) if frames else ""
    return (f"model {model!r}: {stage} failed{where}: {type(error).__name__}: {error}\n"
            "Fix the model or its calibration fixture; other models run on."
            + (f"\nYour code, innermost last:\n{trace.rstrip()}" if trace else ""))
