"""pt2e-style prepare: annotations -> union-find groups of edges/nodes -> one observer per group."""
from __future__ import annotations

from torch import fx, nn

from qcore.graph.deferred import rewritten_value
from qcore.graph.ops import (
    FQN_KEY,
    HANDLE_KEY,
    INSERTED_KEY,
    is_inserted,
    is_weight_value,
    observation_point,
    op_schema,
    original_input,
    viewed_value,
    weight_value,
    written_after,
)
from qcore.observe.observers import DerivedObserver, FixedQParamsObserver, pooled_ranges
from qcore.observe.segmented import segmented_observer
from qcore.quantization.quantizer import (
    ANNOTATION_KEY,
    DerivedQuantizationSpec,
    EdgeOrNode,
    FixedQParamsQuantizationSpec,
    QuantizationSpec,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)
from qcore.quantization.unionfind import UnionFind

__all__ = ["OBSERVER_PREFIX", "QuantizationConfigError", "create_group_observers", "get_edge_or_node_to_group_id",
    "get_edge_or_node_to_qspec", "group_specs", "prepare"]

OBSERVER_PREFIX = "qcore_observer_"


class QuantizationConfigError(ValueError):
    """The annotations cannot be turned into observers (dangling or cyclic sharing)."""


def _describe(key: object) -> str:
    if isinstance(key, tuple):
        return f"edge ({key[0]} -> {key[1]})"
    return f"node {key}"


def get_edge_or_node_to_qspec(gm: fx.GraphModule) -> dict[EdgeOrNode, QuantizationSpecBase]:
    """Map every annotated input edge (producer, consumer) and output node to its spec, in graph order."""
    mapping: dict[EdgeOrNode, QuantizationSpecBase] = {}
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION_KEY)
        if annotation is None:
            continue
        for input_node, qspec in annotation.input_qspec_map.items():
            mapping[(input_node, node)] = qspec
        if annotation.output_qspec is not None:
            mapping[node] = annotation.output_qspec
    return mapping


def _root_qspec(qspec, mapping, forest: UnionFind) -> QuantizationSpecBase:
    """Follow SharedQuantizationSpec links (through each target's group leader) to a concrete spec."""
    seen = set()
    while isinstance(qspec, SharedQuantizationSpec):
        target = qspec.edge_or_node
        if target not in forest:
            raise QuantizationConfigError(
                f"SharedQuantizationSpec points at {_describe(target)}, which has no spec. "
                "Fix: annotate that edge/node too, or share with one that is annotated."
            )
        leader = forest.leader(target)
        if leader in seen:
            # a shared spec that points at itself or into its own group adds nothing: any concrete spec of
            # the group is the group's spec
            root = forest.find(target)
            concrete = next((spec for key, spec in mapping.items()
                             if not isinstance(spec, SharedQuantizationSpec) and key in forest
                             and forest.find(key) == root), None)
            if concrete is not None:
                return concrete
            raise QuantizationConfigError(
                f"SharedQuantizationSpec links form a cycle through {_describe(target)} with no concrete spec. "
                "Fix: give one member of the group a QuantizationSpec."
            )
        seen.add(leader)
        qspec = mapping[leader]
    return qspec


_IMPLICIT_SHARING_ATTRS = ("dtype", "is_dynamic", "quant_min", "quant_max", "qscheme", "ch_axis", "scale", "zero_point")


def _compatible(a, b) -> bool:
    """Root specs that may share an observer: equal on every quantization attribute both or neither have."""
    for name in _IMPLICIT_SHARING_ATTRS:
        has_a, has_b = hasattr(a, name), hasattr(b, name)
        if has_a != has_b or (has_a and getattr(a, name) != getattr(b, name)):
            return False
    # rows by expert share an observer with rows of the same experts, quantized for the same experts, only (qcore's
    # own fields: None and () elsewhere)
    return getattr(a, "experts", None) is getattr(b, "experts", None) and \
        getattr(a, "float_experts", ()) == getattr(b, "float_experts", ()) and \
        getattr(a, "dynamic_experts", ()) == getattr(b, "dynamic_experts", ())


def _union(forest: UnionFind, mapping, parent, child) -> None:
    """pt2e's union: the parent's group leads, unless its leader's spec shares with the child's leader."""
    root_parent, root_child = forest.find(parent), forest.find(child)
    spec = mapping[forest.leader_of_root(root_parent)]
    child_leads = isinstance(spec, SharedQuantizationSpec) and spec.edge_or_node == forest.leader_of_root(root_child)
    forest.link(root_parent, root_child, child_leads=child_leads)


