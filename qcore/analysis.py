"""One analysis of a model: capture once, annotate once, measure on shared calibration batches.

`ModelAnalysis` is the plain (pytest-free) entry point behind every quality check: it lists the layers a
quantizer quantizes (no data needed), then measures lazily and at most once each: SQNR of the quantized
model (per layer, per weight, per output), ModelReport detector statistics, and input-weight
equalization (gain per layer, float equivalence). Results are typed records of builtins.
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qcore.artifact import (
    ArtifactAnalysis,
    ArtifactError,
    ArtifactFix,
    ArtifactGroup,
    ArtifactMismatchError,
    BlockwiseArtifactError,
    tool_recipes,
)
from qcore.graph.capture import capture, clone_graph_module, experts_grouped, experts_grouping, graph_view
from qcore.graph.deferred import deferred_parameters, materialized, read_rewritten_where_used
from qcore.graph.experts import (
    ExpertLayer,
    MoeBlock,
    Router,
    compact_expert_layers,
    expert_layers,
    fused_experts_modules,
    moe_blocks,
    routers,
)
from qcore.graph.inputs import call_model, move_to
from qcore.graph.ops import (
    QuantizableOp,
    expert_views,
    find_quantizable_ops,
    last_layers,
    layer_places,
    matches_layer,
)
from qcore.graph.rewritable import equalization_refusal
from qcore.measure.blockwise import BlockwiseError, split_into_blocks
from qcore.measure.diagnose import (
    Nondeterminism,
    NonDeterministicModelError,
    describe_outputs,
    first_nondeterministic,
)
from qcore.measure.passes import (
    LAYER_KINDS,
    LayerSqnr,
    ModelMeasurement,
    OutputSqnr,
    SqnrMeasurement,
    VariantSqnr,
    measure_model,
    measure_sqnr,
)
from qcore.measure.screens import Screen, ScreenedLayers
from qcore.measure.variants import NO_TOKEN_REASON, variant_batches
from qcore.numeric.compare import KeptBudget, KeptFloatOutputs, KeptLayerInputs
from qcore.numeric.logits import LogitsComparator, LogitsMeasurement
from qcore.quantization.calibrate import calibrate, model_device
from qcore.quantization.calibrated import CalibratedObservers
from qcore.quantization.convert import quantize_weights_where_read, weights_quantized_where_read
from qcore.quantization.format_quantizer import FORMAT_REFUSAL_KEY
from qcore.quantization.quantizer import ANNOTATION_KEY, Int8StaticQuantizer, Quantizer, with_layer_overrides
from qcore.report import ModelReport
from qcore.report.detectors import DetectorBase
from qcore.rewrites.equalize import cross_layer_equalize, equalize, resolve_layers
from qcore.rewrites.smoothing import smooth, smoothing_alpha
from qcore.runtime.collector import full_collections_deferred
from qcore.runtime.progress import (
    FixBudgetUse,
    StageTimes,
    fix_budget_use,
    stage,
    tracked,
    trial_step,
    trials_allowed,
)
from qcore.search.sensitivity import with_float_layers

__all__ = ["LAYER_KINDS", "MEASUREMENTS", "NO_TOKEN_REASON", "AnalysisPlan", "ArtifactAnalysis", "ArtifactError",
           "ArtifactFix", "ArtifactGroup", "ArtifactMismatchError", "BlockwiseArtifactError", "BlockwiseError",
           "BlockwiseUnsupported", "ExpertLayer", "FixBudgetUse", "MoeBlock", "Router", "LayerSqnr", "ModelAnalysis",
           "OutputSqnr", "QuantizedLayer", "CapturedModel", "Screen", "SqnrMeasurement", "StageTimes", "VariantSqnr",
           "analyze_model", "calibration_digest", "capture_for_analysis", "compact_expert_layers", "describe",
           "expert_views", "experts_grouped", "groups_experts", "takes_grouped_capture",
           "fix_budget_use", "matches_layer", "measure_sqnr", "model_device", "move_to", "quantize_weights_where_read",
           "quantized_layers", "smoothing_alpha", "split_into_blocks", "stage", "tool_recipes", "tracked",
           "trial_step", "trials_allowed", "variant_batches", "with_float_layers", "with_layer_overrides"]
# the plugin reads qcore through this module, qcore itself, qcore.report and qcore.numeric only (an import-linter
# contract): the names above that live deeper are re-exported for it

FLOAT_LAYERS_CANDIDATES = 8  # the layers a float_layers search screens (ModelAnalysis.fix_candidates)
_DIGEST_COPY_BYTES = 64 << 20  # calibration_digest copies batches on an accelerator to the host this much at a time


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
    format: str = "int8"  # the deployed format of a FormatQuantizer's layer (qcore.formats.presets), else "int8"
    format_refusal: str = ""  # why the layer's shapes cannot take its format (it then stays in float)


def quantized_layers(float_gm: fx.GraphModule, quantizer: Quantizer | None = None) -> list[QuantizedLayer]:
    """The layers `quantizer` quantizes, in graph order, from one annotation of a copy. No calibration."""
    annotated = graph_view(float_gm)  # read, never run
    (quantizer or Int8StaticQuantizer()).annotate(annotated)
    layers: list[QuantizedLayer] = []
    layer_preset = getattr(quantizer, "layer_preset", None)
    ops = find_quantizable_ops(annotated, grouped=True)
    for op in ops:
        if op.kind == "grouped_linear":
            layers.extend(_grouped_quantized_layers(op, layer_preset))
            continue
        annotation = op.node.meta.get(ANNOTATION_KEY)
        specs = annotation.input_qspec_map if annotation is not None else {}
        format_refusal = str(op.node.meta.get(FORMAT_REFUSAL_KEY, ""))
        if format_refusal:  # listed, so that its items can say why it is not quantized
            layers.append(QuantizedLayer(layer=op.layer, fqn=op.fqn, op=op.kind, weighted=op.weight is not None,
                                         per_channel=False, dynamic=False, clipping=False, equalizable=False,
                                         format=format_refusal.split(":")[0], format_refusal=format_refusal))
            continue
        if not specs:
            continue
        weight = specs.get(op.weight) if op.weight is not None else None
        activation = next((specs[a] for a in op.activation_inputs if a in specs), None)
        chosen = layer_preset(op.fqn, op.layer, op.item) if layer_preset is not None else None
        # equalization's gains are measured with int8 observers: a layer in a deployed format is no candidate
        candidate = op.kind in ("linear", "conv") and op.weight is not None and chosen is None
        refusal = equalization_refusal(annotated, op) if candidate else ""
        layers.append(QuantizedLayer(
            layer=op.layer, fqn=op.fqn, op=op.kind, weighted=weight is not None,
            per_channel=bool(getattr(weight, "per_channel", False)),
            dynamic=bool(getattr(activation, "is_dynamic", False)),
            clipping=bool(getattr(activation, "clips_outliers", False)),
            equalizable=candidate and not refusal, equalization_refusal=refusal if candidate else "",
            format=chosen.name if chosen is not None else "int8"))
    places = layer_places(ops)  # a grouped capture's experts as the per-expert graph orders them
    return sorted(layers, key=lambda entry: places[entry.layer])


def _grouped_quantized_layers(op: QuantizableOp, layer_preset: Any) -> list[QuantizedLayer]:
    """Each expert of an annotated grouped projection as the QuantizedLayer its Linear is on the per-expert graph:
    the experts its specs leave in float are left out, those made dynamic say so."""
    annotation = op.node.meta.get(ANNOTATION_KEY)
    specs = annotation.input_qspec_map if annotation is not None else {}
    format_refusal = str(op.node.meta.get(FORMAT_REFUSAL_KEY, ""))
    weight = specs.get(op.weight) if op.weight is not None else None
    activation = next((specs[a] for a in op.activation_inputs if a in specs), None)
    if not format_refusal and weight is None and activation is None:
        return []
    kept_float = set(getattr(weight if weight is not None else activation, "float_experts", ()))
    dynamic = set(getattr(activation, "dynamic_experts", ()))
    observers = getattr(getattr(activation, "observer_or_fake_quant_ctr", None), "classes", None)
    layers = []
    for expert, layer in enumerate(op.expert_layers):
        if format_refusal:  # listed, so that its items can say why it is not quantized
            layers.append(QuantizedLayer(layer=layer, fqn=layer, op="linear", weighted=True, per_channel=False,
                                         dynamic=False, clipping=False, equalizable=False,
                                         format=format_refusal.split(":")[0], format_refusal=format_refusal))
            continue
        if expert in kept_float:
            continue
        chosen = layer_preset(layer, layer, op.item) if layer_preset is not None else None
        clipping = bool(getattr(observers[expert], "clips_outliers", False)) if observers is not None else \
            bool(getattr(activation, "clips_outliers", False))
        layers.append(QuantizedLayer(
            layer=layer, fqn=layer, op="linear", weighted=weight is not None,
            per_channel=bool(getattr(weight, "per_channel", False)), dynamic=expert in dynamic, clipping=clipping,
            equalizable=chosen is None, format=chosen.name if chosen is not None else "int8"))
    return layers


def _max_relative_error(reference: fx.GraphModule, candidate: fx.GraphModule, batches: list) -> float:
    """max |candidate - reference| / max |reference| over every floating output tensor and batch (NaN when an
    output is NaN); read back once, not per batch."""
    device, errors = model_device(reference), []
    with torch.no_grad():
        for batch in batches:
            batch = move_to(batch, device)
            expected = pytree.tree_leaves(call_model(reference, batch))
            for a, b in zip(expected, pytree.tree_leaves(call_model(candidate, batch))):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    scale = a.abs().max().double()
                    errors.append((b - a).abs().max().double() / torch.where(scale == 0, 1.0, scale))
    return float(torch.stack(errors).max()) if errors else 0.0


MEASUREMENTS = frozenset({"sqnr", "detectors", "equalization", "equivalence", "logits"})


@dataclass(frozen=True)
class AnalysisPlan:
    """What a model's analysis will be asked for, known before the first measurement, so that one calibration
    pass and one comparison pass measure it all: the measurements (a subset of MEASUREMENTS: "logits" compares the
    output logits in the comparison pass, "equalization" adds
    each layer's equalization and smoothing variants to the comparison pass) and the detectors, by name, whose
    reports come from the shared calibration pass."""

    measurements: frozenset[str] = frozenset({"sqnr"})
    detectors: Mapping[str, DetectorBase] = dataclasses.field(default_factory=dict)
    screens: tuple[Screen, ...] = ()  # fixes measured on the layers the detectors name, in the comparison pass

    def __post_init__(self) -> None:
        unknown = set(self.measurements) - MEASUREMENTS
        if unknown:
            raise ValueError(f"unknown measurement(s) {sorted(unknown)}; known: {sorted(MEASUREMENTS)}")
        object.__setattr__(self, "measurements", frozenset(self.measurements))
        object.__setattr__(self, "detectors", MappingProxyType(dict(self.detectors)))
        object.__setattr__(self, "screens", tuple(self.screens))

    @property
    def equalization(self) -> bool:
        """Whether the equalization variants are measured in the shared comparison pass."""
        return "equalization" in self.measurements


class BlockwiseUnsupported(RuntimeError):
    """A block-wise analysis was asked for what needs the whole model quantized at once."""


class _Unknown:
    """Not measured yet (None is a measured answer)."""


_UNKNOWN = _Unknown()
_KEEP: Any = object()  # variant(): keep the analysis's own equalize recipe


class CapturedModel:
    """What every configuration of one model's analysis shares: the float graph, the calibration batches, whether
    two float runs agree, the equalization and smoothing scales measured on the float graph, the calibrated
    observers of each quantized float graph, and the variants measured so far."""

    def __init__(self, float_gm: fx.GraphModule, batches: Iterable[Any] | None = None, *,
                 blockwise: bool | str = False) -> None:
        """`blockwise`: see ModelAnalysis."""
        self.float_gm = float_gm
        self.blockwise = blockwise
        self._batches = None if batches is None else list(batches)
        self._nondeterminism: Nondeterminism | None | _Unknown = _UNKNOWN
        self._rewrite_scales: dict[tuple[str, str], tuple[Any, torch.Tensor]] = {}
        self._observers: dict[str, CalibratedObservers] = {}
        self.variants: dict[str, ModelAnalysis] = {}  # by configuration (see ModelAnalysis.variant)
        # what the analyses of this model keep for later passes holds KEPT_BYTES in all (theirs and their trials')
        self.kept_budget = KeptBudget()
        # the float graph's output on each calibration batch, from a comparison pass
        self.float_outputs: KeptFloatOutputs | None = None
        # the float inputs of the screened layers on each calibration batch, from the same pass (KeptLayerInputs)
        self.layer_inputs: KeptLayerInputs | None = None
        # {layer: [(shadow_signature, shadow record)]} the screens of the float graph's comparison pass measured
        self.screened_shadows: dict[str, list[tuple[tuple, Mapping[str, float]]]] = {}

    @property
    def batches(self) -> list[Any]:
        """The calibration batches, materialized once."""
        if self._batches is None:
            raise ValueError("this analysis was made without calibration batches; pass batches=... to measure")
        return self._batches

    def attach_batches(self, batches: Iterable[Any]) -> None:
        """Give the model its calibration batches (materialized once; later calls keep the first set)."""
        if self._batches is None:
            self._batches = list(batches)

    @property
    def determinism_known(self) -> bool:
        """Whether it is known yet if two float runs agree."""
        return not isinstance(self._nondeterminism, _Unknown)

    @property
    def nondeterminism(self) -> Nondeterminism | None:
        """Where two float runs on the first batch differ (None when they agree): two forward passes, unless a
        measurement already saw batch 0 run alike twice."""
        if isinstance(self._nondeterminism, _Unknown):
            self._nondeterminism = first_nondeterministic(self.float_gm, self.batches[0])
        return self._nondeterminism

    def saw_float_runs_agree(self) -> None:
        """Record that two float runs on batch 0 gave the same outputs (a calibration and a comparison pass)."""
        if isinstance(self._nondeterminism, _Unknown):
            self._nondeterminism = None

    @property
    def rewrite_scales(self) -> Mapping[tuple[str, str], tuple[Any, torch.Tensor]]:
        """{(method, layer): (alpha, scale)} of the equalization and smoothing rewrites measured on the float
        graph and batches so far."""
        return MappingProxyType(self._rewrite_scales)

    def keep_rewrite_scales(self, scales: Mapping[tuple[str, str], tuple[Any, torch.Tensor]]) -> None:
        """Keep the rewrite scales a measurement of the float graph found (the first found for a layer stays)."""
        for key, value in scales.items():
            self._rewrite_scales.setdefault(key, value)

    def observers_for(self, recipe: Any) -> CalibratedObservers:
        """The calibrated observers of the float graph as the equalize `recipe` rewrites it, shared by every
        quantizer that quantizes that graph."""
        return self._observers.setdefault(repr(describe(recipe)), CalibratedObservers())


class ModelAnalysis:
    """Measures one configuration (quantizer, equalize recipe) of a captured model; every measurement is computed
    on first use and kept. What the configurations of a model share lives in its CapturedModel.

    equalize: None, True (input-weight on every equalizable layer), "cross_layer", "smooth" (SmoothQuant-style,
    alpha 0.5), "smooth:search" or "smooth:<alpha>", or a list of layers.
    The model as quantized is the equalized one when `equalize` is set.
    blockwise: True (or the module path of a stack of blocks, "model.layers") measures one block at a time
    (qcore.measure.blockwise): the same numbers, with one block's quantized copy in memory at a time. What needs the
    whole model quantized at once (sensitivity, float-layer and format searches, the quantized model itself) then
    raises BlockwiseUnsupported.
    """

    def __init__(self, model: fx.GraphModule | CapturedModel, quantizer: Quantizer | None = None,
                 batches: Iterable[Any] | None = None, *, equalize: Any = None, plan: AnalysisPlan | None = None,
                 layers: Iterable[QuantizedLayer] | None = None, blockwise: bool | str = False,
                 focus: Iterable[str] | None = None, keep_graphs: bool = True,
                 layer_kinds: Iterable[str] = LAYER_KINDS) -> None:
        """`model`: a captured float graph, or the context of a model whose other configurations are analysed
        (its batches and blockwise then apply). `focus`: the only layers its SQNR measures (None: every one), with
        the model's outputs; `layer_kinds`: which of their SQNRs ("own", "propagated"; the others are nan).
        `keep_graphs`: False drops the equalized graph once measured (a fix trial's copy of the weights)."""
        if isinstance(model, CapturedModel):
            self.context = model
            if batches is not None:
                model.attach_batches(batches)
        else:
            self.context = CapturedModel(model, batches, blockwise=blockwise)
        self.float_gm = self.context.float_gm
        self.blockwise = self.context.blockwise
        self.quantizer = quantizer or Int8StaticQuantizer()
        self.equalize_recipe = equalize
        self.plan = plan or AnalysisPlan()
        self.focus = None if focus is None else frozenset(focus)
        self.layer_kinds = frozenset(layer_kinds)
        unknown_kinds = self.layer_kinds - LAYER_KINDS
        if unknown_kinds:
            raise ValueError(f"unknown layer SQNR kind(s) {sorted(unknown_kinds)}; known: {sorted(LAYER_KINDS)}")
        self._known_layers = None if layers is None else list(layers)
        self._keeps_graphs = keep_graphs
        self._sensitivity: dict[tuple, Any] = {}
        self._fixes: dict[tuple, Any] = {}
        self._logits_on: dict[int, tuple[list, LogitsMeasurement]] = {}
        self._observers = self.context.observers_for(equalize)

    @property
    def expert_layers(self) -> dict[str, ExpertLayer]:
        """{layer: ExpertLayer} of the model's expert projections (empty for a model without experts)."""
        return expert_layers(self.float_gm)

    @property
    def routing_agreement(self) -> dict[str, dict[str, float]]:
        """{MoE block: {"agreement", "tokens"}}: the share of the calibration tokens whose top-k experts the
        quantized router, on the float block input, chooses as the float router does (from the comparison pass)."""
        return {block: dict(entry) for block, entry in self.measurement.routing.items()}

    @property
    def routers(self) -> dict[str, Router]:
        """{MoE block: Router}: the layer each block chooses its experts from."""
        return routers(self.float_gm)

    @property
    def moe_blocks(self) -> dict[str, MoeBlock]:
        """{experts module path: MoeBlock} of the model's mixture-of-experts blocks."""
        return moe_blocks(self.float_gm)

    def planned(self, plan: AnalysisPlan) -> ModelAnalysis:
        """The same configuration, to measure what `plan` names in one calibration and one comparison pass
        (the layers found so far are kept; nothing has been measured yet)."""
        return ModelAnalysis(self.context, self.quantizer, equalize=self.equalize_recipe, plan=plan,
                             layers=self.layers)

    def whole_model(self, purpose: str) -> None:
        """Raise BlockwiseUnsupported when the analysis is block-wise: `purpose` needs the whole model quantized."""
        if self.blockwise:
            raise BlockwiseUnsupported(
                f"{purpose} needs the whole model quantized at once, and this model is analysed one block at a time "
                "(blockwise); give the model blockwise=False on a machine with the memory for its whole analysis")

    def variant(self, quantizer: Quantizer | None = None, equalize: Any = _KEEP,
                layers: Iterable[str] | None = None, layer_kinds: Iterable[str] = LAYER_KINDS) -> ModelAnalysis:
        """The same model and batches under another quantizer and/or equalize recipe (the same as pasting them
        into the model's settings), kept per configuration in the model's context: a fix is measured once, however
        many checks ask. `layers`, when given, are the only layers its SQNR measures (a fix trial's), with the
        model's outputs, and `layer_kinds` which of their SQNRs (see ModelAnalysis)."""
        quantizer = self.quantizer if quantizer is None else quantizer
        recipe = self.equalize_recipe if equalize is _KEEP else equalize
        focus = None if layers is None else frozenset(layers)
        kinds = LAYER_KINDS if focus is None else frozenset(layer_kinds)
        key = repr((describe(quantizer), describe(recipe), None if focus is None else sorted(focus)))
        variants = self.context.variants
        known = variants.get(key)
        if known is None or not kinds <= known.layer_kinds:  # one measuring the kinds of both serves both
            self.require_deterministic()
            kinds = kinds | (known.layer_kinds if known is not None else frozenset())
            variants[key] = ModelAnalysis(self.context, quantizer, equalize=recipe, focus=focus, keep_graphs=False,
                                          layer_kinds=kinds)
        return variants[key]

    @property
    def batches(self) -> list[Any]:
        """The calibration batches, materialized once."""
        return self.context.batches

    def attach_batches(self, batches: Iterable[Any]) -> None:
        """Give the analysis its calibration batches (materialized once; later calls keep the first set)."""
        self.context.attach_batches(batches)


    @cached_property
    def layers(self) -> list[QuantizedLayer]:
        """The quantized layers in graph order (no data needed)."""
        if self._known_layers is not None:
            return self._known_layers
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
        if isinstance(self.equalize_recipe, (list, tuple)):  # names or layer globs
            return [op.layer for op in resolve_layers(self.float_gm, self.equalize_recipe)]
        return []

    def _equalized(self, layers: Any) -> fx.GraphModule:
        # block-wise, rewritten weights are made one block at a time; a large model's fix trial (which only
        # measures) computes each where it is read, instead of holding a rewritten copy of every weight
        where_read = not self.blockwise and not self._keeps_graphs and weights_quantized_where_read()
        deferred = bool(self.blockwise) or where_read
        known = self.context.rewrite_scales  # measured on the float graph (an equalized model measures none)
        if layers == "cross_layer":
            return cross_layer_equalize(self.float_gm)
        if isinstance(layers, str) and layers.startswith("smooth"):
            result = smooth(self.float_gm, self.batches, smoothing_alpha(layers), deferred=deferred, searched=known)
        else:
            result = equalize(self.float_gm, list(layers), self.batches, deferred=deferred, known=known)
        if where_read:
            read_rewritten_where_used(result)
        return result

    @cached_property
    def quantized_input_gm(self) -> fx.GraphModule:
        """The float graph that gets quantized: the equalized one when equalization is on."""
        if not self.equalize_recipe:
            return self.float_gm
        recipe = self.equalize_recipe
        return self._equalized(recipe if isinstance(recipe, str) else self.equalized_layers)

    @property
    def nondeterminism(self) -> Nondeterminism | None:
        """Where two float runs on the first batch differ (None when they agree); see CapturedModel."""
        return self.context.nondeterminism

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
    @full_collections_deferred()  # a large model's graphs go in the one full collection it runs at its end
    def measurement(self) -> ModelMeasurement:
        """The model as quantized, measured in one calibration and one comparison pass, with what the plan names
        (the detectors and variants only when the model is not equalized: they concern the original graph)."""
        if self.context.determinism_known:  # already known (a failed measurement is not kept)
            self.require_deterministic()
        original = not self.equalize_recipe
        planned = self.plan.equalization and original
        options: dict[str, Any] = {"logits": "logits" in self.plan.measurements,
                                   "detectors": dict(self.plan.detectors) if original else None,
                                   "equalization_layers": self.equalizable_layers if planned else (),
                                   "smoothing": "search" if planned else None}
        if self.blockwise:
            self.require_deterministic()  # two float runs of the whole model: activations, no copy of weights
            measured = self._measure_blocks(self.quantized_input_gm, **options)
        else:
            screens = self.plan.screens if original and self.plan.detectors else ()
            float_graph = self.quantized_input_gm is self.float_gm  # its float outputs may be kept, or were
            budget = self.context.kept_budget
            keep = KeptFloatOutputs(budget=budget) if float_graph and self.context.float_outputs is None else None
            keep_inputs = KeptLayerInputs(budget=budget) if keep is not None and screens else None
            kept = self.context.float_outputs
            kept_outputs = kept.outputs if float_graph and kept is not None else None
            measured = measure_model(self.quantized_input_gm, self.batches, self.quantizer, observers=self._observers,
                                     layers=self.focus, screens=screens, layer_kinds=self.layer_kinds,
                                     float_outputs=kept_outputs, keep_float_outputs=keep,
                                     known_shadows=self.context.screened_shadows if float_graph else None,
                                     layer_inputs=self.context.layer_inputs if float_graph else None,
                                     keep_layer_inputs=keep_inputs, kept_budget=budget, **options)
            if keep is not None and keep.outputs is not None and len(keep.outputs) == len(self.batches):
                self.context.float_outputs = keep
                self.context.layer_inputs = keep_inputs
            if float_graph:
                for screened in measured.screens.values():
                    for layer, (signature, record) in screened.shadows.items():
                        if signature is not None:
                            self.context.screened_shadows.setdefault(layer, []).append((signature, record))
            if self.quantized_input_gm is self.float_gm and measured.first_outputs_agree:
                self.context.saw_float_runs_agree()  # calibration and comparison ran batch 0 alike: no extra runs
            self.require_deterministic()  # otherwise two runs (four to name the node where they differ)
        if not self.equalize_recipe:
            self.context.keep_rewrite_scales(measured.rewrite_scales)
        if not self._keeps_graphs:
            self.__dict__.pop("quantized_input_gm", None)  # built again if asked for
        if weights_quantized_where_read():  # a large model: its quantized copies (fx graphs, in cycles) go now
            gc.collect()
        return measured

    def _measure_blocks(self, float_gm: fx.GraphModule, **options: Any) -> ModelMeasurement:
        from qcore.measure.blockwise import measure_blockwise

        stack = self.blockwise if isinstance(self.blockwise, str) else None
        return measure_blockwise(float_gm, self.batches, self.quantizer, stack=stack, **options)

    def screened(self, name: str) -> ScreenedLayers | None:
        """What the plan's screen `name` measured in the comparison pass (None when it named no layer, or the
        analysis measures without screens: block-wise, or equalized)."""
        return self.measurement.screens.get(name)

    @cached_property
    def sqnr(self) -> SqnrMeasurement:
        """SQNR of the model as quantized (equalized first when equalization is on)."""
        return self.measurement.sqnr

    @property
    def logits(self) -> LogitsMeasurement:
        """KL, top-1 agreement and perplexity of the output logits over the calibration batches, from the
        comparison pass when the plan names "logits", else from a pass of their own (its `reason` says why not,
        for a model whose output is not logits)."""
        if "logits" in self.plan.measurements:
            return self.measurement.logits
        return self.logits_on(self.batches)

    @cached_property
    def quantized_gm(self) -> fx.GraphModule:
        """The model as quantized (equalized first when equalization is on), calibrated on the calibration batches:
        a standalone graph called like the float one (its activation observers take the states the model's pass
        calibrated; a calibration pass of its own when that pass has not run)."""
        from qcore.measure.passes import diagnosed_calibration
        from qcore.quantization.calibrated import calibrate_kept
        from qcore.quantization.convert import convert, restore_model_state
        from qcore.quantization.prepare import prepare

        self.whole_model("the quantized model")
        self.require_deterministic()
        reference = self.quantized_input_gm
        prepared = prepare(clone_graph_module(reference, share_parameters=True, recompile=False), self.quantizer,
                           recompile=False)
        with diagnosed_calibration(reference, self.batches):
            calibrate_kept(prepared, self.batches, self._observers)
            quantized = convert(prepared)
        restore_model_state(quantized, reference)
        return quantized

    def logits_on(self, batches: Iterable[Any]) -> LogitsMeasurement:
        """The output logits of the float and the quantized model compared on other batches (evaluation data),
        with the quantization calibrated on the calibration batches; kept per batch list."""
        self.whole_model("comparing logits on evaluation batches")
        batches = batches if isinstance(batches, list) else list(batches)
        kept = self._logits_on.get(id(batches))
        if kept is not None and kept[0] is batches:
            return kept[1]
        from qcore.numeric.compare import run_both

        comparator, outputs = LogitsComparator(), []  # type: ignore[var-annotated]
        device = model_device(self.float_gm)
        with torch.no_grad():
            for batch in batches:
                run_both(self.quantized_input_gm, self.quantized_gm, move_to(batch, device), outputs, comparator)
        self._logits_on[id(batches)] = (batches, comparator.result())
        return self._logits_on[id(batches)][1]

    def task_metric(self, metric: Any, batches: Any) -> tuple[float, float]:
        """(float, quantized) values of a user's `metric(model, batches) -> float` (higher is better), each model
        called like the original one."""
        self.whole_model("a task metric")
        with torch.no_grad():
            return float(metric(self.quantized_input_gm, batches)), float(metric(self.quantized_gm, batches))

    @cached_property
    def _variant_measurement(self) -> ModelMeasurement:
        if not self.equalize_recipe and self.plan.equalization:
            return self.measurement
        self.require_deterministic()
        if self.blockwise:
            measured = self._measure_blocks(self.float_gm, propagate=False,
                                            equalization_layers=self.equalizable_layers, smoothing="search")
        else:
            measured = measure_model(self.float_gm, self.batches, self.quantizer, propagate=False,
                                     equalization_layers=self.equalizable_layers, smoothing="search")
        if not self.equalize_recipe:
            self.context.keep_rewrite_scales(measured.rewrite_scales)
        return measured

    @property
    def equalization_variants(self) -> Mapping[str, Mapping[str, VariantSqnr]]:
        """{layer: {"input_weight" | "smoothing": VariantSqnr}}: each equalizable layer's own SQNR with
        input-weight equalization and with smoothing (searched alpha), against the unequalized model's."""
        return self._variant_measurement.variants

    @property
    def unmeasured_variants(self) -> Mapping[str, str]:
        """{layer: why its equalization variants could not be measured}."""
        return self._variant_measurement.unmeasured

    @property
    def smoothing(self) -> Mapping[str, Mapping[str, Any]]:
        """{layer: {"alpha", "producer", "producer_name"}} for the smoothable layers of the unequalized model,
        {layer: {"refused": reason}} for the others."""
        return self._variant_measurement.smoothing

    @cached_property
    def unequalized_sqnr(self) -> SqnrMeasurement:
        """Propagated SQNR without equalization (the same as `sqnr` when equalization is off; otherwise one more
        calibration and comparison, without the shadow pass)."""
        if not self.equalize_recipe:
            return self.sqnr
        if self.blockwise:
            return self._measure_blocks(self.float_gm).sqnr
        return measure_sqnr(self.float_gm, self.batches, self.quantizer, shadow=False)

    @cached_property
    def equalized_sqnr(self) -> SqnrMeasurement:
        """Propagated SQNR with input-weight equalization of every equalizable layer (or the model's own recipe);
        when the model is not equalized, an equalization pass and one more calibration and comparison."""
        if self.equalize_recipe:
            return self.sqnr
        self.require_deterministic()
        if self.blockwise:
            return self._measure_blocks(self._equalized(self.equalizable_layers)).sqnr
        return measure_sqnr(self._equalized(self.equalizable_layers), self.batches, self.quantizer, shadow=False)

    @cached_property
    def equivalence_error(self) -> float:
        """How far the equalized float model is from the original: max error relative to the output's range."""
        self.require_deterministic()
        equalized = self.quantized_input_gm
        with materialized([equalized], deferred_parameters(equalized)):  # block-wise: all of them, for this
            return _max_relative_error(self.float_gm, equalized, self.batches)

    @cached_property
    def switchable(self) -> Any:
        """The quantized model with per-layer quantizer switches (qcore.search.sensitivity), built on first use."""
        from qcore.search.sensitivity import SwitchableModel

        self.whole_model("switching layers between float and quantized")
        self.require_deterministic()
        return SwitchableModel(self.quantized_input_gm, self.batches, self.quantizer, observers=self._observers)

    def sensitivity(self, max_layers: int | None = None, max_batches: int | None = None,
                    only_quantized: bool | int = True, confirmed: int | None = None) -> Any:
        """qcore.search.sensitivity.SensitivityResult of the quantized layers (kept per budget; see layer_sensitivity
        for `only_quantized` and `confirmed`)."""
        from qcore.search.sensitivity import layer_sensitivity

        self.whole_model("the sensitivity ranking")
        key = (max_layers, max_batches, only_quantized, confirmed)
        cache = self._sensitivity
        if key not in cache and not trials_allowed(whole=True):  # the budget left holds no search: none measured
            from qcore.search.sensitivity import SensitivityResult

            layers = [entry.layer for entry in self.layers]
            return SensitivityResult(self._output_db(), (), tuple(layers[max_layers:] if max_layers else ()), 0,
                                     tuple(layers[:max_layers] if max_layers else layers))
        if key not in cache:
            with stage("trials"):
                cache[key] = layer_sensitivity(self.quantized_input_gm, self.batches, self.quantizer,
                                               max_layers=max_layers, max_batches=max_batches, model=self.switchable,
                                               only_quantized=only_quantized, confirmed=confirmed)
        return cache[key]

    def format_fix(self, target_db: float, max_moves: int = 16, max_batches: int | None = 2) -> Any:
        """qcore.search.format_search.FormatFix: verified moves up the format ladder to reach `target_db` (a
        FormatQuantizer's model only)."""
        from qcore.quantization.format_quantizer import FormatQuantizer
        from qcore.search.format_search import search_formats

        if not isinstance(self.quantizer, FormatQuantizer):
            raise TypeError(f"format_fix needs a FormatQuantizer, not {type(self.quantizer).__name__}")
        self.whole_model("the format search")
        key = ("formats", target_db, max_moves, max_batches)
        if key not in self._fixes and not trials_allowed(whole=True):  # the budget left holds no search
            from qcore.search.format_search import FormatFix

            return FormatFix({}, self._output_db(), self._output_db(), target_db, False, stopped=True)
        if key not in self._fixes:
            self.require_deterministic()
            with stage("trials"):
                self._fixes[key] = search_formats(self.quantized_input_gm, self.batches, self.quantizer, target_db,
                                                  max_moves=max_moves, max_batches=max_batches,
                                                  observers=self._observers)
        return self._fixes[key]

    def float_layers_fix(self, target_db: float, max_float_layers: int = 8, max_batches: int | None = 2,
                         candidates: int = FLOAT_LAYERS_CANDIDATES, early_layers: int | None = None) -> Any:
        """qcore.search.sensitivity.FloatLayersFix: a verified set of layers to keep in float to reach `target_db`,
        searched among `candidates` layers (fix_candidates; screened on the first `max_batches` batches, the set
        returned measured on every batch), and when that set falls short among them and the first `early_layers`
        in graph order (default EARLY_LAYERS: the sensitivity ranking's, whose runs it shares)."""
        from qcore.search.sensitivity import EARLY_LAYERS, find_float_layers

        self.whole_model("the float_layers search")
        early_layers = EARLY_LAYERS if early_layers is None else early_layers
        key = (target_db, max_float_layers, max_batches, candidates, early_layers)
        cache = self._fixes
        if key not in cache and not trials_allowed(whole=True):  # the budget left holds no search: none runs
            from qcore.search.sensitivity import FloatLayersFix

            return FloatLayersFix((), self._output_db(), self._output_db(), target_db, False, stopped=True)
        if key not in cache:
            with stage("trials"):
                cache[key] = find_float_layers(self.quantized_input_gm, self.batches, self.quantizer, target_db,
                                               max_float_layers=max_float_layers, max_batches=max_batches,
                                               model=self.switchable, candidates=candidates,
                                               ranking=self.fix_candidates(candidates),
                                               early_layers=early_layers, observers=self._observers)
        return cache[key]

    def _output_db(self) -> float:
        """The worst output leaf's SQNR in the model's comparison pass (nan without a floating output)."""
        worst = self.sqnr.worst_output()
        return worst.sqnr_db if worst is not None else math.nan

    def fix_candidates(self, count: int = FLOAT_LAYERS_CANDIDATES) -> list[str]:
        """The quantized layers in the order a float_layers search takes its `count` candidates from: the layer
        nearest each output (an LM head, a pooler: their error reaches the output whole, whatever its own size) and
        the layers with the largest own error make the first `count`, largest own error first; the others follow."""
        ranked = self.own_error_ranking()
        last = last_layers(self.float_gm, ranked)[:count]
        first = set(last) | set([name for name in ranked if name not in last][:max(0, count - len(last))])
        return [name for name in ranked if name in first] + [name for name in ranked if name not in first]

    def own_error_ranking(self) -> list[str]:
        """The quantized layers, largest own error first (SqnrMeasurement.by_own_error); graph order among equals."""
        return self.sqnr.by_own_error(entry.layer for entry in self.layers)

    def detector_reports(self, detectors: Mapping[str, DetectorBase]) -> dict[str, dict[str, dict[str, Any]]]:
        """Every detector's report over the batches: {key: {layer: raw detector entry}}. Planned detectors come
        from the shared calibration pass; others run in one ModelReport pass of their own."""
        if not detectors:
            return {}
        planned = self.plan.detectors
        shared = not self.equalize_recipe and all(planned.get(key) is detector for key, detector in detectors.items())
        if shared:
            try:
                shared_reports = self.measurement.detector_reports
                return {key: dict(shared_reports.get(key, {})) for key in detectors}
            except NonDeterministicModelError:
                pass  # detector statistics stay valid when SQNR cannot be measured: one pass of their own
        report = ModelReport(clone_graph_module(self.float_gm, share_parameters=True), list(detectors.values()))
        calibrate(report.prepare_detailed_calibration(), self.batches)
        reports = report.generate_model_report(remove_inserted_observers=True)
        return {key: dict(reports.get(detector.get_detector_name(), ("", {}))[1])
                for key, detector in detectors.items()}


def calibration_digest(batches: Iterable[Any]) -> str:
    """'sha256:...' of the batches' structure, dtypes, shapes and bytes: same data, same digest, on any device. The
    bytes of batches on an accelerator come to the host together, one copy per 64 MiB, not one per batch."""
    digest = hashlib.sha256()
    pieces: list[bytes | torch.Tensor] = []  # in digest order
    device_bytes = 0
    for batch in batches:
        leaves, spec = pytree.tree_flatten(batch)
        pieces.append(str(spec).encode())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                data = leaf.detach().contiguous()
                pieces += [f"{data.dtype}{tuple(data.shape)}".encode(), data]
                device_bytes += 0 if data.is_cpu else data.numel() * data.element_size()
            else:
                pieces.append(repr(leaf).encode())
        if device_bytes >= _DIGEST_COPY_BYTES:
            _digest_pieces(digest, pieces)
            pieces, device_bytes = [], 0
    _digest_pieces(digest, pieces)
    return "sha256:" + digest.hexdigest()


def _digest_pieces(digest: Any, pieces: list[bytes | torch.Tensor]) -> None:
    """Feed `pieces` to `digest` in order; the tensors on each other device come to the host in one copy."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for piece in pieces:
        if isinstance(piece, torch.Tensor) and not piece.is_cpu:
            by_device.setdefault(piece.device, []).append(piece.reshape(-1).view(torch.uint8))
    copied = {device: iter(torch.cat(flat).cpu().split([t.numel() for t in flat]))
              for device, flat in by_device.items()}
    for piece in pieces:
        if isinstance(piece, torch.Tensor):
            data = piece if piece.is_cpu else next(copied[piece.device])
            digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))
        else:
            digest.update(piece)


# fingerprints name qcore's classes and functions by the modules they lived in before qcore had subpackages, so that
# the baselines recorded then still match
_FINGERPRINT_MODULES = {
    "qcore.runtime.native": "qcore.native",
    "qcore.runtime.progress": "qcore.progress",
    "qcore.formats.numerics": "qcore.formats",
    "qcore.formats.presets": "qcore.presets",
    "qcore.graph.ops": "qcore.graph",
    "qcore.graph.inputs": "qcore.inputs",
    "qcore.graph.fold": "qcore.fold",
    "qcore.graph.capture": "qcore.capture",
    "qcore.graph.rewritable": "qcore.rewritable",
    "qcore.graph.deferred": "qcore.deferred",
    "qcore.observe.observers": "qcore.observers",
    "qcore.observe.qparams": "qcore.qparams",
    "qcore.quantization.quantizer": "qcore.quantizer",
    "qcore.quantization.unionfind": "qcore.unionfind",
    "qcore.quantization.prepare": "qcore.prepare",
    "qcore.quantization.convert": "qcore.convert",
    "qcore.quantization.calibrate": "qcore.calibrate",
    "qcore.quantization.calibrated": "qcore.calibrated",
    "qcore.quantization.format_quantizer": "qcore.format_quantizer",
    "qcore.rewrites.equalize": "qcore.equalize",
    "qcore.rewrites.smoothing": "qcore.smoothing",
    "qcore.measure.passes": "qcore.measure",
    "qcore.measure.variants": "qcore.variants",
    "qcore.measure.screens": "qcore.screens",
    "qcore.measure.blockwise": "qcore.blockwise",
    "qcore.measure.probes": "qcore.probes",
    "qcore.measure.diagnose": "qcore.diagnose",
    "qcore.search.sensitivity": "qcore.sensitivity",
    "qcore.search.format_search": "qcore.format_search",
    "qcore.search.resume": "qcore.resume",
}


def describe(value: Any) -> Any:
    """A stable, builtins-only description of a setting (classes and functions by qualified name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        module = str(getattr(value, "__module__", ""))
        return f"{_FINGERPRINT_MODULES.get(module, module)}.{value.__qualname__}"
    if isinstance(value, Quantizer) or hasattr(value, "__dict__"):
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        return {"class": describe(type(value)), **{k: describe(v) for k, v in sorted(public.items())}}
    return type(value).__qualname__


def capture_for_analysis(model: nn.Module, example_inputs: Any, quantizer: Quantizer | None = None, *,
                         name: str | None = None, grouped: bool = True) -> fx.GraphModule:
    """`model` captured for its analysis under `quantizer`: with `grouped`, a model whose experts transformers
    computes fused is captured with each projection of every expert as one op where its analysis measures that form
    (groups_experts, then takes_grouped_capture); one Linear per expert otherwise, and always within
    experts_grouped(False)."""
    if grouped and groups_experts(model, quantizer):
        with experts_grouped():
            gm = capture(model, example_inputs, name=name)
        if takes_grouped_capture(gm, quantizer):
            return gm
    with experts_grouped(False):
        return capture(model, example_inputs, name=name)


def groups_experts(model: nn.Module, quantizer: Quantizer | None = None) -> bool:
    """Whether an analysis of `model` under `quantizer` captures its fused experts with each projection of every
    expert as one op (experts_grouped): the per-expert capture's items and values, at a cost that follows the
    model's compute rather than its expert count. Where every pass measures that form as it measures one Linear per
    expert: qcore's own Int8StaticQuantizer (the default) with per-channel weights, on a model held whole in memory
    (not offloaded); and not within experts_grouped(False)."""
    quantizer = quantizer or Int8StaticQuantizer()
    offloaded = getattr(model, "hf_device_map", None) or any(hasattr(module, "_hf_hook") for module in
                                                             model.modules())
    return experts_grouping() is not False and type(quantizer) is Int8StaticQuantizer and \
        quantizer.per_channel and not offloaded and bool(fused_experts_modules(model))


def takes_grouped_capture(gm: fx.GraphModule, quantizer: Quantizer | None = None) -> bool:
    """Whether a grouped capture (groups_experts) is the one to analyse: torch.export captured it (an FX capture
    is captured again one Linear per expert), and `quantizer` takes it (a layer override that gives one expert of a
    projection other weight settings is refused)."""
    if gm.meta.get("qcore_capture_method") != "export":
        return False
    if quantizer is None or (type(quantizer) is Int8StaticQuantizer and not quantizer.layer_overrides):
        return True  # every expert of a projection gets the same settings: nothing to refuse, nothing to annotate
    try:
        (quantizer or Int8StaticQuantizer()).annotate(graph_view(gm))  # read, never run
    except ValueError:
        return False
    return True


def analyze_model(model: nn.Module | fx.GraphModule, batches: Iterable[Any], quantizer: Quantizer | None = None, *,
                  example_inputs: Any = None, equalize: Any = None, name: str | None = None) -> ModelAnalysis:
    """Capture `model` (unless it is a qcore graph) and return its analysis, with SQNR measured."""
    batches = list(batches)
    if not isinstance(model, fx.GraphModule):
        if not batches and example_inputs is None:
            raise ValueError("analyze_model needs at least one calibration batch")
        model = capture_for_analysis(model, batches[0] if example_inputs is None else example_inputs, quantizer,
                                     name=name)
    analysis = ModelAnalysis(model, quantizer, batches, equalize=equalize)
    analysis.sqnr  # noqa: B018 - measure now, so that errors surface here
    return analysis
