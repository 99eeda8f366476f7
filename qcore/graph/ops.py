"""The quantizable ops of a captured graph, the same way for torch.export (aten) and FX graphs."""
from __future__ import annotations

import fnmatch
import functools
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["EXPERTS_KEY", "FQN_KEY", "HANDLE_KEY", "INSERTED_KEY", "LAYER_NAME_KEY", "QUANTIZABLE_KINDS",
           "QuantizableOp", "WEIGHTED_KINDS", "aten", "expert_views", "fetch_attr", "few_named", "find_quantizable_ops",
           "fused_output",
           "is_inserted", "layer_places", "observation_point",
           "last_layers", "LayerPatterns", "layer_patterns",
           "matches_layer", "op_kind", "original_input", "QUANTIZED_WHERE_READ_KEY", "REWRITTEN_KEY",
           "WEIGHT_VIEWS", "is_weight_value", "may_change_after", "normalize_module_path", "op_schema", "viewed_value",
           "weight_value", "written_after"]

FQN_KEY = "qcore_fqn"
HANDLE_KEY = "qcore_debug_handle"
INSERTED_KEY = "qcore_inserted"  # "observer" or "qdq" on nodes that qcore adds
# on a converted weight fake-quantized from the float one where it is read
QUANTIZED_WHERE_READ_KEY = "qcore_quantized_where_read"
REWRITTEN_KEY = "qcore_rewritten_weight"  # on a rewritten (equalized, smoothed) weight computed where it is read
LAYER_NAME_KEY = "qcore_layer_name"  # a layer's name in the whole model, on the ops of a block cut from it
EXPERTS_KEY = "qcore_experts"  # gm.meta: {"layers": {layer: ExpertLayer}, "blocks": {path: MoeBlock}}

aten = torch.ops.aten

# kind -> (call_function targets, call_method names)
_OP_TABLE: dict[str, tuple[set, set]] = {
    "linear": ({aten.linear.default, F.linear}, set()),
    "conv": (
        {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
         aten.conv1d.padding, aten.conv2d.padding, F.conv1d, F.conv2d, F.conv3d},
        set(),
    ),
    "matmul": ({aten.matmul.default, aten.mm.default, torch.matmul, torch.mm, operator.matmul}, {"matmul", "mm"}),
    "bmm": ({aten.bmm.default, torch.bmm}, {"bmm"}),
    "addmm": ({aten.addmm.default, torch.addmm}, {"addmm"}),
    "add": ({aten.add.Tensor, aten.add_.Tensor, torch.add, operator.add, operator.iadd}, {"add", "add_"}),
    "mul": ({aten.mul.Tensor, aten.mul_.Tensor, torch.mul, operator.mul, operator.imul}, {"mul", "mul_"}),
    "cat": ({aten.cat.default, torch.cat, torch.concat}, set()),
    "sdpa": ({aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention}, set()),
    "relu": ({aten.relu.default, aten.relu_.default, F.relu, torch.relu}, {"relu", "relu_"}),
    "passthrough": (
        {aten.max_pool2d.default, aten.max_pool1d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
         aten.adaptive_avg_pool1d.default, aten.flatten.using_ints, aten.view.default, aten.reshape.default,
         aten.permute.default, aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.unsqueeze.default, aten.contiguous.default, aten.clone.default, aten.dropout.default,
         aten.hardtanh.default, aten.hardtanh_.default,
         aten.mean.dim, aten._unsafe_view.default, aten.slice.Tensor, aten.expand.default,
         F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.dropout, F.hardtanh, F.relu6, torch.flatten,
         torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.mean},
        {"view", "reshape", "permute", "transpose", "flatten", "squeeze", "unsqueeze", "contiguous", "t", "mean",
         "expand"},
    ),
}
_MODULE_KINDS: dict[type, str] = {
    torch.nn.ReLU: "relu",
    torch.nn.MaxPool2d: "passthrough", torch.nn.MaxPool1d: "passthrough", torch.nn.AvgPool2d: "passthrough",
    torch.nn.AdaptiveAvgPool2d: "passthrough", torch.nn.AdaptiveAvgPool1d: "passthrough",
    torch.nn.Flatten: "passthrough", torch.nn.Dropout: "passthrough", torch.nn.Identity: "passthrough",
    torch.nn.Hardtanh: "passthrough", torch.nn.ReLU6: "passthrough",
}
WEIGHTED_KINDS = ("linear", "conv", "addmm")
# sdpa: its query, key and value are quantized (as the x86 inductor quantizer does), its output is not
QUANTIZABLE_KINDS = ("linear", "conv", "matmul", "bmm", "addmm", "sdpa")


