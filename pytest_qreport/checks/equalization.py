"""Equalization checks: the SQNR gain the best equalization method would bring, and the float equivalence of an
equalized or smoothed model."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..core.findings import Finding
from ..core.numbers import format_bound
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels
from .advice import Advice, Trial, equalize_fix, others_untried, search_further, verify

__all__ = ["EqualizationCheck", "EqualizationEquivalenceCheck", "equalization_advice", "equalize_all_advice",
           "input_weight_advice", "smoothing_advice", "variant_gains"]


def _gains(model: ModelContext, method: str) -> list[str]:
    """The equalizable layers whose `method` variant gained at least the minimum, in graph order."""
    analysis, min_gain = model.analysis, model.settings.equalization_min_gain_db
    if not analysis.equalizable_layers:
        return []
    variants = analysis.equalization_variants
    return [layer for layer in analysis.equalizable_layers
            if method in variants.get(layer, {}) and variants[layer][method].gain_db >= min_gain]


def variant_gains(model: ModelContext, method: str, layers: list[str] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """{layer: (own SQNR, own SQNR with the `method` variant)} that the comparison pass measured (the verdict
    pass's screen of the equalization fixes), for `layers` (default: every equalizable layer) that have one."""
    variants = model.analysis.equalization_variants
    chosen = model.analysis.equalizable_layers if layers is None else layers
    return {layer: (variant.baseline_db, variant.sqnr_db) for layer in chosen
            if (variant := variants.get(layer, {}).get(method)) is not None}


def input_weight_advice(model: ModelContext, layers: list[str] | None = None) -> Advice:
    """equalize=[the layers whose input-weight variant gains at least the minimum], tried on the model within its
    fix budget; with `layers`, the advice concerns those (the heuristic's), the others pass unmeasured."""
    min_gain = model.settings.equalization_min_gain_db
    chosen = _gains(model, "input_weight")
    named = list(layers) if layers is not None else chosen
    if not chosen:
        empty = Advice(first=_no_trial(), trial=None, recommended=(), min_gain=min_gain, kind="own",
                       notes={layer: _variant_note(model, layer) for layer in named})
        return empty
    advice = verify(model, chosen, lambda picked: equalize_fix(picked, picked), min_gain,
                    screened=variant_gains(model, "input_weight", chosen))
    notes = {layer: _variant_note(model, layer) for layer in named if layer not in chosen}
    return Advice(advice.first, advice.trial, advice.recommended, min_gain, "own", {**advice.notes, **notes},
                  stopped=advice.stopped)


def equalize_all_advice(model: ModelContext) -> Advice | None:
    """equalize=True (every equalizable layer) tried on the model within its fix budget, for the layers it raises
    by the minimum (None when the model has no equalizable layer)."""
    layers = list(model.analysis.equalizable_layers)
    if not layers:
        return None
    return verify(model, layers, lambda picked: equalize_fix(True, layers), model.settings.equalization_min_gain_db,
                  screened=variant_gains(model, "input_weight", layers))


def smoothing_advice(model: ModelContext) -> Advice | None:
    """equalize='smooth:search' tried on the model within its fix budget, for the layers whose smoothing variant
    gains at least the minimum (None when there are none)."""
    chosen = _gains(model, "smoothing")
    if not chosen:
        return None
    return verify(model, chosen, lambda picked: equalize_fix("smooth:search", chosen),
                  model.settings.equalization_min_gain_db, screened=variant_gains(model, "smoothing", chosen))


def equalization_advice(model: ModelContext, layers: list[str] | None = None, smooth: bool = True) -> Advice:
    """The best measured equalization fix (by output SQNR): input-weight equalization of the layers its variant
    helps, or of every layer (tried when some layer's variant helps), or smoothing, each tried within the model's
    fix budget (the advice is `stopped` when the budget left one untried); `layers` are the layers the caller asks
    about (the heuristic's), for the notes. The most promising method is tried first: smoothing when its variants
    gain more in all than the input-weight ones."""
    smoothing_first = smooth and _promise(model, "smoothing") > _promise(model, "input_weight")
    smoothed = smoothing_advice(model) if smoothing_first else None
    options: list[Advice | None] = [input_weight_advice(model, layers)]
    if options[0] is not None and options[0].trial is not None:
        options.append(equalize_all_advice(model))
    if smooth:
        options.append(smoothed if smoothing_first else smoothing_advice(model))
    stopped = any(option is not None and option.stopped for option in options)
    helping = [a for a in options if a is not None and a.recommended and a.trial is not None]
    if helping:
        best = max(helping, key=lambda a: a.trial.output[1] if a.trial is not None else -math.inf)
        return replace(best, stopped=stopped)
    notes: dict[str, str] = {}
    for option in options:
        if option is not None:
            notes.update({k: v for k, v in option.notes.items() if k not in notes})
    first = options[0]
    assert first is not None
    return Advice(first.first, None, (), first.min_gain, "own", notes, stopped=stopped)


def _promise(model: ModelContext, method: str) -> float:
    """What the comparison pass measured `method` to gain in all, in dB, on the layers where it gains the minimum."""
    gains = variant_gains(model, method, _gains(model, method))
    return sum(after - before for before, after in gains.values())


def _no_trial() -> Trial:
    """The trial of an advice that tried nothing."""
    return Trial(equalize_fix(None, ()), (math.nan, math.nan), {}, {}, {})


def _variant_note(model: ModelContext, layer: str) -> str:
    """What the layer's input-weight variant measured, when it was not worth a trial."""
    variant = model.analysis.equalization_variants.get(layer, {}).get("input_weight")
    if variant is None:
        return "its equalization could not be measured: " + model.analysis.unmeasured_variants.get(layer, "unknown")
    return (f"measured {variant.gain_db:+.2f} dB on this layer's own SQNR ({variant.baseline_db:.2f} -> "
            f"{variant.sqnr_db:.2f} dB; the minimum gain is {model.settings.equalization_min_gain_db:g} dB)")


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
        analysis, min_gain = model.analysis, model.settings.equalization_min_gain_db
        applied = bool(analysis.equalize_recipe)
        refused = {layer: analysis.layer(layer).equalization_refusal for layer in layers}
        measured = analysis.equalization_variants if any(not reason for reason in refused.values()) else {}
        smoothing = analysis.smoothing if measured and self.options.get("smooth", True) else {}
        advice = None if applied else self._advice(model, measured)
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
                    f"equalized; {advice.claim(layer)}.{others_untried(model, advice)} Fix: {advice.fix_text()}.")))
            else:  # the comparison pass measured the gain: the item fails, with what the fix budget measured
                results.append(found.replace(verdict="fail", message=self._unadvised(model, layer, best, label,
                                                                                      advice)))
        return results

    def _unadvised(self, model: ModelContext, layer: str, best: Any, label: str, advice: Advice | None) -> str:
        """The message of a layer whose best variant gains the minimum in the comparison pass but whose fix the
        whole model's trials did not keep: what they measured, or that the fix budget left them untried."""
        min_gain = model.settings.equalization_min_gain_db
        claim = (f"layer {layer}: {label} raises its own SQNR (float input) by {best.gain_db:.1f} dB in the "
                 f"comparison pass ({best.baseline_db:.1f} -> {best.sqnr_db:.1f} dB; the minimum gain is "
                 f"{min_gain:g} dB) and the model is not equalized")
        if advice is not None and advice.stopped:
            setting = (equalize_fix("smooth:search", [layer]) if best.method == "smoothing"
                       else equalize_fix([layer], [layer])).paste()
            return (f"{claim}; its effect on the model output was not measured: the model's fix budget was spent."
                    f"{search_further(model)} The setting that applies it: qmodel(..., {setting}).")
        why = advice.notes.get(layer, "not measured") if advice is not None else "not measured"
        return (f"{claim}, but on the whole model {why}, so it is not advised: raise equalization_min_gain_db above "
                f"{format_bound(best.gain_db, 'gain_db', up=True)}, or set severity={{{self.name!r}: 'warn'}}, to "
                "accept the layer as it is.")

    def _advice(self, model: ModelContext, measured: Any) -> Advice | None:
        """The best measured fix (by output SQNR) of: input-weight equalization of the layers it helps, of every
        layer, and smoothing; None when no layer gains the minimum in the comparison pass."""
        if not measured:
            return None
        return equalization_advice(model, smooth=self.options.get("smooth", True))


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
