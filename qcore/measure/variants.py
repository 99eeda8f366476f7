"""Equalization variants: one quantized layer re-run on its float input with a per-input-channel factor m > 0.

x * m is quantized per tensor with the qparams its calibrated channel ranges give (exact for a min/max observer,
since scaling by m > 0 keeps each channel's minimum and maximum), and the weight columns divided by m are
quantized with a fresh copy of the layer's weight observer. Input-weight equalization uses m = s, smoothing
m = 1 / s. After a quantized producer that keeps its output (an add, say), input-weight equalization quantizes
the producer's output, scales it and quantizes it again, as the equalized model does. The variant's SQNR
against the float layer output is the layer's own (shadow) SQNR under that equalization.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.grouped import rows_of_experts
from qcore.graph.ops import INSERTED_KEY, QuantizableOp, fetch_attr, find_quantizable_ops, is_inserted, is_weight_value
from qcore.measure.probes import ChannelStatisticsProbe
from qcore.numeric.compare import ShadowGraph
from qcore.numeric.instrument import attach_after, copy_layer_into
from qcore.numeric.loggers import ExpertsComparator, StreamingComparator
from qcore.numeric.matching import LayerPair
from qcore.observe.observers import MinMaxObserver, ObserverBase, PerChannelMinMaxObserver, fresh_copy
from qcore.observe.qparams import (
    calculate_qparams,
    fake_quantize_divided_rows,
    fake_quantize_per_channel,
    fake_quantize_per_tensor,
    row_slices,
)
from qcore.observe.segmented import (
    ExpertsObserver,
    SegmentedMinMaxObserver,
    fake_quantize_divided_experts,
    fake_quantize_per_expert,
)
from qcore.quantization.convert import fake_quantize_with, weights_quantized_where_read
from qcore.quantization.quantizer import ANNOTATION_KEY
from qcore.report import InputWeightEqualizationDetector, ReportObserver
from qcore.report.detectors import DetectorBase, observer_name
from qcore.rewrites.equalize import (
    InputEqualizationObserver,
    equalization_scale_of_ranges,
    input_channel_axis,
    input_weight_scales,
    producer_layer,
    weight_column_factor,
)
from qcore.runtime import deferred
from qcore.runtime.scratch import elementwise

__all__ = ["NO_TOKEN_REASON", "GroupedVariant", "Variant", "VariantSqnr", "add_grouped_variant_shadow",
           "add_variant_shadow", "detector_channel_ranges", "grouped_variants_of", "input_ranges",
           "kept_producer_outputs", "make_variant_weights", "op_experts", "plan_grouped_variants", "plan_variants",
           "produced_quantized",
           "rewrite_scales", "ScaledWeightQuantizer", "variant_batches", "variant_results"]


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


@dataclass
class Variant:
    layer: str
    method: str
    factor: torch.Tensor  # m, one per input channel
    low: torch.Tensor  # the input's calibrated channel minima and maxima
    high: torch.Tensor
    alpha: float | None = None
    producer_name: str = ""
    comparator: StreamingComparator | None = None
    baseline: Variant | None = None  # the same layer with m = 1, when the quantizer's own qparams are not min/max
    requantize: bool = False  # the input is quantized before the mul too (a quantized producer that keeps its output)
    extras: dict[str, Any] = field(default_factory=dict)
    rewrite_scale: torch.Tensor | None = None  # the scale s the float rewrite uses (equalize/smooth), unrounded


# why an expert that no calibration token reached has no variant (ModelMeasurement.unmeasured_variants)
NO_TOKEN_REASON = "no calibration token reached it, so it has no input range to equalize"


def variant_batches(batches: int) -> int:
    """How many of the calibration batches measure the equalization variants: a quarter, at least 2 (the
    variants' qparams still come from every batch)."""
    return min(batches, max(2, batches // 4))


def detector_channel_ranges(prepared: fx.GraphModule, op: QuantizableOp, detectors: Mapping[str, DetectorBase]
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


def input_ranges(observer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A calibrated observer's per-channel (min, max): an InputEqualizationObserver's own, another's copied (a report
    observer goes on updating its state in place)."""
    if isinstance(observer, InputEqualizationObserver):
        return observer.min_val, observer.max_val
    return observer.min_val.clone(), observer.max_val.clone()


def kept_producer_outputs(float_gm: fx.GraphModule, prepared: fx.GraphModule, layers: Iterable[str]) -> set[str]:
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


def plan_variants(prepared: fx.GraphModule, ops: dict[str, QuantizableOp], statistics: list[ChannelStatisticsProbe],
              smoothing: float | str | None, requantized: set[str]
              ) -> tuple[list[Variant], dict[str, str], dict[str, dict[str, Any]]]:
    """The variants to measure, {layer: why not} for layers whose input is not quantized per tensor, and the
    smoothing groups' alphas by layer."""
    variants: list[Variant] = []
    unmeasured: dict[str, str] = {}
    smoothed: dict[str, dict[str, Any]] = {}
    ranges = {}
    for index, probe in enumerate(statistics):
        if probe.kind != "input_weight":
            continue
        low, high = input_ranges(probe.observer)
        if low.numel() == 0:  # an expert no calibration token was routed to: no range to equalize
            unmeasured[probe.key.layer] = NO_TOKEN_REASON
            continue
        ranges[index] = (low, high)
    scales = dict(zip(ranges, input_weight_scales(prepared, [(statistics[index].key, *found)
                                                              for index, found in ranges.items()])))
    for index, probe in enumerate(statistics):
        kind, key, observer = probe.kind, probe.key, probe.observer
        if kind == "input_weight":
            if index not in scales:
                continue
            scale = scales[index]
            variants.append(Variant(key.layer, kind, scale, *ranges[index], requantize=key.layer in requantized,
                                    rewrite_scale=scale))
            continue
        if observer.low is None or observer.low.numel() == 0:  # no calibration token reached the group's layers
            unmeasured.update(dict.fromkeys(key.layers, NO_TOKEN_REASON))
            continue
        alpha = observer.best_alpha() if smoothing == "search" else float(smoothing)  # type: ignore[arg-type]
        observer.first = None
        scale = observer.scale(alpha)
        inverse = 1.0 / scale
        for layer in key.layers:
            smoothed[layer] = {"alpha": alpha, "producer": key.producer, "producer_name": key.producer_name}
            variants.append(Variant(layer, kind, inverse, observer.low, observer.high, alpha, key.producer_name,
                                    rewrite_scale=scale))
    kept: list[Variant] = []
    identities: dict[str, Variant] = {}  # one unequalized baseline per layer, shared by its methods
    for variant in variants:
        op = ops[variant.layer]
        reason = _variant_refusal(prepared, op)
        if reason:
            unmeasured[variant.layer] = reason
            continue
        kept.append(variant)
        if type(_observer_of(prepared, op.node.args[0])) is not MinMaxObserver:
            # a clipping or averaging observer's qparams do not follow from channel ranges: compare like with like
            if variant.layer not in identities:
                identity = Variant(variant.layer, "identity", torch.ones_like(variant.factor), variant.low,
                                   variant.high)
                identities[variant.layer] = identity
                kept.append(identity)
            variant.baseline = identities[variant.layer]
    _prepare_variants(prepared, [(ops[variant.layer], variant) for variant in kept])
    return kept, unmeasured, smoothed


def _observer_of(prepared: fx.GraphModule, arg: Any) -> ObserverBase | None:
    if isinstance(arg, fx.Node) and arg.op == "call_module" and arg.meta.get(INSERTED_KEY) == "observer":
        module = prepared.get_submodule(str(arg.target))
        return module if isinstance(module, ObserverBase) else None
    return None


def _variant_refusal(prepared: fx.GraphModule, op: QuantizableOp) -> str:
    """Why a layer's variants cannot be measured ("" when they can)."""
    input_observer = _observer_of(prepared, op.node.args[0])
    weight_observer = _observer_of(prepared, op.node.args[1] if len(op.node.args) > 1 else None)
    if input_observer is None or weight_observer is None:
        return "its input or weight is not quantized, so equalization changes nothing it measures"
    if input_observer.is_dynamic or input_observer.per_channel or getattr(input_observer, "is_float", False):
        return "its input is not quantized statically per tensor, which is what equalization balances"
    return ""


def _prepare_variants(prepared: fx.GraphModule, chosen: list[tuple[QuantizableOp, Variant]]) -> None:
    """Each variant's input qparams and how to make its quantized weight (variant.extras). The input ranges x * m
    of the variants whose input observers share settings are reduced and their qparams computed together, in one
    chain of ops and one host read (elementwise: each variant's are those it would get alone)."""
    groups: dict[tuple, list[tuple[QuantizableOp, Variant]]] = {}
    for op, variant in chosen:
        observer = _observer_of(prepared, op.node.args[0])
        assert observer is not None
        key = (observer.quant_min, observer.quant_max, observer.symmetric, observer.eps, variant.low.device)
        groups.setdefault(key, []).append((op, variant))
    for (quant_min, quant_max, symmetric, eps, device), members in groups.items():
        low, high = _scaled_ranges([variant for _, variant in members], device)
        scales, zero_points = calculate_qparams(low, high, quant_min, quant_max, symmetric, eps)
        for (op, variant), scale, zero_point in zip(members, scales.tolist(), zero_points.tolist()):
            variant.extras = _weight_plan(prepared, op, variant)
            variant.extras.update(scale=float(scale), zero_point=int(zero_point))


def _scaled_ranges(variants: list[Variant], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each variant's input range with its factor applied, (min of low * m, max of high * m), as two 1-d tensors:
    x * m is monotone per channel for m > 0."""
    factors = [variant.factor.float() for variant in variants]
    if all(v.low.shape == v.high.shape == f.shape and f.dim() == 1 for v, f in zip(variants, factors)):
        lengths = deferred.segment_lengths(device, tuple(f.numel() for f in factors))
        factor = torch.cat(factors)
        low = torch.segment_reduce(torch.cat([v.low for v in variants]) * factor, "min", lengths=lengths,
                                   unsafe=True)  # a NaN stays, as with amin
        high = torch.segment_reduce(torch.cat([v.high for v in variants]) * factor, "max", lengths=lengths,
                                    unsafe=True)
        return low, high
    return (torch.stack([(v.low * f).amin() for v, f in zip(variants, factors)]),
            torch.stack([(v.high * f).amax() for v, f in zip(variants, factors)]))


def _weight_plan(prepared: fx.GraphModule, op: QuantizableOp, variant: Variant) -> dict[str, Any]:
    """How a variant's quantized weight is made: its factor laid out for its input, and "weight", which makes the
    weight (once: make_variant_weights may have made it with others ahead)."""
    weight_observer = _observer_of(prepared, op.node.args[1] if len(op.node.args) > 1 else None)
    assert weight_observer is not None
    weight = fetch_attr(prepared, op.weight_target).detach()
    extras: dict[str, Any] = {}

    def make_weight() -> Any:  # made when its shadow is added: one block's at a time, block-wise
        if "made" in extras:  # handed over once: the graph that reads it holds it from then on
            return extras.pop("made")
        column_factor = weight_column_factor(op, variant.factor, weight)
        where_read = weights_quantized_where_read()  # a large model: quantized from the float weight where read
        # where read, the divided copy is only observed: a reused buffer, not fresh pages for each variant
        scaled = elementwise(torch.div, weight, column_factor) if where_read else weight / column_factor
        fresh = fresh_copy(weight_observer)
        with torch.no_grad():
            fresh(scaled)
            if where_read:
                return ScaledWeightQuantizer(fresh, column_factor)
            return fake_quantize_with(fresh, scaled)

    shape = [1, -1] + [1] * (weight.dim() - 2) if op.kind == "conv" else [-1]
    extras.update(factor=variant.factor.reshape(shape).to(weight.dtype), weight=make_weight,
                  weight_source=(op, weight, weight_observer))
    return extras


def make_variant_weights(variants: Iterable[Variant]) -> None:
    """Make the quantized weights of variants ahead, together: the weights divided by their column factors are
    laid end to end along their rows wherever their observers quantize per row with the same settings (the same
    dtype, device and row shape too), then observed and fake-quantized in one chain of ops and one host read
    instead of a chain and a read each. Per-row qparams depend on the row alone: each variant gets exactly the
    weight it would make alone. Not where weights are quantized where read (a large model holds no such copy)."""
    if weights_quantized_where_read():
        return
    groups: dict[tuple, list[Variant]] = {}
    for variant in variants:
        source = variant.extras.get("weight_source")
        if source is None or "made" in variant.extras:
            continue
        _, weight, observer = source
        if type(observer) is not PerChannelMinMaxObserver or (observer.ch_axis or 0) != 0 or weight.dim() < 2:
            continue
        key = (observer.dtype, observer.quant_min, observer.quant_max, observer.qscheme, observer.eps,
               tuple(weight.shape[1:]), weight.dtype, weight.device)
        groups.setdefault(key, []).append(variant)
    for members in groups.values():
        if len(members) < 2:
            continue
        sources = [variant.extras["weight_source"] for variant in members]
        rows = [weight.shape[0] for _, weight, _ in sources]
        first = sources[0][1]
        with torch.no_grad():
            scaled = torch.empty((sum(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
            for variant, (op, weight, _), part in zip(members, sources, scaled.split(rows)):
                torch.div(weight, weight_column_factor(op, variant.factor, weight), out=part)
            fresh = fresh_copy(sources[0][2])
            fresh(scaled)
            scale, zero_point = fresh.memoized_qparams()  # only read: not copied
            quantized = fake_quantize_per_channel(scaled, scale, zero_point, 0, fresh.quant_min, fresh.quant_max,
                                                  in_place=True)
        for variant, piece in zip(members, quantized.split(rows)):
            variant.extras["made"] = piece


_ROWS_ELEMENTS = 1 << 22  # of a variant's weight quantized at a time where it is read (16 MB of float32)


class ScaledWeightQuantizer(nn.Module):
    """A variant's quantized weight computed from the float weight each time it is read: the float weight divided
    by the column factor, fake-quantized with the qparams observed on it once (the same values as the weight
    quantized ahead, without holding them)."""

    def __init__(self, observer: ObserverBase, column_factor: torch.Tensor) -> None:
        super().__init__()
        scale, zero_point = observer.calculate_qparams()
        self.register_buffer("column_factor", column_factor)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.axis = (observer.ch_axis or 0) if observer.per_channel else None
        self.quant_min, self.quant_max = observer.quant_min, observer.quant_max

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """The variant's fake-quantized weight, a bounded number of rows at a time (no scaled copy of an LM head)."""
        weight, factor = weight.detach(), self.column_factor
        whole = weight.dim() == 0 or weight.numel() <= _ROWS_ELEMENTS or self.axis not in (None, 0)
        parts = [slice(None)] if whole else row_slices(weight, _ROWS_ELEMENTS)
        out = None if whole else torch.empty_like(weight)
        per_column = self.axis == 0 and weight.dim() == 2 and factor.numel() == weight.shape[1] and \
            (factor.dim() == 1 or factor.shape[0] == 1)
        with torch.no_grad():
            for part in parts:  # elementwise: the same values as the whole at once
                if per_column:  # divided and quantized in one pass, into a reused buffer
                    result = fake_quantize_divided_rows(weight[part], factor, self.scale[part], self.zero_point[part],
                                                        self.quant_min, self.quant_max, reuse_output=True)
                    if out is None:
                        return result
                    out[part] = result
                    continue
                # into a reused buffer: a fresh one each batch is new pages, each zeroed on its first write
                scaled = elementwise(torch.div, weight[part],
                                     factor[part] if factor.dim() and factor.shape[0] > 1 else factor)
                if self.axis is None:
                    result = fake_quantize_per_tensor(scaled, float(self.scale.reshape(-1)[0]),
                                                      int(self.zero_point.reshape(-1)[0]), self.quant_min,
                                                      self.quant_max)
                else:
                    channels = part if self.axis == 0 else slice(None)
                    result = fake_quantize_per_channel(scaled, self.scale[channels], self.zero_point[channels],
                                                       self.axis, self.quant_min, self.quant_max, in_place=True)
                if out is None:
                    return result
                out[part] = result
        return out


def add_variant_shadow(graph: ShadowGraph, pair: LayerPair, variant: Variant, index: int) -> str:
    """Copy the quantized layer into the float graph with the variant's input factor, input qparams and weight,
    and compare it with the float layer; else the reason it cannot be."""
    gm_a = graph.gm
    copied = _layer_copy(graph, pair, 1, fake_quantize_per_tensor)
    if isinstance(copied, str):
        return copied
    result, copies, input_copy, weight_copy = copied
    base = f"qcore_variant_{index}"
    gm_a.register_buffer(f"{base}_factor", variant.extras["factor"])
    made = variant.extras["weight"]()
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
    with gm_a.graph.inserting_before(weight_copy):
        if isinstance(made, ScaledWeightQuantizer):
            gm_a.add_submodule(f"{base}_weight", made)
            weight_node = gm_a.graph.call_module(f"{base}_weight", (pair.a.weight,))
        else:
            gm_a.register_buffer(f"{base}_weight", made)
            weight_node = gm_a.graph.get_attr(f"{base}_weight")
    _read_instead(gm_a, weight_copy, weight_node)
    variant.comparator = StreamingComparator()
    attach_after(gm_a, result, f"{base}_compare", variant.comparator, graph.references[variant.layer])
    return ""


def _layer_copy(graph: ShadowGraph, pair: LayerPair, weight_arg: int, input_quantization: Any
                ) -> tuple[fx.Node, dict[fx.Node, fx.Node], fx.Node, fx.Node] | str:
    """The quantized layer copied into the float graph, for a variant to change: (its result, {quantized graph's
    node: its copy}, the copies of its input quantization and of its weight), when its input is quantized by
    `input_quantization` and its weight (argument `weight_arg`) is a value; else why a variant cannot replace them."""
    quant_input = pair.b.node.args[0]
    quant_weight = pair.b.node.args[weight_arg] if len(pair.b.node.args) > weight_arg else None
    if not (is_inserted(quant_input) and quant_input.target is input_quantization) or \
            not is_weight_value(quant_weight):
        return "its quantized input or weight is not in the form a variant can replace"
    copies: dict[fx.Node, fx.Node] = {}
    result = copy_layer_into(graph.gm, pair.a, pair.b, graph.prefix, copies, known=graph.float_nodes())
    return result, copies, copies[quant_input], copies[quant_weight]


def _read_instead(gm: fx.GraphModule, weight_copy: fx.Node, weight_node: fx.Node) -> None:
    """The variant's weight read where the copied layer read its quantized weight, which is erased (with what only
    it read)."""
    weight_node.meta[INSERTED_KEY] = "shadow"
    weight_copy.replace_all_uses_with(weight_node)
    for node in [weight_copy, *weight_copy.all_input_nodes]:  # the quantized graph's weight, read no more
        if not node.users:
            gm.graph.erase_node(node)


def rewrite_scales(variants: list[Variant]) -> dict[tuple[str, str], tuple[float | None, torch.Tensor]]:
    """{(method, layer): (alpha, s)}: what input-weight equalization and smoothing (searched alpha) of each layer
    rewrite the float weights with, from the same channel ranges (equalize() and smooth() take them instead of a
    calibration pass of their own)."""
    return {(v.method, v.layer): (v.alpha, v.rewrite_scale) for v in variants if v.rewrite_scale is not None}


def variant_results(variants: list[Variant], shadows: dict[str, dict], unmeasured: dict[str, str]
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


@dataclass
class GroupedVariant:
    """One method's variants of the experts of one grouped projection, measured as one shadow of the projection:
    each expert's factor (1 for an expert not measured) and input qparams, the weight divided by the factors and
    quantized, and one comparator of every expert's rows. `experts` holds each measured expert's Variant, whose
    comparator reads its expert's result."""

    op: QuantizableOp  # the grouped projection (kind "grouped_linear")
    method: str
    factor: torch.Tensor  # [E, in]
    scale: torch.Tensor  # [E]: each expert's input qparams with its factor
    zero_point: torch.Tensor
    # [E, out, in], quantized; or, where weights are quantized where read, its qparams (scale, zero point), with
    # which the float weight divided by the factors is quantized each time the shadow reads it
    weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    requantize: bool
    weight_range: tuple[int, int]  # the weight's quant_min and quant_max
    experts: dict[int, Variant] = field(default_factory=dict)
    comparator: ExpertsComparator | None = None
    _results: list[dict[str, float]] | None = field(default=None, repr=False)

    def result(self, expert: int) -> dict[str, float]:
        """An expert's comparator result (every expert's read to the host once, after the pass)."""
        assert self.comparator is not None
        if self._results is None:
            self._results = self.comparator.results()
        return self._results[expert]


class _ExpertVariantResult:
    """A measured expert's view of its GroupedVariant's comparator, as a Variant's comparator is read."""

    def __init__(self, grouped: GroupedVariant, expert: int) -> None:
        self.grouped, self.expert = grouped, expert

    def result(self) -> dict[str, float]:
        return self.grouped.result(self.expert)


def plan_grouped_variants(prepared: fx.GraphModule, op: QuantizableOp, wanted: Iterable[int], observer: Any,
                          requantize: bool) -> tuple[list[Variant], dict[str, str]]:
    """The input-weight equalization variants of the `wanted` experts of grouped projection `op` from `observer`
    (the channel ranges of its routed rows, every expert's: [E, in]), each expert's the Variant the per-expert graph
    plans for its Linear; and {expert layer: why not} for the others wanted. Its input and weight observers are
    the prepared graph's, of every expert at once."""
    wanted = list(wanted)
    layers = op.expert_layers
    input_observer = _observer_of(prepared, op.node.args[0])
    weight_observer = _observer_of(prepared, op.node.args[2])
    if not isinstance(input_observer, ExpertsObserver) or not isinstance(weight_observer, ExpertsObserver):
        return [], dict.fromkeys((layers[e] for e in wanted),
                                 "its input or weight is not quantized, so equalization changes nothing it measures")
    if input_observer.is_dynamic or input_observer.per_channel or getattr(input_observer, "is_float", False):
        return [], dict.fromkeys((layers[e] for e in wanted), _NOT_STATIC)
    reached = observer.observed.tolist()  # one host read
    unmeasured: dict[str, str] = {}
    measured = []
    for expert in wanted:
        if expert in input_observer.float_experts or expert in weight_observer.float_experts:
            unmeasured[layers[expert]] = "its input or weight is not quantized, so equalization changes nothing it " \
                                         "measures"
        elif expert in input_observer.dynamic_experts:
            unmeasured[layers[expert]] = _NOT_STATIC
        elif not reached[expert]:
            unmeasured[layers[expert]] = NO_TOKEN_REASON
        else:
            measured.append(expert)
    if not measured:
        return [], unmeasured
    weight = fetch_attr(prepared, op.weight_target).detach()  # [E, out, in]
    low, high = observer.min_val, observer.max_val
    # each expert's scale as input_weight_scales gives its Linear's: its column ranges, then the formula, elementwise
    scale = equalization_scale_of_ranges(low, high, weight.amin(dim=1).float(), weight.amax(dim=1).float())
    keep = torch.zeros(op_experts(op), dtype=torch.bool, device=scale.device)
    keep[measured] = True
    factor = torch.where(keep[:, None], scale, torch.ones_like(scale))
    variants: list[Variant] = []
    plans = [("input_weight", factor)]
    if type(input_observer) is not SegmentedMinMaxObserver:
        # a clipping or averaging observer's qparams do not follow from channel ranges: compare like with like
        plans.append(("identity", torch.ones_like(factor)))
    made: dict[str, GroupedVariant] = {}
    for method, factors in plans:
        scaled_low, scaled_high = (low * factors).amin(dim=1), (high * factors).amax(dim=1)
        input_scale, input_zero_point = calculate_qparams(scaled_low, scaled_high, input_observer.quant_min,
                                                          input_observer.quant_max, input_observer.symmetric,
                                                          input_observer.eps)
        fresh = fresh_copy(weight_observer)
        where_read = weights_quantized_where_read()  # a large model: quantized from the float weight where read
        with torch.no_grad():
            column_factors = factors.to(weight.dtype)[:, None, :]
            if where_read:  # only observed: a few experts' divided weights at a time, none held
                step = max(1, _ROWS_ELEMENTS // max(1, weight[0].numel()))
                fresh.observe_constant_in_parts(weight[start:start + step] / column_factors[start:start + step]
                                                for start in range(0, weight.shape[0], step))
                quantized = fresh.calculate_qparams()
            else:
                divided = weight / column_factors
                fresh.observe_constant(divided)
                quantized = fresh.fake_quantize_weight(divided)
                del divided
        made[method] = GroupedVariant(op, method, factors.to(weight.dtype), input_scale, input_zero_point, quantized,
                                      requantize, (fresh.quant_min, fresh.quant_max))
    for expert in measured:
        identity = None
        if "identity" in made:
            identity = Variant(layers[expert], "identity", torch.ones_like(scale[expert]), low[expert], high[expert],
                               extras={"grouped": made["identity"]})
            made["identity"].experts[expert] = identity
            variants.append(identity)
        variant = Variant(layers[expert], "input_weight", scale[expert], low[expert], high[expert],
                          requantize=requantize, rewrite_scale=scale[expert], baseline=identity,
                          extras={"grouped": made["input_weight"]})
        made["input_weight"].experts[expert] = variant
        variants.append(variant)
    return variants, unmeasured


_NOT_STATIC = "its input is not quantized statically per tensor, which is what equalization balances"


def produced_quantized(prepared: fx.GraphModule, op: QuantizableOp) -> bool:
    """Whether the value a layer reads is a quantized output (its producer's annotation quantizes it): input-weight
    equalization's mul then quantizes it again, as the equalized model does."""
    if not op.activation_inputs:
        return False
    source = {node.name: node for node in prepared.graph.nodes}.get(op.activation_inputs[0].name)
    annotation = source.meta.get(ANNOTATION_KEY) if source is not None else None
    return annotation is not None and annotation.output_qspec is not None


def op_experts(op: QuantizableOp) -> int:
    """How many experts a grouped projection computes."""
    return len(op.expert_layers)


def grouped_variants_of(variants: Iterable[Variant]) -> list[GroupedVariant]:
    """The GroupedVariants the variants of grouped projections' experts belong to, each once, in order."""
    found: dict[int, GroupedVariant] = {}
    for variant in variants:
        grouped = variant.extras.get("grouped")
        if grouped is not None:
            found.setdefault(id(grouped), grouped)
    return list(found.values())


def add_grouped_variant_shadow(graph: ShadowGraph, pair: LayerPair, grouped: GroupedVariant, index: int) -> str:
    """Copy the quantized grouped projection into the float graph with each expert's factor on its rows, its input
    qparams and the divided weight, compared with the float projection expert by expert; else why it cannot be."""
    gm_a = graph.gm
    copied = _layer_copy(graph, pair, 2, fake_quantize_per_expert)
    if isinstance(copied, str):
        return copied
    result, copies, input_copy, weight_copy = copied
    counts = input_copy.args[1]
    base = f"qcore_grouped_variant_{index}"
    where_read = isinstance(grouped.weight, tuple)
    weights = (("weight_scale", grouped.weight[0]), ("weight_zero_point", grouped.weight[1])) if where_read else (
        ("weight", grouped.weight),)
    for name, value in (("factor", grouped.factor), ("scale", grouped.scale.float()),
                        ("zero_point", grouped.zero_point), *weights):
        gm_a.register_buffer(f"{base}_{name}", value)
    quant_min, quant_max, symmetric = input_copy.args[4], input_copy.args[5], input_copy.args[8]
    source = input_copy if grouped.requantize else input_copy.args[0]  # the producer's quantized output, or float
    with gm_a.graph.inserting_before(copies[pair.b.node]):  # in this order, after the input's copy
        factor = gm_a.graph.get_attr(f"{base}_factor")
        rows = gm_a.graph.call_function(rows_of_experts, (factor, counts))
        scaled = gm_a.graph.call_function(torch.mul, (source, rows))
        scale = gm_a.graph.get_attr(f"{base}_scale")
        zero_point = gm_a.graph.get_attr(f"{base}_zero_point")
        requantized = gm_a.graph.call_function(fake_quantize_per_expert, (
            scaled, counts, scale, zero_point, quant_min, quant_max, None, None, symmetric))
    copies[pair.b.node].replace_input_with(input_copy, requantized)
    for node in (factor, rows, scaled, scale, zero_point, requantized):
        node.meta[INSERTED_KEY] = "shadow"
    with gm_a.graph.inserting_before(weight_copy):
        if where_read:  # the float weight the copy quantized where read, divided and quantized where read
            weight = gm_a.graph.call_function(fake_quantize_divided_experts, (
                weight_copy.args[0], gm_a.graph.get_attr(f"{base}_factor"), gm_a.graph.get_attr(f"{base}_weight_scale"),
                gm_a.graph.get_attr(f"{base}_weight_zero_point"), *grouped.weight_range))
            for node in weight.all_input_nodes[1:]:
                node.meta[INSERTED_KEY] = "shadow"
        else:
            weight = gm_a.graph.get_attr(f"{base}_weight")
        _read_instead(gm_a, weight_copy, weight)
    if not input_copy.users:  # the model's input quantization, read no more
        for node in [input_copy, *input_copy.all_input_nodes]:
            if not node.users and node.op in ("call_function", "get_attr") and node is not counts:
                gm_a.graph.erase_node(node)
    grouped.comparator = ExpertsComparator(op_experts(grouped.op))
    attach_after(gm_a, result, f"{base}_compare", grouped.comparator, graph.references[pair.layer],
                 pair.a.node.args[1])
    for expert, variant in grouped.experts.items():
        variant.comparator = _ExpertVariantResult(grouped, expert)  # type: ignore[assignment]
    return ""
