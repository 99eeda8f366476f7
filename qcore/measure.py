"""One calibration pass and one comparison pass that feed every measurement of a model.

- Calibration runs the prepared graph once over the batches. The quantizer's observers, the detectors'
  observers and the channel ranges that equalization and smoothing need all watch the same float activations.
- Comparison runs the float graph once per batch, carrying shadow copies of the quantized layers and of their
  equalized and smoothed variants, and the quantized graph once per batch for the propagated SQNR.

A variant is one quantized layer re-run on its float input x with a per-input-channel factor m > 0: x * m is
quantized per tensor with the qparams its calibrated channel ranges give (exact for a min/max observer, since
scaling by m > 0 keeps each channel's minimum and maximum), and the weight columns divided by m are quantized
with a fresh copy of the layer's weight observer. Its SQNR against the float layer output is the layer's own
(shadow) SQNR under that equalization: a method's gain is measured on the layers concerned, with no second
pass over the model.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .calibrate import CalibrationError, calibrate
from .capture import clone_graph_module
from .convert import convert, fake_quantize_with, restore_model_state
from .diagnose import ResolutionLimit, first_non_finite, resolution_limits
from .equalize import (
    InputEqualizationObserver,
    input_channel_axis,
    input_weight_scale,
    producer_layer,
    weight_column_factor,
)
from .graph import INSERTED_KEY, QuantizableOp, fetch_attr, find_quantizable_ops, is_inserted
from .numeric.compare import ShadowGraph, compare_propagated_and_shadow
from .numeric.instrument import attach_after, copy_layer_into
from .numeric.loggers import StreamingComparator
from .numeric.matching import LayerPair
from .numeric.metrics import compute_sqnr
from .numeric.suite import extract_weights
from .observers import MinMaxObserver, ObserverBase
from .prepare import prepare
from .qparams import calculate_qparams, fake_quantize_per_tensor
from .quantizer import ANNOTATION_KEY, Int8StaticQuantizer, Quantizer
from .report import InputWeightEqualizationDetector, ModelReport, ReportObserver
from .report.detectors import DetectorBase, observer_name
from .smoothing import group_observer, smoothing_groups

__all__ = ["LayerSqnr", "ModelMeasurement", "OutputSqnr", "SqnrMeasurement", "VariantSqnr", "calibrate_and_convert",
           "measure_model", "sqnr_measurement", "variant_batches"]


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


@dataclass(frozen=True)
class VariantSqnr:
    """A layer's own SQNR (float input, as in the shadow comparison) with an equalization method applied, and
    without it under the same input quantization."""

    layer: str
    method: str  # "input_weight" or "smoothing"
    sqnr_db: float
    baseline_db: float
    alpha: float | None = None  # smoothing only
    producer_name: str = ""  # smoothing only: what absorbs 1/s

    @property
    def gain_db(self) -> float:
        """How much the method raises the layer's own SQNR."""
        return self.sqnr_db - self.baseline_db


@dataclass(frozen=True)
class ModelMeasurement:
    """Everything one calibration pass and one comparison pass measured."""

    sqnr: SqnrMeasurement
    detector_reports: Mapping[str, dict[str, Any]]  # {detector key: {layer: raw detector entry}}
    variants: Mapping[str, Mapping[str, VariantSqnr]]  # {layer: {method: VariantSqnr}}
    unmeasured: Mapping[str, str]  # {layer: why its variants could not be measured}
    smoothing: Mapping[str, Mapping[str, Any]]  # {layer: {"alpha", "producer", "producer_name"} | {"refused": why}}
    first_outputs: tuple[Any, ...] = ()  # the float outputs of batch 0 in calibration and in comparison


@dataclass
class _Variant:
    layer: str
    method: str
    factor: torch.Tensor  # m, one per input channel
    low: torch.Tensor  # the input's calibrated channel minima and maxima
    high: torch.Tensor
    alpha: float | None = None
    producer_name: str = ""
    comparator: StreamingComparator | None = None
    baseline: _Variant | None = None  # the same layer with m = 1, when the quantizer's own qparams are not min/max
    requantize: bool = False  # the input is quantized before the mul too (a quantized producer that keeps its output)
    extras: dict[str, Any] = field(default_factory=dict)


