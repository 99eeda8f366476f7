"""Fold eval-mode BatchNorm into the conv or linear before it, as torchao's prepare_pt2e and torch.ao's fusion do,
and weights computed from parameters alone (weight norm and other parametrizations) into constants.

The folded op keeps its node, so its module FQN and debug handle, and the layer is reported under the conv's
name. Folded weights are new attributes of the GraphModule: the user's model is never changed.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from qcore.graph.ops import FQN_KEY, WEIGHT_VIEWS, aten, normalize_module_path, op_kind

__all__ = ["FoldedBatchNorm", "fold_batch_norm", "fold_computed_weights", "linear_from_transposed_weight_matmuls"]


@dataclass(frozen=True)
class FoldedBatchNorm:
    """One BatchNorm folded into the layer before it (module FQNs)."""

    layer: str
    batch_norm: str


@dataclass
class _Norm:
    output: fx.Node          # the node whose users read the normalized value
    nodes: list[fx.Node]     # every node to erase
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    mean: torch.Tensor
    var: torch.Tensor
    eps: float
    fqn: str


def _fetch(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op != "get_attr":
        raise LookupError("not a constant")
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value.detach()


def _batch_norm_after(gm: fx.GraphModule, producer: fx.Node) -> _Norm | None:
    """The eval-mode BatchNorm that is the only user of `producer`, with its statistics."""
    if len(producer.users) != 1:
        return None
    node = next(iter(producer.users))
    if node.args[:1] != (producer,):
        return None
    try:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
                return None
            return _Norm(node, [node], _opt(module.weight), _opt(module.bias), module.running_mean.detach(),
                         module.running_var.detach(), float(module.eps), str(node.target))
        if node.target is aten.batch_norm.default and node.args[5] is False:
            weight, bias, mean, var = (_fetch(gm, a) for a in node.args[1:5])
            return _Norm(node, [node], weight, bias, mean, var, float(node.args[7]), _fqn(node))
        if node.target is aten._native_batch_norm_legit_no_training.default:
            getters = list(node.users)
            if any(g.target is not operator.getitem or g.args[1] != 0 for g in getters) or len(getters) != 1:
                return None
            weight, bias, mean, var = (_fetch(gm, a) for a in node.args[1:5])
            return _Norm(getters[0], [getters[0], node], weight, bias, mean, var, float(node.args[6]), _fqn(node))
        if node.target in (F.batch_norm, torch.batch_norm):
            return _functional(gm, node)
    except LookupError:  # statistics that are computed, not stored: nothing to fold
        return None
    return None


def _functional(gm: fx.GraphModule, node: fx.Node) -> _Norm | None:
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if bound.get("training", False) or bound.get("running_mean") is None:
        return None
    mean, var = _fetch(gm, bound["running_mean"]), _fetch(gm, bound["running_var"])
    assert mean is not None and var is not None
    return _Norm(node, [node], _fetch(gm, bound.get("weight")), _fetch(gm, bound.get("bias")), mean, var,
                 float(bound.get("eps", 1e-5)), _fqn(node))


def _opt(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.detach()


def _fqn(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return normalize_module_path(str(list(stack.values())[-1][0])) if stack else str(node.meta.get(FQN_KEY, ""))


def _new_attribute(gm: fx.GraphModule, stem: str, value: torch.Tensor) -> str:
    name = "qcore_folded_" + "".join(c if c.isalnum() else "_" for c in stem)
    while hasattr(gm, name):
        name += "_"
    gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
    return name


def _foldable(node: fx.Node, gm: fx.GraphModule) -> str | None:
    kind = op_kind(node, gm)
    if kind not in ("conv", "linear") or node.op != "call_function" or len(node.args) < 2:
        return None
    if node.target is aten.convolution.default and node.args[6]:  # transposed: another weight layout
        return None
    if kind == "linear":
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 2:  # BatchNorm1d normalizes dim 1 of [N, C] only
            return None
    return kind


def fold_batch_norm(gm: fx.GraphModule) -> list[FoldedBatchNorm]:
    """Fold every eval-mode BatchNorm that directly and solely follows a conv or linear (in place)."""
    folded = []
    for node in list(gm.graph.nodes):
        if _foldable(node, gm) is None:
            continue
        norm = _batch_norm_after(gm, node)
        if norm is None:
            continue
        try:
            weight = _fetch(gm, node.args[1])
            bias = _fetch(gm, node.args[2]) if len(node.args) > 2 else _fetch(gm, node.kwargs.get("bias"))
        except LookupError:
            continue
        if weight is None or weight.shape[0] != norm.mean.shape[0]:
            continue
        scale = (norm.weight.double() if norm.weight is not None else 1.0) / torch.sqrt(norm.var.double() + norm.eps)
        shift = norm.bias.double() if norm.bias is not None else 0.0
        new_weight = (weight.double() * scale.reshape(-1, *[1] * (weight.dim() - 1))).to(weight.dtype)
        base = bias.double() if bias is not None else torch.zeros_like(norm.mean, dtype=torch.float64)
        new_bias = ((base - norm.mean.double()) * scale + shift).to(weight.dtype)
        layer = str(node.meta.get(FQN_KEY, "")) or _fqn(node)
        with gm.graph.inserting_before(node):
            weight_node = gm.graph.get_attr(_new_attribute(gm, f"{layer}_weight", new_weight))
            bias_node = gm.graph.get_attr(_new_attribute(gm, f"{layer}_bias", new_bias))
        args = list(node.args)
        args[1] = weight_node
        if len(args) > 2:
            args[2] = bias_node
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        else:
            args.append(bias_node)
        node.args = tuple(args)
        norm.output.replace_all_uses_with(node)
        for erased in norm.nodes:
            gm.graph.erase_node(erased)
        folded.append(FoldedBatchNorm(layer, norm.fqn))
    if folded:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return folded


def _constant_value(gm: fx.GraphModule, node: object, values: dict[fx.Node, object]) -> object:
    """The value of `node` when it depends on parameters and constants only; LookupError otherwise."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (list, tuple)):
            return type(node)(_constant_value(gm, item, values) for item in node)
        return node
    if node in values:
        return values[node]
    if node.op == "get_attr":
        value: object = _fetch(gm, node)
    elif node.op == "call_function" and not node.meta.get("qcore_inserted"):
        args = [_constant_value(gm, a, values) for a in node.args]
        kwargs = {k: _constant_value(gm, v, values) for k, v in node.kwargs.items()}
        with torch.no_grad():
            value = node.target(*args, **kwargs)
    else:
        raise LookupError("not a constant")
    values[node] = value
    return value


