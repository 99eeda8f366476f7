"""Equalization findings as plain records: per-layer SQNR gain, and float equivalence of an equalized model."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from .equalize import cross_layer_equalize, equalize
from .graph import find_quantizable_ops
from .inputs import call_model
from torch.utils import _pytree as pytree


def equalizable_layers(float_gm: fx.GraphModule, quantized: list[str]) -> list[str]:
    """Quantized linear/conv layers with a weight parameter, in graph order."""
    wanted = set(quantized)
    return [op.layer for op in find_quantizable_ops(float_gm)
            if op.kind in ("linear", "conv") and op.weight is not None and op.weight.op == "get_attr"
            and op.layer in wanted]


def apply_recipe(float_gm: fx.GraphModule, recipe: Any, layers: list[str], batches: list) -> fx.GraphModule:
    """The model equalized as qmodel(equalize=...) asks: True (input-weight, every eligible layer), a list of
    layer names (input-weight), or "cross_layer"."""
    if recipe == "cross_layer":
        return cross_layer_equalize(float_gm)
    if recipe is True or recipe == "input_weight":
        return equalize(float_gm, layers, batches)
    if isinstance(recipe, (list, tuple)):
        return equalize(float_gm, list(recipe), batches)
    raise ValueError(f"equalize must be True, 'input_weight', 'cross_layer' or a list of layer names, not {recipe!r}")


def max_relative_error(reference: fx.GraphModule, candidate: fx.GraphModule, batches: list) -> float:
    """max |candidate - reference| / max |reference| over every floating output tensor and batch."""
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            for a, b in zip(pytree.tree_leaves(call_model(reference, batch)), pytree.tree_leaves(call_model(candidate, batch))):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    scale = float(a.abs().max()) or 1.0
                    worst = max(worst, float((b - a).abs().max()) / scale)
    return worst


def equivalence_finding(model: str, error: float, threshold: float = 1e-4) -> dict:
    """The equalized float model must match the original (error relative to the output's magnitude)."""
    failed = not (error <= threshold)
    return {"model": model, "check": "equalization_equivalence", "layer": "output", "metric": "max_relative_error",
            "value": float(error), "threshold": float(threshold), "verdict": "fail" if failed else "pass",
            "message": (f"model {model}: the equalized float model differs from the original by {error:.3g} "
                        f"(relative, > {threshold:g}); equalization must not change the float function. Report "
                        "this model, or use equalize='cross_layer' / a smaller layer list.") if failed else "",
            "details": {}, "order": 0}


def equalization_findings(model: str, layers: list[str], before: dict[str, float], after: dict[str, float],
                          min_gain_db: float, applied: bool) -> list[dict]:
    """One finding per layer: fails when equalizing gains >= min_gain_db and the recipe does not equalize."""
    findings = []
    for order, layer in enumerate(layers):
        gain = after.get(layer, math.nan) - before.get(layer, math.nan)
        failed = (not applied) and gain >= min_gain_db
        message = (f"layer {layer}: input-weight equalization raises its SQNR by {gain:.1f} dB "
                   f"({before[layer]:.1f} -> {after[layer]:.1f} dB, >= {min_gain_db:.1f} dB) and the model is not "
                   "equalized. Fix: qmodel(..., equalize=True).") if failed else ""
        findings.append({"model": model, "check": "equalization", "layer": layer, "metric": "sqnr_gain_db",
                         "value": float(gain), "threshold": float(min_gain_db), "verdict": "fail" if failed else "pass",
                         "message": message, "details": {"sqnr_db": before.get(layer), "equalized_sqnr_db": after.get(layer),
                                                         "applied": applied}, "order": order})
    return findings
