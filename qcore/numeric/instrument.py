"""Graph surgery for the numeric suite: loggers after layers, and shadow copies of quantized layers."""
from __future__ import annotations

import functools
import hashlib
import math
import operator
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.ops import (
    HANDLE_KEY,
    INSERTED_KEY,
    REWRITTEN_KEY,
    QuantizableOp,
    fetch_attr,
    is_inserted,
    may_change_after,
    viewed_value,
    written_after,
)
from qcore.numeric.matching import layer_value, nodes_by_handle
from qcore.observe.qparams import fake_quantize_per_tensor
from qcore.quantization.convert import QPARAMS_KEY, fake_quantize_where_read, qparams_meta_digest

__all__ = ["QPARAMS_DIGEST_KEY", "attach_after", "copy_layer_into", "linear_on_rows_together",
           "merge_repeated_shadow_inputs", "merge_repeated_shadow_weights", "makes_new_tensor",
           "pair_shadow_matmuls",
           "grid_comes_back", "qparams_digest", "reads_only", "shadow_signature", "skip_requantizations"]

_FLOAT_WEIGHT_KEY = "qcore_float_weight"  # the float weight a converted one was made from (convert's metadata)
QPARAMS_DIGEST_KEY = "qcore_qparams_digest"  # qparams_digest of the qparams, where a graph drops them
_DIGESTED_ELEMENTS = 1 << 16  # a smaller tensor that is no parameter is told by its values (a per-channel scale)


def attach_after(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module, *extra: fx.Node) -> fx.Node:
    """Add `module` as submodule `name` and call it on `node` (plus `extra` args) right after it.

    The call is a side branch: the node's users keep reading the node itself.
    """
    gm.add_submodule(name, module)
    anchor = max([node, *extra])  # fx nodes compare by their place in the graph
    with gm.graph.inserting_after(anchor):
        call = gm.graph.call_module(name, (node, *extra))
    call.meta["qcore_inserted"] = "logger"
    return call


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


class FloatNodes:
    """gm_a's original nodes by debug handle and its placeholders by name, read once for a loop of
    copy_layer_into calls (each call adds nodes, none of them original but the rewritten weights it copies, which
    it adds here as nodes_by_handle would find them)."""

    def __init__(self, gm_a: fx.GraphModule) -> None:
        self.by_handle = nodes_by_handle(gm_a)
        self.placeholders = {n.target: n for n in gm_a.graph.nodes if n.op == "placeholder"}


def copy_layer_into(
    gm_a: fx.GraphModule, op_a: QuantizableOp, op_b: QuantizableOp, b_prefix: str,
    copies: dict[fx.Node, fx.Node] | None = None, known: FloatNodes | None = None,
) -> fx.Node:
    """Copy op_b's quantized layer into gm_a, fed by gm_a's float inputs; returns the copy's result node.
    `copies`, when given, receives each copied node of gm_b with its copy in gm_a; `known`: gm_a's FloatNodes, for
    a caller that copies many layers (read from gm_a when not given).

    gm_b must be registered in gm_a under `b_prefix`, so that its weights resolve as get_attr targets.
    """
    known = known if known is not None else FloatNodes(gm_a)
    float_nodes, placeholders = known.by_handle, known.placeholders
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
            if HANDLE_KEY in env[node].meta and not is_inserted(env[node]):
                float_nodes[env[node].meta[HANDLE_KEY]] = env[node]  # as nodes_by_handle finds it from now on
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


def shadow_signature(gm_b: fx.GraphModule, op_b: QuantizableOp) -> tuple | None:
    """What a shadow copy of op_b's quantized layer (copy_layer_into) computes from its float inputs, as a value that
    two quantized graphs of the same float graph share only when their shadows compute the same values: the ops and
    their constants in order, each input by its float node, each converted weight by the float weight and qparams
    it was made from, a small tensor by its values, any other by identity. None where that cannot be told (a module
    call, a rewritten weight, a tensor constant)."""
    chain = _layer_chain(op_b)
    position = {node: index for index, node in enumerate(chain)}

    def describe(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value in position:
                return ("op", position[value])
            if value.meta.get(REWRITTEN_KEY):
                raise _Untold
            if value.op == "get_attr":
                return _attribute(gm_b, value)
            if value.op == "placeholder":
                return ("placeholder", value.target)
            if value.meta.get(HANDLE_KEY) is None:
                raise _Untold
            return ("input", value.meta[HANDLE_KEY])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *[describe(item) for item in value])
        if isinstance(value, dict):
            return ("dict", *sorted((key, describe(item)) for key, item in value.items()))
        if isinstance(value, torch.Tensor):
            raise _Untold
        return ("constant", type(value).__name__, repr(value))

    try:
        return tuple((repr(node.target), describe(node.args), describe(node.kwargs)) if node.op == "call_function"
                     else _untold() for node in chain)
    except _Untold:
        return None


