"""Graph surgery for the numeric suite: loggers after layers, and shadow copies of quantized layers."""
from __future__ import annotations

from collections.abc import Callable

from torch import fx, nn

from qcore.graph.ops import HANDLE_KEY, REWRITTEN_KEY, QuantizableOp, is_inserted
from qcore.numeric.matching import layer_value, nodes_by_handle

__all__ = ["attach_after", "copy_layer_into"]


def attach_after(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module, *extra: fx.Node) -> fx.Node:
    """Add `module` as submodule `name` and call it on `node` (plus `extra` args) right after it.

    The call is a side branch: the node's users keep reading the node itself.
    """
    gm.add_submodule(name, module)
    anchor = max([node, *extra], key=_position(gm))
    with gm.graph.inserting_after(anchor):
        call = gm.graph.call_module(name, (node, *extra))
    call.meta["qcore_inserted"] = "logger"
    return call


def _position(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: order[n]


def _layer_chain(op: QuantizableOp) -> list[fx.Node]:
    """The quantized layer's own nodes: input quantizers, the op, a fused relu, the output quantizer."""
    chain: list[fx.Node] = []
    for arg in op.node.all_input_nodes:
        run = []
        while is_inserted(arg) and arg.op != "get_attr":
            run.append(arg)
            arg = arg.args[0]
        chain.extend(reversed(run))
    chain.append(op.node)
    node = op.node
    while node is not (op.output or op.node):
        node = next(iter(node.users))
        chain.append(node)
    value = layer_value(op)
    if value is not chain[-1]:
        chain.append(value)
    return chain


def copy_layer_into(
    gm_a: fx.GraphModule, op_a: QuantizableOp, op_b: QuantizableOp, b_prefix: str,
    copies: dict[fx.Node, fx.Node] | None = None,
) -> fx.Node:
    """Copy op_b's quantized layer into gm_a, fed by gm_a's float inputs; returns the copy's result node.
    `copies`, when given, receives each copied node of gm_b with its copy in gm_a.

    gm_b must be registered in gm_a under `b_prefix`, so that its weights resolve as get_attr targets.
    """
    float_nodes = nodes_by_handle(gm_a)
    placeholders = {n.target: n for n in gm_a.graph.nodes if n.op == "placeholder"}
    env: dict[fx.Node, fx.Node] = {}
    graph = gm_a.graph
    anchor = layer_value(op_a).next

    def lookup(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if node.op == "get_attr":
            with graph.inserting_before(anchor):
                env[node] = graph.get_attr(f"{b_prefix}.{node.target}")
            return env[node]
        if node.meta.get(REWRITTEN_KEY):  # a float weight the quantized layer reads rewritten (a bias, say)
            with graph.inserting_before(anchor):
                env[node] = graph.node_copy(node, lookup)
            return env[node]
        if node.op == "placeholder" and node.target in placeholders:
            return placeholders[node.target]
        handle = node.meta.get(HANDLE_KEY)
        if handle in float_nodes:
            return float_nodes[handle]
        raise ValueError(f"layer {op_b.layer}: input {node.name} has no counterpart in the float model")

    for node in _layer_chain(op_b):
        with graph.inserting_before(anchor):
            copied = graph.node_copy(node, lookup)
        if copied.op == "call_module":
            copied.target = f"{b_prefix}.{node.target}"
        copied.meta["qcore_inserted"] = "shadow"
        env[node] = copied
    if copies is not None:
        copies.update(env)
    return env[_layer_chain(op_b)[-1]]
