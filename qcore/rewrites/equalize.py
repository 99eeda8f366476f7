"""Input-weight equalization (calibrated) and cross-layer equalization (data-free) as graph rewrites.

Input-weight equalization, per input channel j of a layer: s_j = sqrt(weight range_j / input range_j)
(inf/nan/0 become 1); weight columns are divided by s_j and the input is multiplied by s_j, so the float
result is unchanged while the input the quantizer sees is better balanced. When the input comes straight
from another linear/conv (through at most a relu, which is positively homogeneous), that layer's weight rows
and bias absorb s instead of a mul node.

Cross-layer equalization (Nagel et al. 2019): for conv/linear -> (relu) -> conv/linear pairs,
s_i = sqrt(r1_i * r2_i) / r2_i; the first layer's output channel i is divided by s_i and the second layer's
input channel i multiplied by s_i.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections import namedtuple
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.capture import clone_graph_module
from qcore.graph.deferred import RuleFactors, rewrite
from qcore.graph.ops import (
    FQN_KEY,
    INSERTED_KEY,
    QuantizableOp,
    expert_views,
    few_named,
    find_quantizable_ops,
    matches_layer,
    op_kind,
)
from qcore.graph.rewritable import conv_groups, equalization_refusal, fetch_tensor, node_is_transposed
from qcore.quantization.calibrate import calibrate
from qcore.runtime import scratch

__all__ = ["EqualizationError", "EqualizationQConfig", "InputEqualizationObserver", "WeightEqualizationObserver",
    "calculate_equalization_scale", "cross_layer_equalize", "cross_layer_pairs", "default_equalization_qconfig",
    "equalization_refusal", "equalize", "get_equalization_qconfig_dict", "get_layer_sqnr_dict", "input_channel_axis",
    "input_weight_scale", "input_weight_scales", "node_is_transposed", "producer_layer", "resolve_layers",
    "weight_column_factor", "weight_column_ranges", "weight_column_ranges_shared"]


class EqualizationError(ValueError):
    """A layer cannot be equalized (names the layer and the reason)."""


def _minmax_along(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    axis = axis % x.dim()
    others = [d for d in range(x.dim()) if d != axis]
    return x.amin(dim=others).float(), x.amax(dim=others).float()


# {(the weight's address, device, dtype, shape, strides, version): (the weight, its column ranges)} within
# weight_column_ranges_shared(); the weight is held so that no other tensor takes its address meanwhile
_SHARED_RANGES: contextvars.ContextVar[dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] | None] = \
    contextvars.ContextVar("qcore_weight_column_ranges_shared", default=None)


@contextlib.contextmanager
def weight_column_ranges_shared() -> Iterator[None]:
    """Within the block, weight_column_ranges reduces each weight once (the same storage, view and version):
    the input-weight equalization detector and the equalization variants' plan both read every layer's."""
    token = _SHARED_RANGES.set({})
    try:
        yield
    finally:
        _SHARED_RANGES.reset(token)


def weight_column_ranges(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max (float32) of each weight column (axis 1, the input channels); the same tensors for the same
    weight within weight_column_ranges_shared(), which their readers never change in place."""
    shared = _SHARED_RANGES.get()
    if shared is None:
        return _column_ranges(w)
    key = (w.data_ptr(), w.device, w.dtype, tuple(w.shape), w.stride(), w._version)
    if key not in shared:
        shared[key] = (w, _column_ranges(w))
    return shared[key][1]