def get_edge_or_node_to_group_id(
        edge_or_node_to_qspec: dict[EdgeOrNode, QuantizationSpecBase]) -> dict[EdgeOrNode, int]:
    """Group ids of edges/nodes that must share one observer: explicit and implicit sharing.

    Explicit: a SharedQuantizationSpec joins its key with its target. Implicit (when the consumer's
    annotation allows it): an input edge joins the producer's other user edges and then the producer's
    output, when their root specs agree on dtype, is_dynamic, quant range, qscheme, ch_axis and fixed
    qparams. Edges are joined with the other users first and with the output second, as pt2e does
    (torchao 0.18 semantics). The find is iterative, so chains of any length work,
    and sharing targets may come before or after their users.
    """
    mapping = edge_or_node_to_qspec
    group_ids = _sharing_forest(mapping).group_ids(mapping.keys())
    group_specs(mapping, group_ids)
    return group_ids


def _sharing_forest(mapping: dict[EdgeOrNode, QuantizationSpecBase]) -> UnionFind:
    forest: UnionFind = UnionFind(mapping.keys())

    def root_or_none(qspec):
        """The concrete spec behind `qspec`; None when its links only lead back into its own group (a no-op)."""
        try:
            return _root_qspec(qspec, mapping, forest)
        except QuantizationConfigError as error:
            if "cycle" in str(error):
                return None
            raise

    def join_implicitly(edge, edge_root, other) -> None:
        if other not in mapping:
            return
        other_root = root_or_none(mapping[other])
        if edge_root is None or other_root is None or _compatible(other_root, edge_root):
            _union(forest, mapping, other, edge)

    for key, qspec in mapping.items():
        if isinstance(key, tuple):
            producer, consumer = key
            annotation = consumer.meta.get(ANNOTATION_KEY) if isinstance(consumer, fx.Node) else None
            if annotation is None or annotation.allow_implicit_sharing:
                edge_root = root_or_none(qspec)
                for user in getattr(producer, "users", ()):
                    if user is not consumer:
                        join_implicitly(key, edge_root, (producer, user))
                join_implicitly(key, edge_root, producer)
        if isinstance(qspec, SharedQuantizationSpec):
            if qspec.edge_or_node not in forest:
                raise QuantizationConfigError(
                    f"{_describe(key)} shares with {_describe(qspec.edge_or_node)}, which has no spec. "
                    "Fix: annotate the target, or point the SharedQuantizationSpec at an annotated edge/node."
                )
            _union(forest, mapping, qspec.edge_or_node, key)
    return forest


def group_specs(mapping: dict, group_ids: dict) -> dict[int, QuantizationSpecBase]:
    """Each group's spec: its first non-shared spec in key order (the one pt2e builds the observer from)."""
    specs: dict[int, QuantizationSpecBase] = {}
    for key, qspec in mapping.items():
        if not isinstance(qspec, SharedQuantizationSpec):
            specs.setdefault(group_ids[key], qspec)
    for key in mapping:
        if group_ids[key] not in specs:
            raise QuantizationConfigError(
                f"{_describe(key)} belongs to a group of SharedQuantizationSpecs that only point at each other "
                "(a cycle with no concrete spec). Fix: give one member of the group a QuantizationSpec."
            )
    return specs


def _observer_for(qspec: QuantizationSpecBase, sources: list[nn.Module]) -> nn.Module:
    if isinstance(qspec, QuantizationSpec) and qspec.format is not None:
        return qspec.observer_or_fake_quant_ctr(qspec.format)  # rows by expert: its own factory observes each
    if isinstance(qspec, QuantizationSpec):
        kwargs = {"dtype": qspec.dtype, "quant_min": qspec.quant_min, "quant_max": qspec.quant_max,
                  "is_dynamic": qspec.is_dynamic}
        if qspec.qscheme is not None:
            kwargs["qscheme"] = qspec.qscheme
        if qspec.ch_axis is not None:
            kwargs["ch_axis"] = qspec.ch_axis
        if qspec.experts is not None:  # every expert of a grouped projection at once
            observer = segmented_observer(qspec.observer_or_fake_quant_ctr, _expert_count(qspec.experts), **kwargs)
            observer.float_experts = tuple(qspec.float_experts)
            observer.dynamic_experts = tuple(qspec.dynamic_experts)
            return observer
        return qspec.observer_or_fake_quant_ctr(**kwargs)
    if isinstance(qspec, FixedQParamsQuantizationSpec):
        return FixedQParamsObserver(qspec.scale, qspec.zero_point, dtype=qspec.dtype, quant_min=qspec.quant_min,
                                    quant_max=qspec.quant_max, **({"qscheme": qspec.qscheme} if qspec.qscheme else {}))
    if isinstance(qspec, DerivedQuantizationSpec):
        kwargs = {"dtype": qspec.dtype, "quant_min": qspec.quant_min, "quant_max": qspec.quant_max}
        if qspec.qscheme is not None:
            kwargs["qscheme"] = qspec.qscheme
        if qspec.ch_axis is not None:
            kwargs["ch_axis"] = qspec.ch_axis
        return DerivedObserver(sources, qspec.derive_qparams_fn, **kwargs)
    raise QuantizationConfigError(f"unsupported spec type {type(qspec).__name__}")


