"""Quantization specs, annotations and the quantizers that write them onto graph nodes (pt2e style)."""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch
from torch import fx

from qcore.formats.presets import TensorFormat
from qcore.graph.grouped import GroupedOp, find_grouped_ops
from qcore.graph.ops import QUANTIZABLE_KINDS, find_quantizable_ops, is_inserted, layer_patterns, op_kind
from qcore.observe.observers import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver
from qcore.observe.segmented import PerExpertObservers

__all__ = ["ANNOTATION_KEY", "DerivedQuantizationSpec", "EdgeOrNode", "FixedQParamsQuantizationSpec",
    "Int8StaticQuantizer", "PerExpertObserverClasses", "QuantizationAnnotation", "QuantizationSpec",
    "QuantizationSpecBase", "Quantizer",
    "SharedQuantizationSpec", "int8_activation_spec", "int8_dynamic_activation_spec", "int8_weight_spec",
    "with_layer_overrides"]

EdgeOrNode = Union[tuple[fx.Node, fx.Node], fx.Node]  # noqa: UP007 - a runtime alias: `|` needs Python 3.10 types
ANNOTATION_KEY = "quantization_annotation"


class QuantizationSpecBase:
    """Base of every spec kind."""


@dataclass(eq=False)
class QuantizationSpec(QuantizationSpecBase):
    """How one tensor is quantized, and the observer factory that measures it."""

    dtype: torch.dtype
    observer_or_fake_quant_ctr: Callable[..., torch.nn.Module] = MinMaxObserver
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False
    format: TensorFormat | None = None  # a deployed format (qcore.formats.presets), its observer's argument
    # the counts node of a grouped projection's experts (qcore.graph.grouped) whose values the tensor holds, as
    # rows by expert or as an [E, ...] weight: one observer of every expert at once (qcore.observe.segmented)
    experts: fx.Node | None = None
    # of such a tensor: the experts it is left in float for (a layer a quantizer skips: `skip`, float_layers), and
    # those whose rows are quantized with qparams from their own range in each batch (dynamic activations)
    float_experts: tuple[int, ...] = ()
    dynamic_experts: tuple[int, ...] = ()

    @property
    def per_channel(self) -> bool:
        """Whether the tensor gets more than one scale (per channel, group or block)."""
        if self.format is not None:
            return self.format.granularity != "tensor"
        return self.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)

    @property
    def clips_outliers(self) -> bool:
        """Whether the spec's observer may clip extremes to lower the error (its class says so)."""
        observer = getattr(self.observer_or_fake_quant_ctr, "func", self.observer_or_fake_quant_ctr)  # with_args
        return bool(getattr(observer, "clips_outliers", False))


@dataclass(eq=False)
class FixedQParamsQuantizationSpec(QuantizationSpecBase):
    """A tensor quantized with a known scale and zero point."""

    dtype: torch.dtype
    scale: float
    zero_point: int
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    is_dynamic: bool = False


@dataclass(eq=False)
class SharedQuantizationSpec(QuantizationSpecBase):
    """Use the same observer (so the same qparams) as another edge or node."""

    edge_or_node: EdgeOrNode


