"""Detector findings (per_channel, dynamic_static, input_weight_equalization, outlier) as plain records.

An item fails when its detector recommends something the model's quantizer does not already do.
"""
from __future__ import annotations

import math
from typing import Any

from torch import fx

from .capture import clone_graph_module
from .calibrate import calibrate
from .graph import find_quantizable_ops
from .observers import HistogramObserver
from .quantizer import ANNOTATION_KEY, Quantizer
from .report import (
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    ModelReport,
    OutlierDetector,
    PerChannelDetector,
)

DETECTOR_CHECKS = ("per_channel", "dynamic_static", "input_weight_equalization", "outlier")
DEFAULT_DETECTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "dynamic_static": {"tolerance": 0.5},
    "input_weight_equalization": {"ratio_threshold": 0.5},
    "outlier": {"ratio_threshold": 3.5, "reference_percentile": 0.975, "fraction_batches_used_threshold": 0.95},
}
SEVERITIES = ("fail", "warn", "off")


def make_detectors(options: dict[str, dict[str, Any]] | None, quantizer: Quantizer) -> dict[str, Any]:
    """check name -> detector, with DEFAULT_DETECTOR_OPTIONS updated by `options`."""
    merged = {k: dict(v) for k, v in DEFAULT_DETECTOR_OPTIONS.items()}
    for check, values in (options or {}).items():
        if check not in DETECTOR_CHECKS:
            raise ValueError(f"detector options for unknown check {check!r}; known: {', '.join(DETECTOR_CHECKS)}")
        merged.setdefault(check, {}).update(values)
    return {
        "per_channel": PerChannelDetector(quantizer=quantizer),
        "dynamic_static": DynamicStaticDetector(**merged["dynamic_static"]),
        "input_weight_equalization": InputWeightEqualizationDetector(**merged["input_weight_equalization"]),
        "outlier": OutlierDetector(**merged["outlier"]),
    }


def quantizer_facts(float_gm: fx.GraphModule, quantizer: Quantizer) -> dict[str, dict[str, bool]]:
    """What the quantizer does per layer: quantized, per_channel, dynamic, clipping activation observer."""
    annotated = clone_graph_module(float_gm)
    quantizer.annotate(annotated)
    facts = {}
    for op in find_quantizable_ops(annotated):
        annotation = op.node.meta.get(ANNOTATION_KEY)
        specs = annotation.input_qspec_map if annotation is not None else {}
        weight = specs.get(op.weight) if op.weight is not None else None
        activation = next((specs[a] for a in op.activation_inputs if a in specs), None)
        facts[op.layer] = {
            "quantized": bool(specs),
            "per_channel": "per_channel" in str(getattr(weight, "qscheme", "")),
            "dynamic": bool(getattr(activation, "is_dynamic", False)),
            "clipping": getattr(activation, "observer_or_fake_quant_ctr", None) is HistogramObserver,
        }
    return facts


def detector_layers(float_gm: fx.GraphModule, quantizer: Quantizer, options=None) -> dict[str, list[str]]:
    """The layers each detector check looks at, restricted to layers the quantizer quantizes. No data."""
    facts = quantizer_facts(float_gm, quantizer)
    result = {}
    for check, detector in make_detectors(options, quantizer).items():
        layers = [op.layer for op in detector.layers(float_gm)]
        if check == "per_channel":
            layers = [op.layer for op in detector.layers(float_gm) if op.weight is not None]
        result[check] = [layer for layer in layers if facts.get(layer, {}).get("quantized")]
    return result


def measure_detectors(float_gm: fx.GraphModule, batches: list, quantizer: Quantizer, checks: list[str],
                      options=None) -> dict[str, Any]:
    """Run ModelReport with the requested detectors on `batches`; plain-data results per check and layer."""
    detectors = make_detectors(options, quantizer)
    wanted = [detectors[c] for c in checks if c in detectors]
    result: dict[str, Any] = {"facts": quantizer_facts(float_gm, quantizer)}
    if not wanted:
        return result
    report = ModelReport(clone_graph_module(float_gm), wanted)
    calibrate(report.prepare_detailed_calibration(), batches)
    reports = report.generate_model_report(remove_inserted_observers=True)
    for check in checks:
        detector = detectors[check]
        raw = reports.get(detector.get_detector_name(), ("", {}))[1]
        result[check] = {layer: _plain(check, detector, entry) for layer, entry in raw.items()}
    return result


