"""SmoothQuant-style smoothing: migrate activation outliers into the weights of the layers that read them.

For a group of linear layers that read one tensor X, each input channel j gets
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (W: the group's weights side by side). The layers' weight columns
are multiplied by s and X is divided by s where it is produced, so the float model is unchanged:

- LayerNorm: its weight and bias are divided by s;
- RMSNorm (`aten.rms_norm`, or `x * rsqrt(...) * weight`): its weight is divided by s;
- a Linear: its output rows and bias are divided by s;
- the value projection of an attention whose output projection is the group: per-channel scaling passes
  through the attention-weighted sum and the head split and merge, so the value projection's rows absorb s.

Anything else is refused with its reason: a nonlinearity between producer and layer (GELU), another user of
X such as a residual add (the scale would leak into it), a tied weight. alpha is fixed, or "search": per group,
the alpha of a grid whose fake-quantized group outputs are closest to the float ones on the first calibration
batch (the input quantized with the qparams the whole calibration gives it), after one statistics pass.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.capture import clone_graph_module
from qcore.graph.deferred import RuleFactors, rewrite
from qcore.graph.ops import FQN_KEY, QuantizableOp, fetch_attr, find_quantizable_ops, op_kind
from qcore.graph.rewritable import equalization_refusal
from qcore.observe.qparams import (
    calculate_qparams,
    fake_quantize_per_channel,
    fake_quantize_scaled_rows,
    scaled_row_extremes,
)
from qcore.quantization.calibrate import calibrate
from qcore.runtime import scratch

__all__ = ["ALPHA_GRID", "SmoothingGroup", "smooth", "smoothing_alpha", "smoothing_groups"]

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
_ALPHAS_ELEMENTS = 1 << 24  # of an input or weight scaled for several alphas at once (64 MB of float32)
_CHANNEL_VIEWS = {"view", "reshape", "_unsafe_view", "transpose", "permute", "flatten", "contiguous", "clone",
                  "unflatten"}
_ROW_SELECTIONS = {"select", "slice", "getitem"}


@dataclass
class SmoothingGroup:
    """Layers that read one tensor, and what produces it."""

    layers: list[str]
    producer: str          # "layernorm", "rmsnorm", "linear" or "attention_value"
    producer_name: str     # the producing module's FQN (or node name)
    input_node: fx.Node
    ops: list[QuantizableOp] = field(default_factory=list)
    producer_node: fx.Node | None = None
    alpha: float = math.nan


def _base(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    return str(getattr(target, "_opname", None) or getattr(target, "__name__", "") or target)


def _param_target(node: Any) -> str | None:
    return str(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _producer_of(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.Node] | str:
    """(kind, node) of what computes `node` in a way a per-channel scale can be folded into; else the reason."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.LayerNorm) and module.weight is not None:
            return "layernorm", node
        if isinstance(module, nn.RMSNorm) and module.weight is not None:
            return "rmsnorm", node
        return f"its input comes from {type(module).__name__}, which cannot absorb a scale"
    if node.op == "placeholder":
        return f"its input is the model's input {node.name}, which no op produces, so nothing can absorb a scale"
    base = _base(node)
    if base in ("layer_norm",) and len(node.args) > 2 and _param_target(node.args[2]):
        return "layernorm", node
    if base == "rms_norm" and len(node.args) > 2 and _param_target(node.args[2]):
        return "rmsnorm", node
    if base == "mul" and any(_param_target(a) for a in node.args[:2]):
        weight = next(a for a in node.args[:2] if _param_target(a))
        if getattr(fetch_attr(gm, str(weight.target)), "dim", lambda: 0)() == 1:
            return "rmsnorm", node
    kind = op_kind(node, gm)
    if kind == "linear" and _param_target(node.args[1]):
        return "linear", node
    value = _attention_value(gm, node)
    if value is not None:
        return "attention_value", value
    return f"its input comes from {base or node.op}, which is not linear in the scaled channel"


def _value_users(node: fx.Node) -> list[fx.Node]:
    """The users that read a node's values (an FX trace also reads `.shape` or `.size()` of it)."""
    return [u for u in node.users if _base(u) not in ("getattr", "size", "dim", "sym_size")]


def _through_views(node: fx.Node) -> fx.Node:
    while node.op in ("call_function", "call_method") and _base(node) in _CHANNEL_VIEWS and \
            len(_value_users(node)) == 1:
        node = node.args[0]
    return node


