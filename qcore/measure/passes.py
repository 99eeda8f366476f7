"""One calibration pass and one comparison pass that feed every measurement of a model.

- Calibration runs the prepared graph once over the batches. The quantizer's observers, the detectors'
  observers and the channel ranges that equalization and smoothing need all watch the same float activations.
- Comparison runs the float graph once per batch, carrying shadow copies of the quantized layers and of their
  equalized and smoothed variants, and the quantized graph once per batch for the propagated SQNR.

The equalization variants (qcore.measure.variants) are single layers re-run on their float input with the method
applied: a method's gain is measured on the layers concerned, with no second pass over the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from qcore.graph.capture import clone_graph_module
from qcore.graph.experts import Router, expert_layers, routers
from qcore.graph.grouped import find_grouped_ops
from qcore.graph.ops import QUANTIZED_WHERE_READ_KEY, find_quantizable_ops, weight_value
from qcore.measure.diagnose import ResolutionLimit, first_non_finite, outputs_agree, resolution_limits
from qcore.measure.probes import ChannelStatisticsProbe, DetectorProbe, Probe
from qcore.measure.screens import ObserversAhead, Screen, ScreenedLayers, quantize_for_screen
from qcore.measure.variants import (
    VariantSqnr,
    add_grouped_variant_shadow,
    add_variant_shadow,
    detector_channel_ranges,
    grouped_variants_of,
    kept_producer_outputs,
    make_variant_weights,
    plan_grouped_variants,
    plan_variants,
    produced_quantized,
    rewrite_scales,
    variant_batches,
    variant_results,
)
from qcore.numeric.compare import (
    ExtraShadows,
    KeptBudget,
    KeptFloatOutputs,
    KeptLayerInputs,
    KnownShadows,
    ShadowGraph,
    compare,
    compare_propagated_and_shadow,
)
from qcore.numeric.instrument import attach_after
from qcore.numeric.loggers import TopKAgreement
from qcore.numeric.logits import LogitsComparator, LogitsMeasurement
from qcore.numeric.matching import LayerPair, match_layers
from qcore.numeric.metrics import compared_by_rows, compute_sqnr, large_tensor_sqnr, read_to_host, rowwise_sqnr
from qcore.observe.qparams import (
    fake_quantize_finite_per_channel,
    fake_quantize_per_channel,
    fake_quantize_per_channel_steps,
    fake_quantize_per_tensor,
)
from qcore.observe.segmented import ExpertsQuantizedWhereRead, SegmentedPerChannelMinMaxObserver
from qcore.quantization.calibrate import CalibrationError, OutputSink, calibrate
from qcore.quantization.calibrated import CalibratedObservers
from qcore.quantization.convert import convert, fake_quantize_over_input, fake_quantize_where_read, restore_model_state
from qcore.quantization.prepare import prepare
from qcore.quantization.quantizer import Int8StaticQuantizer, Quantizer
from qcore.report.detectors import DetectorBase
from qcore.rewrites.equalize import (
    InputEqualizationObserver,
    input_channel_axis,
    weight_column_ranges_shared,
)
from qcore.rewrites.smoothing import group_observer, smoothing_groups
from qcore.runtime.collector import full_collections_deferred

__all__ = ["LAYER_KINDS", "FirstOutputs", "LayerSqnr", "ModelMeasurement", "OutputSqnr", "ProbedModel",
           "SqnrMeasurement", "VariantSqnr", "calibrate_and_convert", "compare_quantized", "diagnosed_calibration",
           "measure_model", "measure_sqnr", "sqnr_measurement", "weight_sqnrs"]


LAYER_KINDS = frozenset({"own", "propagated"})  # the per-layer SQNRs a measurement makes: shadow and propagated


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

    def by_own_error(self, names: Iterable[str]) -> list[str]:
        """`names` (layers), largest own error first: own (shadow) SQNR where measured, else the propagated SQNR;
        unmeasured last; the given order among equals."""
        def own(name: str) -> float:
            entry = self.layers.get(name)
            if entry is None:
                return math.inf
            value = entry.shadow_sqnr_db if not math.isnan(entry.shadow_sqnr_db) else entry.sqnr_db
            return math.inf if math.isnan(value) else value

        return sorted(names, key=own)


@dataclass(frozen=True)
class ModelMeasurement:
    """Everything one calibration pass and one comparison pass measured."""

    sqnr: SqnrMeasurement
    detector_reports: Mapping[str, dict[str, Any]]  # {detector key: {layer: raw detector entry}}
    variants: Mapping[str, Mapping[str, VariantSqnr]]  # {layer: {method: VariantSqnr}}
    unmeasured: Mapping[str, str]  # {layer: why its variants could not be measured}
    smoothing: Mapping[str, Mapping[str, Any]]  # {layer: {"alpha", "producer", "producer_name"} | {"refused": why}}
    logits: LogitsMeasurement = LogitsMeasurement(reason="not measured (measure_model(..., logits=True))")
    # whether the float outputs of batch 0 in calibration and in comparison agree (None: not both were run)
    first_outputs_agree: bool | None = None
    # {(method, layer): (alpha, s)}: the scales an equalize/smooth rewrite of the same graph and batches would use
    rewrite_scales: Mapping[tuple[str, str], tuple[float | None, torch.Tensor]] = dataclasses.field(
        default_factory=dict)
    screens: Mapping[str, ScreenedLayers] = dataclasses.field(default_factory=dict)  # {screen name: what it measured}
    # {MoE block: {"agreement", "tokens"}}: the share of tokens whose top-k experts the quantized router keeps
    routing: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)


@full_collections_deferred()  # its graphs all live until it returns
def measure_model(float_gm: fx.GraphModule, batches: Iterable[Any], quantizer: Quantizer | None = None, *,
                  propagate: bool = True, detectors: Mapping[str, DetectorBase] | None = None,
                  equalization_layers: Iterable[str] = (), smoothing: float | str | None = None,
                  logits: bool = False, observers: CalibratedObservers | None = None,
                  layers: Collection[str] | None = None, screens: Sequence[Screen] = (),
                  layer_kinds: Collection[str] = LAYER_KINDS, float_outputs: Sequence[Any] | None = None,
                  keep_float_outputs: KeptFloatOutputs | None = None,
                  known_shadows: KnownShadows | None = None, layer_inputs: KeptLayerInputs | None = None,
                  keep_layer_inputs: KeptLayerInputs | None = None,
                  kept_budget: KeptBudget | None = None) -> ModelMeasurement:
    """Quantize a copy of `float_gm` on `batches` and measure it in one calibration and one comparison pass:
    per-layer and output SQNR (propagate=False: shadow SQNR only), the detectors' reports, the input-weight
    equalization variant of `equalization_layers`, the smoothing variant (alpha, or "search") of every
    smoothable layer, and with `logits` the output logits' KL, top-1 agreement and perplexity. `observers`: the
    activation observers calibrated earlier on this graph and these batches; those it holds are not calibrated
    again (no calibration pass when it holds them all), and the others are added to it. `layers`, when given, are
    the only layers measured (a fix trial's: the outputs are always measured). `screens` measure their fixes on
    the layers the detectors' reports name for them (qcore.measure.screens), in the same comparison pass.
    `layer_kinds` are the per-layer SQNRs measured ("own": shadow, "propagated"; the others are nan): a trial
    measures those it reads. `float_outputs`, `keep_float_outputs`, `known_shadows` (from the screens of an
    earlier measurement of the same float graph: ScreenedLayers.shadows), `layer_inputs` and `keep_layer_inputs`
    (the float inputs of the screened layers) are compare_propagated_and_shadow's; what a trial's calibration pass
    keeps for its comparison counts against `kept_budget` (shared with what the model's comparison pass kept)."""
    batches = list(batches)
    kept = observers if observers is not None else CalibratedObservers()
    ahead = ObserversAhead(float_gm, quantizer or Int8StaticQuantizer(), screens, kept)
    probed = ProbedModel(float_gm, quantizer, detectors, equalization_layers, smoothing,
                         ahead if ahead.screens else None, recompile=False)  # generated below if it runs
    planned: list[Any] = []
    first_outputs = FirstOutputs(float_gm)  # two float runs of batch 0 from the same state: they must agree
    signatures = observers.signatures(probed.prepared) if observers is not None else {}
    still_to_calibrate = observers.take(probed.prepared, signatures) if observers is not None else None

    def read() -> None:
        planned.extend(probed.read())
        if observers is not None:
            observers.keep(probed.prepared, signatures)

    # compare_quantized adds its comparators to quant_gm and generates its code once, below
    if still_to_calibrate == [] and not probed.probes:  # every observer's state is known: nothing to watch
        read()
        quant_gm = convert(probed.prepared, keep_float_weights=False, recompile=False)
    else:
        # a pass that measures some layers only (a trial's) takes the float outputs and those layers' float inputs
        # from its calibration pass, whose observers change no value: its comparison then runs only the rest
        calibration_outputs = KeptFloatOutputs(budget=kept_budget) if layers is not None and float_outputs is None \
            else None
        calibration_inputs = KeptLayerInputs(budget=kept_budget) if calibration_outputs is not None else None
        if calibration_inputs is not None:
            focus = set(layers or ())
            calibration_inputs.watch(probed.prepared, [
                op for op in find_quantizable_ops(float_gm, grouped=True)
                if op.layer in focus or not focus.isdisjoint(op.expert_layers)], outputs=True)
        probed.prepared.recompile()

        def read_and_unwatch() -> None:
            if calibration_inputs is not None:
                calibration_inputs.unwatch(probed.prepared)  # convert generates the code once for all
            read()

        quant_gm = calibrate_and_convert(probed.prepared, float_gm, batches, read_and_unwatch,
                                         keep_float_weights=False, keep_first_output=first_outputs, recompile=False,
                                         every_output=calibration_outputs)
        if calibration_outputs is not None and calibration_outputs.outputs is not None and \
                len(calibration_outputs.outputs) == len(batches):
            float_outputs, layer_inputs = calibration_outputs.outputs, calibration_inputs
    variants, unmeasured, smoothed = planned
    restore_model_state(quant_gm, float_gm)  # calibration ran forward, which may update buffers in place
    screened = _screen_copies(float_gm, batches, quantizer, screens, probed.detector_reports, kept, quant_gm)
    comparator = (LogitsComparator() if logits else None) if propagate else None
    every = None if layers is None else set(layers)
    routing: dict[str, Any] = {}
    sqnr, baselines = compare_quantized(float_gm, quant_gm, batches, variants, unmeasured, propagate=propagate,
                                        logits=comparator, keep_first_output=first_outputs, layers=layers,
                                        extra_shadows=[extra for _, _, extra in screened],
                                        shadowed_layers=every if "own" in layer_kinds else set(),
                                        propagated_layers=every if "propagated" in layer_kinds else set(),
                                        float_outputs=float_outputs, keep_float_outputs=keep_float_outputs,
                                        known_shadows=known_shadows, layer_inputs=layer_inputs,
                                        keep_layer_inputs=keep_layer_inputs, routing=routing)
    compared = comparator.result() if comparator is not None else ModelMeasurement.logits
    screen_results = {name: ScreenedLayers(changes, {layer: float(extra.results[layer]["sqnr_db"])
                                                     for layer in changes if layer in extra.results},
                                           {layer: (extra.signatures.get(layer), extra.results[layer])
                                            for layer in changes if layer in extra.results})
                      for name, changes, extra in screened}
    return ModelMeasurement(sqnr, probed.detector_reports, variant_results(variants, baselines, unmeasured),
                            unmeasured, smoothed, compared, first_outputs.agree, rewrite_scales(variants),
                            screen_results, routing=routing)


class FirstOutputs:
    """Collects the float outputs of batch 0 in the calibration and in the comparison pass (`append`, as a list
    would): compared as soon as the second is made, then let go, so that an LM's logits are not held through the
    comparison pass. `agree` is None until both were made."""

    def __init__(self, float_gm: fx.GraphModule) -> None:
        self.float_gm = float_gm
        self.agree: bool | None = None
        self._first: Any = None
        self._count = 0

    def append(self, output: Any) -> None:
        """Keep the first output; compare the second with it."""
        self._count += 1
        if self._count == 1:
            self._first = output
        elif self._count == 2:
            self.agree = outputs_agree(self.float_gm, self._first, output)
            self._first = None


def _screen_copies(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer | None,
                   screens: Sequence[Screen], reports: Mapping[str, dict[str, Any]],
                   kept: CalibratedObservers, quant_gm: fx.GraphModule
                   ) -> list[tuple[str, dict[str, Any], ExtraShadows]]:
    """(screen name, {layer: change}, its quantized copy to shadow) of each screen that names layers; a copy shares
    the weights `quant_gm` (the model's) quantized as it does."""
    found = []
    projection_of = {layer: op.layer for op in find_grouped_ops(float_gm) for layer in op.layers}
    for screen in screens:
        try:
            changes = {layer: dict(change) for layer, change in screen.candidates(reports).items()}
            if changes:
                # a grouped projection's copy takes every change the screen may make to its experts: its observers
                # of every expert are then those the calibration pass ran ahead (ObserversAhead), and each changed
                # expert's shadow is what it is alone (an expert's quantization reads its own rows only)
                touched = {projection_of[layer] for layer in changes if layer in projection_of}
                copied = {**{layer: dict(change) for layer, change in screen.ahead.items()
                             if projection_of.get(layer) in touched}, **changes}
                quantized = quantize_for_screen(float_gm, batches, quantizer or Int8StaticQuantizer(), copied, kept,
                                                quant_gm)
                found.append((screen.name, changes, ExtraShadows(quantized, set(changes))))
        except Exception:  # noqa: BLE001 - a screen only saves a trial: its advice then runs the trial, which reports
            continue
    return found


class ProbedModel:
    """A prepared copy of a float graph with the detectors' observers and the channel statistics that the
    equalization and smoothing variants need, all watching one calibration pass (`prepared`); `read()` after it."""

    def __init__(self, float_gm: fx.GraphModule, quantizer: Quantizer | None,
                 detectors: Mapping[str, DetectorBase] | None, equalization_layers: Iterable[str],
                 smoothing: float | str | None, ahead: Probe | None = None, recompile: bool = True) -> None:
        """recompile=False leaves `prepared`'s code generation to a caller that may never run it."""
        self.float_gm, self.smoothing = float_gm, smoothing
        self.equalization_layers = list(equalization_layers)
        # one code generation for the quantizer's, the detectors' and the statistics' observers: below
        prepared = prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False),
                           quantizer or Int8StaticQuantizer(), recompile=False)
        self.detector_probe = DetectorProbe(detectors) if detectors else None
        if self.detector_probe is not None:
            self.detector_probe.attach(prepared)
        self.ops = {op.layer: op for op in find_quantizable_ops(prepared)}
        self.statistics: list[ChannelStatisticsProbe] = []
        for index, layer in enumerate(self.equalization_layers):
            op = self.ops.get(layer)
            if op is None or not op.activation_inputs:
                continue
            shared = detector_channel_ranges(prepared, op, detectors or {})
            if shared is not None:  # the input-weight equalization detector already watches these channel ranges
                self.statistics.append(ChannelStatisticsProbe("input_weight", op, shared))
                continue
            self.statistics.append(ChannelStatisticsProbe("input_weight", op, InputEqualizationObserver(
                ch_axis=input_channel_axis(op)), op.activation_inputs[0], f"qcore_eq_stats_{index}"))
            self.statistics[-1].attach(prepared)
        wanted = set(self.equalization_layers)
        for op in find_quantizable_ops(prepared, grouped=True):  # a grouped projection's experts: one probe
            experts = [expert for expert, layer in enumerate(op.expert_layers) if layer in wanted]
            if op.kind != "grouped_linear" or not experts:
                continue
            counts = op.node.args[1]
            self.statistics.append(ChannelStatisticsProbe(
                "grouped_input_weight", (op, experts), SegmentedPerChannelMinMaxObserver(len(op.expert_layers)),
                op.activation_inputs[0], f"qcore_eq_grouped_stats_{len(self.statistics)}", (counts,)))
            self.statistics[-1].attach(prepared)
        groups, self.refused = smoothing_groups(float_gm) if smoothing is not None else ([], {})
        nodes = {node.name: node for node in prepared.graph.nodes}
        for index, group in enumerate(groups):
            self.statistics.append(ChannelStatisticsProbe("smoothing", group, group_observer(
                float_gm, group, keep_first=smoothing == "search"), nodes[group.input_node.name],
                f"qcore_smooth_stats_{index}"))
            self.statistics[-1].attach(prepared)
        self.ahead = ahead  # the screens' observers (qcore.measure.screens.ObserversAhead)
        if ahead is not None:
            ahead.attach(prepared)
        if recompile:
            prepared.recompile()
        self.prepared = prepared
        self.probes: list[Probe] = [*self.statistics, *([self.detector_probe] if self.detector_probe else []),
                                    *([ahead] if ahead is not None else [])]

    @weight_column_ranges_shared()  # the detectors' reports and the variants' plan read the same weights
    def read(self) -> tuple[list[Any], dict[str, str], dict[str, dict[str, Any]]]:
        """After calibration: read and remove the probes; (variants to measure, {layer: why not}, smoothing)."""
        if self.ahead is not None:  # its observers are not the variants' to see
            self.ahead.read(self.prepared)
            self.ahead.detach(self.prepared)
            self.probes.remove(self.ahead)
        for probe in self.probes:
            probe.read(self.prepared)
        variants, unmeasured, smoothed = plan_variants(
            self.prepared, self.ops, [probe for probe in self.statistics if probe.kind != "grouped_input_weight"],
            self.smoothing, kept_producer_outputs(self.float_gm, self.prepared, self.equalization_layers))
        for probe in self.statistics:
            if probe.kind == "grouped_input_weight":
                op, experts = probe.key
                found, why = plan_grouped_variants(self.prepared, op, experts, probe.observer,
                                                   produced_quantized(self.prepared, op))
                variants.extend(found)
                unmeasured.update(why)
        for probe in self.probes:  # convert recompiles the graph once for all
            probe.detach(self.prepared)
        smoothed.update({layer: {"refused": reason} for layer, reason in self.refused.items()})
        return variants, unmeasured, smoothed

    @property
    def detector_reports(self) -> dict[str, dict[str, Any]]:
        """{detector key: {layer: raw detector entry}} once read."""
        return self.detector_probe.reports if self.detector_probe is not None else {}