def measure_model(float_gm: fx.GraphModule, batches: Iterable[Any], quantizer: Quantizer | None = None, *,
                  propagate: bool = True, detectors: Mapping[str, DetectorBase] | None = None,
                  equalization_layers: Iterable[str] = (), smoothing: float | str | None = None) -> ModelMeasurement:
    """Quantize a copy of `float_gm` on `batches` and measure it in one calibration and one comparison pass:
    per-layer and output SQNR (propagate=False: shadow SQNR only), the detectors' reports, the input-weight
    equalization variant of `equalization_layers`, and the smoothing variant (alpha, or "search") of every
    smoothable layer."""
    batches = list(batches)
    prepared = prepare(clone_graph_module(float_gm, share_parameters=True), quantizer or Int8StaticQuantizer())
    report = ModelReport(prepared, list(detectors.values())) if detectors else None
    if report is not None:
        report.prepare_detailed_calibration()
    ops = {op.layer: op for op in find_quantizable_ops(prepared)}
    statistics: list[tuple[str, Any, Any, fx.Node | None]] = []  # (kind, key, observer, node it added)
    for index, layer in enumerate(equalization_layers):
        op = ops.get(layer)
        if op is None or not op.activation_inputs:
            continue
        shared = _detector_channel_ranges(prepared, op, detectors or {})
        if shared is not None:  # the input-weight equalization detector already watches these channel ranges
            statistics.append(("input_weight", op, shared, None))
            continue
        observer = InputEqualizationObserver(ch_axis=input_channel_axis(op))
        statistics.append(("input_weight", op, observer,
                           _watch(prepared, op.activation_inputs[0], f"qcore_eq_stats_{index}", observer)))
    groups, refused = smoothing_groups(float_gm) if smoothing is not None else ([], {})
    nodes = {node.name: node for node in prepared.graph.nodes}
    for index, group in enumerate(groups):
        observer = group_observer(float_gm, group, keep_first=smoothing == "search")
        statistics.append(("smoothing", group, observer,
                           _watch(prepared, nodes[group.input_node.name], f"qcore_smooth_stats_{index}", observer)))
    prepared.recompile()
    read: dict[str, Any] = {}

    def read_statistics() -> None:
        reports = report.generate_model_report(remove_inserted_observers=False) if report is not None else {}
        read["detectors"] = {key: dict(reports.get(detector.get_detector_name(), ("", {}))[1])
                             for key, detector in (detectors or {}).items()}
        read["variants"] = _variants(prepared, ops, statistics, smoothing,
                                     _kept_producer_outputs(float_gm, prepared, equalization_layers))
        for _kind, _key, _observer, node in statistics:
            if node is not None:
                prepared.graph.erase_node(node)
                delattr(prepared, str(node.target))
        if report is not None:  # the detectors' observers go too; convert recompiles the graph once for all
            for node in [n for n in prepared.graph.nodes if n.meta.get(INSERTED_KEY) == "report"]:
                prepared.graph.erase_node(node)
            for name in set().union(*report.get_observers_of_interest().values()):
                if hasattr(prepared, name):
                    delattr(prepared, name)

    first_outputs: list[Any] = []  # two float runs of batch 0 from the same state: they must agree
    quant_gm = calibrate_and_convert(prepared, float_gm, batches, read_statistics, keep_float_weights=False,
                                     keep_first_output=first_outputs)
    detector_reports = read["detectors"]
    variants, unmeasured, smoothed = read["variants"]
    smoothed.update({layer: {"refused": reason} for layer, reason in refused.items()})
    restore_model_state(quant_gm, float_gm)  # calibration ran forward, which may update buffers in place
    limits = resolution_limits(quant_gm)
    weights = extract_weights("float", float_gm, "quant", quant_gm)

    baselines: dict[str, dict[str, Any]] = {}

    def instrument(graph: ShadowGraph) -> Callable[[], None]:
        by_layer = {pair.layer: pair for pair in graph.pairs}
        for index, variant in enumerate(v for v in variants if v.layer in by_layer):
            reason = _add_variant_shadow(graph, by_layer[variant.layer], variant, index)
            if reason:
                unmeasured.setdefault(variant.layer, reason)
        # the unequalized layer's own SQNR over the same batches as its variants
        return lambda: baselines.update({v.layer: graph.shadows[v.layer].result() for v in variants})

    propagated, shadow_records = compare_propagated_and_shadow(
        float_gm, quant_gm, batches, own_quant_model=True, propagate=propagate, instrument=instrument if variants
        else None, instrument_batches=variant_batches(len(batches)), keep_first_output=first_outputs)
    shadows = {r["layer"]: r for r in shadow_records}
    measurement = sqnr_measurement(propagated if propagate else shadow_records, shadows, weights, limits)
    return ModelMeasurement(measurement, detector_reports, _variant_results(variants, baselines, unmeasured),
                            unmeasured, smoothed, tuple(first_outputs))