def _attention_value(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The value-projection linear behind an attention output (matmul(probs, v) or SDPA, through head views)."""
    attention = _through_views(node) if _base(node) in _CHANNEL_VIEWS else node
    kind = op_kind(attention, gm)
    if kind in ("matmul", "bmm") and len(attention.args) > 1:
        value = attention.args[1]
    elif kind == "sdpa":
        value = attention.args[2]
    else:
        return None
    if not isinstance(value, fx.Node) or len(_value_users(value)) != 1:
        return None
    value = _through_views(value)
    if op_kind(value, gm) == "linear" and _param_target(value.args[1]) and len(_value_users(value)) == 1:
        return value
    return None


def smoothing_groups(gm: fx.GraphModule, layers: Sequence[str] | None = None) -> tuple[list[SmoothingGroup],
                                                                                          dict[str, str]]:
    """The groups that smoothing can rewrite, and {layer: reason} for the linear layers it must leave alone."""
    by_input: dict[fx.Node, list[QuantizableOp]] = {}
    refused: dict[str, str] = {}
    for op in find_quantizable_ops(gm):
        if op.kind != "linear" or op.weight is None or (layers is not None and op.layer not in layers):
            continue
        reason = equalization_refusal(gm, op)
        if reason:
            refused[op.layer] = reason
            continue
        source = op.node.args[0]
        while isinstance(source, fx.Node) and _base(source) in _ROW_SELECTIONS and source.args and \
                _selects_rows(source):
            source = source.args[0]
        by_input.setdefault(source, []).append(op)
    groups = []
    for source, ops in by_input.items():
        names = [op.layer for op in ops]
        found = _producer_of(gm, source)
        if isinstance(found, str):
            refused.update({name: found for name in names})
            continue
        leaks = [u.name for u in _value_users(source) if u not in {op.node for op in ops} and not _leads_to(u, ops)]
        if leaks:
            reason = (f"its input also feeds {', '.join(leaks)} (a residual add?), into which the scale would leak")
            refused.update({name: reason for name in names})
            continue
        kind, producer = found
        group = SmoothingGroup(names, kind, str(producer.meta.get(FQN_KEY, "")) or producer.name, source, ops,
                               producer)
        problem = _producer_problem(gm, group)
        if problem:
            refused.update({name: problem for name in names})
            continue
        groups.append(group)
    refused.update(_grouped_refusals(gm, layers))
    return groups, refused


def _grouped_refusals(gm: fx.GraphModule, layers: Sequence[str] | None) -> dict[str, str]:
    """{expert layer: why smoothing leaves it alone} of a grouped capture's projections: each expert reads its own
    rows of its block's routed tokens, so no producer's channels are its alone to rescale."""
    from qcore.graph.grouped import find_grouped_ops

    refused: dict[str, str] = {}
    for op in find_grouped_ops(gm):
        names = [name for name in op.layers if layers is None or name in layers]
        found = _producer_of(gm, op.routed) if names else ""
        reason = found if isinstance(found, str) else (
            f"it reads its expert's rows of the tokens {found[1].name} routes to every expert of its block, so no "
            "producer's channels are its own to rescale")
        refused.update(dict.fromkeys(names, reason))
    return refused


def _producer_problem(gm: fx.GraphModule, group: SmoothingGroup) -> str:
    """Why the producer cannot take the scale: a shared parameter, or channels that do not line up."""
    targets = _producer_targets(gm, group)
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in targets]
    if any(len(n.users) > 1 for n in readers) or len(readers) > len(set(targets)):
        return f"{group.producer_name}'s parameters are shared with other ops (tied), so they cannot be rescaled"
    channels = {int(fetch_attr(gm, t).shape[0]) for t in targets}
    widths = {int(fetch_attr(gm, op.weight_target).shape[1]) for op in group.ops}
    if len(channels | widths) != 1:
        return (f"the channels of {group.producer_name} ({sorted(channels)}) do not line up with the layers' inputs "
                f"({sorted(widths)})")
    return ""


def _selects_rows(node: fx.Node) -> bool:
    """select/slice/indexing that keeps the last (channel) dimension whole."""
    if _base(node) == "getitem":
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        return Ellipsis not in items and len(items) < 3 and not (len(items) >= 1 and items[-1] is Ellipsis)
    dim = node.args[1] if len(node.args) > 1 else 0
    return isinstance(dim, int) and dim >= 0


def _leads_to(node: fx.Node, ops: list[QuantizableOp]) -> bool:
    targets = {op.node for op in ops}
    while node not in targets:
        if _base(node) not in _ROW_SELECTIONS or len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return True


class _ChannelStats(nn.Module):
    """Per-channel (last axis) min and max of a group's input, and its first batch (for the alpha search)."""

    def __init__(self, keep_first: bool = False) -> None:
        super().__init__()
        self.low: torch.Tensor | None = None
        self.high: torch.Tensor | None = None
        self.weights: list[torch.Tensor] = []
        self.keep_first = keep_first
        self.first: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        low, high = flat.amin(0), flat.amax(0)
        self.low = low if self.low is None else torch.minimum(self.low, low)
        self.high = high if self.high is None else torch.maximum(self.high, high)
        if self.keep_first and self.first is None:
            self.first = flat.clone()
        return x

    def best_alpha(self, grid: Sequence[float] = ALPHA_GRID) -> float:
        """The alpha of the grid whose fake-quantized group outputs on the first batch are closest to the float
        ones, the input quantized with the qparams the whole calibration gives it."""
        signal, noises = self.alpha_errors(grid)
        sqnr = 10 * torch.log10(signal / noises.clamp(min=1e-30))
        return float(grid[int(torch.argmax(sqnr))])

    def alpha_errors(self, grid: Sequence[float] = ALPHA_GRID) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's float output energy on the first batch, each alpha's squared error of the fake-quantized
        outputs), float64. The alphas' scaled inputs and weights are quantized together (per alpha along a first
        dimension: each alpha's qparams and values are those it would get alone); each alpha's matmul then runs
        on its own copies, as alone (the CPU's matmul roundings depend on where its operands lie in memory)."""
        assert self.first is not None and self.low is not None and self.high is not None
        flat = self.first
        weights = [weight.float() for weight in self.weights]  # one float32 copy each, not one per alpha
        references = [flat @ weight.t() for weight in weights]
        signal = sum(reference.double().square().sum() for reference in references)
        scales = self.scales(grid)
        # x / s is monotone per channel, so its range is the observed channel ranges divided by s
        steps, zero_points = calculate_qparams((self.low / scales).amin(1), (self.high / scales).amax(1), -128, 127,
                                               False)
        noises = torch.zeros(len(grid), dtype=torch.float64, device=flat.device)
        largest = max([flat.numel(), *(weight.numel() for weight in weights)])
        chunk = max(1, _ALPHAS_ELEMENTS // max(1, largest))  # alphas at a time: a bounded copy of each
        for begin in range(0, len(grid), chunk):
            part = slice(begin, begin + chunk)
            # each chunk-sized value is dropped as soon as its errors are summed: one weight's quantized copies are
            # alive at once besides the inputs' (never the last weight's beside the next one's)
            quantized_x = _apart(fake_quantize_per_channel(flat[None] / scales[part, None, :], steps[part],
                                                           zero_points[part], 0, -128, 127, in_place=True))
            errors = []
            for weight, reference in zip(weights, references):
                # each alpha's scaled weight, quantized per row into a tensor of its own; on the CPU the native
                # kernels scale as they read, so no scaled copy is made
                low, high = scaled_row_extremes(weight, scales[part])  # [alphas, out]
                row_steps, row_zero_points = calculate_qparams(low.reshape(-1), high.reshape(-1), -127, 127, True)
                quantized_w = fake_quantize_scaled_rows(weight, scales[part], row_steps, row_zero_points, -127, 127)
                del low, high
                errors.append(torch.stack([(reference - x @ w.t()).double().square().sum()
                                           for x, w in zip(quantized_x, quantized_w)]))
                del quantized_w
            del quantized_x
            total = errors[0]
            for error in errors[1:]:  # weight by weight, in the order a single alpha adds them
                total = total + error
            noises[part] = total
        return signal, noises

    def scale(self, alpha: float) -> torch.Tensor:
        """s for one alpha from the observed activation range and the group's weights (the row `scales` made, while
        neither has changed since)."""
        known = self.__dict__.get("_known_scales")
        if known is not None and self._same_terms(known[0]) and alpha in known[1]:
            return known[1][alpha]
        return self._scale(alpha, *self._scale_terms())

    def scales(self, grid: Sequence[float]) -> torch.Tensor:
        """[len(grid), channels]: each alpha's s (scale(alpha), to the bit), in one chain of ops but the powers; kept
        for scale() until the ranges or the weights change."""
        activation, weight = self._scale_terms()  # alike for every alpha: made once
        found = torch.stack([activation.pow(alpha) for alpha in grid]) / torch.stack([weight.pow(1 - alpha)
                                                                                     for alpha in grid])
        found = self._usable(found)
        self.__dict__["_known_scales"] = (self._terms_key(), dict(zip(grid, found.unbind(0))))
        return found

    def _terms_key(self) -> tuple:
        """What the scales are made of: the ranges and the weights (each as it is now)."""
        return (self.low, self.high, [(weight, weight._version) for weight in self.weights])

    def _same_terms(self, key: tuple) -> bool:
        low, high, weights = key
        return (low is self.low and high is self.high and len(weights) == len(self.weights)
                and all(w is now and version == now._version for (w, version), now in zip(weights, self.weights)))

    def _scale_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(activation, weight) magnitudes per channel that every alpha's s is made of."""
        assert self.low is not None and self.high is not None
        activation = torch.maximum(self.low.abs(), self.high.abs()).clamp(min=1e-5)
        weight = torch.stack([w.abs().amax(0).float() for w in self.weights]).amax(0).clamp(min=1e-5)
        return activation, weight

    @staticmethod
    def _scale(alpha: float, activation: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _ChannelStats._usable(activation.pow(alpha) / weight.pow(1 - alpha))

    @staticmethod
    def _usable(scale: torch.Tensor) -> torch.Tensor:
        """Scales that are no positive number become 1; the others are kept within [1e-4, 1e4]."""
        return torch.where(torch.isfinite(scale) & (scale > 0), scale, 1.0).clamp(1e-4, 1e4)


def _apart(stacked: torch.Tensor) -> list[torch.Tensor]:
    """The slices of `stacked` along its first dimension, each in an allocation of its own, in one op."""
    return list(torch._foreach_mul(list(stacked.unbind(0)), 1.0))  # x * 1.0 is x, bit for bit


def smoothing_alpha(recipe: str) -> float | str:
    """The alpha of an equalize recipe: "smooth" (0.5), "smooth:search" or "smooth:<alpha>"; ValueError if bad."""
    _, _, value = recipe.partition(":")
    if not value:
        return 0.5
    if value == "search":
        return "search"
    try:
        alpha = float(value)
    except ValueError:
        alpha = math.nan
    if not 0 <= alpha <= 1:
        raise ValueError(f"equalize={recipe!r}: the alpha after 'smooth:' must be 'search' or a number in [0, 1]")
    return alpha


def smooth(gm: fx.GraphModule, calibration: Iterable[Any], alpha: float | str = 0.5,
           layers: Sequence[str] | None = None, *, deferred: bool = False,
           searched: Mapping[tuple[str, str], tuple[float | None, torch.Tensor]] | None = None) -> fx.GraphModule:
    """A float-equivalent copy of `gm` with the activation outliers of each smoothable group migrated into the
    group's weights. alpha: a number in [0, 1], or "search" (the best of ALPHA_GRID per group).

    The copy's meta["qcore_smoothing"] lists each group ({"layers", "producer", "producer_name", "alpha"}),
    meta["qcore_smoothing_refused"] the layers left alone with the reason. deferred=True: the rewritten weights are
    computed when needed (qcore.graph.deferred), not held. `searched`: {("smoothing", layer): (alpha, s)} found on the
    same graph and batches before (a measurement's rewrite_scales); with alpha="search" and every group's layers in
    it, no calibration pass observes the groups again.
    """
    if alpha != "search" and not (isinstance(alpha, (int, float)) and 0 <= float(alpha) <= 1):
        raise ValueError(f"alpha must be a number in [0, 1] or 'search', not {alpha!r}")
    batches = list(calibration)
    smoothed = clone_graph_module(gm, share_parameters=True)  # rewrites assign new tensors: the rest is shared
    groups, refused = smoothing_groups(smoothed, layers)
    known = _known_searches(groups, searched) if alpha == "search" else None
    if known is not None:
        for group, (best, scale) in zip(groups, known):
            group.alpha = best
            _rewrite(smoothed, group, scale, deferred)
    elif groups:
        stats = observe_groups(smoothed, groups, batches, keep_first=alpha == "search")
        for group, observer in zip(groups, stats):
            group.alpha = observer.best_alpha() if alpha == "search" else float(alpha)
            _rewrite(smoothed, group, observer.scale(group.alpha), deferred)
    smoothed.meta["qcore_smoothing"] = [{"layers": g.layers, "producer": g.producer, "producer_name": g.producer_name,
                                         "alpha": g.alpha} for g in groups]
    smoothed.meta["qcore_smoothing_refused"] = refused
    smoothed.graph.lint()
    smoothed.recompile()
    return smoothed


def _known_searches(groups: list[SmoothingGroup],
                    searched: Mapping[tuple[str, str], tuple[float | None, torch.Tensor]] | None
                    ) -> list[tuple[float, torch.Tensor]] | None:
    """Each group's (alpha, s) from `searched` when all of its layers share one there; None when any group is
    missing (then the groups are observed again)."""
    found = []
    for group in groups:
        entries = [(searched or {}).get(("smoothing", layer)) for layer in group.layers]
        first = entries[0]
        if first is None or first[0] is None or any(entry is None or entry[1] is not first[1] for entry in entries):
            return None
        found.append((float(first[0]), first[1]))
    return found


def observe_groups(gm: fx.GraphModule, groups: list[SmoothingGroup], batches: list, keep_first: bool
                   ) -> list[_ChannelStats]:
    """Channel ranges of each group's input in one pass over a copy (and its first batch, with keep_first)."""
    probe = clone_graph_module(gm, share_parameters=True)
    names = {node.name: node for node in probe.graph.nodes}
    observers = []
    for index, group in enumerate(groups):
        observer = group_observer(gm, group, keep_first)
        node = names[group.input_node.name]
        probe.add_submodule(f"qcore_smooth_{index}", observer)
        with probe.graph.inserting_after(node):
            probe.graph.call_module(f"qcore_smooth_{index}", (node,))
        observers.append(observer)
    probe.recompile()
    calibrate(probe, batches)
    return observers


def group_observer(gm: fx.GraphModule, group: SmoothingGroup, keep_first: bool) -> _ChannelStats:
    """An observer of the group's input channel ranges that knows the group's float weights."""
    observer = _ChannelStats(keep_first)
    observer.weights = [fetch_attr(gm, op.weight_target).detach() for op in group.ops]  # upcast where used
    return observer


def _rewrite(gm: fx.GraphModule, group: SmoothingGroup, scale: torch.Tensor, deferred: bool = False) -> None:
    column_factors = RuleFactors(lambda weight: scale.to(weight).reshape(1, -1))
    row_factors = RuleFactors(lambda value: scale.to(value).reshape(-1, *([1] * (value.dim() - 1))))

    def columns(weight: torch.Tensor) -> torch.Tensor:
        return scratch.elementwise(torch.mul, weight, column_factors(weight))

    def rows(value: torch.Tensor) -> torch.Tensor:
        return scratch.elementwise(torch.div, value, row_factors(value))

    for op in group.ops:
        rewrite(gm, op.weight_target, columns, deferred)
    for target in _producer_targets(gm, group):
        rewrite(gm, target, rows, deferred)


def _producer_targets(gm: fx.GraphModule, group: SmoothingGroup) -> list[str]:
    """The producer's parameters that take 1/s: LayerNorm weight and bias, RMSNorm weight, linear rows and bias."""
    producer = group.producer_node
    assert producer is not None
    if group.producer in ("layernorm", "rmsnorm") and producer.op == "call_module":
        module = gm.get_submodule(str(producer.target))
        has_bias = getattr(module, "bias", None) is not None
        targets = [f"{producer.target}.weight"] + ([f"{producer.target}.bias"] if has_bias else [])
    elif group.producer == "layernorm":
        targets = [t for t in (_param_target(producer.args[2]), _param_target(producer.args[3])
                               if len(producer.args) > 3 else None) if t]
    elif group.producer == "rmsnorm" and _base(producer) == "rms_norm":
        targets = [str(producer.args[2].target)]
    elif group.producer == "rmsnorm":
        targets = [next(str(a.target) for a in producer.args[:2] if _param_target(a))]
    else:  # a linear, or the value projection: its output rows and bias
        targets = [t for t in (_param_target(producer.args[1]),
                               _param_target(producer.args[2]) if len(producer.args) > 2 else None) if t]
    return targets