# the table read the other way, the first kind of a target winning as in the table's order: one lookup a node
_FUNCTION_KINDS: dict[Any, str] = {}
_METHOD_KINDS: dict[str, str] = {}
for _kind, (_functions, _methods) in _OP_TABLE.items():
    for _function in _functions:
        _FUNCTION_KINDS.setdefault(_function, _kind)
    for _method in _methods:
        _METHOD_KINDS.setdefault(_method, _kind)


def op_kind(node: fx.Node, gm: fx.GraphModule | None = None) -> str | None:
    """Classify a node: 'linear', 'conv', 'matmul', 'bmm', 'addmm', 'add', 'mul', 'cat', 'relu', 'passthrough'."""
    if node.op == "call_function":
        return _FUNCTION_KINDS.get(node.target)
    elif node.op == "call_method":
        return _METHOD_KINDS.get(str(node.target))
    elif node.op == "call_module" and gm is not None and not node.meta.get(INSERTED_KEY):
        try:
            module = gm.get_submodule(str(node.target))
        except AttributeError:
            return None
        return _MODULE_KINDS.get(type(module))
    return None


@dataclass
class QuantizableOp:
    """One linear/conv/matmul-like op: where it is, what it reads, and where its result leaves."""

    node: fx.Node
    kind: str
    fqn: str
    layer: str
    handle: int
    activation_inputs: list[fx.Node] = field(default_factory=list)
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    output: fx.Node | None = None  # the node whose value is the layer's result (a fused relu, else the op)
    # the name of the item it is measured under, where that is not its own: an MoE expert's projection path
    # (`model.layers.3.mlp.experts.down_proj` for `model.layers.3.mlp.experts.5.down_proj`); a layer glob naming it
    # names the layer too
    item: str = ""
    # a grouped projection's (kind "grouped_linear": every expert of an MoE projection as one op): each expert's
    # layer name, as the per-expert graph names it, in expert order; its counts are node.args[1]
    expert_layers: tuple[str, ...] = ()
    # one expert of a grouped projection seen as its own Linear (expert_views): its index; `node` is the grouped op,
    # whose rows of this expert, and whose weight's slice [expert], are the layer's
    expert: int | None = None

    @property
    def names(self) -> tuple[str, str, str]:
        """The names a layer glob may give it: its layer name, its module's FQN and its item's name."""
        return self.layer, self.fqn, self.item

    @property
    def weight_target(self) -> str:
        """The attribute path of the layer's weight (of the original, for a weight rewritten where it is read);
        ValueError for a layer without one."""
        if self.weight is None:
            raise ValueError(f"layer {self.layer} has no weight")
        if self.weight.meta.get(REWRITTEN_KEY):
            return str(self.weight.meta["qcore_float_weight"])
        return str(self.weight.target)