@dataclass(eq=False)
class DerivedQuantizationSpec(QuantizationSpecBase):
    """Qparams computed from the observers of other edges or nodes."""

    derived_from: list[EdgeOrNode]
    derive_qparams_fn: Callable[[list], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False


@dataclass
class QuantizationAnnotation:
    """What a node wants quantized: some input edges, and its output."""

    input_qspec_map: dict[fx.Node, QuantizationSpecBase] = field(default_factory=dict)
    output_qspec: QuantizationSpecBase | None = None
    allow_implicit_sharing: bool = True
    _annotated: bool = False


class Quantizer(abc.ABC):
    """Writes QuantizationAnnotation objects into node.meta['quantization_annotation']."""

    @abc.abstractmethod
    def annotate(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Annotate the nodes of `gm` in place and return it."""

    def validate(self, gm: fx.GraphModule) -> None:
        """Check the annotated graph; the default accepts everything."""

    def prepare_obs_or_fq_callback(self, model: fx.GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        """Called by prepare once each sharing group has its observer, before insertion (torchao 0.18): the
        quantizer may replace entries of the {edge or node: observer} dict. The default changes nothing."""


INPUT_OBSERVER_KEY = "qcore_input_observer"  # node.meta: (observer class, activations it reads) of an override


def int8_activation_spec(observer: Callable[..., torch.nn.Module] = MinMaxObserver) -> QuantizationSpec:
    """Per-tensor affine int8 for activations."""
    return QuantizationSpec(torch.int8, observer, -128, 127, torch.per_tensor_affine)


def int8_weight_spec(per_channel: bool = True) -> QuantizationSpec:
    """Symmetric int8 for weights, per output channel (axis 0) or per tensor."""
    if per_channel:
        return QuantizationSpec(torch.int8, PerChannelMinMaxObserver, -127, 127, torch.per_channel_symmetric, ch_axis=0)
    return QuantizationSpec(torch.int8, MinMaxObserver, -127, 127, torch.per_tensor_symmetric)


def int8_dynamic_activation_spec() -> QuantizationSpec:
    """Per-tensor affine int8 whose qparams are chosen per batch at run time."""
    return QuantizationSpec(torch.int8, PlaceholderObserver, -128, 127, torch.per_tensor_affine, is_dynamic=True)


ACTIVATION_OBSERVERS: dict[str, Callable[..., torch.nn.Module]] = {"minmax": MinMaxObserver,
                                                                   "histogram": HistogramObserver}


def _activation_observer(observer: Callable[..., torch.nn.Module] | str) -> Callable[..., torch.nn.Module]:
    """An activation observer class from its name ("minmax", "histogram") or itself."""
    if isinstance(observer, str):
        if observer not in ACTIVATION_OBSERVERS:
            raise ValueError(f"unknown activation observer {observer!r}; known: {sorted(ACTIVATION_OBSERVERS)}")
        return ACTIVATION_OBSERVERS[observer]
    return observer


def with_layer_overrides(quantizer: Quantizer, overrides: dict[str, dict]) -> Quantizer:
    """A copy of `quantizer` with `overrides` merged into its `layer_overrides`, glob by glob and key by key;
    ValueError for a quantizer without them."""
    import copy

    existing = getattr(quantizer, "layer_overrides", None)
    if not isinstance(existing, dict):
        raise ValueError(f"{type(quantizer).__name__} has no layer_overrides; use qcore.Int8StaticQuantizer or a "
                         "quantizer that honours layer_overrides={glob: {...}}")
    merged = {**existing, **{glob: {**existing.get(glob, {}), **dict(change)} for glob, change in overrides.items()}}
    changed = copy.copy(quantizer)  # a subclass stays itself
    setattr(changed, "layer_overrides", merged)  # noqa: B010 - any quantizer class that has the attribute
    if isinstance(changed, Int8StaticQuantizer):
        changed.validate_overrides()
    return changed


@dataclass(frozen=True)
class PerExpertObserverClasses:
    """The activation observer class of each expert of a grouped projection, where they differ: an observer factory
    whose observer of every expert at once is one of each class per expert (qcore.observe.segmented)."""

    classes: tuple[Callable[..., torch.nn.Module], ...]

    def __call__(self, **kwargs: Any) -> torch.nn.Module:
        """One observer per expert, each of its class (PerExpertObservers)."""
        return PerExpertObservers([observer(**kwargs) for observer in self.classes])


def _experts_rows(node: fx.Node) -> bool:
    """Whether a node's output is quantized as rows by expert (a grouped projection's)."""
    annotation = node.meta.get(ANNOTATION_KEY)
    return annotation is not None and getattr(annotation.output_qspec, "experts", None) is not None


def _is_quantized_output(node: object) -> bool:
    if not isinstance(node, fx.Node):
        return False
    annotation = node.meta.get(ANNOTATION_KEY)
    return annotation is not None and annotation.output_qspec is not None


def _annotate(node: fx.Node, inputs: dict, output: QuantizationSpecBase | None) -> None:
    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=output, _annotated=True)


class Int8StaticQuantizer(Quantizer):
    """Static int8: symmetric weights (per channel by default), per-tensor affine activations.

    linear/conv/matmul/bmm/addmm are quantized; scaled_dot_product_attention gets quantized query, key and
    value (its output stays float); a relu that solely follows one is fused (observed after the relu); add/mul
    of quantized tensors get their own output observer; cat and pass-through ops (relu, pooling,
    view/reshape/permute/flatten, ...) share their input's qparams.

    `layer_overrides` maps layer or FQN globs to {"per_channel": bool, "is_dynamic": bool, "skip": bool,
    "activation_observer": "minmax" | "histogram" | observer class}, so a report's recommendation becomes a config
    in one step. A layer's activation_observer observes the tensors the layer reads, and nothing else: where an
    input is another layer's output, that one tensor's observer is the reading layer's (the tensor is quantized
    once), and the layer's own output keeps the quantizer's observer (its readers decide).
    """

    OVERRIDE_KEYS = frozenset({"per_channel", "is_dynamic", "skip", "activation_observer"})

    def __init__(
        self,
        per_channel: bool = True,
        activation_observer: Callable[..., torch.nn.Module] | str = MinMaxObserver,
        layer_overrides: dict[str, dict] | None = None,
    ) -> None:
        self.per_channel = per_channel
        self.activation_observer = _activation_observer(activation_observer)
        self.layer_overrides = dict(layer_overrides or {})
        self.validate_overrides()

    def validate_overrides(self) -> None:
        """ValueError naming an override key this quantizer does not know, or an unknown activation observer."""
        for pattern, override in self.layer_overrides.items():
            unknown = set(override) - self.OVERRIDE_KEYS if isinstance(override, dict) else {"(not a dict)"}
            if unknown:
                raise ValueError(f"layer_overrides[{pattern!r}]: unknown key(s) {sorted(unknown)}; known: "
                                 f"{sorted(self.OVERRIDE_KEYS)}")
            if "activation_observer" in override:
                _activation_observer(override["activation_observer"])

    def __repr__(self) -> str:
        return (f"Int8StaticQuantizer(per_channel={self.per_channel!r}, activation_observer="
                f"{getattr(self.activation_observer, '__name__', self.activation_observer)}, "
                f"layer_overrides={self.layer_overrides!r})")

    def _settings(self, fqn: str, layer: str, item: str = "") -> dict:
        settings: dict[str, Any] = {"per_channel": self.per_channel, "is_dynamic": False, "skip": False,
                                    "activation_observer": self.activation_observer}
        for pattern in layer_patterns(tuple(self.layer_overrides)).matching(layer, fqn, item):
            settings.update(self.layer_overrides[pattern])
        settings["activation_observer"] = _activation_observer(settings["activation_observer"])
        return settings

    def annotate(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Annotate every quantizable op, then propagate to add/mul/cat and pass-through ops."""
        for op in find_quantizable_ops(gm):
            settings = self._settings(op.fqn, op.layer, op.item)
            op.node.meta.pop(INPUT_OBSERVER_KEY, None)
            if settings["skip"]:
                continue
            observer = settings["activation_observer"]
            if settings["is_dynamic"]:
                act = int8_dynamic_activation_spec()
            else:
                act = int8_activation_spec(observer)
                if observer is not self.activation_observer:  # the observer of what it reads (the callback)
                    op.node.meta[INPUT_OBSERVER_KEY] = (observer, tuple(op.activation_inputs))
            inputs: dict = {a: act for a in op.activation_inputs}
            if op.weight is not None:
                spec = int8_weight_spec(settings["per_channel"])
                if op.kind == "addmm" and spec.ch_axis is not None:  # mat2 is [in, out]
                    spec = QuantizationSpec(spec.dtype, spec.observer_or_fake_quant_ctr, spec.quant_min,
                                            spec.quant_max, spec.qscheme, ch_axis=1)
                inputs[op.weight] = spec
            quantize_output = not settings["is_dynamic"] and op.kind != "sdpa"
            output = int8_activation_spec(self.activation_observer) if quantize_output else None
            if op.output is not op.node:
                _annotate(op.node, inputs, None)
                _annotate(op.output, {}, output)
            else:
                _annotate(op.node, inputs, output)
        grouped_ops = find_grouped_ops(gm)
        readers = self._readers_observers(grouped_ops)
        for grouped in grouped_ops:
            self._annotate_grouped(grouped, readers.get(grouped.routed, {}))
        self._propagate(gm)
        return gm

    def _annotate_grouped(self, op: GroupedOp, readers_observers: dict[int, Callable[..., torch.nn.Module]]
                          ) -> None:
        """A grouped projection quantized as each expert's Linear would be: its routed rows, its weight and its
        output observed per expert at once, the experts a layer override skips left in float, those it makes
        dynamic quantized from each batch's own range (their output left in float), and the routed rows of an
        expert whose layer (this one, or another reading them: `readers_observers`, {expert: class}) asks for
        another activation observer observed with it, as prepare's callback gives a per-expert graph's shared
        input. ValueError where its quantized experts' settings differ otherwise (a per-expert override of another
        kind: the per-expert capture takes those)."""
        every = [self._settings(op.block, layer, op.item) for layer in op.layers]
        float_experts = tuple(expert for expert, settings in enumerate(every) if settings["skip"])
        quantized = [settings for settings in every if not settings["skip"]]
        if not quantized:
            return
        settings = quantized[0]
        if any({**other, "activation_observer": None, "is_dynamic": None} !=
               {**settings, "activation_observer": None, "is_dynamic": None} for other in quantized[1:]):
            raise ValueError(f"{op.item}: layer_overrides give its experts different settings, which a grouped "
                             "capture does not take yet (but for skip, is_dynamic and activation_observer); capture "
                             "it expert by expert")
        dynamic = tuple(expert for expert, settings in enumerate(every)
                        if settings["is_dynamic"] and not settings["skip"])
        per_expert = {"experts": op.counts, "float_experts": float_experts}
        observers = [readers_observers.get(expert, self.activation_observer) for expert in range(op.experts)]
        observer = observers[0] if len(set(observers)) == 1 else PerExpertObserverClasses(tuple(observers))
        inputs: dict = {op.routed: replace(int8_activation_spec(observer), **per_expert, dynamic_experts=dynamic),
                        op.weight: replace(int8_weight_spec(settings["per_channel"]), **per_expert)}
        # a dynamic layer's output is left in float, as Int8StaticQuantizer leaves it on the per-expert graph
        output = {"experts": op.counts, "float_experts": tuple(sorted({*float_experts, *dynamic}))}
        if len(output["float_experts"]) == op.experts:
            _annotate(op.node, inputs, None)
            return
        _annotate(op.node, inputs, replace(int8_activation_spec(self.activation_observer), **output))

    def _readers_observers(self, ops: list[GroupedOp]) -> dict[fx.Node, dict[int, Callable[..., torch.nn.Module]]]:
        """{routed rows: {expert: observer class}} of the experts whose static layer reading those rows overrides
        the activation observer (the gate's and the up projection's read the same rows)."""
        found: dict[fx.Node, dict[int, Callable[..., torch.nn.Module]]] = {}
        for op in ops:
            for expert, layer in enumerate(op.layers):
                settings = self._settings(op.block, layer, op.item)
                # a dynamic layer's override names no observer of what it reads: its qparams are its own
                if not settings["skip"] and not settings["is_dynamic"] and \
                        settings["activation_observer"] is not self.activation_observer:
                    found.setdefault(op.routed, {})[expert] = settings["activation_observer"]
        return found

    def prepare_obs_or_fq_callback(self, model: fx.GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        """A layer whose activation_observer is overridden observes the tensors it reads with it: the sharing group
        of each of its input edges gets that observer (pt2e's grouping would give the group's first spec's)."""
        replaced: dict[int, torch.nn.Module] = {}
        for key, observer in list(edge_or_node_to_obs_or_fq.items()):
            wanted, reads = key[1].meta.get(INPUT_OBSERVER_KEY, (None, ())) if isinstance(key, tuple) else (None, ())
            if wanted is None or key[0] not in reads or type(observer) is wanted or id(observer) in replaced:
                continue  # not an activation it reads (a weight), or observed as wanted already
            spec = int8_activation_spec(wanted)
            replaced[id(observer)] = spec.observer_or_fake_quant_ctr(
                dtype=spec.dtype, quant_min=spec.quant_min, quant_max=spec.quant_max, qscheme=spec.qscheme,
                is_dynamic=False)
        for key, observer in edge_or_node_to_obs_or_fq.items():
            if id(observer) in replaced:
                edge_or_node_to_obs_or_fq[key] = replaced[id(observer)]

    def _propagate(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if ANNOTATION_KEY in node.meta or is_inserted(node):
                continue
            kind = op_kind(node, gm)
            if kind in QUANTIZABLE_KINDS or kind is None:
                continue
            if any(_experts_rows(a) for a in node.all_input_nodes):
                continue  # rows by expert: an op over them is quantized per expert or not at all
            if kind in ("add", "mul"):
                tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
                if tensors and all(_is_quantized_output(a) for a in tensors) and len(tensors) == 2:
                    act = int8_activation_spec(self.activation_observer)
                    _annotate(node, {a: act for a in tensors}, int8_activation_spec(self.activation_observer))
            elif kind == "cat":
                tensors = list(node.args[0]) if node.args and isinstance(node.args[0], (list, tuple)) else []
                if tensors and all(_is_quantized_output(a) for a in tensors):
                    first = (tensors[0], node)
                    inputs = {tensors[0]: int8_activation_spec(self.activation_observer)}
                    # a tensor given twice (cat([x, x])) is one edge, already annotated: it must not share with itself
                    inputs.update({a: SharedQuantizationSpec(first) for a in tensors[1:] if a not in inputs})
                    _annotate(node, inputs, SharedQuantizationSpec(first))
            elif kind in ("relu", "passthrough"):
                source = node.args[0] if node.args else None
                if _is_quantized_output(source):
                    _annotate(node, {source: int8_activation_spec(self.activation_observer)},
                              SharedQuantizationSpec((source, node)))
