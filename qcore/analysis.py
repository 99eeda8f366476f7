"""One analysis of a model: capture once, annotate once, measure on shared calibration batches.

`ModelAnalysis` is the plain (pytest-free) entry point behind every quality check: it lists the layers a
quantizer quantizes (no data needed), then measures lazily and at most once each: SQNR of the quantized
model (per layer, per weight, per output), ModelReport detector statistics, and input-weight
equalization (gain per layer, float equivalence). Results are typed records of builtins.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .calibrate import CalibrationError, calibrate
from .capture import capture, clone_graph_module
from .convert import convert, restore_model_state
from .diagnose import (
    Nondeterminism,
    NonDeterministicModelError,
    ResolutionLimit,
    describe_outputs,
    first_non_finite,
    first_nondeterministic,
    resolution_limits,
)
from .equalize import cross_layer_equalize, equalization_refusal, equalize
from .graph import find_quantizable_ops
from .inputs import call_model
from .numeric.compare import compare, compare_propagated_and_shadow
from .numeric.metrics import compute_sqnr
from .numeric.suite import extract_weights
from .observers import HistogramObserver
from .prepare import prepare
from .quantizer import ANNOTATION_KEY, Int8StaticQuantizer, Quantizer
from .report import ModelReport
from .report.detectors import DetectorBase
from .smoothing import smooth, smoothing_alpha

__all__ = ["LayerSqnr", "ModelAnalysis", "OutputSqnr", "QuantizedLayer", "SqnrMeasurement", "analyze_model",
           "calibration_digest", "describe", "measure_sqnr", "quantized_layers"]


@dataclass(frozen=True)
class QuantizedLayer:
    """A layer the quantizer quantizes, and how (known from annotation alone)."""

    layer: str
    fqn: str
    op: str
    weighted: bool
    per_channel: bool
    dynamic: bool
    clipping: bool
    equalizable: bool
    equalization_refusal: str = ""  # why a linear/conv layer cannot be equalized ("" when it can, or is no candidate)


@dataclass(frozen=True)
class LayerSqnr:
    """SQNR of one quantized layer: propagated (quantized inputs), shadow (float inputs) and weight."""

    layer: str
    fqn: str
    op: str
    sqnr_db: float
    shadow_sqnr_db: float
    normalized_l2: float
    cosine: float
    batches: int
    weight_sqnr_db: float | None = None
    below_resolution: tuple[ResolutionLimit, ...] = ()  # its input/output/weight that int8 rounds to ~zero


@dataclass(frozen=True)
class OutputSqnr:
    """SQNR of one floating output leaf of the model."""

    name: str
    sqnr_db: float
    cosine: float
    normalized_l2: float


@dataclass(frozen=True)
class SqnrMeasurement:
    """Float vs quantized, per layer and per output leaf, in graph order."""

    layers: Mapping[str, LayerSqnr]
    outputs: Mapping[str, OutputSqnr]

    def worst_output(self) -> OutputSqnr | None:
        """The output leaf with the lowest SQNR (a model with several outputs is judged by its worst)."""
        return min(self.outputs.values(), key=lambda o: o.sqnr_db, default=None)


def quantized_layers(float_gm: fx.GraphModule, quantizer: Quantizer | None = None) -> list[QuantizedLayer]:
    """The layers `quantizer` quantizes, in graph order, from one annotation of a copy. No calibration."""
    annotated = clone_graph_module(float_gm)
    (quantizer or Int8StaticQuantizer()).annotate(annotated)
    layers = []
    for op in find_quantizable_ops(annotated):
        annotation = op.node.meta.get(ANNOTATION_KEY)
        specs = annotation.input_qspec_map if annotation is not None else {}
        if not specs:
            continue
        weight = specs.get(op.weight) if op.weight is not None else None
        activation = next((specs[a] for a in op.activation_inputs if a in specs), None)
        candidate = op.kind in ("linear", "conv") and op.weight is not None
        refusal = equalization_refusal(annotated, op) if candidate else ""
        layers.append(QuantizedLayer(
            layer=op.layer, fqn=op.fqn, op=op.kind, weighted=weight is not None,
            per_channel="per_channel" in str(getattr(weight, "qscheme", "")),
            dynamic=bool(getattr(activation, "is_dynamic", False)),
            clipping=getattr(activation, "observer_or_fake_quant_ctr", None) is HistogramObserver,
            equalizable=candidate and not refusal, equalization_refusal=refusal if candidate else ""))
    return layers


def measure_sqnr(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer | None = None, *,
                 shadow: bool = True) -> SqnrMeasurement:
    """Quantize a copy of `float_gm` on `batches`, then compare it with the float graph. shadow=False skips the
    shadow pass (each layer fed float inputs): shadow_sqnr_db is then nan."""
    prepared = prepare(clone_graph_module(float_gm), quantizer or Int8StaticQuantizer())
    try:
        calibrate(prepared, batches)
        quant_gm = convert(prepared)
    except Exception as error:
        try:
            found = first_non_finite(float_gm, batches)
        except Exception:  # noqa: BLE001 - the diagnosis fails the same way: the original error says it best
            found = None
        if found is None:
            raise
        raise CalibrationError(
            f"the float model computes NaN or inf at {found.describe()}, so its ranges cannot be observed "
            "and it cannot be quantized. Fix the model (a log, sqrt or division of out-of-range values?) or the "
            "calibration data there.") from error
    restore_model_state(quant_gm, float_gm)  # calibration ran forward, which may update buffers in place
    limits = resolution_limits(quant_gm)
    weights = extract_weights("float", float_gm, "quant", quant_gm)
    if shadow:  # one pass for both modes; quant_gm is this function's own copy, instrumented in place
        propagated, shadow_records = compare_propagated_and_shadow(float_gm, quant_gm, batches, own_quant_model=True)
        shadows = {r["layer"]: r["sqnr_db"] for r in shadow_records}
    else:
        propagated, shadows = compare(float_gm, quant_gm, batches, propagate=True), {}
    layers: dict[str, LayerSqnr] = {}
    outputs: dict[str, OutputSqnr] = {}
    for record in propagated:
        if record["op"] == "output":
            outputs[record["layer"]] = OutputSqnr(record["layer"], float(record["sqnr_db"]), float(record["cosine"]),
                                                  float(record["normalized_l2"]))
            continue
        weight_db = None
        if record["layer"] in weights:
            pair = weights[record["layer"]]["weight"]
            original, quantized = pair["float"][0]["values"][0], pair["quant"][0]["values"][0]
            # an exact reconstruction (an all-zero weight, say) is inf, as for activations, not 0/0 = nan
            exact = bool(torch.equal(original, quantized))
            weight_db = math.inf if exact else float(compute_sqnr(original, quantized))
        layers[record["layer"]] = LayerSqnr(
            layer=record["layer"], fqn=record["fqn"], op=record["op"], sqnr_db=float(record["sqnr_db"]),
            shadow_sqnr_db=float(shadows.get(record["layer"], math.nan)),
            normalized_l2=float(record["normalized_l2"]), cosine=float(record["cosine"]),
            batches=int(record["batches"]), weight_sqnr_db=weight_db,
            below_resolution=limits.get(record["layer"], ()))
    return SqnrMeasurement(layers, outputs)


def _max_relative_error(reference: fx.GraphModule, candidate: fx.GraphModule, batches: list) -> float:
    """max |candidate - reference| / max |reference| over every floating output tensor and batch."""
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            expected = pytree.tree_leaves(call_model(reference, batch))
            for a, b in zip(expected, pytree.tree_leaves(call_model(candidate, batch))):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    scale = float(a.abs().max()) or 1.0
                    worst = max(worst, float((b - a).abs().max()) / scale)
    return worst


class ModelAnalysis:
    """Measures one captured model once; every measurement is computed on first use and kept.

    equalize: None, True (input-weight on every equalizable layer), "cross_layer", "smooth" (SmoothQuant-style,
    alpha 0.5), "smooth:search" or "smooth:<alpha>", or a list of layers.
    The model as quantized is the equalized one when `equalize` is set.
    """

    def __init__(self, float_gm: fx.GraphModule, quantizer: Quantizer | None = None,
                 batches: Iterable[Any] | None = None, *, equalize: Any = None) -> None:
        self.float_gm = float_gm
        self.quantizer = quantizer or Int8StaticQuantizer()
        self.equalize_recipe = equalize
        self._batches = None if batches is None else list(batches)

    @property
    def batches(self) -> list[Any]:
        """The calibration batches, materialized once."""
        if self._batches is None:
            raise ValueError("this analysis was made without calibration batches; pass batches=... to measure")
        return self._batches

    def attach_batches(self, batches: Iterable[Any]) -> None:
        """Give the analysis its calibration batches (materialized once; later calls keep the first set)."""
        if self._batches is None:
            self._batches = list(batches)

    @cached_property
    def layers(self) -> list[QuantizedLayer]:
        """The quantized layers in graph order (no data needed)."""
        return quantized_layers(self.float_gm, self.quantizer)

    @cached_property
    def _layers_by_name(self) -> dict[str, QuantizedLayer]:
        return {entry.layer: entry for entry in self.layers}

    def layer(self, name: str) -> QuantizedLayer:
        """One quantized layer by name."""
        if name not in self._layers_by_name:
            raise KeyError(f"{name!r} is not a quantized layer; known: {[e.layer for e in self.layers]}")
        return self._layers_by_name[name]

    @cached_property
    def equalizable_layers(self) -> list[str]:
        """Quantized linear/conv layers that input-weight equalization can rewrite, in graph order."""
        return [entry.layer for entry in self.layers if entry.equalizable]

    @cached_property
    def dtype(self) -> torch.dtype:
        """The model's floating dtype (of its first floating parameter or buffer; float32 if none)."""
        tensors = list(self.float_gm.parameters()) + list(self.float_gm.buffers())
        return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)

    def describe_outputs(self) -> list[str]:
        """What each output leaf of the float model is on the first batch (one forward pass)."""
        return describe_outputs(self.float_gm, self.batches[0])

    @cached_property
    def equalization_candidates(self) -> list[str]:
        """Quantized linear/conv layers with a weight: the equalizable ones and those it must leave alone
        (each with its QuantizedLayer.equalization_refusal)."""
        return [entry.layer for entry in self.layers if entry.equalizable or entry.equalization_refusal]

    @cached_property
    def equalized_layers(self) -> list[str]:
        """The layers the equalize recipe equalizes (none for cross-layer, which rescales pairs)."""
        if self.equalize_recipe is True:
            return list(self.equalizable_layers)
        if isinstance(self.equalize_recipe, (list, tuple)):
            return list(self.equalize_recipe)
        return []

    def _equalized(self, layers: Any) -> fx.GraphModule:
        if layers == "cross_layer":
            return cross_layer_equalize(self.float_gm)
        if isinstance(layers, str) and layers.startswith("smooth"):
            return smooth(self.float_gm, self.batches, smoothing_alpha(layers))
        return equalize(self.float_gm, list(layers), self.batches)

    @cached_property
    def quantized_input_gm(self) -> fx.GraphModule:
        """The float graph that gets quantized: the equalized one when equalization is on."""
        if not self.equalize_recipe:
            return self.float_gm
        recipe = self.equalize_recipe
        return self._equalized(recipe if isinstance(recipe, str) else self.equalized_layers)

    @cached_property
    def nondeterminism(self) -> Nondeterminism | None:
        """Where two float runs on the first batch differ (None when they agree): two forward passes."""
        return first_nondeterministic(self.float_gm, self.batches[0])

    def require_deterministic(self) -> None:
        """Raise NonDeterministicModelError when float runs differ: every float-vs-quantized number would be noise."""
        found = self.nondeterminism
        if found is not None:
            raise NonDeterministicModelError(
                f"the model is non-deterministic: two float runs on calibration batch 0 differ (the SQNR of one "
                f"run's output against the other's is {found.output_sqnr_db:.1f} dB), first at {found.describe()}. "
                "Quantization error cannot be measured against a reference that moves. qcore captures the model in "
                "eval mode: make random ops follow it (F.dropout(x, p, training=self.training), not training=True) "
                "or take them (noise, sampling) out of the forward that is checked.")

    @cached_property
    def sqnr(self) -> SqnrMeasurement:
        """SQNR of the model as quantized (equalized first when equalization is on)."""
        self.require_deterministic()
        return measure_sqnr(self.quantized_input_gm, self.batches, self.quantizer)

    @cached_property
    def unequalized_sqnr(self) -> SqnrMeasurement:
        """SQNR without equalization (the same as `sqnr` when equalization is off; otherwise without the shadow
        pass, which the equalization gains do not use)."""
        if not self.equalize_recipe:
            return self.sqnr
        return measure_sqnr(self.float_gm, self.batches, self.quantizer, shadow=False)

    @cached_property
    def equalized_sqnr(self) -> SqnrMeasurement:
        """SQNR with input-weight equalization of every equalizable layer (or the model's own recipe); without the
        shadow pass unless it is the model's own measurement."""
        if self.equalize_recipe:
            return self.sqnr
        self.require_deterministic()
        return measure_sqnr(self._equalized(self.equalizable_layers), self.batches, self.quantizer, shadow=False)

    @cached_property
    def smoothed_gm(self) -> fx.GraphModule:
        """The model smoothed with a searched alpha per group (the model's own smoothing when it is smoothed)."""
        if isinstance(self.equalize_recipe, str) and self.equalize_recipe.startswith("smooth"):
            return self.quantized_input_gm
        return smooth(self.float_gm, self.batches, "search")

    @cached_property
    def smoothed_sqnr(self) -> SqnrMeasurement:
        """SQNR of the smoothed model (see smoothed_gm); without the shadow pass unless it is the model's own."""
        if self.smoothed_gm is self.quantized_input_gm:
            return self.sqnr
        self.require_deterministic()
        return measure_sqnr(self.smoothed_gm, self.batches, self.quantizer, shadow=False)

    @cached_property
    def smoothing(self) -> dict[str, dict[str, Any]]:
        """{layer: {"alpha", "producer", "producer_name"}} for the smoothed layers, {layer: {"refused": reason}}
        for the others."""
        meta = self.smoothed_gm.meta
        result: dict[str, dict[str, Any]] = {layer: {"refused": reason}
                                             for layer, reason in meta.get("qcore_smoothing_refused", {}).items()}
        for group in meta.get("qcore_smoothing", []):
            for layer in group["layers"]:
                result[layer] = {k: group[k] for k in ("alpha", "producer", "producer_name")}
        return result

    @cached_property
    def equivalence_error(self) -> float:
        """How far the equalized float model is from the original: max error relative to the output's range."""
        self.require_deterministic()
        return _max_relative_error(self.float_gm, self.quantized_input_gm, self.batches)

    @cached_property
    def switchable(self) -> Any:
        """The quantized model with per-layer quantizer switches (qcore.sensitivity), built on first use."""
        from .sensitivity import SwitchableModel

        self.require_deterministic()
        return SwitchableModel(self.quantized_input_gm, self.batches, self.quantizer)

    def sensitivity(self, max_layers: int | None = None, max_batches: int | None = None) -> Any:
        """qcore.sensitivity.SensitivityResult of the quantized layers (kept per budget)."""
        from .sensitivity import layer_sensitivity

        key = (max_layers, max_batches)
        cache = self.__dict__.setdefault("_sensitivity", {})
        if key not in cache:
            cache[key] = layer_sensitivity(self.quantized_input_gm, self.batches, self.quantizer,
                                           max_layers=max_layers, max_batches=max_batches, model=self.switchable)
        return cache[key]

    def float_layers_fix(self, target_db: float, max_float_layers: int = 8, max_batches: int | None = 2) -> Any:
        """qcore.sensitivity.FloatLayersFix: a verified set of layers to keep in float to reach `target_db`."""
        from .sensitivity import find_float_layers

        key = (target_db, max_float_layers, max_batches)
        cache = self.__dict__.setdefault("_fixes", {})
        if key not in cache:
            cache[key] = find_float_layers(self.quantized_input_gm, self.batches, self.quantizer, target_db,
                                           max_float_layers=max_float_layers, max_batches=max_batches,
                                           sensitivity=self.sensitivity(None, max_batches), model=self.switchable)
        return cache[key]

    def detector_reports(self, detectors: Mapping[str, DetectorBase]) -> dict[str, dict[str, dict[str, Any]]]:
        """Run every detector in one ModelReport over the batches: {key: {layer: raw detector entry}}."""
        if not detectors:
            return {}
        report = ModelReport(clone_graph_module(self.float_gm), list(detectors.values()))
        calibrate(report.prepare_detailed_calibration(), self.batches)
        reports = report.generate_model_report(remove_inserted_observers=True)
        return {key: dict(reports.get(detector.get_detector_name(), ("", {}))[1])
                for key, detector in detectors.items()}