def _column_ranges(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # a conv's kernel window first: twice as fast as one reduction over dims (0, 2, 3)
    if w.dim() == 2:
        return _minmax_along(w, 1)
    windows = w.flatten(2)
    return windows.amin(dim=2).amin(dim=0).float(), windows.amax(dim=2).amax(dim=0).float()


class InputEqualizationObserver(nn.Module):
    min_val: torch.Tensor
    max_val: torch.Tensor
    """Running min/max per input channel (the feature axis: 1 for conv, last for linear)."""

    def __init__(self, dtype: torch.dtype = torch.uint8, qscheme: torch.qscheme = torch.per_tensor_affine,
                 quant_min: int | None = None, quant_max: int | None = None, ch_axis: int = 1) -> None:
        super().__init__()
        if qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            raise TypeError("input qscheme must be per-tensor")
        self.dtype, self.qscheme, self.ch_axis = dtype, qscheme, ch_axis
        self.quant_min, self.quant_max = quant_min, quant_max
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))
        self.equalization_scale = torch.tensor(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.dim() > 5:
            raise ValueError("InputEqualizationObserver supports linear and conv inputs (2 to 5 dims)")
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        low, high = _minmax_along(x.detach(), self.ch_axis)
        if self.min_val.numel() == 0:
            self.min_val, self.max_val = low, high
        else:
            torch.minimum(self.min_val, low, out=self.min_val)
            torch.maximum(self.max_val, high, out=self.max_val)
        return x

    def get_input_minmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel (min, max)."""
        return self.min_val, self.max_val

    def set_equalization_scale(self, equalization_scale: torch.Tensor) -> None:
        """Remember the scale (for calculate_scaled_minmax)."""
        self.equalization_scale = equalization_scale

    def calculate_scaled_minmax(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The overall (min, max) of the input after scaling, for the next quantization observer."""
        if self.equalization_scale.numel() == 1 and float(self.equalization_scale) == 1.0:
            warnings.warn("call calculate_equalization_scale before calculate_scaled_minmax", stacklevel=2)
            return None, None
        return (self.min_val * self.equalization_scale).min(), (self.max_val * self.equalization_scale).max()


class WeightEqualizationObserver(nn.Module):
    min_val: torch.Tensor
    max_val: torch.Tensor
    """Min/max per weight column (input channel, axis 1)."""

    def __init__(self, dtype: torch.dtype = torch.int8, qscheme: torch.qscheme = torch.per_tensor_affine,
                 quant_min: int | None = None, quant_max: int | None = None) -> None:
        super().__init__()
        self.dtype, self.qscheme, self.quant_min, self.quant_max, self.ch_axis = dtype, qscheme, quant_min, quant_max, 1
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))
        self.equalization_scale = torch.tensor(1.0)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if w.dim() < 2 or w.dim() > 5:
            raise ValueError("WeightEqualizationObserver supports linear and conv weights (2 to 5 dims)")
        low, high = _column_ranges(w.detach())  # held as buffers: never the shared ranges
        if self.min_val.numel() == 0:
            self.min_val, self.max_val = low, high
        else:
            self.min_val, self.max_val = torch.minimum(self.min_val, low), torch.maximum(self.max_val, high)
        return w

    def get_weight_col_minmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column (min, max)."""
        return self.min_val, self.max_val

    def set_equalization_scale(self, equalization_scale: torch.Tensor) -> None:
        """Remember the scale."""
        self.equalization_scale = equalization_scale


def calculate_equalization_scale(input_obs: InputEqualizationObserver,
                                 weight_obs: WeightEqualizationObserver) -> torch.Tensor:
    """sqrt((max_w - min_w) / (max_x - min_x)) per column; 0, nan and inf become 1."""
    min_inputs, max_inputs = input_obs.get_input_minmax()
    min_weights, max_weights = weight_obs.get_weight_col_minmax()
    return _equalization_scale(min_inputs, max_inputs, min_weights, max_weights)


def equalization_scale_of_ranges(min_inputs: torch.Tensor, max_inputs: torch.Tensor, min_weights: torch.Tensor,
                                 max_weights: torch.Tensor) -> torch.Tensor:
    """calculate_equalization_scale from the input's and the weight's column ranges, elementwise (any shape)."""
    return _equalization_scale(min_inputs, max_inputs, min_weights, max_weights)


def _equalization_scale(min_inputs: torch.Tensor, max_inputs: torch.Tensor, min_weights: torch.Tensor,
                        max_weights: torch.Tensor) -> torch.Tensor:
    if min_inputs.numel() == 0 or min_weights.numel() == 0:
        warnings.warn("run the observers before calculate_equalization_scale; returning scale 1", stacklevel=2)
        return torch.tensor(1)
    if min_inputs.shape != min_weights.shape:
        raise ValueError(f"input and weight must have the same number of columns, got {tuple(min_inputs.shape)} "
                         f"and {tuple(min_weights.shape)}")
    scale = torch.sqrt((max_weights - min_weights) / (max_inputs - min_inputs))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)


EqualizationQConfig = namedtuple("EqualizationQConfig", ["input_activation", "weight"])
EqualizationQConfig.__doc__ = "Observer factories for input-weight equalization (input columns, weight columns)."
default_equalization_qconfig = EqualizationQConfig(InputEqualizationObserver, WeightEqualizationObserver)


# ---------------------------------------------------------------------------------------------------------------
# graph helpers


def _check_layer(gm: fx.GraphModule, op: QuantizableOp) -> None:
    reason = equalization_refusal(gm, op)
    if reason:
        raise EqualizationError(f"layer {op.layer}: {reason}. Remove it from the equalization mapping")


def _input_channel_scale(op: QuantizableOp, scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The per-input-channel scale laid out over the weight: [out, in/groups, ...] broadcastable."""
    groups = conv_groups(op)
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    if groups == 1:  # one row of factors, broadcast over the output channels: no weight-sized tensor
        return scale.reshape(1, in_per_group, *([1] * (weight.dim() - 2)))
    per_group = scale.reshape(groups, in_per_group)  # input channel g * in_per_group + j
    expanded = per_group.repeat_interleave(out_channels // groups, dim=0)  # row o belongs to group o // (out/groups)
    return expanded.reshape(out_channels, in_per_group, *([1] * (weight.dim() - 2)))


def _scale_weight_columns(gm: fx.GraphModule, op: QuantizableOp, scale: torch.Tensor, inverse: bool,
                          deferred: bool = False) -> None:
    factors = RuleFactors(lambda weight: _input_channel_scale(op, scale.to(weight), weight))

    def rule(weight: torch.Tensor) -> torch.Tensor:
        factor = factors(weight)
        return scratch.elementwise(torch.div if inverse else torch.mul, weight, factor)

    rewrite(gm, op.weight_target, rule, deferred)


def _scale_output_rows(gm: fx.GraphModule, op: QuantizableOp, scale: torch.Tensor, inverse: bool,
                       deferred: bool = False) -> None:
    def rule(value: torch.Tensor) -> torch.Tensor:
        factor = scale.to(value).reshape(-1, *([1] * (value.dim() - 1)))
        return scratch.elementwise(torch.div if inverse else torch.mul, value, factor)

    for node in (op.weight, op.bias):
        if node is not None:
            rewrite(gm, str(node.target), rule, deferred)


def producer_layer(gm: fx.GraphModule, op: QuantizableOp, layers: dict[fx.Node, QuantizableOp]
                   ) -> QuantizableOp | None:
    """The linear/conv whose output feeds `op` directly (or through one relu) and nothing else."""
    node = op.activation_inputs[0] if op.activation_inputs else None
    if node is None:
        return None
    if op_kind(node, gm) == "relu" and len(node.users) == 1:
        node = node.args[0]
    producer = layers.get(node)
    if producer is None or len(node.users) != 1 or producer.weight is None:
        return None
    return producer


def _channel_axis(op: QuantizableOp) -> int:
    return 1 if op.kind == "conv" else -1


def resolve_layers(gm: fx.GraphModule, equalization_mapping: Any) -> list[QuantizableOp]:
    """The layers named by a ModelReport equalization mapping, a torch.ao equalization_qconfig_dict
    ({"module_name": [(fqn, qconfig)]}), a dict or a list of FQNs (graph order). A name that is no layer's is a
    layer glob (`model.layers.3.mlp.experts.*.down_proj`; a module's name reaches its layers), as float_layers
    takes."""
    if isinstance(equalization_mapping, dict) and isinstance(equalization_mapping.get("module_name"), list):
        names = [name for name, qconfig in equalization_mapping["module_name"] if qconfig is not None]
    elif isinstance(equalization_mapping, dict):
        names = [k for k, v in equalization_mapping.items() if v is not None and v is not False and
                 not (isinstance(v, dict) and v.get("equalize") is False)]
    else:
        names = list(equalization_mapping)
    every = [*find_quantizable_ops(gm), *expert_views(gm)]  # a grouped projection's experts, each as its Linear
    ops = {op.layer: op for op in every}
    ops.update({op.fqn: op for op in ops.values() if op.fqn not in ops})
    chosen: dict[tuple[int, int | None], QuantizableOp] = {}
    missing = []
    for name in names:
        matched = [ops[name]] if name in ops else [op for op in every if matches_layer(name, *op.names)]
        if not matched:
            missing.append(name)
        chosen.update(((id(op.node), op.expert), op) for op in matched)
    if missing:
        raise EqualizationError(f"layer(s) {missing} are not quantizable ops of this graph; known layers: "
                                f"{sorted(op.layer for op in every)}")
    return [op for op in every if (id(op.node), op.expert) in chosen]


def get_layer_sqnr_dict(model_a: fx.GraphModule, model_b: fx.GraphModule, x: Any) -> dict[str, float]:
    """{layer: SQNR of model_b's output against model_a's} for the quantized layers, on one batch `x`
    (torch.ao's selective-equalization helper, through qcore's numeric suite)."""
    from qcore.graph.inputs import call_model, move_to
    from qcore.numeric import (
        OutputLogger,
        add_loggers,
        compute_sqnr,
        extend_logger_results_with_comparison,
        extract_logger_info,
    )
    from qcore.quantization.calibrate import model_device

    logged_a, logged_b = add_loggers("fp32", model_a, "int8", model_b, OutputLogger, only_quantized_layers=True)
    x = move_to(x, model_device(model_a))
    with torch.no_grad():
        call_model(logged_a, x)
        call_model(logged_b, x)
    results = extract_logger_info(logged_a, logged_b, OutputLogger, "int8")
    extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
    return {layer: float(entry["node_output"]["int8"][0]["sqnr"][0]) for layer, entry in results.items()}


def get_equalization_qconfig_dict(layer_sqnr_dict: dict[str, float], num_layers_to_equalize: int = 1) -> dict:
    """{"module_name": [(layer, default_equalization_qconfig)]} for the layers with the lowest SQNR, which
    `equalize` accepts as its mapping (torch.ao's equalization_qconfig_dict)."""
    worst = sorted(layer_sqnr_dict.items(), key=lambda item: item[1])[:num_layers_to_equalize]
    return {"module_name": [(layer, default_equalization_qconfig) for layer, _ in worst]}


def equalize(gm: fx.GraphModule, equalization_mapping: Any, calibration: Iterable[Any], *,
             deferred: bool = False, known: Mapping[tuple[str, str], tuple[Any, torch.Tensor]] | None = None
             ) -> fx.GraphModule:
    """A float-equivalent copy of `gm` with input-weight equalization applied to the mapped layers. deferred=True:
    the rewritten weights are computed when needed (qcore.graph.deferred), not held. `known`: {("input_weight", layer):
    (None, s)} found on the same graph and batches before (a measurement's rewrite_scales); when it holds every
    mapped layer, no calibration pass observes their inputs again."""
    result = clone_graph_module(gm, share_parameters=True)  # rewrites assign new tensors: the rest is shared
    ops = resolve_layers(result, equalization_mapping)
    for op in ops:
        _check_layer(result, op)
    if known is not None and all(("input_weight", op.layer) in known for op in ops):
        scales = {op.layer: known[("input_weight", op.layer)][1] for op in ops}
    else:
        batches = list(calibration)
        scales = _observed_scales(result, [op for op in ops if op.expert is None], batches) \
            if any(op.expert is None for op in ops) else {}
        if any(op.expert is not None for op in ops):
            scales.update(_observed_grouped_scales(result, [op for op in ops if op.expert is not None], batches))
        unreached = [op.layer for op in ops if op.layer not in scales]
        if unreached:  # an expert no calibration token was routed to: no range to balance, left as it is
            warnings.warn(f"no calibration batch reached the inputs of {len(unreached)} layer(s) to equalize "
                          f"({few_named(unreached)}): they are left unequalized", stacklevel=2)
            ops = [op for op in ops if op.layer in scales]
    _apply_scales(result, [op for op in ops if op.expert is None], scales, deferred)
    if any(op.expert is not None for op in ops):
        _apply_grouped_scales(result, [op for op in ops if op.expert is not None], scales, deferred)
    result.meta["qcore_equalization_scales"] = {layer: scale.tolist() for layer, scale in scales.items()}
    return result


def _observed_scales(result: fx.GraphModule, ops: list[QuantizableOp], calibration: Iterable[Any]
                     ) -> dict[str, torch.Tensor]:
    """Each op's equalization scale from its input channel ranges, observed in one calibration pass of `result`;
    an op whose input no batch reached (an expert no token was routed to) has none."""
    observers = {}
    for index, op in enumerate(ops):
        observer = InputEqualizationObserver(ch_axis=_channel_axis(op))
        name = f"qcore_equalization_observer_{index}"
        result.add_submodule(name, observer)
        with result.graph.inserting_after(op.activation_inputs[0]):
            node = result.graph.call_module(name, (op.activation_inputs[0],))
        node.meta[INSERTED_KEY] = "equalization_observer"
        observers[op.layer] = (observer, node)
    result.recompile()
    calibrate(result, calibration)
    reached = [op for op in ops if observers[op.layer][0].min_val.numel()]
    scales = dict(zip([op.layer for op in reached], input_weight_scales(
        result, [(op, *observers[op.layer][0].get_input_minmax()) for op in reached])))
    for _observer, node in observers.values():
        result.graph.erase_node(node)
        delattr(result, node.target)
    return scales


def _observed_grouped_scales(result: fx.GraphModule, experts: list[QuantizableOp], calibration: Iterable[Any]
                             ) -> dict[str, torch.Tensor]:
    """Each expert's equalization scale (experts of grouped projections: expert_views), from its rows' channel
    ranges, one observer of every expert's rows a projection, in one calibration pass; as _observed_scales gives
    its Linear's. An expert no batch routed a token to has none."""
    from qcore.observe.segmented import SegmentedPerChannelMinMaxObserver

    by_node: dict[fx.Node, list[QuantizableOp]] = {}
    for op in experts:
        by_node.setdefault(op.node, []).append(op)
    observers = []
    for index, (node, members) in enumerate(by_node.items()):
        observer = SegmentedPerChannelMinMaxObserver(fetch_tensor(result, members[0].weight_target).shape[0])
        name = f"qcore_grouped_equalization_observer_{index}"
        result.add_submodule(name, observer)
        with result.graph.inserting_before(node):
            call = result.graph.call_module(name, (node.args[0], node.args[1]))
        call.meta[INSERTED_KEY] = "equalization_observer"
        observers.append((observer, call, members))
    result.recompile()
    calibrate(result, calibration)
    scales: dict[str, torch.Tensor] = {}
    for observer, call, members in observers:
        weight = fetch_tensor(result, members[0].weight_target).detach()
        found = _equalization_scale(observer.min_val, observer.max_val, weight.amin(dim=1).float(),
                                    weight.amax(dim=1).float())
        reached = observer.observed.tolist()
        scales.update({op.layer: found[op.expert] for op in members if reached[op.expert]})
        result.graph.erase_node(call)
        delattr(result, call.target)
    return scales


def _apply_grouped_scales(gm: fx.GraphModule, experts: list[QuantizableOp], scales: dict[str, torch.Tensor],
                          deferred: bool = False) -> None:
    """Input-weight equalization of experts of grouped projections: each projection's [E, out, in] weight divided
    by each chosen expert's scale along its columns, and its rows multiplied by their expert's scale (1 for an
    expert not chosen) before it; each expert's Linear rewritten as _apply_scales rewrites it."""
    from qcore.graph.grouped import scale_rows_by_expert

    by_node: dict[fx.Node, list[QuantizableOp]] = {}
    for op in experts:
        by_node.setdefault(op.node, []).append(op)
    for node, members in by_node.items():
        weight = fetch_tensor(gm, members[0].weight_target)
        factor = torch.ones(weight.shape[0], weight.shape[2], dtype=torch.float32, device=weight.device)
        for op in members:
            factor[op.expert] = scales[op.layer].to(factor)

        def rule(value: torch.Tensor, factor: torch.Tensor = factor) -> torch.Tensor:
            return scratch.elementwise(torch.div, value, factor.to(value)[:, None, :])

        rewrite(gm, members[0].weight_target, rule, deferred)
        name = "qcore_equalization_scale_" + members[0].item.replace(".", "_")
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, factor.to(weight.dtype))  # the model's dtype
        source = node.args[0]
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
            mul = gm.graph.call_function(scale_rows_by_expert, (source, attr, node.args[1]))
        mul.meta[INSERTED_KEY] = "equalization"
        mul.meta[FQN_KEY] = members[0].fqn
        node.replace_input_with(source, mul)
    gm.graph.lint()
    gm.recompile()