def variant_batches(batches: int) -> int:
    """How many of the calibration batches measure the equalization variants: a quarter, at least 2 (the
    variants' qparams still come from every batch)."""
    return min(batches, max(2, batches // 4))


def _detector_channel_ranges(prepared: fx.GraphModule, op: QuantizableOp, detectors: Mapping[str, DetectorBase]
                             ) -> ReportObserver | None:
    """The input-weight equalization detector's observer of this layer's input channels, when it has one on the
    same channel axis (its per-channel minima and maxima are what input-weight equalization needs)."""
    for detector in detectors.values():
        if not isinstance(detector, InputWeightEqualizationDetector):
            continue
        name = observer_name(op.layer, detector.get_detector_name(), "pre")
        observer = getattr(prepared, name, None)
        if isinstance(observer, ReportObserver) and observer.per_channel and \
                observer.ch_axis == input_channel_axis(op):
            return observer
    return None


def _input_observer(observer: Any) -> InputEqualizationObserver:
    """An InputEqualizationObserver holding a calibrated observer's per-channel ranges."""
    if isinstance(observer, InputEqualizationObserver):
        return observer
    copy_ = InputEqualizationObserver(ch_axis=observer.ch_axis)
    copy_.min_val, copy_.max_val = observer.min_val.clone(), observer.max_val.clone()
    return copy_


def _watch(gm: fx.GraphModule, node: fx.Node, name: str, observer: torch.nn.Module) -> fx.Node:
    """Call `observer` on `node` as a side branch (removed again before convert)."""
    gm.add_submodule(name, observer)
    with gm.graph.inserting_after(node):
        call = gm.graph.call_module(name, (node,))
    call.meta[INSERTED_KEY] = "equalization_observer"
    return call


def calibrate_and_convert(prepared: fx.GraphModule, float_gm: fx.GraphModule, batches: list[Any],
                          before_convert: Callable[[], None] | None = None, keep_float_weights: bool = True,
                          keep_first_output: list | None = None) -> fx.GraphModule:
    """Calibrate `prepared` and convert it (in place); a failure caused by NaN or inf in the float model says where
    they appear. `before_convert` runs between the two (to read and remove other observers)."""
    try:
        calibrate(prepared, batches, keep_first_output)
        if before_convert is not None:
            before_convert()
        return convert(prepared, keep_float_weights)
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


def _kept_producer_outputs(float_gm: fx.GraphModule, prepared: fx.GraphModule, layers: Iterable[str]) -> set[str]:
    """The layers whose equalization mul would sit after a quantized producer output: input-weight equalization
    keeps that quantization, then quantizes the scaled input again. A linear/conv producer that is equalized
    too absorbs the scale into its rows instead, and a model input or float producer is quantized once."""
    chosen = set(layers)
    float_ops = find_quantizable_ops(float_gm)
    by_node = {op.node: op for op in float_ops}
    annotated = {node.name: node for node in prepared.graph.nodes}
    kept = set()
    for op in float_ops:
        if op.layer not in chosen or not op.activation_inputs:
            continue
        producer = producer_layer(float_gm, op, by_node)
        if producer is not None and producer.layer in chosen:
            continue
        source = annotated.get(op.activation_inputs[0].name)
        annotation = source.meta.get(ANNOTATION_KEY) if source is not None else None
        if annotation is not None and annotation.output_qspec is not None:
            kept.add(op.layer)
    return kept


def _variants(prepared: fx.GraphModule, ops: dict[str, QuantizableOp], statistics: list,
              smoothing: float | str | None, requantized: set[str]
              ) -> tuple[list[_Variant], dict[str, str], dict[str, dict[str, Any]]]:
    """The variants to measure, {layer: why not} for layers whose input is not quantized per tensor, and the
    smoothing groups' alphas by layer."""
    variants: list[_Variant] = []
    unmeasured: dict[str, str] = {}
    smoothed: dict[str, dict[str, Any]] = {}
    for kind, key, observer, _node in statistics:
        if kind == "input_weight":
            observer = _input_observer(observer)
            scale = input_weight_scale(prepared, key, observer)
            variants.append(_Variant(key.layer, kind, scale, observer.min_val, observer.max_val,
                                     requantize=key.layer in requantized))
            continue
        alpha = observer.best_alpha() if smoothing == "search" else float(smoothing)  # type: ignore[arg-type]
        observer.first = None
        inverse = 1.0 / observer.scale(alpha)
        for layer in key.layers:
            smoothed[layer] = {"alpha": alpha, "producer": key.producer, "producer_name": key.producer_name}
            variants.append(_Variant(layer, kind, inverse, observer.low, observer.high, alpha, key.producer_name))
    kept = []
    for variant in variants:
        reason = _prepare_variant(prepared, ops[variant.layer], variant)
        if reason:
            unmeasured[variant.layer] = reason
        else:
            kept.append(variant)
            if variant.baseline is not None:
                kept.append(variant.baseline)
    return kept, unmeasured, smoothed


def _observer_of(prepared: fx.GraphModule, arg: Any) -> ObserverBase | None:
    if isinstance(arg, fx.Node) and arg.op == "call_module" and arg.meta.get(INSERTED_KEY) == "observer":
        module = prepared.get_submodule(str(arg.target))
        return module if isinstance(module, ObserverBase) else None
    return None


def _prepare_variant(prepared: fx.GraphModule, op: QuantizableOp, variant: _Variant) -> str:
    """Compute the variant's input qparams and quantized weight (in variant.extras); else the reason it cannot be
    measured."""
    input_observer = _observer_of(prepared, op.node.args[0])
    weight_observer = _observer_of(prepared, op.node.args[1] if len(op.node.args) > 1 else None)
    if input_observer is None or weight_observer is None:
        return "its input or weight is not quantized, so equalization changes nothing it measures"
    if input_observer.is_dynamic or input_observer.per_channel or getattr(input_observer, "is_float", False):
        return "its input is not quantized statically per tensor, which is what equalization balances"
    factor = variant.factor.float()
    low, high = (variant.low * factor).amin(), (variant.high * factor).amax()
    scale, zero_point = calculate_qparams(low, high, input_observer.quant_min, input_observer.quant_max,
                                          input_observer.symmetric, input_observer.eps)
    weight = fetch_attr(prepared, op.weight_target).detach()
    scaled = weight / weight_column_factor(op, variant.factor, weight)
    fresh = _fresh_copy(weight_observer)
    with torch.no_grad():
        fresh(scaled)
        quantized = fake_quantize_with(fresh, scaled)
    shape = [1, -1] + [1] * (weight.dim() - 2) if op.kind == "conv" else [-1]
    variant.extras = {"scale": float(scale.reshape(-1)[0]), "zero_point": int(zero_point.reshape(-1)[0]),
                      "factor": variant.factor.reshape(shape).to(weight.dtype), "weight": quantized}
    if type(input_observer) is not MinMaxObserver and variant.baseline is None and variant.method != "identity":
        # a clipping or averaging observer's qparams do not follow from channel ranges: compare like with like
        identity = _Variant(variant.layer, "identity", torch.ones_like(variant.factor), variant.low, variant.high)
        _prepare_variant(prepared, op, identity)
        variant.baseline = identity
    return ""


def _fresh_copy(observer: ObserverBase) -> ObserverBase:
    """The observer with the same settings and nothing observed."""
    fresh = copy.deepcopy(observer)
    fresh.frozen = False
    if fresh.per_channel:
        fresh.min_val, fresh.max_val = torch.empty(0), torch.empty(0)
    else:
        fresh.min_val, fresh.max_val = torch.tensor(math.inf), torch.tensor(-math.inf)
    if hasattr(fresh, "histogram"):
        fresh.histogram = torch.zeros_like(fresh.histogram)
    return fresh


def _add_variant_shadow(graph: ShadowGraph, pair: LayerPair, variant: _Variant, index: int) -> str:
    """Copy the quantized layer into the float graph with the variant's input factor, input qparams and weight,
    and compare it with the float layer; else the reason it cannot be."""
    gm_a, prefix = graph.gm, graph.prefix
    quant_input = pair.b.node.args[0]
    quant_weight = pair.b.node.args[1] if len(pair.b.node.args) > 1 else None
    if not (is_inserted(quant_input) and quant_input.target is fake_quantize_per_tensor) or \
            not (isinstance(quant_weight, fx.Node) and quant_weight.op == "get_attr"):
        return "its quantized input or weight is not in the form a variant can replace"
    copies: dict[fx.Node, fx.Node] = {}
    result = copy_layer_into(gm_a, pair.a, pair.b, prefix, copies)
    input_copy = copies[quant_input]
    base = f"qcore_variant_{index}"
    gm_a.register_buffer(f"{base}_factor", variant.extras["factor"])
    gm_a.register_buffer(f"{base}_weight", variant.extras["weight"])
    qparams = (variant.extras["scale"], variant.extras["zero_point"], *input_copy.args[3:])
    if variant.requantize:  # the producer's quantized output, scaled, quantized again
        with gm_a.graph.inserting_after(input_copy):
            factor = gm_a.graph.get_attr(f"{base}_factor")
        with gm_a.graph.inserting_after(factor):
            scaled = gm_a.graph.call_function(torch.mul, (input_copy, factor))
        with gm_a.graph.inserting_after(scaled):
            requantized = gm_a.graph.call_function(fake_quantize_per_tensor, (scaled, *qparams))
        copies[pair.b.node].replace_input_with(input_copy, requantized)
        requantized.meta[INSERTED_KEY] = "shadow"
    else:
        with gm_a.graph.inserting_before(input_copy):
            factor = gm_a.graph.get_attr(f"{base}_factor")
            scaled = gm_a.graph.call_function(torch.mul, (input_copy.args[0], factor))
        input_copy.args = (scaled, *qparams)
    scaled.meta[INSERTED_KEY] = "shadow"
    copies[quant_weight].target = f"{base}_weight"
    variant.comparator = StreamingComparator()
    attach_after(gm_a, result, f"{base}_compare", variant.comparator, graph.references[variant.layer])
    return ""


def _variant_results(variants: list[_Variant], shadows: dict[str, dict], unmeasured: dict[str, str]
                     ) -> dict[str, dict[str, VariantSqnr]]:
    """{layer: {method: VariantSqnr}}; `shadows` holds each layer's shadow result over the variants' batches."""
    results: dict[str, dict[str, VariantSqnr]] = {}
    for variant in variants:
        if variant.method == "identity" or variant.comparator is None or variant.layer in unmeasured:
            continue
        if variant.baseline is not None:
            if variant.baseline.comparator is None:
                continue
            baseline = variant.baseline.comparator.result()["sqnr_db"]
        else:
            baseline = shadows[variant.layer]["sqnr_db"]
        results.setdefault(variant.layer, {})[variant.method] = VariantSqnr(
            variant.layer, variant.method, float(variant.comparator.result()["sqnr_db"]), float(baseline),
            variant.alpha, variant.producer_name)
    return results


def sqnr_measurement(records: list[dict], shadows: dict[str, dict], weights: dict,
                      limits: dict[str, tuple[ResolutionLimit, ...]]) -> SqnrMeasurement:
    """Typed records from the numeric suite's propagated (or shadow) records, shadow records and weights."""
    layers: dict[str, LayerSqnr] = {}
    outputs: dict[str, OutputSqnr] = {}
    for record in records:
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
        shadow = shadows.get(record["layer"], {}).get("sqnr_db", math.nan)
        layers[record["layer"]] = LayerSqnr(
            layer=record["layer"], fqn=record["fqn"], op=record["op"], sqnr_db=float(record["sqnr_db"]),
            shadow_sqnr_db=float(shadow), normalized_l2=float(record["normalized_l2"]),
            cosine=float(record["cosine"]), batches=int(record["batches"]), weight_sqnr_db=weight_db,
            below_resolution=limits.get(record["layer"], ()))
    return SqnrMeasurement(layers, outputs)
