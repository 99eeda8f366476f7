"""Match the layers of a float graph and its quantized derivative, by debug handle then by layer name."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..graph import HANDLE_KEY, QuantizableOp, find_quantizable_ops, is_inserted

__all__ = ["LayerMatchError", "LayerPair", "layer_value", "match_layers", "nodes_by_handle", "target_type"]


class LayerMatchError(ValueError):
    """The two models do not come from the same capture."""


@dataclass
class LayerPair:
    """One layer present in both models."""

    layer: str
    a: QuantizableOp
    b: QuantizableOp


def match_layers(gm_a: fx.GraphModule, gm_b: fx.GraphModule) -> list[LayerPair]:
    """Pairs of matching quantizable ops, in gm_a's graph order."""
    ops_b = find_quantizable_ops(gm_b)
    by_handle = {op.handle: op for op in ops_b if op.handle >= 0}
    by_layer = {op.layer: op for op in ops_b}
    pairs = []
    for op_a in find_quantizable_ops(gm_a):
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
