"""Streaming float-vs-quantized comparison: per-layer sums on the device, memory flat in the batch count."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..calibrate import model_device
from ..capture import clone_graph_module
from ..inputs import call_model, move_to
from .instrument import attach_after, copy_layer_into
from .loggers import ActivationStash, StreamingComparator
from .matching import layer_value, match_layers

__all__ = ["compare", "compare_propagated_and_shadow"]

_SHADOW_PREFIX = "qcore_shadow_b"


def compare(
    float_model: fx.GraphModule,
    quant_model: fx.GraphModule,
    batches: Iterable[Any],
    propagate: bool = True,
) -> list[dict]:
    """One record per matched layer: fqn, layer, op, sqnr_db, normalized_l2, cosine, batches.

    propagate=True runs both models end to end (each layer inherits upstream error) and adds one record
    per output leaf (op "output"). propagate=False is the shadow mode: each quantized layer gets the float
    model's input, so it shows the layer's own error.
    """
    if propagate:
        pairs, runner, comparators, outputs = _propagated(float_model, quant_model)
    else:
        pairs, runner, comparators, outputs = _shadowed(float_model, quant_model)
    device = model_device(float_model)
    count = 0
    with torch.no_grad():
        for batch in batches:
            runner(move_to(batch, device))
            count += 1
    if count == 0:
        raise ValueError("compare needs at least one batch")
    records = []
    for pair, comparator in zip(pairs, comparators):
        records.append({"layer": pair.layer, "fqn": pair.a.fqn, "op": pair.a.kind, **comparator.result()})
    for index, comparator in enumerate(outputs):
        name = "output" if len(outputs) == 1 else f"output.{index}"
        records.append({"layer": name, "fqn": "", "op": "output", **comparator.result()})
    return records


def _propagated(float_model, quant_model):
    gm_a, gm_b = clone_graph_module(float_model), clone_graph_module(quant_model)
    pairs = match_layers(gm_a, gm_b)
    comparators = []
    for index, pair in enumerate(pairs):
        stash = ActivationStash()
        attach_after(gm_a, layer_value(pair.a), f"qcore_stash_{index}", stash)
        comparator = StreamingComparator(stash)
        attach_after(gm_b, layer_value(pair.b), f"qcore_compare_{index}", comparator)
        comparators.append(comparator)
    gm_a.recompile()
    gm_b.recompile()
    outputs: list[StreamingComparator] = []
    return pairs, lambda batch: _run_both(gm_a, gm_b, batch, outputs), comparators, outputs


def _run_both(gm_a: fx.GraphModule, gm_b: fx.GraphModule, batch: Any, outputs: list[StreamingComparator]) -> None:
    """Run A then B on one batch and add their floating output leaves to `outputs` (one comparator per leaf)."""
    out_a = pytree.tree_leaves(call_model(gm_a, batch))
    out_b = pytree.tree_leaves(call_model(gm_b, batch))
    tensors = [(a, b) for a, b in zip(out_a, out_b) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    while len(outputs) < len(tensors):
        outputs.append(StreamingComparator())
    for comparator, (a, b) in zip(outputs, tensors):
        comparator.update(a, b)


def _shadowed(float_model, quant_model):
    gm_a, gm_b = clone_graph_module(float_model), clone_graph_module(quant_model)
    gm_a.add_submodule(_SHADOW_PREFIX, gm_b)
    pairs = match_layers(gm_a, gm_b)
    comparators = []
    for index, pair in enumerate(pairs):
        shadow_value = copy_layer_into(gm_a, pair.a, pair.b, _SHADOW_PREFIX)
        comparator = StreamingComparator()
        attach_after(gm_a, shadow_value, f"qcore_compare_{index}", comparator, layer_value(pair.a))
        comparators.append(comparator)
    gm_a.graph.lint()
    gm_a.recompile()
    return pairs, (lambda batch: call_model(gm_a, batch)), comparators, []


def compare_propagated_and_shadow(float_model: fx.GraphModule, quant_model: fx.GraphModule, batches: Iterable[Any],
                                  own_quant_model: bool = False) -> tuple[list[dict], list[dict]]:
    """Both modes of `compare` in one pass over the batches: (propagated records, shadow records).

    The float graph runs once per batch with the shadow copies of the quantized layers inside it, and its
    layer values feed the propagated comparison too. own_quant_model=True instruments `quant_model` itself
    instead of a copy (for a caller that discards it afterwards).
    """
    gm_a = clone_graph_module(float_model)
    gm_b = quant_model if own_quant_model else clone_graph_module(quant_model)
    pairs = match_layers(gm_a, gm_b)
    gm_a.add_submodule(_SHADOW_PREFIX, gm_b)
    propagated, shadowed = [], []
    for index, pair in enumerate(pairs):
        shadow_value = copy_layer_into(gm_a, pair.a, pair.b, _SHADOW_PREFIX)
        shadow = StreamingComparator()
        attach_after(gm_a, shadow_value, f"qcore_shadow_compare_{index}", shadow, layer_value(pair.a))
        shadowed.append(shadow)
        stash = ActivationStash()
        attach_after(gm_a, layer_value(pair.a), f"qcore_stash_{index}", stash)
        comparator = StreamingComparator(stash)
        attach_after(gm_b, layer_value(pair.b), f"qcore_compare_{index}", comparator)
        propagated.append(comparator)
    gm_a.graph.lint()
    gm_a.recompile()
    gm_b.recompile()
    outputs: list[StreamingComparator] = []
    device = model_device(float_model)
    count = 0
    with torch.no_grad():
        for batch in batches:
            _run_both(gm_a, gm_b, move_to(batch, device), outputs)
            count += 1
    if count == 0:
        raise ValueError("compare needs at least one batch")
    records = [{"layer": p.layer, "fqn": p.a.fqn, "op": p.a.kind, **c.result()} for p, c in zip(pairs, propagated)]
    for index, comparator in enumerate(outputs):
        records.append({"layer": "output" if len(outputs) == 1 else f"output.{index}", "fqn": "", "op": "output",
                        **comparator.result()})
    shadows = [{"layer": p.layer, "fqn": p.a.fqn, "op": p.a.kind, **c.result()} for p, c in zip(pairs, shadowed)]
    return records, shadows