def few_named(names: Sequence[str], shown: int = 8) -> str:
    """The first `shown` of `names`, comma-separated, and how many more there are: a message about an MoE model's
    experts names a few of hundreds."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute at a dotted get_attr target ("layers.0.weight") of a module."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def is_weight_value(node: object) -> bool:
    """True for a parameter read (get_attr), and for a converted weight quantized and a rewritten weight computed
    where they are read (values of their own, made from parameters)."""
    return isinstance(node, fx.Node) and (node.op == "get_attr" or bool(node.meta.get(QUANTIZED_WHERE_READ_KEY))
                                          or bool(node.meta.get(REWRITTEN_KEY)))


def weight_value(gm: torch.nn.Module, node: fx.Node) -> torch.Tensor:
    """The tensor a weight node reads: the attribute of a get_attr, or the weight a node computes from
    parameters (quantized or rewritten where it is read)."""
    if node.op == "get_attr":
        return fetch_attr(gm, str(node.target))
    args = [weight_value(gm, a) if isinstance(a, fx.Node) else a for a in node.args]
    return node.target(*args)


def is_inserted(node: object) -> bool:
    """True for observer and quantize/dequantize nodes that qcore inserted."""
    return isinstance(node, fx.Node) and bool(node.meta.get(INSERTED_KEY))


def original_input(node: fx.Node) -> fx.Node:
    """Walk back through inserted observer/qdq nodes to the value they stand for. An equalization mul is a value
    of its own: the layer after it reads (and its quantizer observes) the scaled input."""
    while is_inserted(node) and node.meta[INSERTED_KEY] != "equalization" and \
            not node.meta.get(QUANTIZED_WHERE_READ_KEY) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _operands(node: fx.Node, kind: str) -> tuple[list, fx.Node | None, fx.Node | None]:
    args = list(node.args)
    if kind in ("linear", "conv"):
        weight = args[1] if len(args) > 1 else node.kwargs.get("weight")
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        return [args[0]], weight, bias
    if kind == "addmm":
        bias, mat1, mat2 = args[0], args[1], args[2]
        return [mat1], mat2, bias
    if kind == "sdpa":
        return args[:3], None, None
    return args[:2], None, None


def _is_parameter(node: object) -> bool:
    return is_weight_value(node)


def fused_output(node: fx.Node, gm: fx.GraphModule) -> fx.Node:
    """The relu that directly and solely follows `node`, else `node` itself."""
    users = [u for u in node.users if not is_inserted(u)]
    observed = [u for u in node.users if u.meta.get(INSERTED_KEY) in ("observer", "qdq")]
    if len(users) == 1 and not observed and op_kind(users[0], gm) == "relu":
        return users[0]
    return node


def last_layers(gm: fx.GraphModule, layers: Iterable[str]) -> list[str]:
    """For each of the model's output values, the last of `layers` (layer names of find_quantizable_ops, graph
    order) whose output reaches it on a path through none of the others: the layer nearest that output (an LM head,
    a pooler, the last block's output projection). In graph order, each once."""
    chosen = set(layers)
    ops = [op for op in find_quantizable_ops(gm) if op.layer in chosen]
    layer_nodes = {op.node for op in ops}
    nodes = list(gm.graph.nodes)
    output = next((node for node in nodes if node.op == "output"), None)
    found: set[str] = set()
    for leaf in (output.all_input_nodes if output is not None else []):
        free: dict[fx.Node, bool] = {leaf: True}  # whether a node's value reaches the leaf through no layer
        for node in reversed(nodes):
            if node is not leaf:
                free[node] = any(user not in layer_nodes and free.get(user, False) for user in node.users)
        reaching = [op.layer for op in ops if free[op.node]]
        if reaching:
            found.add(reaching[-1])
    return [op.layer for op in ops if op.layer in found]


def layer_places(ops: Iterable[QuantizableOp]) -> dict[str, tuple[int, int, int]]:
    """{layer: its place} of `ops` (find_quantizable_ops(gm, grouped=True), in graph order), sorting as the per-expert
    graph orders its layers: a grouped capture's expert layers at their block's first projection, expert by expert,
    each expert's projections in the order they run."""
    places: dict[str, tuple[int, int, int]] = {}
    blocks: dict[str, tuple[int, int]] = {}  # block: (its first projection's place, projections so far)
    for index, op in enumerate(ops):
        if op.kind != "grouped_linear":
            places.setdefault(op.layer, (index, 0, 0))
            continue
        first, seen = blocks.get(op.fqn, (index, 0))
        blocks[op.fqn] = (first, seen + 1)
        places.update({layer: (first, expert, seen) for expert, layer in enumerate(op.expert_layers)})
    return places


def expert_views(gm: fx.GraphModule) -> list[QuantizableOp]:
    """Each expert of each grouped projection as the Linear layer it stands for (kind "linear", its layer name as
    the per-expert graph's, `expert` its index), in graph order: for the passes that look at experts one by one
    (ModelReport's detectors) on a grouped capture."""
    from qcore.graph.grouped import find_grouped_ops

    views: list[QuantizableOp] = []
    for op in find_grouped_ops(gm):  # one walk over the nodes: a graph without grouped ops costs no more
        views.extend(QuantizableOp(node=op.node, kind="linear", fqn=layer, layer=layer,
                                   handle=op.node.meta.get(HANDLE_KEY, -1),
                                   activation_inputs=[original_input(op.routed)], weight=original_input(op.weight),
                                   bias=op.bias, output=op.node, item=op.item, expert=expert)
                     for expert, layer in enumerate(op.layers))
    return views


def find_quantizable_ops(gm: fx.GraphModule, grouped: bool = False) -> list[QuantizableOp]:
    """Every quantizable op in graph order, with a layer name that is unique within the graph. With `grouped`, a
    grouped capture's grouped projections too (kind "grouped_linear", named `block.down_proj`, their experts'
    layers in expert_layers): for the passes that measure them per expert."""
    from qcore.graph.grouped import find_grouped_ops

    found: list[QuantizableOp] = []
    groups = {op.node: op for op in find_grouped_ops(gm)} if grouped else {}
    named: list[QuantizableOp] = []
    for node in gm.graph.nodes:
        if is_inserted(node):
            continue
        group = groups.get(node)
        if group is not None:
            found.append(QuantizableOp(
                node=node, kind="grouped_linear", fqn=group.block, layer=group.layer,
                handle=node.meta.get(HANDLE_KEY, -1), activation_inputs=[original_input(group.routed)],
                weight=original_input(group.weight), bias=group.bias, output=node, item=group.item,
                expert_layers=group.layers))
            continue
        kind = op_kind(node, gm)
        if kind not in QUANTIZABLE_KINDS:
            continue
        inputs, weight, bias = _operands(node, kind)
        activations = [original_input(a) if isinstance(a, fx.Node) else a for a in inputs]
        if kind in ("matmul", "bmm", "sdpa"):
            params = [a for a in activations if _is_parameter(a)]
            activations = [a for a in activations if isinstance(a, fx.Node) and not _is_parameter(a)]
            weight = params[0] if params else None
        else:
            activations = [a for a in activations if isinstance(a, fx.Node)]
        weight = original_input(weight) if isinstance(weight, fx.Node) else None
        found.append(
            QuantizableOp(
                node=node, kind=kind, fqn=node.meta.get(FQN_KEY, ""), layer="",
                handle=node.meta.get(HANDLE_KEY, -1), activation_inputs=activations,
                weight=weight, bias=bias if isinstance(bias, fx.Node) else None,
                output=node if kind == "sdpa" else fused_output(node, gm),
            )
        )
        named.append(found[-1])
    _assign_layer_names(named)
    items = getattr(gm, "meta", {}).get(EXPERTS_KEY, {}).get("layers", {})
    for op in found:
        entry = items.get(op.layer)
        if entry is not None:
            op.item = entry.projection
    return found



# ops that read a parameter as it is stored (a slice, a view, a copy): the parameter stays the weight's source
WEIGHT_VIEWS = frozenset({"getitem", "split", "split_with_sizes", "chunk", "unbind", "unflatten", "view", "reshape",
                           "t", "transpose", "permute", "contiguous", "select", "slice", "squeeze", "unsqueeze",
                           "_to_copy", "to", "detach", "clone"})


def _weight_owner(op: QuantizableOp) -> str | None:
    """The name of the module that owns the op's weight, when the op is a functional call elsewhere
    (F.linear(x, self.qkv.weight) in 'attn' -> 'attn.qkv'; MultiheadAttention's in_proj_weight -> 'mha.in_proj')."""
    source = op.weight
    for _ in range(8):  # through the split of a packed weight: in_proj_weight -> chunk/unflatten -> getitem
        if source is None or is_weight_value(source):
            break
        base = getattr(source.target, "_opname", None) or getattr(source.target, "__name__", "")
        if base not in WEIGHT_VIEWS or not source.args or not isinstance(source.args[0], fx.Node):
            return None
        source = source.args[0]
    if source is None or not is_weight_value(source):
        return None
    target = str(source.meta.get("qcore_float_weight", source.target))  # a converted weight names its float one
    if target.startswith("qcore_") or target.startswith("_"):  # qcore's own (folded) or export's lifted constants
        return None
    owner, _, attribute = target.rpartition(".")
    name = owner if attribute == "weight" else ".".join(p for p in (owner, attribute.removesuffix("_weight")) if p)
    if not name or name == op.fqn or (op.fqn and not name.startswith(op.fqn + ".")):
        return None  # a module's own weight, or one from outside the calling module: keep the FQN
    return name


def _assign_layer_names(ops: list[QuantizableOp]) -> None:
    per_fqn: dict[str, list[QuantizableOp]] = {}
    for op in ops:
        if LAYER_NAME_KEY in op.node.meta:  # a block cut from a bigger graph keeps the whole graph's names
            op.layer = str(op.node.meta[LAYER_NAME_KEY])
            continue
        per_fqn.setdefault(_weight_owner(op) or op.fqn, []).append(op)
    for fqn, group in per_fqn.items():
        if len(group) == 1 and fqn:
            group[0].layer = fqn
            continue
        counts: dict[str, int] = {}
        for op in group:
            index = counts.get(op.kind, 0)
            counts[op.kind] = index + 1
            suffix = op.kind if index == 0 else f"{op.kind}_{index}"
            op.layer = f"{fqn}.{suffix}" if fqn else suffix


def matches_layer(pattern: str, *names: str) -> bool:
    """Whether a layer glob matches any of `names` (a layer's name, its module's FQN): as a glob, or as the name of
    a module that contains the layer (`head` matches `head.1`), so that a Sequential's name reaches its layers."""
    return any(name and (fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")) for name in names)


class LayerPatterns:
    """Layer globs to match against many layers, as matches_layer does: a pattern without a wildcard is looked up
    by the layer's name and the modules that contain it, so a quantizer with one override per layer does not
    try every pattern on every layer."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = list(patterns)
        self.literal: dict[str, list[int]] = {}
        self.globs: list[tuple[int, str]] = []
        for index, pattern in enumerate(self.patterns):
            if any(character in pattern for character in "*?["):
                self.globs.append((index, pattern))
            else:
                self.literal.setdefault(pattern, []).append(index)

    def matching(self, *names: str) -> list[str]:
        """The patterns that match any of `names` (matches_layer), in their given order."""
        found: set[int] = set()
        for name in names:
            if not name:
                continue
            prefix = name  # a literal pattern matches the name itself or a module path that contains it
            while True:
                found.update(self.literal.get(prefix, ()))
                cut = prefix.rfind(".")
                if cut < 0:
                    break
                prefix = prefix[:cut]
        found.update(index for index, pattern in self.globs if matches_layer(pattern, *names))
        return [self.patterns[index] for index in sorted(found)]


@functools.lru_cache(maxsize=64)
def layer_patterns(patterns: tuple[str, ...]) -> LayerPatterns:
    """The LayerPatterns of a quantizer's override keys, made once for the many layers it annotates."""
    return LayerPatterns(patterns)


def may_change_after(node: fx.Node, passes_through: Callable[[fx.Node], bool] | None = None,
                     makes_new: Callable[[fx.Node], bool] | None = None) -> bool:
    """Whether the value of `node` may change after its op ran: an op may write to it in place, directly or through
    a view, or it is a view itself. Functional aten ops (most of a torch.export graph) cannot; module calls and
    methods (an FX graph's ReLU(inplace=True)) may, and so may any op whose schema mutates an argument (aten.relu_).
    `passes_through(user)`: a node that returns its input as it is (an observer), followed like a view;
    `makes_new(node)`: a call without an aten schema that returns a new tensor (qcore's fake quantization)."""
    if makes_new is not None and op_schema(node) is None and makes_new(node):
        return written_after(node, passes_through)
    schema = op_schema(node)
    if schema is None and node.op == "call_function" and node.target is operator.getitem and node.args and \
            isinstance(node.args[0], fx.Node):  # one result of an op with several (native_layer_norm's output)
        schema = op_schema(node.args[0])
    if schema is None or any(r.alias_info is not None for r in schema.returns):
        return True
    return written_after(node, passes_through)


def viewed_value(node: fx.Node) -> fx.Node:
    """The value a chain of view ops ends at `node` views (`node` itself when it is no view)."""
    while (schema := op_schema(node)) is not None and any(r.alias_info is not None for r in schema.returns) and \
            node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def written_after(node: fx.Node, passes_through: Callable[[fx.Node], bool] | None = None) -> bool:
    """Whether an op after `node` may write to its value in place, directly or through a view of it (an op without
    a schema may, unless `passes_through` says it returns its input as it is)."""
    pending, seen = [node], {node}
    while pending:
        for user in pending.pop().users:
            if user.op == "output" or user in seen:
                continue
            if passes_through is not None and passes_through(user):
                seen.add(user)
                pending.append(user)
                continue
            schema = op_schema(user)
            if schema is None or schema.is_mutable:
                return True
            if any(r.alias_info is not None for r in schema.returns):  # a view: writing to it writes to `node`
                seen.add(user)
                pending.append(user)
    return False


def observation_point(node: fx.Node, reader: fx.Node | None = None,
                      passes_through: Callable[[fx.Node], bool] | None = None) -> fx.Node:
    """The node after which `node`'s value is what `reader` reads: `node` itself, or the last op before `reader`
    that writes to it in place, directly or through a view (a buffer made with new_empty and filled slice by slice,
    as DeepSeek-V3's attention fills its keys). An observer inserted there sees what the reader reads."""
    pending, seen, writers = [node], {node}, set()
    while pending:
        for user in pending.pop().users:
            if user.op == "output" or user in seen:
                continue
            seen.add(user)
            if passes_through is not None and passes_through(user):
                pending.append(user)
                continue
            schema = op_schema(user)
            if schema is not None and schema.is_mutable:
                writers.add(user)
            if schema is not None and any(r.alias_info is not None for r in schema.returns):
                pending.append(user)
    last, cursor = node, node.next
    while writers and cursor.op != "root" and cursor is not reader:  # graph order, from `node` on: only when written
        if cursor in writers:
            last = cursor
            writers.discard(cursor)
        cursor = cursor.next
    return last


def op_schema(node: fx.Node) -> Any:
    """The aten schema of a call_function node, or None for anything else."""
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


# torch.export names a module reached through a slice of a ModuleList `layers.slice(None, 2, None).0` when the
# model shares a module between two paths (its tracer then records attribute accesses, not module paths)
_SLICED = re.compile(r"\.slice\((None|\d+), (?:None|-?\d+), (None|\d+)\)\.(\d+)(?=\.|$)")


def _slice_index(match: re.Match) -> str:
    start, step, index = match.group(1), match.group(2), int(match.group(3))
    return f".{(0 if start == 'None' else int(start)) + index * (1 if step == 'None' else int(step))}"


def normalize_module_path(path: str) -> str:
    """A module path as named_modules() writes it: without the tracer's root prefix, and with an element of a
    sliced ModuleList named by its index in the list (`layers.slice(None, 2, None).0` -> `layers.0`)."""
    for prefix in ("L['self'].", "L__self__.", "L['self']", "L__self__"):
        if path.startswith(prefix):
            path = path[len(prefix):]
    while ".slice(" in path:
        path, count = _SLICED.subn(_slice_index, path, count=1)
        if not count:
            break
    return path.lstrip(".")
