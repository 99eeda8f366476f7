"""SQNR checks: per-layer propagated SQNR, weight SQNR, and the SQNR of the model's output."""
from __future__ import annotations

import math

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels

__all__ = ["ModelSqnrCheck", "SqnrCheck", "WeightSqnrCheck", "below", "below_resolution_advice", "keep_in_float_hint"]


def keep_in_float_hint(layer: str) -> str:
    """The quantizer setting that keeps one layer unquantized (skip_layers only hides a layer from checks). The
    layer name, unlike its module's FQN, names this one op (layer_overrides match either)."""
    return f"quantizer=qcore.Int8StaticQuantizer(layer_overrides={{{layer!r}: {{'skip': True}}}})"


def below(value: float, threshold: float) -> str:
    """'value dB < threshold dB' with enough digits to show the difference (never '36.0 dB < 36.0 dB')."""
    digits = 1
    while digits < 6 and f"{value:.{digits}f}" == f"{threshold:.{digits}f}":
        digits += 1
    return f"{value:.{digits}f} dB < {threshold:.{digits}f} dB"


def below_resolution_advice(layer: str, limits: tuple) -> str:
    """Why a layer whose tensors are below int8's resolution fails, and the options that help (qcore.diagnose
    ResolutionLimit records: role, observed_range, smallest_scale)."""
    ranges = " and ".join(f"{limit.role} range {limit.observed_range:.3g}" for limit in limits)
    verb, them = ("are", "them") if len(limits) > 1 else ("is", "it")
    return (f" Its {ranges} {verb} below the quantizer's resolution (smallest scale {limits[0].smallest_scale:.3g}), "
            f"so int8 rounds {them} to (nearly) all zeros. Per-channel weights or a clipping observer cannot help: "
            f"keep the layer in float with {keep_in_float_hint(layer)}, or, if the model's output does not depend on "
            f"it (its model_sqnr item passes), hide it from the checks with skip_layers=[{layer!r}].")


def _not_measured(check: Check, model: ModelContext, layer: str, threshold: float) -> Finding:
    return check.finding(model, layer, math.nan, threshold, passed=False,
                         message=f"model {model.name!r}, layer {layer}: collected but not measured: the model's graph "
                                 "changed between collection and run. Re-run pytest.")


def check_finding_without_float_output(check: Check, model: ModelContext, layer: str, threshold: float) -> Finding:
    """A model whose output holds no floating-point tensor cannot have an output SQNR: say what it holds."""
    held = "; ".join(model.analysis.describe_outputs())
    return check.finding(model, layer, math.nan, threshold, passed=False, message=(
        f"model {model.name!r}: its output holds no floating-point tensor ({held}). Only floating outputs are "
        "compared: return the float tensor the model computes (logits, not argmax), or turn this check off "
        "with qmodel(severity={'model_sqnr': 'off'})."))


