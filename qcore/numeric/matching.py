"""Match the layers of a float graph and its quantized derivative, by debug handle then by layer name."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from qcore.graph.ops import (
    FQN_KEY,
    HANDLE_KEY,
    QuantizableOp,
    find_quantizable_ops,
    is_inserted,
    is_weight_value,
    original_input,
)

__all__ = ["LayerMatchError", "LayerPair", "LoggedNode", "NodePair", "layer_value", "logged_node", "match_layers",
           "match_nodes", "nodes_by_handle", "target_type"]

# ops torch.ao's numeric suite does not match (shape and dtype plumbing, indexing, identities in eval mode)
_UNMATCHABLE = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "squeeze", "unsqueeze", "contiguous", "expand",
    "flatten", "clone", "detach", "alias", "slice", "select", "getitem", "size", "sym_size", "numel", "dim", "to",
    "_to_copy", "type_as", "dropout", "split", "chunk", "unbind", "repeat", "repeat_interleave", "lift_fresh_copy",
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "getattr", "float", "long", "int",
})
_UNMATCHABLE_MODULES = (torch.nn.Identity, torch.nn.Dropout, torch.nn.Flatten)
# ops with several outputs whose first one is the value torch.ao logs (an export graph's embedding_bag returns its
# bags, offsets, bag sizes and max indices; FX's nn.EmbeddingBag call returns the bags alone)
_FIRST_OUTPUT_OPS = frozenset({"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"})


class LayerMatchError(ValueError):
    """The two models do not come from the same capture."""


@dataclass
class LayerPair:
    """One layer present in both models."""

    layer: str
    a: QuantizableOp
    b: QuantizableOp


@dataclass
class LoggedNode:
    """One node the numeric suite logs: the op, the value logged as its output, and its activation inputs."""

    ref: fx.Node
    value: fx.Node
    fqn: str
    inputs: list[tuple[int, int, fx.Node]] = field(default_factory=list)  # (index_of_arg, index_within_arg, node)


@dataclass
class NodePair:
    """One node present in both models, under one layer name; quantized for linear/conv/matmul layers."""

    layer: str
    a: LoggedNode
    b: LoggedNode
    quantized: bool


def logged_node(op_or_node: QuantizableOp | fx.Node) -> LoggedNode:
    """What to log for a quantizable op (its fused result, its activation arguments) or any other node."""
    if isinstance(op_or_node, QuantizableOp):
        op = op_or_node
        inputs = [(index, 0, arg) for index, arg in enumerate(op.node.args)
                  if isinstance(arg, fx.Node) and original_input(arg) in op.activation_inputs]
        return LoggedNode(op.node, layer_value(op), op.fqn, inputs)
    node = op_or_node
    node_value = _first_output(node) or node
    inputs = []
    for index, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and not is_weight_value(arg):
            inputs.append((index, 0, arg))
        elif isinstance(arg, (list, tuple)):
            inputs += [(index, within, a) for within, a in enumerate(arg) if isinstance(a, fx.Node)]
    if node.op == "call_module" or _first_output(node) is not None:
        # torch.ao logs one input of a module call and of embedding_bag: the first that is not a parameter (the
        # indices, not the offsets), as argument 0
        inputs = [(0, within, arg) for _, within, arg in inputs[:1]]
    users = list(node_value.users)
    value = users[0] if len(users) == 1 and users[0].meta.get("qcore_inserted") == "qdq" else node_value
    return LoggedNode(node, value, str(node.meta.get(FQN_KEY, "")), inputs)


def _first_output(node: fx.Node) -> fx.Node | None:
    """The getitem(node, 0) of a multi-output op in _FIRST_OUTPUT_OPS (the value to log), else None."""
    if getattr(node.target, "_opname", None) not in _FIRST_OUTPUT_OPS:
        return None
    return next((user for user in node.users if user.op == "call_function" and user.args[1:] == (0,)
                 and getattr(user.target, "__name__", "") == "getitem"), None)


def _base_name(node: fx.Node, gm: fx.GraphModule) -> str | None:
    if node.op == "call_module":
        return None if isinstance(gm.get_submodule(str(node.target)), _UNMATCHABLE_MODULES) else "module"
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "_opname", None) or getattr(node.target, "__name__", None) or str(node.target)


def _matchable(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op not in ("call_function", "call_method", "call_module") or is_inserted(node):
        return False
    if HANDLE_KEY not in node.meta:
        return False
    if _base_name(node, gm) in _UNMATCHABLE:
        return False
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)) and _first_output(node) is not None:
        value = value[0]
    return value is None or (isinstance(value, torch.Tensor) and value.is_floating_point())


def match_nodes(gm_a: fx.GraphModule, gm_b: fx.GraphModule, only_quantized_layers: bool = False) -> list[NodePair]:
    """Every node torch.ao's numeric suite would match between A and B (by debug handle), in A's graph order:
    quantized layers under their layer names, other ops (relu, sigmoid, add, pooling, embedding_bag, ...) under
    '<module fqn>.<node name>'. only_quantized_layers keeps the quantized layers alone."""
    pairs = [NodePair(p.layer, logged_node(p.a), logged_node(p.b), True) for p in match_layers(gm_a, gm_b)]
    if not only_quantized_layers:
        taken = {p.a.ref for p in pairs} | {p.a.value for p in pairs}
        taken |= {op.output for op in find_quantizable_ops(gm_a) if op.output is not None}
        nodes_b = nodes_by_handle(gm_b)
        found = []
        for node in gm_a.graph.nodes:
            if node in taken or not _matchable(node, gm_a):
                continue
            other = nodes_b.get(node.meta[HANDLE_KEY])
            if other is not None and other.target == node.target and _matchable(other, gm_b):
                found.append((node, other))
        per_fqn: dict[str, int] = {}
        for node, _ in found:
            fqn = str(node.meta.get(FQN_KEY, ""))
            per_fqn[fqn] = per_fqn.get(fqn, 0) + 1
        names = {p.layer for p in pairs}
        for node, other in found:
            fqn = str(node.meta.get(FQN_KEY, ""))
            unique = fqn and per_fqn[fqn] == 1 and fqn not in names
            layer = fqn if unique else f"{fqn}.{node.name}" if fqn else node.name
            pairs.append(NodePair(layer, logged_node(node), logged_node(other), False))
        order = {n: i for i, n in enumerate(gm_a.graph.nodes)}
        pairs.sort(key=lambda p: order[p.a.ref])
    return pairs


def match_layers(gm_a: fx.GraphModule, gm_b: fx.GraphModule) -> list[LayerPair]:
    """Pairs of matching quantizable ops, in gm_a's graph order; a grouped capture's grouped projections among them."""
    ops_b = find_quantizable_ops(gm_b, grouped=True)
    by_handle = {op.handle: op for op in ops_b if op.handle >= 0}
    by_layer = {op.layer: op for op in ops_b}
    pairs = []
    for op_a in find_quantizable_ops(gm_a, grouped=True):
        op_b = by_handle.get(op_a.handle) if op_a.handle >= 0 else None
        if op_b is None or op_b.kind != op_a.kind:
            op_b = by_layer.get(op_a.layer)
        if op_b is not None:
            pairs.append(LayerPair(op_a.layer, op_a, op_b))
    if ops_b and not pairs:
        raise LayerMatchError("no layer of model B matches model A: compare a qcore-captured float model with its "
                              "qcore-quantized copy")
    return pairs


def layer_value(op: QuantizableOp) -> fx.Node:
    """The node whose value is the layer's result: its (fused) output, after an output quantizer if any."""
    node = op.output or op.node
    users = list(node.users)
    if len(users) == 1 and is_inserted(users[0]) and users[0].meta.get("qcore_inserted") == "qdq":
        return users[0]
    return node


def target_type(node: fx.Node, gm: fx.GraphModule) -> str:
    """A readable name of what a node calls."""
    if node.op == "call_module":
        return torch.typename(gm.get_submodule(str(node.target)))
    if node.op in ("call_function", "call_method"):
        return str(node.target) if node.op == "call_method" else torch.typename(node.target)
    return node.op


def nodes_by_handle(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Original (non-inserted) nodes keyed by debug handle."""
    return {n.meta[HANDLE_KEY]: n for n in gm.graph.nodes if HANDLE_KEY in n.meta and not is_inserted(n)}
