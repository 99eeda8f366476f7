"""The fix search of an artifact (qmodel(quantized=...)): the layers to keep in float, found by swapping the
reference's modules into the user's quantized model and measuring, printed as the plugin's float_layers and as the
line to paste into the tool that made the artifact, in its words (llm-compressor's ignore, a ModelOpt quant_cfg
entry, bitsandbytes' llm_int8_skip_modules, ...); the JSON's recipe holds every tool's line."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from .search import DEFAULT_BATCHES, DEFAULT_CANDIDATES, FixSearch, OutputAdvice
from .trials import Advice, Fix, max_float_layers, nothing_left_quantized

__all__ = ["ArtifactFixSearch"]


class ArtifactFixSearch(FixSearch):
    """The fix searches of a quantized model the user ships: it is quantized already, so its one fix is keeping
    layers in float."""

    def variant(self, fix: Fix, reads: Collection[str]) -> Any:
        """The artifact with the reference's modules swapped in for the layers the fix keeps in float: the one fix
        an artifact takes; measuring the layers it concerns where a trial reads a layer's SQNR."""
        from qcore.analysis import LAYER_KINDS

        if fix.setting != "float_layers":
            raise ValueError(f"an artifact takes no {fix.setting} fix: it is quantized already")
        analysis = self.scope.analysis
        layers = fix.layers if set(fix.layers) <= {entry.layer for entry in analysis.layers} else None
        kinds = LAYER_KINDS & set(reads)
        per_layer = kinds or "weight" in reads  # else a trial of the outputs only, shared with the fix searches
        return analysis.variant(float_layers=fix.value, layers=layers if per_layer else (), shadow="own" in kinds)

    def setting_fixes(self, failing: list[str], kind: str) -> list[tuple[str, Advice]]:
        return []  # an artifact's quantizer settings are the tool's: its fix is keeping layers in float

    def output_float_layers_search(self, target_db: float) -> Any | None:
        return self.float_layers_search("model_sqnr", "output_sqnr_db", target_db, self.scope.analysis.batches)

    def float_layers_search(self, check: str, metric: str, target: float, batches: list[Any]) -> Any | None:
        """The artifact's verified float_layers fix for `metric` to meet `target` (qcore's ArtifactFix, searched once
        per check and target), or None where the check's fix is off (check_options={check: {'fix': False}})."""
        options = self.scope.options(check)
        if options.get("fix") is False:
            return None
        most = max_float_layers(self.scope, check)
        return self.scope.analysis.float_layers_fix(target, metric, most, options.get("batches", DEFAULT_BATCHES),
                                                    batches=batches,
                                                    max_candidates=int(options.get("candidates", DEFAULT_CANDIDATES)))

    def output_fix(self, check: str, metric: str, target: float, batches: list[Any] | None = None,
                   show: Callable[[float], str] = lambda value: f"{value:.4g}") -> OutputAdvice:
        """The float_layers fix measured for `metric` to meet `target` on `batches` (default: the calibration
        batches), in the plugin's words and the tool's, and the recipe for the JSON and HTML."""
        batches = self.scope.analysis.batches if batches is None else batches
        fix = self.float_layers_search(check, metric, target, batches)
        if fix is not None and fix.stopped and not fix.float_layers:
            return OutputAdvice(self.further(), unsearched=True)
        if fix is None or not fix.float_layers:
            return OutputAdvice("")
        recipes = fix.recipes
        layers = list(fix.float_layers)
        recipe: dict[str, Any] = {**recipes, "float_layers": layers, "qmodel": recipes["float_layers"],
                                  "measured": fix.measured, "reached": fix.reached}
        recipe["tool"] = fix.tool
        if fix.tool_line:
            recipe["tool_name"], recipe["tool_line"] = fix.tool_name, fix.tool_line
        shared = (" (the experts among them keep their projection's input quantizer, which the tool shares "
                  "between experts: only their weights go float)") if fix.inputs_kept_quantized else ""
        lines = f"qmodel(..., {recipes['float_layers']}) swaps the reference's modules in{shared}; " + (
            f"in {fix.tool_name}, which made the artifact: {fix.tool_line}" if fix.tool_line else
            "the tool that made the artifact was not recognised: the JSON report's recipe holds the line for each "
            "tool")
        if fix.reached:
            return OutputAdvice(f" Keeping {len(layers)} layer(s) in float was measured to reach {show(fix.measured)} "
                                f"(from {show(fix.before)}): {lines}.", recipe, "float_layers")
        limit = None if fix.stopped else self._search_limit(fix, check, metric, batches, show)
        if limit is None:  # the fix budget stopped the search, or was spent before a wider one could be measured
            return OutputAdvice(f" No set of up to {len(layers)} layer(s) kept in float that the search measured "
                                f"within the fix budget reaches {show(target)}.{self.further()} The best found was "
                                f"measured at {show(fix.measured)} (from {show(fix.before)}): {lines}.", recipe,
                                "float_layers")
        return OutputAdvice(f" No set of up to {len(layers)} layer(s) kept in float reaches {show(target)} ({limit}); "
                            f"the best found was measured at {show(fix.measured)} (from {show(fix.before)}): "
                            f"{lines}.", recipe, "float_layers")

    def _search_limit(self, fix: Any, check: str, metric: str, batches: list[Any],
                      show: Callable[[float], str]) -> str | None:
        """Why the search stopped short of its target, and how to search further only where that was measured to
        reach it: twice as many of the layers with the largest own error, kept in float at once on the screen's
        batches (keeping more in float does not make the output worse, so a search among them can reach what they
        reach). None when the fix budget is spent before that could be measured."""
        from qcore.analysis import trials_allowed

        quantized = len(self.quantized_layers())
        chosen, searched = len(fix.float_layers), max(fix.searched, len(fix.float_layers))
        if chosen >= quantized - 1:
            return nothing_left_quantized(quantized)
        if not trials_allowed():
            return None
        options = self.scope.options(check)
        wider = min(2 * max(searched, max_float_layers(self.scope, check)), quantized - 1)
        value, screened = self.scope.analysis.largest_errors_in_float(
            metric, wider, options.get("batches", DEFAULT_BATCHES), batches)
        among = f"among the {searched} layers with the largest own error"
        if fix.meets(value):
            return (f"the search chose {among}; keeping the {wider} with the largest own error in float at once "
                    f"measures {show(value)} on the first {screened} batch(es): search among them with "
                    f"qmodel(check_options={{{check!r}: {{'candidates': {wider}, 'max_float_layers': {wider}}}}})")
        return (f"the search chose {among}; even the {wider} with the largest own error kept in float at once "
                f"measure {show(value)} on the first {screened} batch(es), short of it: the threshold is above what "
                "keeping a few layers in float gives")