class SqnrCheck(Check):
    """Propagated SQNR of each quantized layer's output (quantized inputs, so upstream error counts)."""

    name, order, metric, needs = "sqnr", 10, "sqnr_db", frozenset({"sqnr"})
    settings = (Setting("sqnr_min_db", decibels(), 20.0, "minimum per-layer SQNR in dB (propagated error)",
                        metavar="DB"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured, results = model.settings.sqnr_min_db, model.analysis.sqnr.layers, []
        for layer in layers:
            entry = measured.get(layer)
            if entry is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            quantized = model.analysis.layer(layer)
            message = self.message(layer, entry.fqn, entry.sqnr_db, threshold, entry.shadow_sqnr_db,
                                   entry.weight_sqnr_db is not None, quantized.per_channel, quantized.clipping,
                                   entry.below_resolution)
            details = {"shadow_sqnr_db": entry.shadow_sqnr_db, "normalized_l2": entry.normalized_l2,
                       "cosine": entry.cosine, "batches": entry.batches, "op": entry.op, "fqn": entry.fqn,
                       "format": quantized.format}
            results.append(self.finding(model, layer, entry.sqnr_db, threshold, message=message, details=details))
        return results

    @staticmethod
    def message(layer: str, fqn: str, value: float, threshold: float, shadow: float, weighted: bool,
                per_channel: bool = False, clipping: bool = False, below_resolution: tuple = ()) -> str:
        """Explain a low propagated SQNR, telling inherited error from the layer's own, with advice that fits
        the quantizer in force (no per-channel advice to a per-channel quantizer, say)."""
        text = f"layer {layer}: SQNR {below(value, threshold)} (shadow SQNR {shadow:.1f} dB)."
        if below_resolution:
            return text + below_resolution_advice(layer, below_resolution)
        if not math.isnan(shadow) and shadow >= threshold:
            return text + (" With float inputs the layer is fine: it inherits its error from upstream layers. "
                           "Fix the first failing layer upstream, or hide this layer from the checks with "
                           f"skip_layers=[{layer!r}].")
        options = []
        if weighted and not per_channel:
            options.append("quantize its weights per channel (quantizer='int8')")
        if not clipping:
            options.append("clip its activation range by error (quantizer='int8_histogram')")
        options.append(f"keep the layer in float with {keep_in_float_hint(layer)}")
        return text + " The layer's own quantization error is too large: " + ", or ".join(options) + "."


class WeightSqnrCheck(Check):
    """SQNR of each quantized weight."""

    name, order, metric, needs = "weight_sqnr", 20, "weight_sqnr_db", frozenset({"sqnr"})
    settings = (Setting("weight_sqnr_min_db", decibels(), 30.0, "minimum SQNR of each quantized weight in dB",
                        metavar="DB"),)

    def layers(self, model: ModelContext) -> list[str]:
        return [entry.layer for entry in model.analysis.layers if entry.weighted]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured, results = model.settings.weight_sqnr_min_db, model.analysis.sqnr.layers, []
        for layer in layers:
            entry = measured.get(layer)
            if entry is None or entry.weight_sqnr_db is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            per_channel = model.analysis.layer(layer).per_channel
            weight_limits = tuple(limit for limit in entry.below_resolution if limit.role == "weight")
            if weight_limits:
                message = (f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}."
                           + below_resolution_advice(layer, weight_limits))
                results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
                continue
            advice = "" if per_channel else "Quantize its weights per channel (quantizer='int8'), or keep"
            message = (f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}. "
                       f"{advice or 'Its weights are already quantized per channel: keep'} the layer in float with "
                       f"{keep_in_float_hint(layer)}.")
            results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
        return results


class ModelSqnrCheck(Check):
    """SQNR of the model's output (the worst output leaf when there are several)."""

    name, order, metric, needs = "model_sqnr", 30, "sqnr_db", frozenset({"sqnr"})
    settings = (Setting("model_sqnr_min_db", decibels(), 20.0, "minimum SQNR of the model's final output in dB",
                        metavar="DB"),)

    def layers(self, model: ModelContext) -> list[str]:
        return ["output"]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured, results = model.settings.model_sqnr_min_db, model.analysis.sqnr, []
        for name in layers:
            entry = measured.worst_output() if name == "output" else measured.outputs.get(name)
            if entry is None and not measured.outputs:
                results.append(check_finding_without_float_output(self, model, name, threshold))
                continue
            if entry is None:
                results.append(_not_measured(self, model, name, threshold))
                continue
            message = (f"model output {name}: SQNR {below(entry.sqnr_db, threshold)}. See the per-layer sqnr "
                       "items for the layer where the error starts.")
            from .sensitivity import output_fix, recipe

            details: dict = {"cosine": entry.cosine, "normalized_l2": entry.normalized_l2, "leaf": entry.name}
            formats = recipe(model)
            if entry.sqnr_db < threshold:
                advice, formats = output_fix(model, threshold)
                message += advice
            if formats is not None:  # the formats to deploy (with the fix when it fails): {"default", "layers"}
                details["recipe"] = formats
            results.append(self.finding(model, name, entry.sqnr_db, threshold, message=message, details=details))
        return results