def compare_quantized(float_gm: fx.GraphModule, quant_gm: fx.GraphModule, batches: list[Any], variants: list[Any],
                      unmeasured: dict[str, str], *, propagate: bool = True, logits: LogitsComparator | None = None,
                      keep_first_output: OutputSink | None = None, quant_batches: list | None = None,
                      streams: list | None = None, layers: Collection[str] | None = None,
                      extra_shadows: Sequence[ExtraShadows] = (), shadowed_layers: Collection[str] | None = None,
                      propagated_layers: Collection[str] | None = None, float_outputs: Sequence[Any] | None = None,
                      keep_float_outputs: KeptFloatOutputs | None = None,
                      known_shadows: KnownShadows | None = None, layer_inputs: KeptLayerInputs | None = None,
                      keep_layer_inputs: KeptLayerInputs | None = None, routing: dict[str, Any] | None = None
                      ) -> tuple[SqnrMeasurement, dict[str, dict]]:
    """The comparison pass of a converted graph (instrumented in place) against its float graph, with the shadows
    of the `variants` of its layers: (SQNR, {layer: its shadow result over the variants' batches}). `routing`, when
    given, gets each MoE block's routing agreement ({block: TopKAgreement.result()}) when every layer is compared.
    The other keywords are compare_propagated_and_shadow's."""
    limits = resolution_limits(quant_gm)
    weights = weight_sqnrs(float_gm, quant_gm, layers)
    own_layers = {op.layer for op in find_quantizable_ops(float_gm)}
    # an expert runs on the tokens routed to it, which differ between the two models once a router's choice flips:
    # its error is measured on the float model's tokens (its shadow), the flips by routing agreement
    routed = set(expert_layers(float_gm))
    if routed and propagate:
        wanted = own_layers if propagated_layers is None else set(propagated_layers)
        routed = routed & wanted
        propagated_layers = [layer for layer in wanted if layer not in routed]
        if shadowed_layers is not None:
            shadowed_layers = set(shadowed_layers) | routed
    # a grouped capture's projections: measured on the float model's tokens too, a shadow record per expert
    grouped = [op for op in find_grouped_ops(float_gm)
               if layers is None or op.layer in layers or any(layer in layers for layer in op.layers)]
    if grouped and shadowed_layers is not None:
        shadowed_layers = set(shadowed_layers) | {op.layer for op in grouped}
    experts_of = {layer: op for op in find_grouped_ops(float_gm) for layer in op.layers}
    here = [v for v in variants if v.layer in own_layers or v.layer in experts_of]
    baselines: dict[str, dict[str, Any]] = {}

    def instrument(graph: ShadowGraph) -> Callable[[], None]:
        by_layer = {pair.layer: pair for pair in graph.pairs}
        measured = [v for v in here if v.layer in by_layer]
        make_variant_weights(measured)
        for index, variant in enumerate(measured):
            reason = add_variant_shadow(graph, by_layer[variant.layer], variant, index)
            if reason:
                unmeasured.setdefault(variant.layer, reason)
        grouped = [g for g in grouped_variants_of(here) if g.op.layer in by_layer]
        for index, variants_of_op in enumerate(grouped):
            reason = add_grouped_variant_shadow(graph, by_layer[variants_of_op.op.layer], variants_of_op, index)
            for variant in variants_of_op.experts.values() if reason else ():
                unmeasured.setdefault(variant.layer, reason)

        def read() -> None:  # the unequalized layer's own SQNR over the same batches as its variants
            baselines.update({v.layer: graph.shadows[v.layer].result() for v in measured})
            for variants_of_op in grouped:
                results = graph.shadows[variants_of_op.op.layer].results()  # each expert's (ExpertsComparator)
                baselines.update({v.layer: results[expert] for expert, v in variants_of_op.experts.items()})
        return read

    agreements: dict[str, TopKAgreement] = {}

    def watch_routers(graph: ShadowGraph) -> None:
        agreements.update(watch_router_choices(graph, routers(float_gm)))

    propagated, shadow_records = compare_propagated_and_shadow(
        float_gm, quant_gm, batches, own_quant_model=True, propagate=propagate, instrument=instrument if here
        else None, instrument_batches=variant_batches(len(batches)), keep_first_output=keep_first_output,
        logits=logits, quant_batches=quant_batches, streams=streams, layers=layers, extra_shadows=extra_shadows,
        shadowed_layers=shadowed_layers, propagated_layers=propagated_layers, float_outputs=float_outputs,
        keep_float_outputs=keep_float_outputs, known_shadows=known_shadows, layer_inputs=layer_inputs,
        keep_layer_inputs=keep_layer_inputs, watch=watch_routers if (routed or grouped) and layers is None else None)
    if routing is not None:
        routing.update({block: agreement.result() for block, agreement in agreements.items()})
    shadows = {r["layer"]: r for r in shadow_records}
    records = propagated if propagate else shadow_records
    if routed and propagate:
        records = [*records, *(shadows[layer] for layer in sorted(routed & shadows.keys()))]
    if grouped and propagate:
        records = [*records, *(shadows[layer] for op in grouped for layer in op.layers if layer in shadows)]
    return sqnr_measurement(records, shadows, weights, limits), baselines