class _Untold(Exception):
    """shadow_signature cannot tell what a node computes."""


def _untold() -> Any:
    raise _Untold


class _Same:
    """A tensor in a signature: equal to the same tensor object at the same version only (held, so that its id is
    not another tensor's while the signature lives)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.tensor is self.tensor and other.version == self.version

    def __hash__(self) -> int:
        return id(self.tensor)


def qparams_digest(node: fx.Node) -> str | None:
    """A digest of the qparams a converted weight node was made with (None for a node without them)."""
    if QPARAMS_DIGEST_KEY in node.meta:
        return str(node.meta[QPARAMS_DIGEST_KEY])
    qparams = node.meta.get(QPARAMS_KEY)
    return qparams_meta_digest(qparams) if qparams is not None else None


def _attribute(gm: fx.GraphModule, node: fx.Node) -> tuple:
    """A get_attr's value as shadow_signature describes it: a converted weight by the float weight and the qparams it
    was made from, a small tensor that is no parameter by its values, any other by identity and version (held by
    the signature)."""
    source = node.meta.get(_FLOAT_WEIGHT_KEY)
    if source is not None:
        digest = qparams_digest(node)
        if digest is None:
            raise _Untold
        try:  # the float weight, where the converted graph still holds it (it may have dropped it)
            weight: Any = _Same(fetch_attr(gm, str(source)))
        except AttributeError:
            weight = None
        return ("converted", str(source), weight, digest)
    value = fetch_attr(gm, str(node.target))
    if not isinstance(value, torch.Tensor):
        raise _Untold
    if not isinstance(value, nn.Parameter) and value.numel() <= _DIGESTED_ELEMENTS:  # qparams convert made, say
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return ("value", str(value.dtype), tuple(value.shape), hashlib.sha256(data.numpy().tobytes()).hexdigest())
    return ("tensor", str(node.target), _Same(value))


def merge_repeated_shadow_inputs(graph: fx.Graph) -> int:
    """Let shadow layers that quantize the same float value with the same qparams (the query, key and value
    projections of one input) share one fake quantization: the later copies read the first. Only values that no op
    changes in place are merged. Returns how many copies were erased."""
    first: dict[tuple[Any, ...], fx.Node] = {}
    repeated = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not fake_quantize_per_tensor or \
                node.meta.get("qcore_inserted") != "shadow" or node.kwargs:
            continue
        value = node.args[0]
        if not isinstance(value, fx.Node) or may_change_after(value, reads_only) or \
                any(isinstance(arg, fx.Node) for arg in node.args[1:]):
            continue
        key = (value, *node.args[1:])
        if key in first:
            repeated.append((node, first[key]))
        else:
            first[key] = node
    for node, kept in repeated:
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
    return len(repeated)


def merge_repeated_shadow_weights(graph: fx.Graph) -> int:
    """Let shadows that quantize one weight where it is read with the same qparams, one right after the other among
    the graph's weight quantizations (a layer's own shadow and a screen's that changes only its activations, both
    beside the layer), share one quantization: the later copy reads the first's, one pass over the weight a batch
    instead of one a shadow, and the quantized weight lives only until the later shadow's matmul, a few nodes on.
    Returns how many copies were erased."""
    module = graph.owning_module
    if module is None:
        return 0
    kept: tuple[fx.Node, tuple[Any, ...], torch.Tensor, torch.Tensor] | None = None
    repeated = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not fake_quantize_where_read:
            continue
        read = _weight_read(module, node)
        if read is None:
            kept = None
            continue
        key, scale, zero_point = read
        if kept is not None and kept[1] == key and _same_values(kept[2], scale) and _same_values(kept[3], zero_point):
            repeated.append((node, kept[0]))
        else:
            kept = (node, key, scale, zero_point)
    for node, first in repeated:
        node.replace_all_uses_with(first)
        graph.erase_node(node)
    return len(repeated)


# A matmul of few rows against a large weight spends most of its time reading the weight: one matmul over two inputs'
# rows reads it once, and takes less time than one matmul each. From a few hundred rows on, or against a small
# weight, it takes no less (benchmarks/bench_moe.py --shadow-pairs).
_FEW_ROWS = 128  # of each input: together at most twice this
_LARGE_WEIGHT = 1 << 19  # elements


def linear_on_rows_together(first: torch.Tensor, second: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(first), linear(second)) with one weight: one matmul over both inputs' rows where they are few and the
    weight large, else one matmul each. A row's sums may then round otherwise in their last bit than alone (the
    matmul's blocking follows its row count), as they may between two batch sizes."""
    linear = torch.ops.aten.linear.default
    rows = (math.prod(first.shape[:-1]), math.prod(second.shape[:-1]))  # a linear's input has a feature dimension
    together = (weight.dim() == 2 and weight.numel() >= _LARGE_WEIGHT and max(rows) <= _FEW_ROWS
                and first.shape[-1] == second.shape[-1] and first.dtype == second.dtype
                and first.device == second.device)
    if not together:
        return linear(first, weight, bias), linear(second, weight, bias)
    features = first.shape[-1]
    out = linear(torch.cat([first.reshape(rows[0], features), second.reshape(rows[1], features)]), weight, bias)
    return (out[:rows[0]].view(*first.shape[:-1], out.shape[-1]),
            out[rows[0]:].view(*second.shape[:-1], out.shape[-1]))


