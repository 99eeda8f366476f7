"""Per-process model state: capture at collection, analysis once per model at run time. No pytest hooks."""
from __future__ import annotations

import importlib
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import qcore
from qcore.detector_findings import DETECTOR_CHECKS, apply_severity, detector_findings, detector_layers, measure_detectors
from qcore.equalization_findings import (
    apply_recipe,
    equalizable_layers,
    equalization_findings,
    equivalence_finding,
    max_relative_error,
)
from qcore.equalize import equalize
from qcore.findings import measure_sqnr, quantized_layers, select_layers, sqnr_findings

from .options import ModelSettings


class QReportError(Exception):
    """A problem the plugin explains itself: the message is the whole report."""


class QReportModelError(QReportError):
    """The model could not be captured, calibrated or analysed."""


class QReportCheckFailed(QReportError):
    """A quality check is below its threshold."""


_QUANTIZERS: dict[str, Callable[[], Any]] = {
    "int8": lambda: qcore.Int8StaticQuantizer(per_channel=True),
    "int8_per_tensor": lambda: qcore.Int8StaticQuantizer(per_channel=False),
    "int8_histogram": lambda: qcore.Int8StaticQuantizer(per_channel=True, activation_observer="histogram"),
}


def make_quantizer(spec: Any) -> Any:
    """A Quantizer from an instance, a factory, a built-in name or 'module:attribute'."""
    if spec is None:
        return _QUANTIZERS["int8"]()
    if isinstance(spec, qcore.Quantizer):
        return spec
    if isinstance(spec, str):
        if spec in _QUANTIZERS:
            return _QUANTIZERS[spec]()
        if ":" in spec:
            module_name, _, attribute = spec.partition(":")
            return make_quantizer(getattr(importlib.import_module(module_name), attribute))
        raise ValueError(f"unknown quantizer {spec!r}: use {', '.join(_QUANTIZERS)} or 'module:attribute'")
    if callable(spec):
        made = spec()
        if isinstance(made, qcore.Quantizer):
            return made
    raise ValueError(f"quantizer must be a qcore.Quantizer, a factory of one, or a name; got {spec!r}")


def _first_batch(batches: Any) -> Any:
    if isinstance(batches, (list, tuple)):
        if not batches:
            raise ValueError("the calibration batches are empty")
        return batches[0]
    return next(iter(batches))


@dataclass
class ModelState:
    """Everything one process knows about one declared model."""

    name: str
    settings: ModelSettings | None = None
    float_gm: Any = None
    layers: list[dict] = field(default_factory=list)
    items: dict[str, list[str]] = field(default_factory=dict)
    collect_error: str | None = None
    findings: dict[tuple[str, str], dict] | None = None
    analysis_error: str | None = None

    def checks_and_layers(self) -> list[tuple[str, str]]:
        """(check, layer) pairs in item order."""
        return [(check, layer) for check in self.items for layer in self.items[check]]


def collect_model(declaration, settings: ModelSettings, fixture_at_collection: Callable[[str], Any]) -> ModelState:
    """Build and capture the model and list its items; errors are kept, never raised."""
    state = ModelState(declaration.name, settings)
    try:
        model = _build(declaration)
        example = _example_inputs(declaration, settings, fixture_at_collection)
        state.float_gm = qcore.capture(model, example, name=declaration.name)
        quantizer = make_quantizer(settings.quantizer)
        state.layers = quantized_layers(state.float_gm, quantizer)
        wanted_detectors = [c for c in settings.checks if c in DETECTOR_CHECKS]
        by_detector = detector_layers(state.float_gm, quantizer, settings.detector_options) if wanted_detectors else {}
    except Exception as error:  # noqa: BLE001 - reported on the model's item
        state.collect_error = _explain(declaration.name, "capture/set-up", error)
        return state
    names = select_layers([l["layer"] for l in state.layers], settings.layers, settings.skip_layers)
    weighted = {l["layer"] for l in state.layers if l["weighted"]}
    for check in settings.checks:
        if check == "sqnr":
            state.items[check] = names
        elif check == "weight_sqnr":
            state.items[check] = [n for n in names if n in weighted]
        elif check in ("model_sqnr", "equalization_equivalence"):
            state.items[check] = ["output"]
        elif check == "equalization":
            eligible = equalizable_layers(state.float_gm, [l["layer"] for l in state.layers])
            state.items[check] = [n for n in eligible if n in names]
        else:
            state.items[check] = [n for n in by_detector.get(check, []) if n in names]
    return state


