"""The FX numeric suite API (extract_weights, add_loggers, add_shadow_loggers, ...) on qcore graphs.

Signatures and the result structure follow torch.ao.ns._numeric_suite_fx:
{layer_name: {result_type: {model_name: [{"type", "values", "ref_node_name", ...}]}}}.
Layer names are qcore layer names (module FQNs where they are unique).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn

from qcore.graph.capture import clone_graph_module
from qcore.graph.ops import weight_value
from qcore.numeric.instrument import FloatNodes, attach_after, copy_layer_into
from qcore.numeric.matching import LoggedNode, NodePair, logged_node, match_layers, match_nodes, target_type

__all__ = ["NSResultsType", "add_loggers", "add_shadow_loggers", "extend_logger_results_with_comparison",
    "extract_logger_info", "extract_shadow_logger_info", "extract_weights"]

NSResultsType = dict[str, dict[str, dict[str, list[dict]]]]
_SHADOW_PREFIX = "qcore_shadow_b"


def _require_graph(model: nn.Module, role: str) -> fx.GraphModule:
    if not isinstance(model, fx.GraphModule):
        raise TypeError(f"{role} must be a GraphModule from qcore.capture or qcore.quantize, got "
                        f"{type(model).__name__}")
    return model


def _weight_result(gm: fx.GraphModule, pair_op, model_name: str) -> dict:
    weight = weight_value(gm, pair_op.weight)
    return {
        "type": "weight", "values": [weight.detach()], "ref_node_name": pair_op.node.name,
        "ref_node_target_type": target_type(pair_op.node, gm), "prev_node_name": pair_op.node.name,
        "prev_node_target_type": target_type(pair_op.node, gm), "index_within_arg": 0, "index_of_arg": 0,
        "fqn": pair_op.fqn, "qconfig_str": "", "comparisons": [], "comparison_fn_name": "",
    }


def extract_weights(
    model_name_a: str,
    model_a: nn.Module,
    model_name_b: str,
    model_b: nn.Module,
    base_name_to_sets_of_related_ops=None,
    unmatchable_types_map=None,
    op_to_type_to_weight_extraction_fn=None,
) -> NSResultsType:
    """Weights of every matched weighted layer of A and B (B's are the fake-quantized ones)."""
    gm_a, gm_b = _require_graph(model_a, "model_a"), _require_graph(model_b, "model_b")
    results: NSResultsType = {}
    for pair in match_layers(gm_a, gm_b):
        if pair.a.weight is None or pair.b.weight is None:
            continue
        results[pair.layer] = {"weight": {model_name_a: [_weight_result(gm_a, pair.a, model_name_a)],
                                          model_name_b: [_weight_result(gm_b, pair.b, model_name_b)]}}
    return results


def _output_logger(logger_cls, gm: fx.GraphModule, node: LoggedNode, model_name: str, layer: str):
    """torch.ao's output entry: ref_node_name == prev_node_name == the logged node."""
    return logger_cls(node.value.name, node.value.name, model_name, layer, target_type(node.value, gm),
                      target_type(node.ref, gm), "node_output", 0, 0, node.fqn)


def _input_logger(logger_cls, gm: fx.GraphModule, node: LoggedNode, model_name: str, layer: str, index_of_arg: int,
                  index_within_arg: int, source: fx.Node):
    """torch.ao's input entry: ref_node_name is the op, prev_node_name the node that produced the input."""
    return logger_cls(node.ref.name, source.name, model_name, layer, target_type(source, gm),
                      target_type(node.ref, gm), "node_input", index_within_arg, index_of_arg, node.fqn)


def _add_node_loggers(gm: fx.GraphModule, pairs: list[NodePair], side: str, model_name: str, logger_cls,
                      should_log_inputs: bool) -> None:
    for index, pair in enumerate(pairs):
        node = getattr(pair, side)
        if should_log_inputs:
            for position, (of_arg, within_arg, source) in enumerate(node.inputs):
                logger = _input_logger(logger_cls, gm, node, model_name, pair.layer, of_arg, within_arg, source)
                attach_after(gm, source, f"qcore_logger_{side}_in_{index}_{position}", logger)
        logger = _output_logger(logger_cls, gm, node, model_name, pair.layer)
        attach_after(gm, node.value, f"qcore_logger_{side}_{index}", logger)
    gm.recompile()


def add_loggers(
    name_a: str,
    model_a: nn.Module,
    name_b: str,
    model_b: nn.Module,
    logger_cls: Callable,
    should_log_inputs: bool = False,
    base_name_to_sets_of_related_ops=None,
    unmatchable_types_map=None,
    *,
    only_quantized_layers: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """Copies of A and B with a logger after every node matched between them (activations with error
    propagation): quantized layers and the other ops torch.ao matches; only_quantized_layers keeps the first."""
    gm_a = clone_graph_module(_require_graph(model_a, "model_a"))
    gm_b = clone_graph_module(_require_graph(model_b, "model_b"))
    pairs = match_nodes(gm_a, gm_b, only_quantized_layers)
    _add_node_loggers(gm_a, pairs, "a", name_a, logger_cls, should_log_inputs)
    _add_node_loggers(gm_b, pairs, "b", name_b, logger_cls, should_log_inputs)
    return gm_a, gm_b


def _collect(named_modules, logger_cls, results: NSResultsType) -> None:
    for _, module in named_modules:
        if not isinstance(module, logger_cls) or not hasattr(module, "ref_name"):
            continue
        per_type = results.setdefault(module.ref_name, {}).setdefault(module.results_type, {})
        entries = per_type.setdefault(module.model_name, [])
        entries.append({
            "type": module.results_type, "values": module.stats, "ref_node_name": module.ref_node_name,
            "ref_node_target_type": module.ref_node_target_type, "prev_node_name": module.prev_node_name,
            "prev_node_target_type": module.prev_node_target_type, "index_within_arg": module.index_within_arg,
            "index_of_arg": module.index_of_arg, "fqn": module.fqn, "qconfig_str": module.qconfig_str,
            "comparisons": [], "comparison_fn_name": "",
        })
        entries.sort(key=lambda r: (r["index_of_arg"], r["index_within_arg"]))


def extract_logger_info(
    model_a: nn.Module, model_b: nn.Module, logger_cls: Callable, model_name_to_use_for_layer_names: str
) -> NSResultsType:
    """Everything the loggers of A and B recorded, keyed by layer name."""
    results: NSResultsType = {}
    _collect(model_a.named_modules(), logger_cls, results)
    _collect(model_b.named_modules(), logger_cls, results)
    return results


def add_shadow_loggers(
    name_a: str,
    model_a: nn.Module,
    name_b: str,
    model_b: nn.Module,
    logger_cls: Callable,
    should_log_inputs: bool = False,
    base_name_to_sets_of_related_ops=None,
    node_type_to_io_type_map=None,
    unmatchable_types_map=None,
) -> nn.Module:
    """One model: A, plus a copy of each quantized layer of B fed with A's float input (no error propagation).

    With should_log_inputs, each layer has 4 loggers: the input and output of A's layer and of B's copy.
    """
    gm_a = clone_graph_module(_require_graph(model_a, "model_a"))
    gm_b = clone_graph_module(_require_graph(model_b, "model_b"))
    gm_a.add_submodule(_SHADOW_PREFIX, gm_b)
    pairs = match_layers(gm_a, gm_b)
    floats = FloatNodes(gm_a)
    for index, pair in enumerate(pairs):
        copies: dict[fx.Node, fx.Node] = {}
        shadow_value = copy_layer_into(gm_a, pair.a, pair.b, _SHADOW_PREFIX, copies, known=floats)
        node_a, node_b = logged_node(pair.a), logged_node(pair.b)
        shadow = LoggedNode(copies[node_b.ref], shadow_value, node_b.fqn,
                            [(i, j, copies.get(source, source)) for i, j, source in node_b.inputs])
        if should_log_inputs:
            for position, (of_arg, within_arg, source) in enumerate(shadow.inputs):
                attach_after(gm_a, source, f"qcore_logger_b_in_{index}_{position}", _input_logger(
                    logger_cls, gm_a, shadow, name_b, pair.layer, of_arg, within_arg, source))
            for position, (of_arg, within_arg, source) in enumerate(node_a.inputs):
                attach_after(gm_a, source, f"qcore_logger_a_in_{index}_{position}", _input_logger(
                    logger_cls, gm_a, node_a, name_a, pair.layer, of_arg, within_arg, source))
        attach_after(gm_a, shadow_value, f"qcore_logger_b_{index}", _output_logger(logger_cls, gm_a, shadow, name_b,
                                                                                  pair.layer))
        attach_after(gm_a, node_a.value, f"qcore_logger_a_{index}", _output_logger(logger_cls, gm_a, node_a, name_a,
                                                                                  pair.layer))
    gm_a.graph.lint()
    gm_a.recompile()
    return gm_a


def extract_shadow_logger_info(
    model_a_shadows_b: nn.Module, logger_cls: Callable, model_name_to_use_for_layer_names: str
) -> NSResultsType:
    """Everything the loggers of a shadow model recorded, keyed by layer name."""
    results: NSResultsType = {}
    own = ((n, m) for n, m in model_a_shadows_b.named_modules() if not n.startswith(_SHADOW_PREFIX))
    _collect(own, logger_cls, results)
    return results


def extend_logger_results_with_comparison(
    results: NSResultsType,
    model_name_1: str,
    model_name_2: str,
    comparison_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    comparison_name: str,
) -> None:
    """Compare model_name_2's values with model_name_1's, storing the list under comparison_name (in place)."""
    for per_type in results.values():
        for per_model in per_type.values():
            if model_name_1 not in per_model or model_name_2 not in per_model:
                missing = model_name_1 if model_name_1 not in per_model else model_name_2
                raise KeyError(f"{missing!r} not found in results (models: {sorted(per_model)})")
            for result_2 in per_model[model_name_2]:
                result_1 = next(
                    (r for r in per_model[model_name_1]
                     if (r["index_of_arg"], r["index_within_arg"]) == (result_2["index_of_arg"],
                                                                       result_2["index_within_arg"])),
                    None,
                )
                if result_1 is None:
                    raise KeyError(f"no {model_name_1!r} result for {result_2['ref_node_name']}")
                result_2[comparison_name] = [comparison_fn(v1, v2) for v1, v2 in zip(result_1["values"],
                                                                                     result_2["values"])]