def calibrate_and_convert(prepared: fx.GraphModule, float_gm: fx.GraphModule, batches: list[Any],
                          before_convert: Callable[[], None] | None = None, keep_float_weights: bool = True,
                          keep_first_output: OutputSink | None = None, recompile: bool = True,
                          every_output: OutputSink | None = None) -> fx.GraphModule:
    """Calibrate `prepared` and convert it (in place); a failure caused by NaN or inf in the float model says where
    they appear. `before_convert` runs between the two (to read and remove other observers); recompile=False
    leaves the converted graph's code generation to the caller (see convert). `every_output` gets the output of
    every calibration batch (the float graph's: observers change no value)."""
    with diagnosed_calibration(float_gm, batches):
        calibrate(prepared, batches, keep_first_output, every_output=every_output)
        if before_convert is not None:
            before_convert()
        return convert(prepared, keep_float_weights, recompile=recompile)


@contextlib.contextmanager
def diagnosed_calibration(float_gm: fx.GraphModule, batches: list[Any]) -> Iterator[None]:
    """Re-raise a failure of calibration or conversion caused by NaN or inf in the float model as a
    CalibrationError that says where they appear."""
    try:
        yield
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


def weight_sqnrs(float_gm: fx.GraphModule, quant_gm: fx.GraphModule, layers: Collection[str] | None = None
                 ) -> dict[str, float]:
    """{layer: SQNR of its quantized weight against the float one}, one layer's weights at a time (a weight kept
    as codes is dequantized for its own comparison only); the SQNRs of the weights compared whole are read to the
    host together, not one wait per layer. `layers`, when given, are the only layers compared (a fix trial's, whose
    measurement holds no others)."""
    found: dict[str, float] = {}
    on_device: list[tuple[LayerPair, torch.Tensor]] = []
    for pair in match_layers(float_gm, quant_gm):
        wanted = layers is None or pair.layer in layers or any(layer in layers for layer in pair.a.expert_layers)
        if pair.a.weight is None or pair.b.weight is None or not wanted:
            continue
        original = weight_value(float_gm, pair.a.weight).detach()
        if pair.a.kind == "grouped_linear":  # [E, out, in]: each expert's weight against its quantized copy
            quantized = _quantized_weight_value(quant_gm, pair.b.weight, pair.a.weight, original)
            # quantized where read: one expert's weight at a time, not the whole projection's
            by_expert = (quantized.expert(index) for index in range(len(pair.a.expert_layers))) if isinstance(
                quantized, ExpertsQuantizedWhereRead) else quantized.detach()
            for layer, expert, expert_quantized in zip(pair.a.expert_layers, original, by_expert, strict=True):
                found[layer] = _exact_or_sqnr(expert, expert_quantized)
            del original, quantized
            continue
        rows = _quantized_weight_rows(quant_gm, pair.b.weight, pair.a.weight, original)
        if rows is not None:
            found[pair.layer] = rowwise_sqnr(original, rows)
            del original
            continue
        quantized = _quantized_weight_value(quant_gm, pair.b.weight, pair.a.weight, original).detach()
        if compared_by_rows(original):
            found[pair.layer] = _exact_or_sqnr(original, quantized)
        else:
            found[pair.layer] = math.nan  # its place in graph order; read below
            on_device.append((pair, compute_sqnr(original, quantized)))
        del original, quantized
    if on_device:
        for (pair, _), value in zip(on_device, read_to_host([value for _, value in on_device])):
            if math.isnan(value):  # 0/0 or a NaN: made again, to tell an exact copy (an all-zero weight, say)
                original = weight_value(float_gm, pair.a.weight).detach()
                value = _exact_or_sqnr(original, _quantized_weight_value(quant_gm, pair.b.weight, pair.a.weight,
                                                                         original).detach())
            found[pair.layer] = value
    return found