def _op_name(node: fx.Node) -> str:
    return str(getattr(node.target, "_opname", None) or getattr(node.target, "__name__", ""))


def _erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase `node` and, behind it, the nodes that computed only it."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current.users or current.op not in ("call_function", "get_attr"):
            continue
        inputs = list(current.all_input_nodes)
        gm.graph.erase_node(current)
        pending.extend(inputs)


def fold_computed_weights(gm: fx.GraphModule) -> list[str]:
    """Replace each conv/linear weight that the graph computes from parameters alone (torch.nn.utils weight norm
    and other parametrizations: `aten._weight_norm(v, g)`) by its value, in place, as inference does once. The
    quantizers then see the weight the layer uses. Returns the layers' FQNs."""
    folded = []
    for node in list(gm.graph.nodes):
        kind = op_kind(node, gm)
        if kind not in ("conv", "linear") or node.op != "call_function" or len(node.args) < 2:
            continue
        weight = node.args[1]
        if not isinstance(weight, fx.Node) or weight.op != "call_function":
            continue
        computed: dict[fx.Node, object] = {}
        try:
            value = _constant_value(gm, weight, computed)
        except LookupError:
            continue
        if all(_op_name(n) in WEIGHT_VIEWS for n in computed if n.op == "call_function"):
            continue  # a slice or view of a parameter (MultiheadAttention's in_proj) is read where it is
        if not isinstance(value, torch.Tensor):
            continue
        layer = str(node.meta.get(FQN_KEY, "")) or _fqn(node)
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(_new_attribute(gm, f"{layer}_weight", value.detach().clone()))
        constant.meta["val"] = weight.meta.get("val")
        node.args = (node.args[0], constant, *node.args[2:])
        _erase_unused(gm, weight)
        folded.append(layer)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _transposed_parameter(node: object) -> fx.Node | None:
    """The 2-D parameter read that `node` transposes (W.T, W.t(), W.transpose(0, 1), W.permute(1, 0)), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "get_attr" or len(node.users) != 1:
        return None
    value = source.meta.get("val")
    if value is None or getattr(value, "dim", lambda: 0)() != 2:
        return None
    target, rest = node.target, list(node.args[1:])
    if target in (aten.t.default, aten.numpy_T.default, torch.t) or \
            (target is aten.transpose.int and sorted(int(a) % 2 for a in rest) == [0, 1]) or \
            (target is aten.permute.default and [int(a) % 2 for a in rest[0]] == [1, 0]):
        return source
    return None


def linear_from_transposed_weight_matmuls(gm: fx.GraphModule) -> list[str]:
    """Rewrite `x @ W.T` with W a 2-D parameter (transformers' FalconLinear, hand-written linears) as
    `linear(x, W)`, in place: the same product, now seen as a layer with a weight, so that every quantizer
    (per-channel int8, the deployed formats) treats it as the linear it is. Returns the layers' FQNs."""
    rewritten = []
    for node in list(gm.graph.nodes):
        if op_kind(node, gm) != "matmul" or node.op != "call_function" or len(node.args) != 2:
            continue
        weight = _transposed_parameter(node.args[1])
        activation = node.args[0]
        if weight is None or not isinstance(activation, fx.Node) or activation.meta.get("val") is None or \
                activation.meta["val"].dim() < 1:
            continue
        transpose = node.args[1]
        node.target, node.args, node.kwargs = aten.linear.default, (activation, weight), {}
        gm.graph.erase_node(transpose)
        rewritten.append(str(node.meta.get(FQN_KEY, "")) or _fqn(node))
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
