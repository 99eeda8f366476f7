"""What the weight-rescaling rewrites (input-weight equalization and smoothing) can and cannot rewrite, and the
graph lookups they share. Below both equalize.py and smoothing.py."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qcore.graph.ops import QuantizableOp

__all__ = ["conv_groups", "equalization_refusal", "fetch_tensor", "node_is_transposed"]


def fetch_tensor(module: nn.Module, target: str) -> torch.Tensor:
    """The parameter or buffer at a dotted `target` of `module`."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def conv_groups(op: QuantizableOp) -> int:
    """The groups of a conv op (1 for any other op)."""
    if op.kind != "conv":
        return 1
    node = op.node
    if node.target == torch.ops.aten.convolution.default:
        return int(node.args[8])
    if "groups" in node.kwargs:
        return int(node.kwargs["groups"])
    return int(node.args[6]) if len(node.args) > 6 else 1


def node_is_transposed(node: fx.Node) -> bool:
    """True for aten.convolution nodes with transposed=True."""
    return node.target == torch.ops.aten.convolution.default and bool(node.args[6])


def equalization_refusal(gm: fx.GraphModule, op: QuantizableOp) -> str:
    """Why input-weight equalization cannot rewrite this layer ("" when it can)."""
    if op.kind not in ("linear", "conv") or op.weight is None or op.weight.op != "get_attr":
        return "only linear and conv layers with a weight parameter can be equalized"
    users = list(op.weight.users)
    if len(users) > 1:
        return (f"its weight is shared with {len(users) - 1} other op(s) (tied weights, or one module called "
                "several times), and scaling it for one call would change the others")
    weight = fetch_tensor(gm, op.weight_target)
    if op.kind == "conv" and weight.dim() not in (3, 4):
        return f"only Conv1d and Conv2d are supported, not a {weight.dim() - 2}-d conv"
    if op.node.op == "call_function" and op.kind == "conv" and node_is_transposed(op.node):
        return "transposed convolutions are not supported"
    return ""
