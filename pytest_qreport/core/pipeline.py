"""One model's life in a process: its checks and items at collection, its findings once, on first use.

Plain functions over qcore and the check registry; the pytest nodes in items.py only call these.
"""
from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import gc
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .baseline import BaselineError, compare_findings, fingerprint_differences, load_baseline
from .findings import Finding
from .options import ModelSettings
from .registry import Check, CheckRegistry, ModelContext

__all__ = ["ModelState", "QReportCheckFailed", "QReportError", "QReportModelError", "analyze", "as_batches",
           "collect_model", "garbage_collection_paused", "is_single_batch",
           "compare_with_baseline", "explain", "fingerprint", "select_layers", "torch_threads"]


class QReportError(Exception):
    """A problem the plugin explains itself: the message is the whole report."""


class QReportModelError(QReportError):
    """The model could not be captured, calibrated or analysed."""


class QReportCheckFailed(QReportError):
    """A quality check is below its threshold."""


def is_single_batch(source: Any) -> bool:
    """True for one tensor or one dict of kwargs: one batch, not a sequence of rows or keys."""
    return isinstance(source, dict) or (hasattr(source, "shape") and hasattr(source, "dtype"))


def as_batches(source: Any) -> list[Any]:
    """Calibration batches as a list (one tensor or one dict of kwargs is one batch)."""
    return [source] if is_single_batch(source) else list(source)


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
    baseline_path: str | None = None
    fingerprint: dict[str, Any] | None = None
    capture: dict[str, str] = field(default_factory=dict)  # {"method": "export" | "fx", "export_error": ...}
    quantizer: Any = None
    cache_key: str | None = None  # the layer-cache key when the items came from the cache (captured later)

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
    _check_float_layers(name, settings.float_layers, float_gm)
    analysis = ModelAnalysis(float_gm, quantizer, equalize=settings.equalize)
    checks: dict[str, Check] = {}
    for check_name in settings.checks:
        check_class = registry.get(check_name)
        check = check_class(settings.check_options.get(check_name))
        checks[check_name] = check
    context = ModelContext(name, settings, analysis, checks)
    capture = {"method": str(float_gm.meta.get("qcore_capture_method", "export"))}
    if "qcore_export_error" in float_gm.meta:
        capture["export_error"] = str(float_gm.meta["qcore_export_error"])
    state = ModelState(name, settings, context, capture=capture)
    for check_name, check in checks.items():
        check.bind(context)
        if not check.applies(context):
            continue
        state.items[check_name] = select_layers(check.layers(context), settings.layers, settings.skip_layers)
    context.checks = {n: c for n, c in checks.items() if n in state.items}
    analysis.plan(detectors=context.detectors(), equalization=any("equalization" in c.needs
                                                                  for c in context.checks.values()))
    return state


def _check_float_layers(name: str, globs: list[str] | None, float_gm: Any) -> None:
    """A float_layers glob that matches no layer is a typo: say so, with the layer names."""
    import qcore

    ops = qcore.find_quantizable_ops(float_gm)
    unmatched = [g for g in globs or () if not any(fnmatch.fnmatchcase(op.layer, g) or fnmatch.fnmatchcase(op.fqn, g)
                                                   for op in ops)]
    if unmatched:
        raise QReportModelError(f"model {name!r}: float_layers {unmatched} match no layer; layers: "
                                f"{', '.join(op.layer for op in ops)}")


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block on `threads` torch threads, then restore the count (float rounding depends on it)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Run the block without Python's cyclic garbage collector, then free what it left and return freed heap to
    the system. An analysis builds many graph objects: full collections over every object of the session would
    cost more than the analysis itself. Graph modules are reference cycles, so what the block discarded is all
    young, and one young-generation collection frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect(1)
        _trim_heap()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def analyze(state: ModelState, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None],
            threads: int = 1, baseline: dict[str, Any] | None = None) -> None:
    """Measure once (on `threads` torch threads) and keep the findings of every item, compared with the
    model's baseline file when `baseline` options are given; or keep why the model could not be analysed."""
    if state.findings is not None or state.analysis_error is not None:
        return
    assert state.context is not None and state.settings is not None
    try:
        with torch_threads(threads), garbage_collection_paused():
            _measure(state, batches, modify, threads, baseline)
    except Exception as error:  # noqa: BLE001 - reported on every item of the model
        state.analysis_error, state.error_cause = explain(state.name, "calibration/analysis", error), error