def _expert_count(counts: fx.Node) -> int:
    """The experts a grouped projection's counts node counts (its length, known from the trace)."""
    value = counts.meta.get("val")
    if value is None or value.dim() != 1:
        raise QuantizationConfigError(f"the expert count of {counts.name} is not known from the trace")
    return int(value.shape[0])


def _experts_of_groups(mapping, group_ids) -> dict[int, fx.Node]:
    """{group id: counts node} of the groups observing a grouped projection's tensors per expert."""
    found: dict[int, fx.Node] = {}
    for key, qspec in mapping.items():
        counts = getattr(qspec, "experts", None)
        if counts is not None:
            found[group_ids[key]] = counts
    return found


def create_group_observers(mapping, group_ids) -> dict[int, nn.Module]:
    """One observer per group; derived groups are built after the groups they derive from."""
    pending = group_specs(mapping, group_ids)
    observers: dict[int, nn.Module] = {}
    while pending:
        progressed = False
        for gid, qspec in list(pending.items()):
            missing = [k for k in getattr(qspec, "derived_from", []) if k not in group_ids]
            if missing:
                raise QuantizationConfigError(
                    f"DerivedQuantizationSpec derives from {_describe(missing[0])}, which has no spec. "
                    "Fix: annotate that edge/node."
                )
            deps = [group_ids[k] for k in getattr(qspec, "derived_from", [])]
            if all(d in observers for d in deps):
                observers[gid] = _observer_for(qspec, [observers[d] for d in deps])
                del pending[gid]
                progressed = True
        if not progressed:
            raise QuantizationConfigError(
                "DerivedQuantizationSpec dependencies form a cycle; fix the derived_from lists.")
    return observers


def _insert_observer(gm: fx.GraphModule, after: fx.Node, observer_name: str, described: fx.Node,
                     reader: fx.Node | None = None, counts: fx.Node | None = None) -> fx.Node:
    """Observe `after`'s value right after it, or, for one `reader`, as that reader reads it (after the ops before
    it that write the value in place: observation_point). `counts`: the experts' counts of rows by expert, which
    the observer reads too (after they are computed)."""
    anchor = after if reader is None else observation_point(after, reader, _is_observer)
    if counts is not None and anchor < counts:
        anchor = counts
    with gm.graph.inserting_after(anchor):
        node = gm.graph.call_module(observer_name, (after,) if counts is None else (after, counts))
    node.meta[INSERTED_KEY] = "observer"
    node.meta[FQN_KEY] = described.meta.get(FQN_KEY, "")
    node.meta["qcore_observed_handle"] = described.meta.get(HANDLE_KEY, -1)
    if "val" in after.meta:
        node.meta["val"] = after.meta["val"]
    return node


def prepare(gm: fx.GraphModule, quantizer: Quantizer, recompile: bool = True) -> fx.GraphModule:
    """Annotate `gm` with `quantizer` and insert one observer module per sharing group (in place). The graph's
    meta["qcore_quantizer"] names the quantizer whose annotations its nodes carry. recompile=False leaves the
    code generation to a caller that edits the graph further."""
    quantizer.annotate(gm)
    gm.meta["qcore_quantizer"] = quantizer
    quantizer.validate(gm)
    mapping = get_edge_or_node_to_qspec(gm)
    group_ids = get_edge_or_node_to_group_id(mapping)
    with pooled_ranges():  # observers calibrated together: their starting ranges made a few hundred at a time
        observers = create_group_observers(mapping, group_ids)
        group_ids, observers = _after_callback(gm, quantizer, mapping, group_ids, observers)
    names = {}
    for gid, observer in observers.items():
        names[gid] = f"{OBSERVER_PREFIX}{gid}"
        gm.add_submodule(names[gid], observer)
    experts = _experts_of_groups(mapping, group_ids)

    for node in list(gm.graph.nodes):
        annotation = node.meta.get(ANNOTATION_KEY)
        if annotation is None or is_inserted(node):
            continue
        for producer in annotation.input_qspec_map:
            group = group_ids[(producer, node)]
            _observe_edge(gm, producer, node, names[group], group_ids, experts.get(group))
        if node in group_ids:
            observer_node = _insert_observer(gm, node, names[group_ids[node]], node,
                                             counts=experts.get(group_ids[node]))
            for user in list(node.users):
                if user is not observer_node:
                    user.replace_input_with(node, observer_node)
    _observe_constants_once(gm)
    _mark_held_inputs(gm)
    gm.graph.lint()
    if recompile:
        gm.recompile()
    return gm