def input_weight_scale(gm: fx.GraphModule, op: QuantizableOp, input_observer: InputEqualizationObserver
                       ) -> torch.Tensor:
    """The equalization scale s of one layer (1-d, per input channel) from its calibrated input observer."""
    return input_weight_scales(gm, [(op, *input_observer.get_input_minmax())])[0]


def input_weight_scales(gm: fx.GraphModule, layers: Sequence[tuple[QuantizableOp, torch.Tensor, torch.Tensor]]
                        ) -> list[torch.Tensor]:
    """input_weight_scale of several layers from their input channel ranges (min, max): each weight's column ranges
    reduced on its own, the scale's formula over all of them laid end to end, per dtype and device (elementwise:
    each layer's scale is the one it gets alone)."""
    found: list[torch.Tensor | None] = [None] * len(layers)
    groups: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for index, (op, min_inputs, max_inputs) in enumerate(layers):
        weight = fetch_tensor(gm, op.weight_target).detach()
        groups_of_conv = conv_groups(op)
        # a grouped conv's columns: channel g * in_per_group + j
        min_weights, max_weights = (_grouped_column_minmax(weight, groups_of_conv) if groups_of_conv > 1
                                    else weight_column_ranges(weight))
        if min_inputs.numel() == 0 or min_weights.numel() == 0 or min_inputs.shape != min_weights.shape \
                or min_inputs.dim() != 1:  # warned about or refused as alone
            found[index] = _equalization_scale(min_inputs, max_inputs, min_weights, max_weights).reshape(-1)
            continue
        key = (min_inputs.dtype, max_inputs.dtype, min_weights.dtype, max_weights.dtype, min_inputs.device,
               min_weights.device)
        groups.setdefault(key, []).append((index, min_inputs, max_inputs, min_weights, max_weights))
    for members in groups.values():
        ranges = [torch.cat([member[kind] for member in members]) if len(members) > 1 else members[0][kind]
                  for kind in (1, 2, 3, 4)]
        scales = _equalization_scale(*ranges)
        for member, scale in zip(members, scales.split([member[1].numel() for member in members])):
            found[member[0]] = scale
    return [scale for scale in found if scale is not None]