def _measure(state: ModelState, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None],
             threads: int, baseline: dict[str, Any] | None) -> None:
    assert state.context is not None and state.settings is not None
    analysis = state.context.analysis
    analysis.attach_batches(batches())
    found: list[Finding] = []
    for check_name, layers in state.items.items():
        if layers:
            found += _check_findings(state, check_name, layers)
    found = [f.replace(details={**f.details, "capture": dict(state.capture)}) for f in found]
    modify(found)
    state.fingerprint = fingerprint(analysis, state.settings.equalize, threads)
    if baseline is not None and state.baseline_path is not None:
        found = compare_with_baseline(state, found, baseline)
    state.findings = {(f.check, f.layer): f for f in found}


def fingerprint(analysis: Any, equalize: Any, threads: int) -> dict[str, Any]:
    """What a model's numbers depend on: versions, quantizer, calibration data, equalization, threads."""
    import torch

    import qcore
    from qcore.analysis import calibration_digest, describe

    return {"torch": str(torch.__version__), "qcore": str(qcore.__version__), "quantizer": describe(analysis.quantizer),
            "calibration": calibration_digest(analysis.batches), "equalize": describe(equalize), "threads": threads}


def compare_with_baseline(state: ModelState, found: list[Finding], options: dict[str, Any]) -> list[Finding]:
    """The findings compared with the model's baseline file, plus the model's `baseline` finding.

    options: {"update": bool, "strict": bool}. With update, nothing fails for baseline reasons: the file is
    about to be rewritten; deltas are still shown when the fingerprint matches.
    """
    assert state.settings is not None and state.context is not None and state.baseline_path is not None
    path, enforce, strict = state.baseline_path, not options["update"], bool(options["strict"])
    collected = sorted(f"{check}/{layer}" for check, layer in state.checks_and_layers())
    still_collected = set(collected)
    details: dict[str, Any] = {"path": path, "collected": collected, "stale": []}
    update_hint = f"Run pytest --qreport --qreport-update-baseline to {'write' if enforce else 'rewrite'} {path}."

    def model_finding(passed: bool, message: str, stale: int = 0, error: bool = False) -> Finding:
        verdict = "error" if error and enforce else "pass" if passed or not enforce else "fail"
        return Finding(model=state.name, check="baseline", layer="", metric="stale_entries", value=stale,
                       threshold=0, verdict=verdict, message=message, details=details)

    try:
        recorded = load_baseline(path)
    except BaselineError as error:
        return found + [model_finding(False, f"model {state.name!r}: {error}", error=True)]
    if recorded is None:
        why = " (--qreport-baseline-strict)" if strict else ""
        return found + [model_finding(not strict, f"model {state.name!r}: no baseline file {path}{why}. {update_hint}")]
    differences = fingerprint_differences(recorded.fingerprint, state.fingerprint or {})
    if differences:
        return found + [model_finding(False, (
            f"model {state.name!r}: the baseline {path} was recorded under other conditions, so its values "
            f"cannot be compared: {'; '.join(differences)}. If the change is intended, {update_hint[0].lower()}"
            f"{update_hint[1:]}"))]
    checks = state.context.checks
    compared = compare_findings(found, recorded, state.settings.tolerance,
                                lambda check: checks[check].higher_is_better if check in checks else True,
                                strict, enforce)
    stale = sorted(f"{check}/{layer}" for check, layer in recorded.entries if f"{check}/{layer}" not in still_collected)
    details["stale"] = stale
    message = (f"model {state.name!r}: the baseline {path} has entries for layers that no longer exist: "
               f"{', '.join(stale)}. {update_hint}") if stale else ""
    return compared + [model_finding(not (stale and strict), message, stale=len(stale))]


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
                      for name in ("qcore", "pytest_qreport")) + tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})


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

    if isinstance(error, (QReportError, qcore.CaptureError, qcore.NonDeterministicModelError)):
        text = str(error)
        return text if f"'{model}'" in text else f"model '{model}': {text}"
    frames = _user_frames(error)
    where = f" in {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    trace = "".join(traceback.format_list(frames[-3:])) if frames else ""
    return (f"model {model!r}: {stage} failed{where}: {type(error).__name__}: {error}\n"
            "Fix the model or its calibration fixture; other models run on."
            + (f"\nYour code, innermost last:\n{trace.rstrip()}" if trace else ""))
