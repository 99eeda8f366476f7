"""Detectors: where to observe, and what the statistics recommend (torch.ao's four, on qcore graphs).

Report dictionaries keep torch.ao's feature keys. Differences, on purpose: each layer's channel axis is
its feature axis (last for linear/matmul inputs, so [batch, tokens, features] works; `ch_axis` for conv);
an all-zero channel is not an outlier; a constant activation is reported as constant instead of raising;
reports never modify observer state; DynamicStaticDetector also covers conv.
"""
from __future__ import annotations

import abc
import itertools
import math
import re
from typing import Any

import torch
from torch import fx

from qcore.graph.experts import expert_layers
from qcore.graph.ops import (
    HANDLE_KEY,
    REWRITTEN_KEY,
    QuantizableOp,
    expert_views,
    find_quantizable_ops,
    is_inserted,
    normalize_module_path,
    weight_value,
)
from qcore.numeric.metrics import read_to_host
from qcore.quantization.quantizer import ANNOTATION_KEY, Int8StaticQuantizer, Quantizer
from qcore.report.observer import ReportObserver, average_ratio_values, batch_to_epoch_ratios, fresh_ranges
from qcore.rewrites.equalize import weight_column_ranges
from qcore.runtime import deferred

__all__ = ["DETECTOR_EXPERT_KEY", "DETECTOR_IS_POST_OBS_KEY", "DETECTOR_OBS_ARGS_KEY", "DETECTOR_OBS_TO_INSERT_KEY",
    "DETECTOR_TARGET_NODE_KEY", "DetectorBase", "DetectorQConfigInfo", "DynamicStaticDetector",
    "InputWeightEqualizationDetector", "OutlierDetector", "PerChannelDetector", "channel_axis", "observer_name",
    "percentile_estimate_tokens", "reported_axis"]

DETECTOR_TARGET_NODE_KEY = "target_node"
DETECTOR_OBS_TO_INSERT_KEY = "observer_to_insert"
DETECTOR_IS_POST_OBS_KEY = "is_post_observer"
DETECTOR_OBS_ARGS_KEY = "observer_args"
# on a point observing one expert of a grouped projection: (its index, the counts node of the rows by expert)
DETECTOR_EXPERT_KEY = "expert"


def observer_name(layer: str, detector: str, position: str) -> str:
    """A flat submodule name for a detector's observer before ('pre') or after ('post') a layer, ending with
    torch.ao's DEFAULT_PRE_OBSERVER_NAME or DEFAULT_POST_OBSERVER_NAME."""
    suffix = DetectorBase.DEFAULT_PRE_OBSERVER_NAME if position == "pre" else DetectorBase.DEFAULT_POST_OBSERVER_NAME
    return "qcore_report__" + re.sub(r"\W", "_", layer) + f"__{detector}__{suffix}"


def percentile_estimate_tokens(percentile: float, above: int = 3) -> int:
    """The fewest values of a channel in a batch that estimate its `percentile` (a fraction) with `above` of them
    expected above it: above / (1 - percentile), 120 at 97.5%. Over fewer, torch.quantile's "lower" percentile is
    one of the batch's few largest values (its second-largest below 1 / (1 - percentile)), so q100 / q_p compares
    two of its top values: for normal values it exceeds torch.ao's 3.5 in about 1 channel in 14,000 at 40 values,
    1 in 100,000 to 200,000 from 64 to 96, and in none of 200,000 draws from 120 on
    (benchmarks/bench_outlier_ratio.py); an expert projection has thousands of channels."""
    if percentile >= 1:
        return 1
    return math.ceil(round(above / (1 - percentile), 9))  # 1 / (1 - 0.975) is 40.00000000000004


def channel_axis(op: QuantizableOp, conv_axis: int) -> int:
    """The feature axis of a layer's input: `conv_axis` for conv and other modules (torch.ao's axis), the last
    axis for linear and matmul inputs."""
    return conv_axis if op.kind in ("conv", "module") else -1