def _plain(check: str, detector, entry: dict) -> dict[str, Any]:
    """The few numbers a finding needs, as builtins."""
    if check == "per_channel":
        return {"supported": bool(entry[detector.PER_CHAN_SUPPORTED_KEY]), "used": bool(entry[detector.PER_CHAN_USED_KEY])}
    if check == "dynamic_static":
        return {"recommended": bool(entry[detector.DEFAULT_DYNAMIC_REC_KEY]),
                "input_s": float(entry[detector.PRE_OBS_COMP_STAT_KEY]),
                "output_s": float(entry[detector.POST_OBS_COMP_STAT_KEY]),
                "output_class": entry[detector.POST_OBS_DATA_DIST_KEY], "tolerance": float(detector.tolerance)}
    if check == "input_weight_equalization":
        flags = entry[detector.RECOMMENDED_KEY]
        return {"fraction": sum(flags) / len(flags) if flags else 0.0, "channels": len(flags),
                "recommended": detector.is_layer_recommended(entry), "threshold": float(detector.ratio_threshold)}
    ratios = [r for r in entry[detector.COMP_METRIC_KEY].tolist()]
    outliers = [i for i, flag in enumerate(entry[detector.OUTLIER_KEY]) if flag]
    finite = [r for r in ratios if not math.isnan(r)]
    return {"outlier_channels": outliers, "max_ratio": max(finite) if finite else float("nan"),
            "threshold": float(detector.ratio_threshold), "channels": len(ratios),
            "constant_channels": [i for i, n in enumerate(entry[detector.CONSTANT_COUNTS_KEY].tolist()) if n]}


def _record(model, check, layer, metric, value, threshold, failed, message, details, order) -> dict:
    return {"model": model, "check": check, "layer": layer, "metric": metric, "value": float(value),
            "threshold": float(threshold), "verdict": "fail" if failed else "pass",
            "message": message if failed else "", "details": details, "order": order}


def detector_findings(model: str, measured: dict[str, Any], checks: dict[str, list[str]],
                      equalized: list[str] | tuple = ()) -> list[dict]:
    """One finding per (detector check, layer) in `checks`, from measure_detectors' result.

    `equalized` names the layers the model's recipe equalizes (they satisfy the equalization detector)."""
    facts = {layer: dict(fact, equalized=layer in equalized) for layer, fact in measured.get("facts", {}).items()}
    findings = []
    for check in DETECTOR_CHECKS:
        for order, layer in enumerate(checks.get(check, [])):
            entry = measured.get(check, {}).get(layer)
            fact = facts.get(layer, {})
            if entry is None:
                findings.append(_record(model, check, layer, "", math.nan, math.nan, True,
                                        f"layer {layer} was collected but the {check} detector saw no data for it; "
                                        "check that calibration batches reach it.", {}, order))
                continue
            findings.append(_FINDERS[check](model, layer, entry, fact, order))
    return findings


def _per_channel(model, layer, entry, fact, order) -> dict:
    failed = entry["supported"] and not fact.get("per_channel", entry["used"])
    message = (f"layer {layer}: weights are quantized per tensor but per-channel is supported. Fix: use "
               f"quantizer='int8' or Int8StaticQuantizer(layer_overrides={{'{layer}': {{'per_channel': True}}}}).")
    return _record(model, "per_channel", layer, "per_channel_used", float(fact.get("per_channel", entry["used"])),
                   1.0, failed, message, entry, order)


def _dynamic_static(model, layer, entry, fact, order) -> dict:
    failed = entry["recommended"] and not fact.get("dynamic", False)
    message = (f"layer {layer}: its output is {entry['output_class']} (S={entry['output_s']:.3f} <= tolerance "
               f"{entry['tolerance']}), so dynamic quantization is recommended but the quantizer is static. Fix: "
               f"Int8StaticQuantizer(layer_overrides={{'{layer}': {{'is_dynamic': True}}}}).")
    return _record(model, "dynamic_static", layer, "output_batch_to_epoch_ratio", entry["output_s"],
                   entry["tolerance"], failed, message, entry, order)


def _equalization(model, layer, entry, fact, order) -> dict:
    failed = entry["recommended"] and not fact.get("equalized", False)
    message = (f"layer {layer}: input-weight equalization is recommended for {entry['fraction']:.0%} of its "
               f"{entry['channels']} channels (>= 40%) and the model is not equalized. Fix: qmodel(..., equalize=True), "
               "or set this check's severity to warn/off.")
    return _record(model, "input_weight_equalization", layer, "equalization_channel_fraction", entry["fraction"],
                   0.4, failed, message, entry, order)


def _outlier(model, layer, entry, fact, order) -> dict:
    failed = bool(entry["outlier_channels"]) and not fact.get("clipping", False)
    shown = ", ".join(str(c) for c in entry["outlier_channels"][:8])
    more = "" if len(entry["outlier_channels"]) <= 8 else f" and {len(entry['outlier_channels']) - 8} more"
    message = (f"layer {layer}: input channels {shown}{more} have outliers (q100/q_ref up to "
               f"{entry['max_ratio']:.1f} > {entry['threshold']}) and the activation observer does not clip. Fix: "
               "quantizer='int8_histogram' (clipping range chosen by error), or keep the layer in float with skip_layers.")
    return _record(model, "outlier", layer, "max_percentile_ratio", entry["max_ratio"], entry["threshold"], failed,
                   message, entry, order)


_FINDERS = {"per_channel": _per_channel, "dynamic_static": _dynamic_static,
            "input_weight_equalization": _equalization, "outlier": _outlier}


def apply_severity(finding: dict, severity: str) -> dict:
    """'warn' turns a failure into a warning; 'fail' keeps it; ('off' checks are never collected)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, not {severity!r}")
    if severity == "warn" and finding["verdict"] == "fail":
        return dict(finding, verdict="warn")
    return finding