def input_channel_axis(op: QuantizableOp) -> int:
    """The channel axis of a linear (last) or conv (1) layer's input."""
    return _channel_axis(op)


def weight_column_factor(op: QuantizableOp, scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A per-input-channel scale laid out to multiply the weight's columns (grouped convs included)."""
    return _input_channel_scale(op, scale.to(weight), weight)


def _grouped_column_minmax(weight: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_per_group = weight.shape[0] // groups
    blocks = weight.reshape(groups, out_per_group, weight.shape[1], -1)  # group, out, in/groups, kernel
    low = blocks.amin(dim=(1, 3)).reshape(-1).float()
    high = blocks.amax(dim=(1, 3)).reshape(-1).float()
    return low, high


def _apply_scales(gm: fx.GraphModule, ops: list[QuantizableOp], scales: dict[str, torch.Tensor],
                  deferred: bool = False) -> None:
    layers = {op.node: op for op in find_quantizable_ops(gm)}
    chosen = {op.layer for op in ops}
    for op in ops:
        scale = scales[op.layer]
        _scale_weight_columns(gm, op, scale, inverse=True, deferred=deferred)
        producer = producer_layer(gm, op, layers)
        if producer is not None and producer.layer in chosen:  # connected equalized layers: no mul between them
            _scale_output_rows(gm, producer, scale, inverse=False, deferred=deferred)
            continue
        _insert_input_mul(gm, op, scale)
    gm.graph.lint()
    gm.recompile()


def _insert_input_mul(gm: fx.GraphModule, op: QuantizableOp, scale: torch.Tensor) -> None:
    source = op.activation_inputs[0]
    name = "qcore_equalization_scale_" + op.layer.replace(".", "_")
    while hasattr(gm, name):
        name += "_"
    if op.kind == "conv":  # [1, C, 1(, 1)]: the channel axis of a Conv1d/Conv2d input
        weight = fetch_tensor(gm, op.weight_target)
        shape = [1, -1] + [1] * (weight.dim() - 2)
    else:  # the feature (last) axis broadcasts from a 1-d scale
        shape = [-1]
    gm.register_buffer(name, scale.reshape(shape).to(fetch_tensor(gm, op.weight_target).dtype))  # the model's dtype
    with gm.graph.inserting_before(op.node):
        attr = gm.graph.get_attr(name)
        mul = gm.graph.call_function(torch.mul, (source, attr))
    mul.meta[INSERTED_KEY] = "equalization"
    mul.meta[FQN_KEY] = op.fqn
    op.node.replace_input_with(source, mul)


def _weight_ranges(gm: fx.GraphModule, op: QuantizableOp, axis: int) -> torch.Tensor:
    """max |w| per output channel (axis 0) or per input channel (axis 1, grouped convs included)."""
    weight = fetch_tensor(gm, op.weight_target).detach().abs()
    if axis == 0:
        return weight.reshape(weight.shape[0], -1).amax(dim=1)
    groups = conv_groups(op)
    if groups > 1:
        return _grouped_column_minmax(weight, groups)[1]
    return weight.movedim(1, 0).reshape(weight.shape[1], -1).amax(dim=1)


def cross_layer_pairs(gm: fx.GraphModule) -> list[tuple[QuantizableOp, QuantizableOp]]:
    """conv/linear -> (relu) -> conv/linear pairs whose intermediate tensor feeds only the second layer."""
    layers = {op.node: op for op in find_quantizable_ops(gm)}
    pairs = []
    for op in layers.values():
        if op.kind not in ("linear", "conv") or op.weight is None or op.weight.op != "get_attr":
            continue
        producer = producer_layer(gm, op, layers)
        if producer is not None and producer.kind in ("linear", "conv") and producer.weight is not None and \
                producer.weight.op == "get_attr":
            pairs.append((producer, op))
    return pairs


def cross_layer_equalize(gm: fx.GraphModule, iterations: int = 1) -> fx.GraphModule:
    """A float-equivalent copy of `gm` with data-free cross-layer equalization of every eligible pair."""
    result = clone_graph_module(gm, share_parameters=True)  # rewrites assign new tensors: the rest is shared
    pairs = cross_layer_pairs(result)
    for first, second in pairs:
        for op in (first, second):
            _check_layer(result, op)
    for _ in range(iterations):
        for first, second in pairs:
            r1 = _weight_ranges(result, first, axis=0)
            r2 = _weight_ranges(result, second, axis=1)
            scale = torch.sqrt(r1 * r2) / r2
            scale = torch.nan_to_num(torch.where(scale == 0, torch.ones_like(scale), scale), nan=1.0, posinf=1.0,
                                     neginf=1.0)
            _scale_output_rows(result, first, scale, inverse=True)
            _scale_weight_columns(result, second, scale, inverse=False)
    result.recompile()
    result.meta["qcore_cross_layer_equalized"] = [(a.layer, b.layer) for a, b in pairs]
    return result