# what may lie between two shadow matmuls paired into one: nothing that writes into a buffer reused later (a weight
# quantized where read, a module's), so that each matmul's operands still hold their values where the pair runs
_BETWEEN_PAIRED = (fake_quantize_per_tensor,)


def pair_shadow_matmuls(graph: fx.Graph) -> int:
    """Let two shadow copies of one layer that multiply by the same weight one right after the other (a layer's own
    shadow and a screen's that changes only its activations, after merge_repeated_shadow_weights) run as one
    linear_on_rows_together: a large weight is then read once for the few rows an expert gets, not once a copy.
    Between the two, only per-tensor fake quantizations and attribute reads may lie; what reads the first copy's
    result there moves after the pair. Returns how many pairs were made."""
    module = graph.owning_module
    if module is None:
        return 0
    order = {node: index for index, node in enumerate(graph.nodes)}
    pairs: list[tuple[fx.Node, fx.Node]] = []
    earlier: fx.Node | None = None
    for node in graph.nodes:
        if _shadow_linear(node):
            if earlier is not None and _same_operand(module, earlier.args[1], node.args[1]) and \
                    _same_operand(module, _bias(earlier), _bias(node)):
                pairs.append((earlier, node))
                earlier = None
            else:
                earlier = node
        elif node.op not in ("get_attr", "placeholder") and not (
                node.op == "call_function" and node.target in _BETWEEN_PAIRED):
            earlier = None
    made = 0
    for first, second in pairs:
        moved = _read_between(first, second, order)
        if moved is None:
            continue
        with graph.inserting_before(second):
            together = graph.call_function(linear_on_rows_together,
                                           (first.args[0], second.args[0], second.args[1], _bias(second)))
            results = [graph.call_function(operator.getitem, (together, index)) for index in (0, 1)]
        together.meta[INSERTED_KEY] = "shadow"
        for copy, result in zip((first, second), results):
            result.meta.update(copy.meta)
            copy.replace_all_uses_with(result)
        anchor = results[1]
        for node in moved:
            anchor.append(node)
            anchor = node
        graph.erase_node(second)
        graph.erase_node(first)
        made += 1
    return made


def _shadow_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.linear.default and \
        node.meta.get(INSERTED_KEY) == "shadow" and not node.kwargs and len(node.args) in (2, 3) and \
        isinstance(node.args[0], fx.Node) and isinstance(node.args[1], fx.Node)


