"""pt2e-style prepare: annotations -> union-find groups of edges/nodes -> one observer per group."""
from __future__ import annotations

from torch import fx, nn

from .graph import FQN_KEY, HANDLE_KEY, INSERTED_KEY, is_inserted, original_input
from .observers import DerivedObserver, FixedQParamsObserver
from .quantizer import (
    ANNOTATION_KEY,
    DerivedQuantizationSpec,
    EdgeOrNode,
    FixedQParamsQuantizationSpec,
    QuantizationSpec,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)
from .unionfind import UnionFind

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
            raise QuantizationConfigError(
                f"SharedQuantizationSpec links form a cycle through {_describe(target)} with no concrete spec. "
                "Fix: give one member of the group a QuantizationSpec."
            )
        seen.add(leader)
        qspec = mapping[leader]
    return qspec


def _same_attr(a, b, name: str) -> bool:
    return hasattr(a, name) and hasattr(b, name) and getattr(a, name) == getattr(b, name)


def get_edge_or_node_to_group_id(edge_or_node_to_qspec: dict[EdgeOrNode, QuantizationSpecBase]) -> dict[EdgeOrNode, int]:
    """Group ids of edges/nodes that must share one observer: explicit and implicit sharing.

    Explicit: a SharedQuantizationSpec joins its key with its target. Implicit (when the consumer's
    annotation allows it): an input edge joins the producer's other user edges and then the producer's
    output, when their root specs agree on dtype and is_dynamic. Edges are joined with the other users
    first and with the output second, as pt2e does. The find is iterative, so chains of any length work,
    and sharing targets may come before or after their users.
    """
    mapping = edge_or_node_to_qspec
    return _sharing_forest(mapping).group_ids(mapping.keys())


def _sharing_forest(mapping: dict[EdgeOrNode, QuantizationSpecBase]) -> UnionFind:
    forest: UnionFind = UnionFind(mapping.keys())

    def join_implicitly(edge, edge_root, other) -> None:
        if other not in mapping:
            return
        other_root = _root_qspec(mapping[other], mapping, forest)
        if _same_attr(other_root, edge_root, "dtype") and _same_attr(other_root, edge_root, "is_dynamic"):
            forest.union(other, edge)

    for key, qspec in mapping.items():
        if isinstance(key, tuple):
            producer, consumer = key
            annotation = consumer.meta.get(ANNOTATION_KEY) if isinstance(consumer, fx.Node) else None
            if annotation is None or annotation.allow_implicit_sharing:
                edge_root = _root_qspec(qspec, mapping, forest)
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
            forest.union(qspec.edge_or_node, key)
    for key in mapping:  # every group must reach a concrete spec
        _root_qspec(mapping[key], mapping, forest)
    return forest


def _observer_for(qspec: QuantizationSpecBase, sources: list[nn.Module]) -> nn.Module:
    if isinstance(qspec, QuantizationSpec):
        kwargs = {"dtype": qspec.dtype, "quant_min": qspec.quant_min, "quant_max": qspec.quant_max,
                  "is_dynamic": qspec.is_dynamic}
        if qspec.qscheme is not None:
            kwargs["qscheme"] = qspec.qscheme
        if qspec.ch_axis is not None:
            kwargs["ch_axis"] = qspec.ch_axis
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


def create_group_observers(mapping, forest: UnionFind, group_ids) -> dict[int, nn.Module]:
    """One observer per group; derived groups are built after the groups they derive from."""
    pending: dict[int, QuantizationSpecBase] = {}
    for key, qspec in mapping.items():
        if group_ids[key] not in pending:
            pending[group_ids[key]] = _root_qspec(qspec, mapping, forest)
    observers: dict[int, nn.Module] = {}
    while pending:
        progressed = False
        for gid, qspec in list(pending.items()):
            deps = [group_ids[k] for k in getattr(qspec, "derived_from", [])]
            missing = [k for k in getattr(qspec, "derived_from", []) if k not in group_ids]
            if missing:
                raise QuantizationConfigError(
                    f"DerivedQuantizationSpec derives from {_describe(missing[0])}, which has no spec. "
                    "Fix: annotate that edge/node."
                )
            if all(d in observers for d in deps):
                observers[gid] = _observer_for(qspec, [observers[d] for d in deps])
                del pending[gid]
                progressed = True
        if not progressed:
            raise QuantizationConfigError("DerivedQuantizationSpec dependencies form a cycle; fix the derived_from lists.")
    return observers


def _insert_observer(gm: fx.GraphModule, after: fx.Node, observer_name: str, described: fx.Node) -> fx.Node:
    with gm.graph.inserting_after(after):
        node = gm.graph.call_module(observer_name, (after,))
    node.meta[INSERTED_KEY] = "observer"
    node.meta[FQN_KEY] = described.meta.get(FQN_KEY, "")
    node.meta["qcore_observed_handle"] = described.meta.get(HANDLE_KEY, -1)
    if "val" in after.meta:
        node.meta["val"] = after.meta["val"]
    return node


def prepare(gm: fx.GraphModule, quantizer: Quantizer) -> fx.GraphModule:
    """Annotate `gm` with `quantizer` and insert one observer module per sharing group (in place)."""
    quantizer.annotate(gm)
    quantizer.validate(gm)
    mapping = get_edge_or_node_to_qspec(gm)
    forest = _sharing_forest(mapping)
    group_ids = forest.group_ids(mapping.keys())
    observers = create_group_observers(mapping, forest, group_ids)
    names = {}
    for gid, observer in observers.items():
        names[gid] = f"{OBSERVER_PREFIX}{gid}"
        gm.add_submodule(names[gid], observer)

    for node in list(gm.graph.nodes):
        annotation = node.meta.get(ANNOTATION_KEY)
        if annotation is None or is_inserted(node):
            continue
        for producer in annotation.input_qspec_map:
            _observe_edge(gm, producer, node, names[group_ids[(producer, node)]], group_ids)
        if node in group_ids:
            observer_node = _insert_observer(gm, node, names[group_ids[node]], node)
            for user in list(node.users):
                if user is not observer_node:
                    user.replace_input_with(node, observer_node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _observe_edge(gm: fx.GraphModule, producer: fx.Node, consumer: fx.Node, observer_name: str, group_ids) -> None:
    current = _current_arg(consumer, producer)
    if current is None:
        return
    if producer in group_ids and group_ids[producer] == group_ids[(producer, consumer)]:
        return  # the producer's output observer already stands on this edge
    for user in current.users:  # reuse an observer node of the same group already on this value
        if user.op == "call_module" and user.target == observer_name:
            consumer.replace_input_with(current, user)
            return
    observer_node = _insert_observer(gm, current, observer_name, producer)
    consumer.replace_input_with(current, observer_node)


def _current_arg(consumer: fx.Node, producer: fx.Node) -> fx.Node | None:
    """The node `consumer` reads where it originally read `producer` (maybe an output observer now)."""
    for arg in consumer.all_input_nodes:
        if arg is producer or original_input(arg) is producer:
            return arg
    return None