def _exact_or_sqnr(original: torch.Tensor, quantized: torch.Tensor) -> float:
    """The SQNR of a quantized weight; an exact reconstruction is inf, as for activations, not 0/0 = nan."""
    return math.inf if bool(torch.equal(original, quantized)) else large_tensor_sqnr(original, quantized)


def _reads_float_weight(node: fx.Node, float_node: fx.Node) -> bool:
    """Whether `node` quantizes, where it is read, the float weight `float_node` reads in the float graph."""
    source = node.args[0] if node.meta.get(QUANTIZED_WHERE_READ_KEY) and node.args else None
    # the quantized graph is a copy of the float one: the same attribute path, or the same rewrite of it
    return isinstance(source, fx.Node) and source.op == float_node.op and source.target == float_node.target


def _quantized_weight_rows(quant_gm: fx.GraphModule, node: fx.Node, float_node: fx.Node, original: torch.Tensor
                           ) -> Callable[[slice], torch.Tensor] | None:
    """rows -> those rows of a large weight quantized where it is read, per tensor or per output channel (the
    quantization of a row depends on that row alone); None for any other weight."""
    if not compared_by_rows(original) or not _reads_float_weight(node, float_node):
        return None
    rest = [weight_value(quant_gm, a) if isinstance(a, fx.Node) else a for a in node.args[1:]]
    if node.target is fake_quantize_per_tensor:
        return lambda part: fake_quantize_per_tensor(original[part], *rest)
    per_channel = (fake_quantize_per_channel, fake_quantize_where_read, fake_quantize_over_input)
    if node.target in per_channel and rest[2] % original.dim() == 0:
        scale, zero_point, _, quant_min, quant_max = rest
        # each part lives for its comparison alone: a reused buffer, not fresh pages for every part of every layer
        return lambda part: fake_quantize_per_channel(original[part], scale[part], zero_point[part], 0, quant_min,
                                                      quant_max, reuse_output=True)
    if node.target is fake_quantize_finite_per_channel and rest[2] % original.dim() == 0:
        scale, zero_point, _, quant_min, quant_max = rest
        return lambda part: fake_quantize_finite_per_channel(original[part], scale[part], zero_point[part], 0,
                                                             quant_min, quant_max)
    if node.target is fake_quantize_per_channel_steps and rest[3] % original.dim() == 0:
        scale, inverse, zero_point, _, quant_min, quant_max, _ = rest
        return lambda part: fake_quantize_per_channel_steps(
            original[part], scale[part], inverse[part], None if zero_point is None else zero_point[part], 0,
            quant_min, quant_max)
    return None


