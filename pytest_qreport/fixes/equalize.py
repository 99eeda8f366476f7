"""The equalization fixes: input-weight equalization of the layers its variant helps, of every layer, and
smoothing, each screened by the comparison pass's variants and tried on the whole model within the fix budget."""
from __future__ import annotations

import math
from dataclasses import replace

from .trials import Advice, Searcher, SearchScope, Trial, equalize_fix, verify

__all__ = ["equalization_advice", "equalize_all_advice", "input_weight_advice", "smoothing_advice", "variant_gains"]


def _gains(scope: SearchScope, method: str) -> list[str]:
    """The equalizable layers whose `method` variant gained at least the minimum, in graph order."""
    analysis, min_gain = scope.analysis, scope.settings.equalization_min_gain_db
    if not analysis.equalizable_layers:
        return []
    variants = analysis.equalization_variants
    return [layer for layer in analysis.equalizable_layers
            if method in variants.get(layer, {}) and variants[layer][method].gain_db >= min_gain]


def variant_gains(scope: SearchScope, method: str, layers: list[str] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """{layer: (own SQNR, own SQNR with the `method` variant)} that the comparison pass measured (the verdict
    pass's screen of the equalization fixes), for `layers` (default: every equalizable layer) that have one."""
    variants = scope.analysis.equalization_variants
    chosen = scope.analysis.equalizable_layers if layers is None else layers
    return {layer: (variant.baseline_db, variant.sqnr_db) for layer in chosen
            if (variant := variants.get(layer, {}).get(method)) is not None}


def input_weight_advice(searcher: Searcher, layers: list[str] | None = None) -> Advice:
    """equalize=[the layers whose input-weight variant gains at least the minimum], tried on the model within its
    fix budget; with `layers`, the advice concerns those (the heuristic's), the others pass unmeasured."""
    scope = searcher.scope
    min_gain = scope.settings.equalization_min_gain_db
    chosen = _gains(scope, "input_weight")
    named = list(layers) if layers is not None else chosen
    if not chosen:
        empty = Advice(first=_no_trial(), trial=None, recommended=(), min_gain=min_gain, kind="own",
                       notes={layer: _variant_note(scope, layer) for layer in named})
        return empty
    advice = verify(searcher, chosen, lambda picked: equalize_fix(picked, picked, scope), min_gain,
                    screened=variant_gains(scope, "input_weight", chosen))
    notes = {layer: _variant_note(scope, layer) for layer in named if layer not in chosen}
    return Advice(advice.first, advice.trial, advice.recommended, min_gain, "own", {**advice.notes, **notes},
                  stopped=advice.stopped)


def equalize_all_advice(searcher: Searcher) -> Advice | None:
    """equalize=True (every equalizable layer) tried on the model within its fix budget, for the layers it raises
    by the minimum (None when the model has no equalizable layer)."""
    scope = searcher.scope
    layers = list(scope.analysis.equalizable_layers)
    if not layers:
        return None
    return verify(searcher, layers, lambda picked: equalize_fix(True, layers), scope.settings.equalization_min_gain_db,
                  screened=variant_gains(scope, "input_weight", layers))


def smoothing_advice(searcher: Searcher) -> Advice | None:
    """equalize='smooth:search' tried on the model within its fix budget, for the layers whose smoothing variant
    gains at least the minimum (None when there are none)."""
    scope = searcher.scope
    chosen = _gains(scope, "smoothing")
    if not chosen:
        return None
    return verify(searcher, chosen, lambda picked: equalize_fix("smooth:search", chosen),
                  scope.settings.equalization_min_gain_db, screened=variant_gains(scope, "smoothing", chosen))


def equalization_advice(searcher: Searcher, layers: list[str] | None = None, smooth: bool = True) -> Advice:
    """The best measured equalization fix (by output SQNR): input-weight equalization of the layers its variant
    helps, or of every layer (tried when some layer's variant helps), or smoothing, each tried within the model's
    fix budget (the advice is `stopped` when the budget left one untried); `layers` are the layers the caller asks
    about (the heuristic's), for the notes. The most promising method is tried first: smoothing when its variants
    gain more in all than the input-weight ones."""
    scope = searcher.scope
    smoothing_first = smooth and _promise(scope, "smoothing") > _promise(scope, "input_weight")
    smoothed = smoothing_advice(searcher) if smoothing_first else None
    options: list[Advice | None] = [input_weight_advice(searcher, layers)]
    if options[0] is not None and options[0].trial is not None:
        options.append(equalize_all_advice(searcher))
    if smooth:
        options.append(smoothed if smoothing_first else smoothing_advice(searcher))
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


def _promise(scope: SearchScope, method: str) -> float:
    """What the comparison pass measured `method` to gain in all, in dB, on the layers where it gains the minimum."""
    gains = variant_gains(scope, method, _gains(scope, method))
    return sum(after - before for before, after in gains.values())


def _no_trial() -> Trial:
    """The trial of an advice that tried nothing."""
    return Trial(equalize_fix(None, ()), (math.nan, math.nan), {}, {}, {})


def _variant_note(scope: SearchScope, layer: str) -> str:
    """What the layer's input-weight variant measured, when it was not worth a trial."""
    variant = scope.analysis.equalization_variants.get(layer, {}).get("input_weight")
    if variant is None:
        return "its equalization could not be measured: " + scope.analysis.unmeasured_variants.get(layer, "unknown")
    return (f"measured {variant.gain_db:+.2f} dB on this layer's own SQNR ({variant.baseline_db:.2f} -> "
            f"{variant.sqnr_db:.2f} dB; the minimum gain is {scope.settings.equalization_min_gain_db:g} dB)")