def calibration_digest(batches: Iterable[Any]) -> str:
    """'sha256:...' of the batches' structure, dtypes, shapes and bytes: same data, same digest."""
    digest = hashlib.sha256()
    for batch in batches:
        leaves, spec = pytree.tree_flatten(batch)
        digest.update(str(spec).encode())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                data = leaf.detach().to("cpu").contiguous()
                digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
                digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))
            else:
                digest.update(repr(leaf).encode())
    return "sha256:" + digest.hexdigest()


def describe(value: Any) -> Any:
    """A stable, builtins-only description of a setting (classes and functions by qualified name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, Quantizer) or hasattr(value, "__dict__"):
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        return {"class": describe(type(value)), **{k: describe(v) for k, v in sorted(public.items())}}
    return type(value).__qualname__


def analyze_model(model: nn.Module | fx.GraphModule, batches: Iterable[Any], quantizer: Quantizer | None = None, *,
                  example_inputs: Any = None, equalize: Any = None, name: str | None = None) -> ModelAnalysis:
    """Capture `model` (unless it is a qcore graph) and return its analysis, with SQNR measured."""
    batches = list(batches)
    if not isinstance(model, fx.GraphModule):
        if not batches and example_inputs is None:
            raise ValueError("analyze_model needs at least one calibration batch")
        model = capture(model, batches[0] if example_inputs is None else example_inputs, name=name)
    analysis = ModelAnalysis(model, quantizer, batches, equalize=equalize)
    analysis.sqnr  # noqa: B018 - measure now, so that errors surface here
    return analysis
