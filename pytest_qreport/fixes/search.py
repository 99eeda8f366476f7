"""The fix search a check asks for a fix: one interface, FixSearch, that simulation and artifact mode implement.

A check asks it for the fixes of its failing layers (`layer_fixes`, for a layer's propagated or weight SQNR) or of
its failing output (`output_fix`, for a metric and its target), and prints what it returns. Every search and trial
runs here: keeping layers in float, per-channel weights and a clipping observer (layer_overrides), formats, and
equalization; each within the model's fix budget (qcore's StageTimes), each printed fix measured on every batch
its item is judged on.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import equalize
from .trials import (
    Advice,
    Fix,
    SearchScope,
    Trial,
    equalize_fix,
    float_layers_fix,
    float_search_limit,
    layer_overrides_fix,
    max_float_layers,
    others_untried,
    quantized_layer_names,
    search_further,
    try_fix,
    verify,
)

__all__ = ["BLOCKWISE_NOTE", "DEFAULT_BATCHES", "DEFAULT_CANDIDATES", "MIN_FIX_GAIN_DB", "FixSearch", "MeasuredFixes",
           "OutputAdvice"]

# a fix for a failing layer is listed when it raises the layer's SQNR by at least this much (and not the output's)
MIN_FIX_GAIN_DB = 0.1
DEFAULT_BATCHES = 2  # a search's screen batches; the printed fix is measured on every batch the item is judged on
DEFAULT_CANDIDATES = 8  # the layers with the largest own error, each screened alone
BLOCKWISE_NOTE = ("No {search} ran: the model is analysed one block at a time (blockwise), and the {search} "
                  "measures the whole quantized model; it runs with qmodel(blockwise=False) where the whole model's "
                  "analysis fits in memory.")


@dataclass(frozen=True)
class OutputAdvice:
    """What ends an output item's message: the measured fix in words (`text`); the recipe for the JSON and HTML
    reports, or None; the setting whose measured value the text prints ("layer_formats", "float_layers", or "" when
    it prints none); and whether the fix budget was spent before any search ran (`unsearched`: the text then says
    how to search further)."""

    text: str
    recipe: dict[str, Any] | None = None
    setting: str = ""
    unsearched: bool = False

    def __iter__(self) -> Iterator[Any]:
        """(text, recipe): a check written when output_fix answered that pair unpacks it as before."""
        return iter((self.text, self.recipe))

    def __getitem__(self, index: int) -> Any:
        """(text, recipe)[index], as the pair output_fix answered before."""
        return (self.text, self.recipe)[index]


class MeasuredFixes(dict):
    """{failing layer: the fixes measured for it, as text}, and whether the fix budget stopped a search for them."""

    stopped: bool = False


class FixSearch(ABC):
    """The fix searches of one model, shared by its checks (a search measured once is kept: qcore keeps each
    configuration's analysis). Simulation and artifact mode each implement the searches that differ."""

    def __init__(self, scope: SearchScope) -> None:
        self.scope = scope

    # --- the fixes a check names, each one qmodel() keyword with its whole value

    def keep_in_float(self, layers: Iterable[str]) -> Fix:
        """float_layers with `layers` added to the model's own (skip_layers only hides a layer from checks)."""
        return float_layers_fix(self.scope, layers)

    def layer_overrides(self, change: Mapping[str, Mapping[str, Any]]) -> Fix:
        """layer_overrides with `change` merged into the model's own, glob by glob."""
        return layer_overrides_fix(self.scope, change)

    def equalize(self, value: Any, layers: Iterable[str]) -> Fix:
        """equalize=value (True, a list of layers, an MoE block's experts by glob, or a smoothing recipe)."""
        return equalize_fix(value, layers, self.scope)

    def quantized_layers(self) -> list[str]:
        """The layers the model quantizes as declared, in graph order."""
        return quantized_layer_names(self.scope)

    def recipe(self) -> dict[str, Any] | None:
        """The formats in force, {"default": format, "layers": {glob: format}}, for a model in deployed formats."""
        quantizer: Any = self.scope.analysis.quantizer
        if getattr(quantizer, "layer_preset", None) is None:
            return None
        return {"default": quantizer.preset.name, "layers": dict(self.scope.settings.layer_formats or {})}

    # --- what an item says of the budget

    def further(self) -> str:
        """How to search further once the fix budget stopped a search (and how to ask for verdicts only)."""
        return search_further(self.scope)

    def others_untried(self, advice: Advice) -> str:
        """What an item with a measured fix says when the budget left other fixes of its search untried."""
        return others_untried(self.scope, advice)

    # --- the searches

    def verify(self, candidates: Iterable[str], make_fix: Callable[[list[str]], Fix], min_gain: float,
               kind: str = "own", screened: Mapping[str, tuple[float, float]] | None = None,
               verdict: bool = False) -> Advice:
        """A heuristic's fix tried on its candidate layers and kept where it helps (trials.verify)."""
        return verify(self, candidates, make_fix, min_gain, kind, screened, verdict)

    def equalization(self, layers: list[str] | None = None, smooth: bool = True) -> Advice:
        """The best measured equalization fix (fixes.equalize.equalization_advice)."""
        return equalize.equalization_advice(self, layers, smooth)

    def variant_gains(self, method: str, layers: list[str] | None = None) -> dict[str, tuple[float, float]]:
        """{layer: (own SQNR, own SQNR with the `method` variant)} that the comparison pass measured."""
        return equalize.variant_gains(self.scope, method, layers)

    def layer_fixes(self, failing: list[str], kind: str = "propagated") -> MeasuredFixes:
        """Per failing layer, the fixes measured to raise its `kind` SQNR ("propagated" or "weight") without
        lowering the output SQNR, as text to print: per-channel weights and a clipping observer where the mode
        takes them, and keeping the failing layers in float (when that leaves some layer quantized; else the best
        proper subset). Once the fix budget is spent, the searches not yet run are not (`stopped`)."""
        scope = self.scope
        # the fix budget goes to the fixes most sure to help first: the model output's float_layers search, keeping
        # the failing layers in float (or, when every layer fails, the best proper subset), then the quantizer's
        output_target, output_search = self.output_search() if failing else (None, None)
        output_fix = output_search if output_search is not None and output_search.float_layers else None
        # a weight's SQNR depends on its own quantization only: keeping other layers in float leaves it as it is
        subset = self.best_proper_subset(failing) if failing and kind == "propagated" else None
        uncovered = [layer for layer in failing if output_fix is None or layer not in output_fix.float_layers]
        # every weight failing: keeping them all in float would quantize nothing, and changes no weight that stays
        every_weight = kind == "weight" and set(self.quantized_layers()) <= set(failing)
        in_float = try_fix(self, self.keep_in_float(failing), reads=()) \
            if uncovered and subset is None and not every_weight else None
        options = self.setting_fixes(failing, kind)
        fixes = MeasuredFixes()
        fixes.stopped = any(advice.stopped for _, advice in options) or any(
            trial is not None and trial.stopped for trial in (subset, in_float)) or bool(
            output_search is not None and output_search.stopped)
        if subset is not None and subset.stopped:
            subset = None
        if in_float is not None and in_float.stopped:
            in_float = None
        # the layers the subset keeps in float: its float_layers write an MoE projection's experts as one glob
        in_subset = _kept_in_float(subset.fix) if subset is not None else set()
        for layer in failing:
            found = [f"{label} ({advice.claim(layer)}): {advice.fix_text()}" for label, advice in options
                     if advice.helps(layer)]
            if output_fix is not None and layer in output_fix.float_layers:
                # the model's output fails too: the one fix its model_sqnr item advises, not a second one
                worst = scope.analysis.sqnr.worst_output()
                before = worst.sqnr_db if worst is not None else math.nan
                reach = "reaching" if output_fix.reached else "still below"
                found.append(f"keeping it in float with the layers the model_sqnr item names (measured: the model "
                             f"output {before:.2f} -> {output_fix.measured_db:.2f} dB, {reach} model_sqnr_min_db "
                             f"{output_target:g} dB): qmodel(..., "
                             f"{self.keep_in_float(output_fix.float_layers).paste()})")
            elif subset is not None and layer in in_subset:
                def after(name: str, measured: Trial = subset) -> float:
                    value = getattr(measured, kind).get(name, (math.nan, math.nan))[1]
                    return math.inf if math.isnan(value) else value

                left = sorted((name for name in subset.fix.layers if name not in in_subset), key=after)
                lowest = ", ".join(f"{name} at {after(name):.2f} dB" for name in left[:_LOWEST_NAMED])
                found.append(f"keeping it in float with the best subset of at most {len(in_subset)} layer(s), which "
                             f"leaves {len(left)} layer(s) quantized, the lowest {lowest} (measured: "
                             f"{subset.output_claim()}): qmodel(..., {subset.fix.paste()})")
            elif in_float is not None and in_float.output_kept and not math.isnan(in_float.output[0]):
                together = " with the other failing layers" if len(failing) > 1 else ""
                short = (f", still below model_sqnr_min_db {output_target:g} dB" if output_target is not None
                         and in_float.output[1] < output_target else "")
                found.append(f"keeping it in float{together} (measured: {in_float.output_claim()}{short}): "
                             f"qmodel(..., {in_float.fix.paste()})")
            fixes[layer] = found
        return fixes

    def setting_fixes(self, failing: list[str], kind: str) -> list[tuple[str, Advice]]:
        """(label, advice) of the quantizer settings measured for the failing layers: per-channel weights, and a
        clipping observer for a propagated SQNR (simulation mode; an artifact is quantized already)."""
        layers = {layer: self.scope.analysis.layer(layer) for layer in failing}
        options = []
        per_tensor = [layer for layer, q in layers.items() if q.weighted and not q.per_channel]
        if per_tensor:
            options.append(("per-channel weights", self.verify(per_tensor, lambda chosen: self.layer_overrides(
                {c: {"per_channel": True} for c in chosen}), MIN_FIX_GAIN_DB, kind)))
        not_clipping = [layer for layer, q in layers.items() if not q.clipping] if kind == "propagated" else []
        if not_clipping:
            options.append(("a clipping (histogram) activation observer", self.verify(
                not_clipping, lambda chosen: self.layer_overrides(
                    {c: {"activation_observer": "histogram"} for c in chosen}), MIN_FIX_GAIN_DB, kind)))
        return options

    def best_proper_subset(self, failing: list[str]) -> Trial | None:
        """When every quantized layer fails sqnr on its own error (so keeping the failing layers in float would
        quantize nothing): the model measured with the best proper subset kept in float, at most max_float_layers
        (default 8) of the layers with the largest own error, every layer's propagated SQNR read; else None. (A
        weight's SQNR is its own: keeping other layers in float never changes it, so weight_sqnr has no such
        subset.)"""
        quantized = self.quantized_layers()
        if len(quantized) < 2 or not set(quantized) <= set(failing):
            return None
        most = min(max_float_layers(self.scope, "sqnr"), len(quantized) - 1)
        measured = self.scope.analysis.sqnr.layers

        def own_error(layer: str) -> float:
            entry = measured[layer]
            return entry.sqnr_db if math.isnan(entry.shadow_sqnr_db) else entry.shadow_sqnr_db

        subset = sorted(failing, key=own_error)[:most]  # stable: graph order among equals
        fix = self.keep_in_float(subset)
        return try_fix(self, Fix(fix.setting, fix.value, tuple(quantized)), reads=("propagated",))

    def threshold_limit(self, layer: str, failing: list[str], trial: Trial | None) -> str:
        """Why no fix keeps every sqnr item passing when every quantized layer fails on its own error, and what the
        best proper subset kept in float (`trial`: best_proper_subset) measures at this layer ('' when some layer
        passes)."""
        if trial is None:
            return ""
        setting, threshold = "sqnr_min_db", self.scope.settings.sqnr_min_db
        kept = _kept_in_float(trial.fix)
        subset = [name for name in trial.fix.layers if name in failing and name in kept]
        text = (f" All {len(trial.fix.layers)} quantized layers fail {setting} {threshold:g} dB on their own error: "
                "the threshold is above what this quantizer gives, and keeping every failing layer in float would "
                "quantize nothing.")
        if layer in subset:
            return text
        after = trial.propagated.get(layer, (math.nan, math.nan))[1]
        if math.isnan(after):
            return text
        return text + (f" With the best subset of at most {len(subset)} layer(s) kept in float, qmodel(..., "
                       f"{trial.fix.paste()}), this layer measures {after:.2f} dB ({trial.output_claim()}): lower "
                       f"{setting} to {math.floor(after * 10) / 10:g} dB or below to pass it, or choose a finer "
                       "quantizer.")

    def output_search(self) -> tuple[float | None, Any]:
        """(model_sqnr_min_db where the model_sqnr check runs, the float_layers search its item advises when the
        model's output fails it, as it ended (stopped by the fix budget, or empty), else None)."""
        if "model_sqnr" not in self.scope.checks:
            return None, None
        target = float(self.scope.settings.model_sqnr_min_db)
        worst = self.scope.analysis.sqnr.worst_output()
        if worst is None or not worst.sqnr_db < target:
            return target, None
        return target, self.output_float_layers_search(target)

    def output_float_layers(self) -> tuple[float | None, Any]:
        """(model_sqnr_min_db where the model_sqnr check runs, the float_layers fix it advises when the model's
        output fails it, else None)."""
        target, fix = self.output_search()
        return target, fix if fix is not None and fix.float_layers else None

    def output_search_stopped(self) -> bool:
        """Whether the fix budget stopped the float_layers search the model_sqnr item advises (False where none
        runs)."""
        fix = self.output_search()[1]
        return bool(fix is not None and fix.stopped)

    @abstractmethod
    def variant(self, fix: Fix, reads: Collection[str]) -> Any:
        """The model's analysis with `fix` applied as the pasted setting would apply it, measuring the layers the
        fix concerns and of their SQNRs those in `reads` (a trial runs it: trials.try_fix)."""

    @abstractmethod
    def output_float_layers_search(self, target_db: float) -> Any | None:
        """The float_layers search model_sqnr advises for an output SQNR below `target_db` (searched once per model
        and kept), or None where it searches none."""

    @abstractmethod
    def output_fix(self, check: str, metric: str, target: float, batches: list[Any] | None = None,
                   show: Callable[[float], str] = lambda value: f"{value:.4g}") -> OutputAdvice:
        """The measured fix for `check`'s output `metric` to meet `target` (OutputAdvice)."""

    def search_limit(self, chosen: int, check: str) -> str:
        """Why a float_layers search of `check` stopped at `chosen` layers short of its target."""
        return float_search_limit(self.scope, chosen, check)


_LOWEST_NAMED = 3  # the layers a proper subset leaves quantized that its message names, lowest SQNR first


def _kept_in_float(fix: Fix) -> set[str]:
    """The layers among `fix.layers` that its float_layers value (names and globs) keeps in float."""
    from qcore.analysis import matches_layer

    return {name for name in fix.layers if any(matches_layer(kept, name) for kept in fix.value)}