def _bias(node: fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else None


def _same_operand(module: nn.Module, a: Any, b: Any) -> bool:
    """Whether two arguments are one value: the same node or constant, or attributes holding one tensor."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"):
        return False
    try:
        first, second = fetch_attr(module, str(a.target)), fetch_attr(module, str(b.target))
    except AttributeError:
        return False
    return first is second


def _read_between(first: fx.Node, second: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The nodes between `first` and `second` that read `first`'s result, directly or not, in graph order (moved
    after the pair); None when `second` reads one of them or `first` itself."""
    start, end = order[first], order[second]
    reading, pending = set(), list(first.users)
    while pending:
        node = pending.pop()
        if node in reading or order.get(node, end) >= end:
            continue
        reading.add(node)
        pending.extend(node.users)
    needed, pending = set(), list(second.all_input_nodes)
    while pending:
        node = pending.pop()
        if node in needed or order.get(node, -1) <= start:
            if node is first:
                return None
            continue
        needed.add(node)
        pending.extend(node.all_input_nodes)
    if reading & needed:
        return None
    return sorted(reading, key=order.__getitem__)


def _weight_read(module: nn.Module, node: fx.Node) -> tuple[tuple[Any, ...], torch.Tensor, torch.Tensor] | None:
    """(the weight's identity and the quantization's constant arguments, its scale, its zero point) of a shadow's
    weight quantized where it is read, all read from attributes; None for any other."""
    if node.meta.get("qcore_inserted") != "shadow" or node.kwargs or len(node.args) != 6:
        return None
    weight, scale, zero_point, *constants = node.args
    if not all(isinstance(arg, fx.Node) and arg.op == "get_attr" for arg in (weight, scale, zero_point)) or \
            any(isinstance(arg, fx.Node) for arg in constants):
        return None
    values = [fetch_attr(module, str(arg.target)) for arg in (weight, scale, zero_point)]
    if not all(isinstance(value, torch.Tensor) for value in values):
        return None
    tensor = values[0]
    identity = (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor._version)
    return (identity, *constants), values[1], values[2]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def skip_requantizations(graph: fx.Graph) -> int:
    """Let each per-tensor fake quantization of a view of a value fake-quantized with the same qparams (a projection's
    output viewed as heads, then transposed) pass its input on, for the quantized graph's own run: the values are on
    that grid already, so quantizing them again gives them back bit for bit where the dtype holds a grid value to
    within a quarter step (float32, and float16 for 8-bit ranges), or where every value of the grid, as the dtype
    holds it, was quantized again and came back (bfloat16: `grid_comes_back`). A shadow copy of the layer still
    quantizes, as it reads a float value: copy the layers before. Values an op changes in place are left alone.
    Returns how many were skipped."""
    skipped = 0
    for node in list(graph.nodes):
        if _requantizes(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            skipped += 1
    return skipped


def _requantizes(node: fx.Node) -> bool:
    """Whether `node` fake-quantizes a view of a per-tensor fake quantization's value with its qparams, where that
    gives the same values (see skip_requantizations)."""
    if not makes_new_tensor(node) or node.kwargs or len(node.args) != 5 or \
            any(isinstance(arg, fx.Node) for arg in node.args[1:]):
        return False
    value = node.args[0]
    if not isinstance(value, fx.Node):
        return False
    source = viewed_value(value)
    if source is value or not makes_new_tensor(source) or tuple(source.args[1:]) != tuple(node.args[1:]):
        return False
    dtype = getattr(value.meta.get("val"), "dtype", None)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    scale, zero_point, quant_min, quant_max = node.args[1:]
    steps = max(abs(quant_min - zero_point), abs(quant_max - zero_point))
    # a grid value k * scale in the dtype, times 1 / scale, is k to within steps * eps / 2 (plus float32's roundings)
    if steps * torch.finfo(dtype).eps > 0.25 and not grid_comes_back(scale, zero_point, quant_min, quant_max, dtype):
        return False
    # node's users then read the source's value through the views: nothing may write to it (a later fake
    # quantization reads only, and is followed as if it passed its input on)
    return not written_after(source, reads_only)


@functools.lru_cache(maxsize=4096)
def grid_comes_back(scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> bool:
    """Whether every value a per-tensor fake quantization can give in `dtype` ((q - zero_point) * scale in float32,
    rounded to the dtype, for each q of the range; NaN stays NaN) is given back, bit for bit, by quantizing it again
    with the same qparams: tried on all of them (at most 2**16 + 1), on the CPU, once per qparams and dtype."""
    if quant_max - quant_min > 1 << 16 or not quant_min <= zero_point <= quant_max:
        return False
    steps = torch.arange(quant_min - zero_point, quant_max - zero_point + 1, dtype=torch.float32)
    grid = steps.mul_(torch.tensor(scale, dtype=torch.float32)).to(dtype)
    again = fake_quantize_per_tensor(grid, scale, zero_point, quant_min, quant_max)
    bits = torch.int32 if dtype.itemsize == 4 else torch.int16
    return again.dtype == dtype and torch.equal(again.view(bits), grid.view(bits))


def reads_only(node: fx.Node) -> bool:
    """Whether `node` reads its inputs and changes none: a call attach_after added (a stash's copy or its value goes
    on), or a per-tensor fake quantization."""
    return node.meta.get("qcore_inserted") == "logger" or makes_new_tensor(node)


def makes_new_tensor(node: fx.Node) -> bool:
    """Whether `node` is a per-tensor fake quantization: a new tensor from an input it does not change."""
    return node.op == "call_function" and node.target is fake_quantize_per_tensor