def _build(declaration) -> Any:
    required = [p for p in inspect.signature(declaration.factory).parameters.values() if p.default is p.empty]
    if required:
        raise QReportModelError(
            f"model {declaration.name!r}: the qmodel function takes arguments ({', '.join(p.name for p in required)}); "
            "it must build the model with no arguments so that layers can be listed at collection.")
    model = declaration.factory()
    if not hasattr(model, "forward"):
        raise QReportModelError(f"model {declaration.name!r}: the qmodel function returned {type(model).__name__}, "
                                "not an nn.Module")
    return model


def _example_inputs(declaration, settings: ModelSettings, fixture_at_collection) -> Any:
    source = settings.example_inputs
    if source is not None:
        return fixture_at_collection(source) if isinstance(source, str) else (source() if callable(source) else source)
    calibration = settings.calibration
    if calibration is None:
        raise QReportModelError(f"model {declaration.name!r} has no calibration batches: pass "
                                "qmodel(calibration='fixture_name') or set qreport_calibration in the ini file.")
    if isinstance(calibration, str):
        return _first_batch(fixture_at_collection(calibration))
    return _first_batch(calibration() if callable(calibration) else calibration)


def calibration_batches(state: ModelState, get_fixture: Callable[[str], Any]) -> list:
    """The model's calibration batches, as a list."""
    source = state.settings.calibration
    batches = get_fixture(source) if isinstance(source, str) else (source() if callable(source) else source)
    batches = list(batches)
    if not batches:
        raise QReportModelError(f"model {state.name!r}: the calibration source gave no batches")
    return batches


def analyze(state: ModelState, get_fixture: Callable[[str], Any]) -> None:
    """Calibrate, quantize and compare once; store findings or the reason it failed."""
    if state.findings is not None or state.analysis_error is not None:
        return
    try:
        batches = calibration_batches(state, get_fixture)
        state.findings = {(f["check"], f["layer"]): apply_severity(f, state.settings.severity.get(f["check"], "fail"))
                          for f in _measure_all(state, batches)}
    except Exception as error:  # noqa: BLE001 - reported on every item of the model
        state.analysis_error = _explain(state.name, "calibration/analysis", error)


def _explain(model: str, stage: str, error: BaseException) -> str:
    if isinstance(error, (QReportError, qcore.CaptureError)):
        text = str(error)
        return text if f"'{model}'" in text else f"model '{model}': {text}"
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    location = f" (at {where.filename}:{where.lineno})" if where else ""
    return (f"model {model!r}: {stage} failed: {type(error).__name__}: {error}{location}. "
            "Fix the model or its calibration fixture; other models run on.")


def _measure_all(state: ModelState, batches: list) -> list[dict]:
    """Every finding of one model: SQNR, detector and equalization checks."""
    settings, items = state.settings, state.items
    quantizer = make_quantizer(settings.quantizer)
    eligible = equalizable_layers(state.float_gm, [l["layer"] for l in state.layers])
    model_gm, found, equalized = state.float_gm, [], []
    if settings.equalize:
        model_gm = apply_recipe(state.float_gm, settings.equalize, eligible, batches)
        equalized = eligible if settings.equalize is True else (
            list(settings.equalize) if isinstance(settings.equalize, list) else [])
        if items.get("equalization_equivalence"):
            found.append(equivalence_finding(state.name, max_relative_error(state.float_gm, model_gm, batches)))
    measured = None
    if any(items.get(c) for c in ("sqnr", "weight_sqnr", "model_sqnr", "equalization")):
        measured = measure_sqnr(model_gm, batches, quantizer)
        thresholds = {"sqnr": settings.sqnr_min_db, "weight_sqnr": settings.weight_sqnr_min_db,
                      "model_sqnr": settings.model_sqnr_min_db}
        found += sqnr_findings(state.name, measured, items, thresholds)
    if items.get("equalization"):
        if settings.equalize:
            before = measure_sqnr(state.float_gm, batches, quantizer)
            after = measured
        else:
            before = measured
            after = measure_sqnr(equalize(state.float_gm, eligible, batches), batches, quantizer)
        found += equalization_findings(
            state.name, items["equalization"], {k: v["sqnr_db"] for k, v in before["layers"].items()},
            {k: v["sqnr_db"] for k, v in after["layers"].items()}, settings.equalization_min_gain_db,
            applied=bool(settings.equalize))
    detector_checks = [c for c in DETECTOR_CHECKS if items.get(c)]
    if detector_checks:
        observed = measure_detectors(state.float_gm, batches, quantizer, detector_checks, settings.detector_options)
        found += detector_findings(state.name, observed, items, equalized)
    return found