def _quantized_weight_value(quant_gm: fx.GraphModule, node: fx.Node, float_node: fx.Node, original: torch.Tensor
                            ) -> torch.Tensor:
    """The quantized weight `node` reads; one quantized where it is read from the same float weight as `float_node`
    is computed from `original` (that float weight, already made: a rewritten LM head is not made twice)."""
    if not _reads_float_weight(node, float_node):
        return weight_value(quant_gm, node)
    rest = [weight_value(quant_gm, a) if isinstance(a, fx.Node) else a for a in node.args[1:]]
    # which writes over `original`: give it a copy
    over_input = node.target is fake_quantize_over_input or (node.target is fake_quantize_per_channel_steps
                                                            and bool(rest[-1]))
    return node.target(original.clone() if over_input else original, *rest)


def sqnr_measurement(records: list[dict], shadows: dict[str, dict], weights: Mapping[str, float],
                      limits: dict[str, tuple[ResolutionLimit, ...]]) -> SqnrMeasurement:
    """Typed records from the numeric suite's propagated (or shadow) records, shadow records and weight SQNRs."""
    layers: dict[str, LayerSqnr] = {}
    outputs: dict[str, OutputSqnr] = {}
    for record in records:
        if record["op"] == "output":
            outputs[record["layer"]] = OutputSqnr(record["layer"], float(record["sqnr_db"]), float(record["cosine"]),
                                                  float(record["normalized_l2"]))
            continue
        weight_db = weights.get(record["layer"])
        shadow = shadows.get(record["layer"], {}).get("sqnr_db", math.nan)
        layers[record["layer"]] = LayerSqnr(
            layer=record["layer"], fqn=record["fqn"], op=record["op"], sqnr_db=float(record["sqnr_db"]),
            shadow_sqnr_db=float(shadow), normalized_l2=float(record["normalized_l2"]),
            cosine=float(record["cosine"]), batches=int(record["batches"]), weight_sqnr_db=weight_db,
            below_resolution=limits.get(record["layer"], ()))
    return SqnrMeasurement(layers, outputs)


