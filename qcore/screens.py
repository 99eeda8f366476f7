"""Screens: a fix's own SQNR on the layers a detector names, measured inside the model's comparison pass.

A detector's heuristic names layers after the calibration pass (its observers watch that pass), and its fix is a
per-layer quantizer change (`layer_overrides`). A screen quantizes the model with that change on the named layers
(its new activation observers calibrated in one more pass; those it shares with the model's are taken as they
are), and the comparison pass that follows runs each named layer of that quantized copy on its float input as
one more shadow: each layer's own SQNR with the fix, over every batch, exactly as a separate trial of the same
quantizer would measure it, without that trial's float and quantized passes. Only the named layers' weights
are quantized in the copy.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from .calibrate import calibrate
from .calibrated import CalibratedObservers
from .capture import clone_graph_module
from .convert import convert, restore_model_state
from .graph import INSERTED_KEY, find_quantizable_ops, original_input
from .prepare import prepare
from .quantizer import Quantizer, with_layer_overrides

__all__ = ["Screen", "ScreenedLayers", "quantize_for_screen"]


@dataclass(frozen=True)
class Screen:
    """A fix to screen: `candidates(reports)` gives {layer: its layer_overrides change} from the detectors'
    reports ({detector key: {layer: raw entry}}) of the calibration pass."""

    name: str
    candidates: Callable[[Mapping[str, Mapping[str, Any]]], Mapping[str, Mapping[str, Any]]] = field(compare=False)


@dataclass(frozen=True)
class ScreenedLayers:
    """What a screen measured: the changes it made ({layer: change}) and each changed layer's own SQNR with them
    (dB, float input, every batch)."""

    changes: Mapping[str, Mapping[str, Any]]
    own_sqnr_db: Mapping[str, float]


def quantize_for_screen(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer,
                        changes: Mapping[str, Mapping[str, Any]], observers: CalibratedObservers) -> fx.GraphModule:
    """`float_gm` quantized with `changes` merged into `quantizer`'s layer_overrides, calibrated where `observers`
    has no twin of an activation observer, with only the changed layers' weights quantized (the others stay
    float: the screen copies the changed layers only). ValueError for a quantizer without layer_overrides."""
    changed = with_layer_overrides(quantizer, {layer: dict(change) for layer, change in changes.items()})
    prepared = prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False), changed,
                       recompile=False)
    _unobserve_other_weights(prepared, set(changes))
    signatures = observers.signatures(prepared)
    missing = observers.take(prepared, signatures)
    prepared.recompile()
    if missing:
        calibrate(prepared, batches)
        observers.keep(prepared, signatures)
    quantized = convert(prepared, keep_float_weights=False, recompile=False)
    restore_model_state(quantized, float_gm)  # calibration ran forward, which may update buffers in place
    return quantized


def _unobserve_other_weights(prepared: fx.GraphModule, layers: set[str]) -> None:
    """Feed the unchanged layers their float weights, so that convert quantizes the changed layers' only."""
    observers: dict[fx.Node, bool] = {}  # weight observer node: whether a changed layer reads it
    for op in find_quantizable_ops(prepared):
        for node in op.node.all_input_nodes:
            if node.meta.get(INSERTED_KEY) == "observer" and op.weight is not None and \
                    original_input(node) is op.weight:
                observers[node] = observers.get(node, False) or op.layer in layers
    for observer, read_by_changed_layer in observers.items():
        if not read_by_changed_layer:
            observer.replace_all_uses_with(observer.args[0])
            prepared.graph.erase_node(observer)
