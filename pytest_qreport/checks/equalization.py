"""Equalization checks: the SQNR gain the best equalization method would bring, and the float equivalence of an
equalized or smoothed model."""
from __future__ import annotations

import math

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels

__all__ = ["EqualizationCheck", "EqualizationEquivalenceCheck"]


class EqualizationCheck(Check):
    """The SQNR gain of the best equalization method for each layer: input-weight equalization (sqrt balance,
    torch.ao's) or smoothing (SmoothQuant-style, searched alpha). The gain is the layer's own SQNR (float input,
    as in the shadow comparison) with the method against without it, measured in the model's one comparison pass.
    Fails when the best gains at least the minimum and the model is not equalized; the message names the method
    and the setting that applies it."""

    # the gain left on the table without equalization: more is worse
    name, order, metric, needs = "equalization", 80, "sqnr_gain_db", frozenset({"sqnr", "equalization"})
    higher_is_better = False
    settings = (Setting("equalization_min_gain_db", decibels(non_negative=True), 1.0, "equalization items fail "
                        "when equalizing a layer gains at least this many dB", metavar="DB"),)

    def layers(self, model: ModelContext) -> list[str]:
        return list(model.analysis.equalization_candidates)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        analysis, min_gain = model.analysis, model.settings.equalization_min_gain_db
        applied = bool(analysis.equalize_recipe)
        refused = {layer: analysis.layer(layer).equalization_refusal for layer in layers}
        measured = analysis.equalization_variants if any(not reason for reason in refused.values()) else {}
        smoothing = analysis.smoothing if measured and self.options.get("smooth", True) else {}
        results = []
        for layer in layers:
            variants = dict(measured.get(layer, {}))
            if not self.options.get("smooth", True):
                variants.pop("smoothing", None)
            if not variants:
                why = (refused[layer] or analysis.unmeasured_variants.get(layer)
                       or smoothing.get(layer, {}).get("refused", "") or "no equalization method applies to it")
                results.append(Finding(model=model.name, check=self.name, layer=layer, metric=self.metric,
                                       value=math.nan, threshold=min_gain, verdict="skip",
                                       message=f"layer {layer}: not equalized: {why}."))
                continue
            best = max(variants.values(), key=lambda v: v.gain_db if not math.isnan(v.gain_db) else -math.inf)
            if best.method == "smoothing":
                method = f"smoothing into {best.producer_name} (alpha {best.alpha:g})"
                setting = "equalize='smooth:search'"
            else:
                method, setting = "input-weight equalization", "equalize=True"
            message = (f"layer {layer}: {method} raises its own SQNR (float input) by {best.gain_db:.1f} dB "
                       f"({best.baseline_db:.1f} -> {best.sqnr_db:.1f} dB, >= {min_gain:.1f} dB) and the model is not "
                       f"equalized. Fix: qmodel(..., {setting}).")
            details = {"shadow_sqnr_db": best.baseline_db, "method": method, "applied": applied,
                       **{f"{v.method}_sqnr_db": v.sqnr_db for v in variants.values()}}
            results.append(self.finding(model, layer, best.gain_db, min_gain,
                                        passed=applied or not best.gain_db >= min_gain, message=message,
                                        details=details))
        return results


class EqualizationEquivalenceCheck(Check):
    """The equalized float model must compute what the original computes (relative to the output's magnitude)."""

    name, order, metric, higher_is_better = "equalization_equivalence", 90, "max_relative_error", False
    needs = frozenset({"equivalence"})
    max_relative_error = 1e-4

    def applies(self, model: ModelContext) -> bool:
        return bool(model.analysis.equalize_recipe)

    def layers(self, model: ModelContext) -> list[str]:
        return ["output"]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        import torch

        # an fp16/bf16 model cannot be equal to 1e-4: its own rounding of the rescaled weights is ~eps
        default = max(self.max_relative_error, 2 * torch.finfo(model.analysis.dtype).eps)
        error, threshold = model.analysis.equivalence_error, float(self.options.get("max_relative_error", default))
        message = (f"model {model.name}: the equalized float model differs from the original by {error:.3g} "
                   f"(relative, > {threshold:g}); equalization must not change the float function. Report this "
                   "model, or use equalize='cross_layer' / a smaller layer list.")
        return [self.finding(model, layer, error, threshold, passed=error <= threshold, message=message)
                for layer in layers]