def measure_sqnr(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer | None = None, *,
                 shadow: bool = True) -> SqnrMeasurement:
    """Quantize a copy of `float_gm` on `batches`, then compare it with the float graph. shadow=False skips the
    shadow pass (each layer fed float inputs): shadow_sqnr_db is then nan."""
    if shadow:
        return measure_model(float_gm, batches, quantizer).sqnr
    prepared = prepare(clone_graph_module(float_gm, share_parameters=True), quantizer or Int8StaticQuantizer())
    quant_gm = calibrate_and_convert(prepared, float_gm, batches)
    restore_model_state(quant_gm, float_gm)  # calibration ran forward, which may update buffers in place
    weights = weight_sqnrs(float_gm, quant_gm)
    return sqnr_measurement(compare(float_gm, quant_gm, batches, propagate=True), {}, weights,
                            resolution_limits(quant_gm))


def watch_router_choices(graph: ShadowGraph, found: Mapping[str, Router]) -> dict[str, TopKAgreement]:
    """Add a TopKAgreement after each router's shadow (the quantized router on the float block input), against the
    float router's output: {block: its agreement}."""
    if not found:
        return {}
    modules = dict(graph.gm.named_modules())
    comparators = {id(modules[str(node.target)]): node for node in graph.gm.graph.nodes
                   if node.op == "call_module" and str(node.target) in modules}
    agreements = {}
    for index, (block, router) in enumerate(sorted(found.items())):
        shadow = graph.shadows.get(router.layer)
        node = comparators.get(id(shadow)) if shadow is not None else None
        if node is None:
            continue
        agreement = TopKAgreement(router.experts, router.top_k)
        attach_after(graph.gm, node.args[0], f"qcore_routing_{index}", agreement, node.args[1])
        agreements[block] = agreement
    return agreements
