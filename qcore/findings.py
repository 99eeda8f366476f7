"""Quality findings as plain records (builtins only), from a float model and its calibration batches."""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterable

from torch import fx

from .capture import clone_graph_module
from .calibrate import calibrate
from .convert import convert
from .graph import find_quantizable_ops
from .numeric.compare import compare
from .numeric.metrics import compute_sqnr
from .numeric.suite import extract_weights
from .prepare import prepare
from .quantizer import ANNOTATION_KEY, Int8StaticQuantizer, Quantizer


def select_layers(names: Iterable[str], layers: list[str] | None, skip_layers: list[str] | None) -> list[str]:
    """Keep names matching any `layers` glob (all if none) and no `skip_layers` glob, in order."""
    kept = []
    for name in names:
        if layers and not any(fnmatch.fnmatchcase(name, g) for g in layers):
            continue
        if skip_layers and any(fnmatch.fnmatchcase(name, g) for g in skip_layers):
            continue
        kept.append(name)
    return kept


def quantized_layers(float_gm: fx.GraphModule, quantizer: Quantizer | None = None) -> list[dict]:
    """The layers `quantizer` quantizes, in graph order: [{"layer", "fqn", "op", "weighted"}]. No calibration."""
    annotated = clone_graph_module(float_gm)
    (quantizer or Int8StaticQuantizer()).annotate(annotated)
    layers = []
    for op in find_quantizable_ops(annotated):
        annotation = op.node.meta.get(ANNOTATION_KEY)
        if annotation is not None and annotation.input_qspec_map:
            weighted = op.weight is not None and op.weight in annotation.input_qspec_map
            layers.append({"layer": op.layer, "fqn": op.fqn, "op": op.kind, "weighted": weighted})
    return layers


def measure_sqnr(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer | None = None) -> dict:
    """Quantize a copy of `float_gm` on `batches`, then compare: per-layer propagated and shadow SQNR,
    weight SQNR, and output SQNR. Returns plain data: {"layers": {layer: {...}}, "outputs": {name: {...}}}.
    """
    prepared = prepare(clone_graph_module(float_gm), quantizer or Int8StaticQuantizer())
    calibrate(prepared, batches)
    quant_gm = convert(prepared)
    propagated = compare(float_gm, quant_gm, batches, propagate=True)
    shadow = {r["layer"]: r for r in compare(float_gm, quant_gm, batches, propagate=False)}
    weights = extract_weights("float", float_gm, "quant", quant_gm)
    layers: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    for record in propagated:
        if record["op"] == "output":
            outputs[record["layer"]] = {"sqnr_db": record["sqnr_db"], "cosine": record["cosine"],
                                        "normalized_l2": record["normalized_l2"]}
            continue
        entry = dict(record)
        entry["shadow_sqnr_db"] = shadow.get(record["layer"], {}).get("sqnr_db", math.nan)
        if record["layer"] in weights:
            pair = weights[record["layer"]]["weight"]
            entry["weight_sqnr_db"] = float(compute_sqnr(pair["float"][0]["values"][0], pair["quant"][0]["values"][0]))
        layers[record["layer"]] = entry
    return {"layers": layers, "outputs": outputs}


def finding(model: str, check: str, layer: str, metric: str, value: float, threshold: float,
            message: str = "", details: dict | None = None, order: int = 0) -> dict:
    """A finding record: passes when value >= threshold."""
    verdict = "pass" if (not math.isnan(value) and value >= threshold) else "fail"
    return {"model": model, "check": check, "layer": layer, "metric": metric, "value": float(value),
            "threshold": float(threshold), "verdict": verdict, "message": message, "details": details or {},
            "order": order}


def sqnr_message(layer: str, value: float, threshold: float, shadow: float, weighted: bool = True) -> str:
    """Explain a low propagated SQNR, telling inherited error from the layer's own."""
    text = f"layer {layer}: SQNR {value:.1f} dB < {threshold:.1f} dB (shadow SQNR {shadow:.1f} dB)."
    if not math.isnan(shadow) and shadow >= threshold:
        return text + (" With float inputs the layer is fine: it inherits its error from upstream layers. "
                       "Fix the first failing layer upstream, or skip it with skip_layers.")
    advice = "use per-channel weights, " if weighted else ""
    return text + (f" The layer's own quantization error is too large: {advice}a histogram activation observer "
                   "(quantizer='int8_histogram'), or keep the layer in float with skip_layers.")


def sqnr_findings(model: str, measured: dict, checks: dict[str, list[str]], thresholds: dict[str, float]) -> list[dict]:
    """Findings for the checks 'sqnr', 'weight_sqnr' and 'model_sqnr' from measure_sqnr's result.

    `checks` maps a check name to its layer names (the items collected); `thresholds` maps a check to dB.
    """
    results = []
    for order, layer in enumerate(checks.get("sqnr", [])):
        entry = measured["layers"].get(layer)
        if entry is None:
            results.append(_missing(model, "sqnr", layer, thresholds["sqnr"], order))
            continue
        value, threshold = entry["sqnr_db"], thresholds["sqnr"]
        message = "" if value >= threshold else sqnr_message(layer, value, threshold, entry["shadow_sqnr_db"],
                                                             "weight_sqnr_db" in entry)
        details = {k: entry[k] for k in ("shadow_sqnr_db", "normalized_l2", "cosine", "batches", "op", "fqn")}
        results.append(finding(model, "sqnr", layer, "sqnr_db", value, threshold, message, details, order))
    for order, layer in enumerate(checks.get("weight_sqnr", [])):
        entry = measured["layers"].get(layer, {})
        if "weight_sqnr_db" not in entry:
            results.append(_missing(model, "weight_sqnr", layer, thresholds["weight_sqnr"], order))
            continue
        value, threshold = entry["weight_sqnr_db"], thresholds["weight_sqnr"]
        message = "" if value >= threshold else (
            f"layer {layer}: weight SQNR {value:.1f} dB < {threshold:.1f} dB. Use per-channel weight quantization, "
            "or keep the layer in float with skip_layers.")
        results.append(finding(model, "weight_sqnr", layer, "weight_sqnr_db", value, threshold, message, {}, order))
    for order, name in enumerate(checks.get("model_sqnr", [])):
        entry = _worst_output(measured["outputs"]) if name == "output" else measured["outputs"].get(name)
        if entry is None:
            results.append(_missing(model, "model_sqnr", name, thresholds["model_sqnr"], order))
            continue
        value, threshold = entry["sqnr_db"], thresholds["model_sqnr"]
        message = "" if value >= threshold else (
            f"model output {name}: SQNR {value:.1f} dB < {threshold:.1f} dB. See the per-layer sqnr items for the "
            "layer where the error starts.")
        details = {"cosine": entry["cosine"], "normalized_l2": entry["normalized_l2"], "leaf": entry.get("leaf", name)}
        results.append(finding(model, "model_sqnr", name, "sqnr_db", value, threshold, message, details, order))
    return results


def _worst_output(outputs: dict[str, dict]) -> dict | None:
    """The output leaf with the lowest SQNR (models with several outputs are judged by the worst)."""
    if not outputs:
        return None
    name = min(outputs, key=lambda k: outputs[k]["sqnr_db"])
    return {**outputs[name], "leaf": name}


def _missing(model: str, check: str, layer: str, threshold: float, order: int) -> dict:
    record = finding(model, check, layer, "sqnr_db", math.nan, threshold,
                     f"layer {layer} was collected but not measured: the model's graph changed between collection "
                     "and run. Re-run pytest.", {}, order)
    return record