def reported_axis(op: QuantizableOp, conv_axis: int, observer: Any) -> int:
    """The axis a layer's input statistics were taken along, as a non-negative index once the observer has seen
    data (a linear's input [batch, tokens, features] gives 2), for the reports to name the axis they used."""
    observed = getattr(observer, "observed_axis", None)
    return int(observed) if observed is not None else channel_axis(op, conv_axis)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return str(node.target) if node.op == "call_module" else ""
    return normalize_module_path(str(list(stack.values())[-1][0]))


def with_expert_views(model: fx.GraphModule, ops: list[QuantizableOp]) -> list[QuantizableOp]:
    """`ops` and, in a grouped capture, each expert of its grouped projections as its own Linear (expert_views),
    in graph order."""
    views = expert_views(model)
    if not views:
        return ops
    order = {node: index for index, node in enumerate(model.graph.nodes)}
    return sorted([*ops, *views], key=lambda op: (order[op.node], op.expert or 0))


def leaf_module_ops(model: fx.GraphModule) -> list[QuantizableOp]:
    """Every leaf module call in graph order, as torch.ao's ModelReport sees it (ReLU, BatchNorm, pooling, ...):
    quantizable layers as they are, any other leaf module as an op of kind "module" fed by its first input."""
    layers = [op for op in with_expert_views(model, find_quantizable_ops(model)) if op.activation_inputs]
    taken = {op.fqn for op in layers}
    paths = {_module_path(n) for n in model.graph.nodes if n.op in ("call_function", "call_module", "call_method")}
    parents = {p.rsplit(".", 1)[0] for p in paths if "." in p}
    parents |= {q[:index] for q in paths for index, char in enumerate(q) if char == "."} & paths
    first: dict[str, fx.Node] = {}
    for node in model.graph.nodes:
        path = _module_path(node) if node.op in ("call_function", "call_module", "call_method") else ""
        if path and path not in taken and path not in parents and path not in first and not is_inserted(node):
            first[path] = node
    for path, node in first.items():
        source = next((a for a in node.all_input_nodes if a.op != "get_attr" and _module_path(a) != path), None)
        if source is not None:
            layers.append(QuantizableOp(node=node, kind="module", fqn=path, layer=path,
                                        handle=int(node.meta.get(HANDLE_KEY, -1)), activation_inputs=[source]))
    order = {n: i for i, n in enumerate(model.graph.nodes)}
    return sorted(layers, key=lambda op: order[op.node])


class DetectorQConfigInfo:
    """What one detector recommends for one layer."""

    def __init__(self, module_fqn: str) -> None:
        self.module_fqn = module_fqn
        self.is_activation_dynamic = False
        self.is_weight_per_channel = False
        self.is_equalization_recommended = False

    def as_override(self) -> dict[str, bool]:
        """The Int8StaticQuantizer layer override that applies the recommendation."""
        return {"per_channel": self.is_weight_per_channel, "is_dynamic": self.is_activation_dynamic}


class DetectorBase(abc.ABC):
    """A detector picks observer points, then turns the observed statistics into a report."""

    # torch.ao's names for the observers before and after a layer; qcore's observer submodules end with them
    DEFAULT_PRE_OBSERVER_NAME = "model_report_pre_observer"
    DEFAULT_POST_OBSERVER_NAME = "model_report_post_observer"

    def __init__(self) -> None:
        self.detector_config_info = None

    @abc.abstractmethod
    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        """{observer name: {target_node, observer_to_insert, is_post_observer, observer_args}}."""

    @abc.abstractmethod
    def get_detector_name(self) -> str:
        """A unique name; it keys the report."""

    @abc.abstractmethod
    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        """(text report, {layer fqn: {feature: value}})."""

    def get_qconfig_info(self, model: fx.GraphModule) -> dict[str, DetectorQConfigInfo]:
        """Per-layer recommendations; the default recommends nothing."""
        return {}

    def layers(self, model: fx.GraphModule) -> list[QuantizableOp]:
        """The layers this detector looks at (linear and conv by default; a grouped projection's experts each)."""
        return with_expert_views(model, [op for op in find_quantizable_ops(model)
                                         if op.kind in ("linear", "conv", "addmm")])

    def _observer(self, model: fx.GraphModule, layer: str, position: str) -> ReportObserver | None:
        try:
            return model.get_submodule(observer_name(layer, self.get_detector_name(), position))
        except AttributeError:
            return None

    def _observed_inputs(self, model: fx.GraphModule) -> list[tuple[QuantizableOp, ReportObserver]]:
        """(layer, its input's observer) of the layers whose input observer saw data, in graph order (the batches
        it queued in this model call counted)."""
        found = []
        for op in self.layers(model):
            observer = self._observer(model, op.layer, "pre")
            if observer is not None:
                deferred.run_pending(observer)
                if observer.min_val.numel():
                    found.append((op, observer))
        return found

    def _point(self, node: fx.Node, observed: fx.Node, observer, post: bool,
               op: QuantizableOp | None = None) -> dict[str, Any]:
        """An insert point; `op`, an expert of a grouped projection (expert_views), observes that expert's rows."""
        point = {DETECTOR_TARGET_NODE_KEY: node, DETECTOR_OBS_TO_INSERT_KEY: observer,
                 DETECTOR_IS_POST_OBS_KEY: post, DETECTOR_OBS_ARGS_KEY: (observed,)}
        if op is not None and op.expert is not None:
            point[DETECTOR_EXPERT_KEY] = (op.expert, op.node.args[1])
        return point