def _is_observer(node: fx.Node) -> bool:
    return node.meta.get(INSERTED_KEY) == "observer"


def _mark_held_inputs(gm: fx.GraphModule) -> None:
    """Tell each observer that can queue a value as it is (`input_held`) whether every value it observes stays as it
    is after it (no later op writes to it in place, directly or through a view); observers pass values through."""
    held: dict[str, bool] = {}

    def is_observer(node: fx.Node) -> bool:
        return node.meta.get(INSERTED_KEY) == "observer"

    def stays(value: object) -> bool:  # a view, or an observer's output, stays as it is where its source does
        if not isinstance(value, fx.Node):
            return False
        root = viewed_value(value)
        while is_observer(root) and isinstance(root.args[0], fx.Node):
            root = viewed_value(root.args[0])
        return (root.op == "placeholder" or op_schema(root) is not None) and not written_after(root, is_observer)

    for node in gm.graph.nodes:
        if is_observer(node):
            held[str(node.target)] = held.get(str(node.target), True) and stays(node.args[0])
    for name, unchanged in held.items():
        observer = gm.get_submodule(name)
        if hasattr(observer, "input_held"):
            observer.input_held = unchanged


def _after_callback(gm, quantizer: Quantizer, mapping, group_ids, observers):
    """Let the quantizer adjust {edge or node: observer} (torchao's prepare_obs_or_fq_callback), then regroup
    the keys by the observer object each ends up with."""
    callback = getattr(quantizer, "prepare_obs_or_fq_callback", None)
    if callback is None:
        return group_ids, observers
    edge_or_node_to_obs_or_fq = {key: observers[group_ids[key]] for key in mapping}
    callback(gm, edge_or_node_to_obs_or_fq)
    regrouped: dict = {}
    by_identity: dict[int, int] = {}
    new_observers: dict[int, nn.Module] = {}
    for key in mapping:
        observer = edge_or_node_to_obs_or_fq[key]
        gid = by_identity.setdefault(id(observer), len(by_identity))
        new_observers[gid] = observer
        regrouped[key] = gid
    return regrouped, new_observers


def _observe_constants_once(gm: fx.GraphModule) -> None:
    """Observers that only ever see weights (get_attr values, or rewritten ones) observe them now, not on every
    batch."""
    readers: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(INSERTED_KEY) == "observer":
            readers.setdefault(str(node.target), []).append(node.args[0])
    for name, inputs in readers.items():
        observer = gm.get_submodule(name)
        if not hasattr(observer, "observe_constant") or not all(is_weight_value(n) for n in inputs):
            continue
        for source in inputs:
            # a deferred rewrite's weight, made for this (one)
            value = rewritten_value(gm, str(source.target)) if source.op == "get_attr" else weight_value(gm, source)
            observer.frozen = False
            observer.observe_constant(value)


def _observe_edge(gm: fx.GraphModule, producer: fx.Node, consumer: fx.Node, observer_name: str, group_ids,
                  counts: fx.Node | None = None) -> None:
    current = _current_arg(consumer, producer)
    if current is None:
        return
    if producer in group_ids and group_ids[producer] == group_ids[(producer, consumer)]:
        return  # the producer's output observer already stands on this edge
    for user in current.users:  # reuse an observer node of the same group already on this value
        if user.op == "call_module" and user.target == observer_name:
            consumer.replace_input_with(current, user)
            return
    observer_node = _insert_observer(gm, current, observer_name, producer, reader=consumer, counts=counts)
    consumer.replace_input_with(current, observer_node)


def _current_arg(consumer: fx.Node, producer: fx.Node) -> fx.Node | None:
    """The node `consumer` reads where it originally read `producer` (maybe an output observer now)."""
    for arg in consumer.all_input_nodes:
        if arg is producer or original_input(arg) is producer:
            return arg
    return None
