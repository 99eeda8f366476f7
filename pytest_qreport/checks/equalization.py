"""Equalization checks: the SQNR gain the best equalization method would bring, and the float equivalence of an
equalized or smoothed model."""
from __future__ import annotations

import math
from typing import Any

from ..core.experts import not_measured_details, unreached_details
from ..core.findings import Finding
from ..core.numbers import format_bound
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels
from ..fixes import Advice, FixSearch, fix_search

__all__ = ["EqualizationCheck", "EqualizationEquivalenceCheck"]


class EqualizationCheck(Check):
    """The SQNR gain of the best equalization method for each layer: input-weight equalization (sqrt balance,
    torch.ao's) or smoothing (SmoothQuant-style, searched alpha). The gain is the layer's own SQNR (float input,
    as in the shadow comparison) with the method against without it, measured in the model's one comparison pass.
    A layer fails when that gain reaches the minimum and the model is not equalized. Its fix (equalize=[layers],
    equalize=True or equalize='smooth:search', the one that raises the output most) is tried on the whole model
    within the fix budget and printed where it raises the layer's own SQNR by the minimum gain without lowering the
    output SQNR; otherwise the item says what the trials measured, or how to search further."""

    # the gain left on the table without equalization: more is worse
    name, order, metric, needs = "equalization", 80, "sqnr_gain_db", frozenset({"sqnr", "equalization"})
    higher_is_better = False
    settings = (Setting("equalization_min_gain_db", decibels(non_negative=True), 1.0, "equalization and "
                        "input_weight_equalization items fail when equalizing a layer was measured to gain at least "
                        "this many dB", metavar="DB"),)

    def layers(self, model: ModelContext) -> list[str]:
        return list(model.analysis.equalization_candidates)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        from qcore.analysis import NO_TOKEN_REASON

        analysis, min_gain = model.analysis, model.settings.equalization_min_gain_db
        applied = bool(analysis.equalize_recipe)
        refused = {layer: analysis.layer(layer).equalization_refusal for layer in layers}
        measured = analysis.equalization_variants if any(not reason for reason in refused.values()) else {}
        smoothing = analysis.smoothing if measured and self.options.get("smooth", True) else {}
        search = fix_search(model)
        advice = None if applied else self._advice(search, measured)
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
                                       message=f"layer {layer}: not equalized: {why}.",
                                       details=unreached_details() if why == NO_TOKEN_REASON
                                       else not_measured_details(f"not equalized: {why}")))
                continue
            best = max(variants.values(), key=lambda v: v.gain_db if not math.isnan(v.gain_db) else -math.inf)
            if math.isnan(best.gain_db):  # an expert routed tokens only in the batches the variants do not measure
                from qcore.analysis import variant_batches

                why = (f"the equalization variants are measured on the first "
                       f"{variant_batches(len(analysis.batches))} calibration batches, and none of them reached its "
                       "input")
                results.append(Finding(model=model.name, check=self.name, layer=layer, metric=self.metric,
                                       value=math.nan, threshold=min_gain, verdict="skip",
                                       message=f"layer {layer}: not measured: {why}",
                                       details=not_measured_details(why)))
                continue
            label = (f"smoothing into {best.producer_name} (alpha {best.alpha:g})" if best.method == "smoothing"
                     else "input-weight equalization")
            details = {"shadow_sqnr_db": best.baseline_db, "applied": applied, "method": label,
                       **{f"{v.method}_sqnr_db": v.sqnr_db for v in variants.values()}}
            found = self.finding(model, layer, best.gain_db, min_gain, passed=True, details=details)
            if applied or not best.gain_db >= min_gain:
                results.append(found)
            elif advice is not None and advice.helps(layer):
                smoothed = advice.trial is not None and advice.trial.fix.value == "smooth:search"
                chosen = variants.get("smoothing" if smoothed else "input_weight", best)
                method = label if chosen is best else (
                    f"smoothing into {chosen.producer_name} (alpha {chosen.alpha:g})" if smoothed
                    else "input-weight equalization")
                results.append(found.replace(verdict="fail", message=(
                    f"layer {layer}: {method} raises its own SQNR (float input) by {chosen.gain_db:.1f} dB in the "
                    f"comparison pass ({chosen.baseline_db:.1f} -> {chosen.sqnr_db:.1f} dB) and the model is not "
                    f"equalized; {advice.claim(layer)}.{search.others_untried(advice)} Fix: {advice.fix_text()}.")))
            else:  # the comparison pass measured the gain: the item fails, with what the fix budget measured
                results.append(found.replace(verdict="fail", message=self._unadvised(model, search, layer, best,
                                                                                      label, advice)))
        return results

    def _unadvised(self, model: ModelContext, search: FixSearch, layer: str, best: Any, label: str,
                   advice: Advice | None) -> str:
        """The message of a layer whose best variant gains the minimum in the comparison pass but whose fix the
        whole model's trials did not keep: what they measured, or that the fix budget left them untried."""
        min_gain = model.settings.equalization_min_gain_db
        claim = (f"layer {layer}: {label} raises its own SQNR (float input) by {best.gain_db:.1f} dB in the "
                 f"comparison pass ({best.baseline_db:.1f} -> {best.sqnr_db:.1f} dB; the minimum gain is "
                 f"{min_gain:g} dB) and the model is not equalized")
        if advice is not None and advice.stopped:
            setting = (search.equalize("smooth:search", [layer]) if best.method == "smoothing"
                       else search.equalize([layer], [layer])).paste()
            return (f"{claim}; its effect on the model output was not measured: the model's fix budget was spent."
                    f"{search.further()} The setting that applies it: qmodel(..., {setting}).")
        why = advice.notes.get(layer, "not measured") if advice is not None else "not measured"
        return (f"{claim}, but on the whole model {why}, so it is not advised: raise equalization_min_gain_db above "
                f"{format_bound(best.gain_db, 'gain_db', up=True)}, or set severity={{{self.name!r}: 'warn'}}, to "
                "accept the layer as it is.")

    def _advice(self, search: FixSearch, measured: Any) -> Advice | None:
        """The best measured fix (by output SQNR) of: input-weight equalization of the layers it helps, of every
        layer, and smoothing; None when no layer gains the minimum in the comparison pass."""
        if not measured:
            return None
        return search.equalization(smooth=self.options.get("smooth", True))


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