def _to_channels(weight_ranges: torch.Tensor, channels: int) -> torch.Tensor:
    """A weight's per-column ranges for `channels` input channels: a grouped conv's weight holds in/groups columns,
    repeated once per group."""
    if weight_ranges.numel() == channels:
        return weight_ranges
    if weight_ranges.numel() == 0 or channels % weight_ranges.numel():
        raise ValueError(f"a weight with {weight_ranges.numel()} input columns cannot serve {channels} input channels")
    return weight_ranges.repeat(channels // weight_ranges.numel())


def _split_list(values: list, sizes: list[int]) -> list[list]:
    """A host list of values laid end to end, cut back into its pieces of `sizes`."""
    ends = list(itertools.accumulate(sizes))
    return [values[end - size:end] for end, size in zip(ends, sizes)]


def _tolist(t: torch.Tensor) -> list:
    return (t.detach() if t.requires_grad else t).cpu().tolist()  # detach is an op even where nothing needs grad


def _scalars_on_host(rows: list[list[Any]]) -> list[list[Any]]:
    """Rows of 0-d tensors (or numbers) as Python numbers, the tensors of each device and dtype read in one copy."""
    places = [(i, j) for i, row in enumerate(rows) for j, value in enumerate(row) if isinstance(value, torch.Tensor)]
    out = [list(row) for row in rows]
    for (i, j), number in zip(places, read_to_host([rows[i][j] for i, j in places])):
        out[i][j] = number
    return out


class PerChannelDetector(DetectorBase):
    """Recommends per-channel weights for linear/conv layers quantized per tensor."""

    BACKEND_KEY = "backend"
    PER_CHAN_SUPPORTED_KEY = "per_channel_quantization_supported"
    PER_CHAN_USED_KEY = "per_channel_quantization_used"
    SUPPORTED_BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn", "qcore")

    def __init__(self, backend: str = "x86", quantizer: Quantizer | None = None) -> None:
        super().__init__()
        if backend not in self.SUPPORTED_BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {self.SUPPORTED_BACKENDS}")
        self.backend_chosen = backend
        self.quantizer = quantizer

    def get_detector_name(self) -> str:
        return "per_channel_detector"

    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        return {}  # decided from the quantizer's weight specs, no data needed

    def _weights_per_channel(self, model: fx.GraphModule) -> dict[str, bool]:
        quantizer = self.quantizer or Int8StaticQuantizer()
        # a graph prepared with this very quantizer already carries its annotations
        annotated = model if model.meta.get("qcore_quantizer") is quantizer else _annotated_copy(model, quantizer)
        used = {}
        for op in with_expert_views(annotated, find_quantizable_ops(annotated)):
            annotation = op.node.meta.get(ANNOTATION_KEY)
            spec = annotation.input_qspec_map.get(op.weight) if annotation and op.weight is not None else None
            used[op.layer] = spec is not None and getattr(spec, "qscheme", None) in (
                torch.per_channel_symmetric, torch.per_channel_affine)
        return used

    def _info(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        used = self._weights_per_channel(model)
        return {op.layer: {self.PER_CHAN_SUPPORTED_KEY: op.weight is not None,
                           self.PER_CHAN_USED_KEY: used.get(op.layer, False), self.BACKEND_KEY: self.backend_chosen}
                for op in self.layers(model)}

    def get_qconfig_info(self, model: fx.GraphModule) -> dict[str, DetectorQConfigInfo]:
        result = {}
        for layer, info in self._info(model).items():
            result[layer] = DetectorQConfigInfo(layer)
            result[layer].is_weight_per_channel = info[self.PER_CHAN_SUPPORTED_KEY]
        return result

    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        info = self._info(model)
        # torch.ao's exact wording, which tools grep for
        text = f"Further Optimizations for backend {self.backend_chosen}: \n"
        missing = [name for name, v in info.items() if v[self.PER_CHAN_SUPPORTED_KEY] and not v[self.PER_CHAN_USED_KEY]]
        for layer in missing:
            text += f"Module {layer} can be configured to use per_channel quantization.\n"
        if missing:
            text += "To use per_channel quantization, make sure the qconfig has a per_channel weight observer."
            return text, info
        return text + "No further per_channel optimizations possible.", info


def _annotated_copy(model: fx.GraphModule, quantizer: Quantizer) -> fx.GraphModule:
    from qcore.graph.capture import clone_graph_module

    copy_ = clone_graph_module(model, share_parameters=True)
    for node in copy_.graph.nodes:
        node.meta.pop(ANNOTATION_KEY, None)
    quantizer.annotate(copy_)
    return copy_


class DynamicStaticDetector(DetectorBase):
    """S = mean batch range / epoch range, before and after each layer; dynamic if S_post <= tolerance."""

    STATIONARY_STR = "stationary"
    NON_STATIONARY_STR = "non-stationary"
    CONSTANT_STR = "constant"
    INPUT_ACTIVATION_PREFIX = "input_activation_"
    OUTPUT_ACTIVATION_PREFIX = "output_activation_"
    TOLERANCE_KEY = "dynamic_static_tolerance"
    DEFAULT_DYNAMIC_REC_KEY = "dynamic_recommended"
    PRE_OBS_COMP_STAT_KEY = INPUT_ACTIVATION_PREFIX + "dynamic_static_comp_stat"
    POST_OBS_COMP_STAT_KEY = OUTPUT_ACTIVATION_PREFIX + "dynamic_static_comp_stat"
    PRE_OBS_DATA_DIST_KEY = INPUT_ACTIVATION_PREFIX + "dynamic_static_data_classification"
    POST_OBS_DATA_DIST_KEY = OUTPUT_ACTIVATION_PREFIX + "dynamic_static_data_classification"
    IS_CURRENTLY_SUPPORTED_KEY = "is_dynamic_supported"

    def __init__(self, tolerance: float = 0.5) -> None:
        super().__init__()
        self.tolerance = tolerance

    def get_detector_name(self) -> str:
        return "dynamic_vs_static_detector"

    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        points = {}
        ops = [op for op in self.layers(model) if op.activation_inputs]
        ranges = iter(fresh_ranges(2 * len(ops)))
        for op in ops:
            name = self.get_detector_name()
            points[observer_name(op.layer, name, "pre")] = self._point(
                op.node, op.activation_inputs[0], ReportObserver(per_channel=False, ranges=next(ranges)), post=False,
                op=op)
            points[observer_name(op.layer, name, "post")] = self._point(
                op.node, op.node, ReportObserver(per_channel=False, ranges=next(ranges)), post=True, op=op)
        return points

    def _classify(self, stat: float) -> str:
        if stat != stat:
            return self.CONSTANT_STR
        return self.STATIONARY_STR if stat > self.tolerance else self.NON_STATIONARY_STR

    def _info(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        info, observed = {}, []
        for op in self.layers(model):
            pre, post = self._observer(model, op.layer, "pre"), self._observer(model, op.layer, "post")
            if pre is not None and post is not None and post.num_batches_tracked:
                observed.append((op.layer, pre, post))
        stats = batch_to_epoch_ratios([observer for _, pre, post in observed for observer in (pre, post)])
        for (layer, _, _), pre_stat, post_stat in zip(observed, stats[0::2], stats[1::2]):
            info[layer] = {
                self.TOLERANCE_KEY: self.tolerance,
                # tensors, as torch.ao reports them (its visualizer plots tensor-valued features only)
                self.DEFAULT_DYNAMIC_REC_KEY: torch.tensor(post_stat <= self.tolerance),  # nan (constant): static
                self.PRE_OBS_COMP_STAT_KEY: torch.tensor(pre_stat),
                self.PRE_OBS_DATA_DIST_KEY: self._classify(pre_stat),
                self.POST_OBS_COMP_STAT_KEY: torch.tensor(post_stat),
                self.POST_OBS_DATA_DIST_KEY: self._classify(post_stat),
                self.IS_CURRENTLY_SUPPORTED_KEY: True,
            }
        return info

    def get_qconfig_info(self, model: fx.GraphModule) -> dict[str, DetectorQConfigInfo]:
        result = {}
        for layer, info in self._info(model).items():
            result[layer] = DetectorQConfigInfo(layer)
            result[layer].is_activation_dynamic = bool(info[self.DEFAULT_DYNAMIC_REC_KEY])
        return result

    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        info = self._info(model)
        lines = ["Dynamic vs. static quantization suggestions:"]
        keys = (self.DEFAULT_DYNAMIC_REC_KEY, self.PRE_OBS_COMP_STAT_KEY, self.POST_OBS_COMP_STAT_KEY)
        numbers = _scalars_on_host([[entry[key] for key in keys] for entry in info.values()])
        for (layer, entry), (dynamic, before, after) in zip(info.items(), numbers):
            kind = "dynamic" if bool(dynamic) else "static"
            lines.append(f"\t{layer}: {kind} quantization is recommended; the data before it is "
                         f"{entry[self.PRE_OBS_DATA_DIST_KEY]} (S={before:.3f}) "
                         "and after it "
                         f"{entry[self.POST_OBS_DATA_DIST_KEY]} (S={after:.3f}), "
                         f"tolerance {self.tolerance}.")
        if not info:
            lines.append("\tNo linear or conv layers were observed.")
        return "\n".join(lines) + "\n", info


class InputWeightEqualizationDetector(DetectorBase):
    """s_c = sqrt(w_c/W) / sqrt(i_c/I); a channel qualifies if t <= s_c <= 1/t, a layer if >= 40% do."""

    WEIGHT_PREFIX = "weight_"
    ACTIVATION_PREFIX = "input_activation_"
    PER_CHANNEL_MAX_KEY = "per_channel_max"
    PER_CHANNEL_MIN_KEY = "per_channel_min"
    GLOBAL_MAX_KEY = "global_max"
    GLOBAL_MIN_KEY = "global_min"
    RECOMMENDED_KEY = "input_weight_equalization_recommended"
    COMP_METRIC_KEY = "input_weight_channel_comparison_metrics"
    THRESHOLD_KEY = "input_weight_threshold"
    CHANNEL_KEY = "input_weight_channel_axis"
    DEFAULT_RECOMMEND_INPUT_WEIGHT_CHANNEL_RATIO = 0.4

    def __init__(self, ratio_threshold: float, ch_axis: int = 1) -> None:
        super().__init__()
        if not 0 < ratio_threshold < 1:
            raise ValueError("ratio_threshold must be > 0 and < 1")
        self.ratio_threshold = ratio_threshold
        self.ch_axis = ch_axis

    def get_detector_name(self) -> str:
        return "input_weight_equalization_detector"

    def layers(self, model: fx.GraphModule) -> list[QuantizableOp]:
        return with_expert_views(model, [op for op in find_quantizable_ops(model)
                                         if op.kind in ("linear", "conv") and op.weight is not None])

    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        points = {}
        ops = [op for op in self.layers(model) if op.activation_inputs]
        for op, ranges in zip(ops, fresh_ranges(len(ops))):
            observer = ReportObserver(ch_axis=channel_axis(op, self.ch_axis), ranges=ranges)
            points[observer_name(op.layer, self.get_detector_name(), "pre")] = self._point(
                op.node, op.activation_inputs[0], observer, post=False, op=op)
        return points

    def _weight_ranges(self, model: fx.GraphModule, op: QuantizableOp) -> tuple[torch.Tensor, torch.Tensor]:
        # a weight the graph reads through a view of a parameter (a slice, a transpose) is that view's value
        node = op.weight
        assert node is not None, f"layer {op.layer} has no weight"
        weight = _fetch(model, op.weight_target) if node.op == "get_attr" or node.meta.get(REWRITTEN_KEY) \
            else weight_value(model, node)
        if op.expert is not None:  # one expert of a grouped projection: its slice of the [E, out, in] weight
            weight = weight[op.expert]
        return weight_column_ranges(weight.detach())

    def _info(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        # every layer's channels laid end to end, one chain of ops and one host read for all layers on a device;
        # each layer's extremes are its own segment's (segment_reduce keeps a nan, as max() and min() do)
        groups: dict[tuple, list[tuple[QuantizableOp, ReportObserver, torch.Tensor, torch.Tensor]]] = {}
        observed = self._observed_inputs(model)
        for op, observer in observed:
            w_min, w_max = self._weight_ranges(model, op)
            key = (observer.min_val.device, observer.min_val.dtype, observer.max_val.dtype, w_min.device, w_min.dtype,
                   w_max.dtype)
            groups.setdefault(key, []).append((op, observer, w_min, w_max))
        found = {}
        for members in groups.values():
            sizes = [observer.min_val.numel() for _, observer, _, _ in members]
            lengths = deferred.segment_lengths(members[0][1].min_val.device, tuple(sizes))
            in_min = torch.cat([observer.min_val for _, observer, _, _ in members])
            in_max = torch.cat([observer.max_val for _, observer, _, _ in members])
            w_low = torch.cat([_to_channels(w_min, n) for (_, _, w_min, _), n in zip(members, sizes)])
            w_high = torch.cat([_to_channels(w_max, n) for (_, _, _, w_max), n in zip(members, sizes)])
            in_top, in_bottom, w_top, w_bottom = (torch.segment_reduce(values, reduction, lengths=lengths) for
                                                  values, reduction in ((in_max, "max"), (in_min, "min"),
                                                                        (w_high, "max"), (w_low, "min")))
            input_ratio = (in_max - in_min) / (in_top - in_bottom).repeat_interleave(lengths)
            weight_ratio = (w_high - w_low) / (w_top - w_bottom).repeat_interleave(lengths)
            comparison = torch.sqrt(weight_ratio) / torch.sqrt(input_ratio)
            recommended = _split_list(_tolist((comparison >= self.ratio_threshold)
                                              & (comparison <= 1 / self.ratio_threshold)), sizes)
            for (op, observer, w_min, w_max), flags, (metric, layer_max, layer_min), extremes in zip(
                    members, recommended, zip(*(torch.split(t, sizes) for t in (comparison, in_max, in_min))),
                    zip(*(t.unbind() for t in (in_top, in_bottom, w_top, w_bottom)))):
                found[op.layer] = {
                    self.RECOMMENDED_KEY: flags,
                    self.COMP_METRIC_KEY: metric, self.THRESHOLD_KEY: self.ratio_threshold,
                    self.CHANNEL_KEY: reported_axis(op, self.ch_axis, observer),
                    self.ACTIVATION_PREFIX + self.PER_CHANNEL_MAX_KEY: layer_max,
                    self.ACTIVATION_PREFIX + self.PER_CHANNEL_MIN_KEY: layer_min,
                    self.ACTIVATION_PREFIX + self.GLOBAL_MAX_KEY: extremes[0],
                    self.ACTIVATION_PREFIX + self.GLOBAL_MIN_KEY: extremes[1],
                    self.WEIGHT_PREFIX + self.PER_CHANNEL_MAX_KEY: w_max,
                    self.WEIGHT_PREFIX + self.PER_CHANNEL_MIN_KEY: w_min,
                    self.WEIGHT_PREFIX + self.GLOBAL_MAX_KEY: extremes[2],
                    self.WEIGHT_PREFIX + self.GLOBAL_MIN_KEY: extremes[3],
                }
        return {op.layer: found[op.layer] for op, _ in observed}  # in graph order

    def is_layer_recommended(self, entry: dict[str, Any]) -> bool:
        """At least 40% of the layer's channels qualify."""
        flags = entry[self.RECOMMENDED_KEY]
        return bool(flags) and sum(flags) / len(flags) >= self.DEFAULT_RECOMMEND_INPUT_WEIGHT_CHANNEL_RATIO

    def get_qconfig_info(self, model: fx.GraphModule) -> dict[str, DetectorQConfigInfo]:
        result = {}
        for layer, entry in self._info(model).items():
            result[layer] = DetectorQConfigInfo(layer)
            result[layer].is_equalization_recommended = self.is_layer_recommended(entry)
        return result

    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        info = self._info(model)
        lines = ["Input-weight equalization suggestions:"]
        for layer, entry in info.items():
            flags = entry[self.RECOMMENDED_KEY]
            verdict = "use" if self.is_layer_recommended(entry) else "do not use"
            lines.append(f"\t{layer}: {verdict} input-weight equalization; {sum(flags)}/{len(flags)} channels have "
                         f"a comparison metric within [{self.ratio_threshold}, {1 / self.ratio_threshold:.3f}].")
        if not info:
            lines.append("\tNo linear or conv layers were observed.")
        return "\n".join(lines) + "\n", info


class OutlierDetector(DetectorBase):
    """A channel has outliers when its mean q100/q_ref ratio exceeds ratio_threshold."""

    INPUT_ACTIVATION_PREFIX = "input_activation_"
    OUTLIER_KEY = "outliers_detected"
    NUM_BATCHES_KEY = "outlier_detection_batches_used"
    IS_SUFFICIENT_BATCHES_KEY = "outlier_detection_is_sufficient_batches"
    COMP_METRIC_KEY = "outlier_detection_percentile_ratios"
    RATIO_THRES_KEY = "outlier_detection_ratio_threshold"
    REF_PERCENTILE_KEY = "outlier_detection_reference_percentile"
    CHANNEL_AXIS_KEY = "outlier_detection_channel_axis"
    MAX_VALS_KEY = INPUT_ACTIVATION_PREFIX + "per_channel_max"
    CONSTANT_COUNTS_KEY = "constant_batch_counts"

    def __init__(self, ratio_threshold: float = 3.5, reference_percentile: float = 0.975,
                 fraction_batches_used_threshold: float = 0.95, ch_axis: int = 1,
                 expert_min_batch_tokens: int = 0) -> None:
        """`expert_min_batch_tokens`: an expert's batch (the tokens its router sent it) with fewer tokens gives
        no ratio, as a batch where a channel is all zero gives none for it (0: every batch counts, as in torch.ao;
        see percentile_estimate_tokens)."""
        super().__init__()
        if not 0 <= reference_percentile <= 1:
            raise ValueError("reference_percentile must be between 0 and 1")
        if not 0 <= fraction_batches_used_threshold <= 1:
            raise ValueError("fraction_batches_used_threshold must be between 0 and 1")
        if isinstance(expert_min_batch_tokens, bool) or not isinstance(expert_min_batch_tokens, int) or \
                expert_min_batch_tokens < 0:
            raise ValueError(f"expert_min_batch_tokens must be a whole number of at least 0, got "
                             f"{expert_min_batch_tokens!r}")
        self.ratio_threshold = ratio_threshold
        self.reference_percentile = reference_percentile
        self.fraction_batches_used_threshold = fraction_batches_used_threshold
        self.ch_axis = ch_axis
        self.expert_min_batch_tokens = expert_min_batch_tokens

    def get_detector_name(self) -> str:
        return "outlier_detector"

    def layers(self, model: fx.GraphModule) -> list[QuantizableOp]:
        """Every leaf module, as in torch.ao (quantizable layers, and ReLU, BatchNorm, pooling, ...)."""
        return leaf_module_ops(model)

    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        points = {}
        ops = self.layers(model)
        experts = expert_layers(model)
        for op, ranges in zip(ops, fresh_ranges(len(ops))):
            fewest = self.expert_min_batch_tokens if op.expert is not None or op.layer in experts else 0
            observer = ReportObserver(ch_axis=channel_axis(op, self.ch_axis), percentiles=(self.reference_percentile,),
                                      ranges=ranges, min_ratio_values=fewest)
            points[observer_name(op.layer, self.get_detector_name(), "pre")] = self._point(
                op.node, op.activation_inputs[0], observer, post=False, op=op)
        return points

    def _info(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        # every layer's channels laid end to end, one chain of ops and two host reads for all layers that share
        # a device, dtypes, their percentile's row and their batch count; each value is what its layer alone gives
        groups: dict[tuple, list[tuple[QuantizableOp, ReportObserver]]] = {}
        observed = self._observed_inputs(model)
        for op, observer in observed:
            row = observer.percentiles.index(self.reference_percentile)
            buffers = (observer.ratio_sums, observer.ratio_counts, observer.constant_channels, observer.max_val)
            key = (observer.ratio_sums.device, *(t.dtype for t in buffers), observer.ratio_sums.shape[0], row,
                   observer.num_batches_tracked)
            groups.setdefault(key, []).append((op, observer))
        found = {}
        for (*_, row, total), members in groups.items():
            observers = [observer for _, observer in members]
            sizes = [observer.min_val.numel() for observer in observers]
            counts = torch.cat([observer.ratio_counts for observer in observers], 1)[row]
            ratios = average_ratio_values(torch.cat([observer.ratio_sums for observer in observers], 1)[row],
                                          counts).abs()
            ratios = torch.where(ratios < 1, 1 / ratios, ratios)  # magnitude either way; nan stays nan
            used = counts.to(torch.int32)  # torch.ao's dtype
            outliers = _split_list(_tolist(ratios > self.ratio_threshold), sizes)  # nan (all-zero) is no outlier
            sufficient = _split_list(_tolist(used / max(total, 1) >= self.fraction_batches_used_threshold), sizes)
            constant = torch.cat([observer.constant_channels for observer in observers]).to(torch.int32)
            maxima = torch.cat([observer.max_val for observer in observers])
            for (op, observer), layer_outliers, layer_sufficient, values in zip(
                    members, outliers, sufficient, zip(*(torch.split(t, sizes) for t in (ratios, used, constant,
                                                                                       maxima)))):
                found[op.layer] = {
                    self.CHANNEL_AXIS_KEY: reported_axis(op, self.ch_axis, observer),
                    self.REF_PERCENTILE_KEY: self.reference_percentile,
                    self.RATIO_THRES_KEY: self.ratio_threshold, self.COMP_METRIC_KEY: values[0],
                    self.NUM_BATCHES_KEY: values[1], self.OUTLIER_KEY: layer_outliers,
                    self.IS_SUFFICIENT_BATCHES_KEY: layer_sufficient,
                    self.CONSTANT_COUNTS_KEY: values[2], self.MAX_VALS_KEY: values[3],
                }
        return {op.layer: found[op.layer] for op, _ in observed}  # in graph order

    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        info = self._info(model)
        lines = ["Outlier detection report:"]
        found = False
        for layer, entry in info.items():
            if any(entry[self.OUTLIER_KEY]):  # read once per layer, not once per channel
                found = True
                max_vals, ratios = _tolist(entry[self.MAX_VALS_KEY]), _tolist(entry[self.COMP_METRIC_KEY])
                lines.extend(f"\t{layer}, channel {channel}: outliers in the input (max value {max_vals[channel]:.4g}, "
                             f"ratio {ratios[channel]:.3g} > {self.ratio_threshold})."
                             for channel, outlier in enumerate(entry[self.OUTLIER_KEY]) if outlier)
            constant = [c for c, n in enumerate(_tolist(entry[self.CONSTANT_COUNTS_KEY])) if n]
            if constant:
                found = True
                lines.append(f"\t{layer}: channels {constant} were constant in some batches.")
        lines.append("Outlier detection is reliable for stationary inputs; check them with DynamicStaticDetector."
                     if found else "No outliers were found in the activations.")
        return "\n".join(lines) + "\n", info


def _fetch(module: torch.nn.Module, target: str) -> torch.Tensor:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value
