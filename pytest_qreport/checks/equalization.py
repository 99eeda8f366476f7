"""Equalization checks: the SQNR gain the best equalization method would bring, and the float equivalence of an
equalized or smoothed model."""
from __future__ import annotations

import math

from ..findings import Finding
from ..registry import Check, ModelContext

__all__ = ["EqualizationCheck", "EqualizationEquivalenceCheck"]


class EqualizationCheck(Check):
    """The SQNR gain of the best equalization method for each layer: input-weight equalization (sqrt balance,
    torch.ao's) or smoothing (SmoothQuant-style, searched alpha). Fails when the best gains at least the
    minimum and the model is not equalized; the message names the method and the setting that applies it."""

    name, order, metric, needs = "equalization", 80, "sqnr_gain_db", frozenset({"sqnr", "equalization"})

    def layers(self, model: ModelContext) -> list[str]:
        return list(model.analysis.equalization_candidates)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        analysis, min_gain = model.analysis, model.settings.equalization_min_gain_db
        applied = bool(analysis.equalize_recipe)
        refused = {layer: analysis.layer(layer).equalization_refusal for layer in layers}
        smoothing = analysis.smoothing if self.options.get("smooth", True) else {}
        smoothable = {layer for layer in layers if layer in smoothing and "refused" not in smoothing[layer]}
        measured = [layer for layer in layers if not refused[layer]]
        before = {k: v.sqnr_db for k, v in analysis.unequalized_sqnr.layers.items()} if measured or smoothable else {}
        after = {k: v.sqnr_db for k, v in analysis.equalized_sqnr.layers.items()} if measured else {}
        smoothed = {k: v.sqnr_db for k, v in analysis.smoothed_sqnr.layers.items()} if smoothable else {}
        results = []
        for layer in layers:
            old = before.get(layer, math.nan)
            options = []
            if not refused[layer]:
                options.append((after.get(layer, math.nan) - old, "input-weight equalization", "equalize=True"))
            if layer in smoothable:
                alpha = smoothing[layer]["alpha"]
                options.append((smoothed.get(layer, math.nan) - old,
                                f"smoothing into {smoothing[layer]['producer_name']} (alpha {alpha:g})",
                                "equalize='smooth:search'"))
            if not options:
                why = refused[layer] or smoothing.get(layer, {}).get("refused", "")
                results.append(Finding(model=model.name, check=self.name, layer=layer, metric=self.metric,
                                       value=math.nan, threshold=min_gain, verdict="skip",
                                       message=f"layer {layer}: not equalized: {why}."))
                continue
            gain, method, setting = max(options, key=lambda o: o[0] if not math.isnan(o[0]) else -math.inf)
            message = (f"layer {layer}: {method} raises its SQNR by {gain:.1f} dB ({old:.1f} -> {old + gain:.1f} dB, "
                       f">= {min_gain:.1f} dB) and the model is not equalized. Fix: qmodel(..., {setting}).")
            details = {"sqnr_db": old, "equalized_sqnr_db": after.get(layer), "smoothed_sqnr_db": smoothed.get(layer),
                       "method": method, "applied": applied}
            results.append(self.finding(model, layer, gain, min_gain, passed=applied or not gain >= min_gain,
                                        message=message, details=details))
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
