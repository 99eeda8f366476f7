"""Verified advice in artifact mode (qmodel(quantized=...)): the layers to keep in float, found by swapping the
reference's modules into the user's quantized model and measuring, printed as the plugin's float_layers and as the
line to paste into the tool that made the artifact, in its words (llm-compressor's ignore, a ModelOpt quant_cfg
entry, bitsandbytes' llm_int8_skip_modules, ...); the JSON's recipe holds every tool's line."""
from __future__ import annotations

from typing import Any

from ..core.pipeline import is_artifact
from ..core.registry import ModelContext
from .advice import DEFAULT_MAX_FLOAT_LAYERS, max_float_layers, quantized_layer_names, search_further

__all__ = ["DEFAULT_BATCHES", "DEFAULT_MAX_FLOAT_LAYERS", "artifact_fix", "artifact_fix_advice", "is_artifact"]

DEFAULT_BATCHES = 2  # the screen's batches; the printed set is measured on every batch the item is judged on
DEFAULT_CANDIDATES = 8  # the layers with the largest own error, each screened alone


def artifact_fix(model: ModelContext, check: str, metric: str, target: float, batches: list[Any]) -> Any | None:
    """The artifact's verified float_layers fix for `metric` to meet `target` (qcore's ArtifactFix, searched once per
    check and target), or None where the check's fix is off (check_options={check: {'fix': False}})."""
    options = model.checks[check].options if check in model.checks else {}
    if options.get("fix") is False:
        return None
    most = max_float_layers(model, check)
    return model.analysis.float_layers_fix(target, metric, most, options.get("batches", DEFAULT_BATCHES),
                                           batches=batches,
                                           max_candidates=int(options.get("candidates", DEFAULT_CANDIDATES)))


def artifact_fix_advice(model: ModelContext, check: str, metric: str, target: float, batches: list[Any],
                        show: Any = lambda value: f"{value:.4g}") -> tuple[str, dict[str, Any] | None]:
    """(the advice to print for a failing output item in artifact mode, the recipe for the JSON and HTML: the
    float_layers setting and each tool's line)."""
    fix = artifact_fix(model, check, metric, target, batches)
    if fix is not None and fix.stopped and not fix.float_layers:
        return search_further(model), None
    if fix is None or not fix.float_layers:
        return "", None
    recipes = fix.recipes
    layers = list(fix.float_layers)
    recipe: dict[str, Any] = {**recipes, "float_layers": layers, "qmodel": recipes["float_layers"],
                              "measured": fix.measured, "reached": fix.reached}
    recipe["tool"] = fix.tool
    if fix.tool_line:
        recipe["tool_name"], recipe["tool_line"] = fix.tool_name, fix.tool_line
    lines = f"qmodel(..., {recipes['float_layers']}) swaps the reference's modules in; " + (
        f"in {fix.tool_name}, which made the artifact: {fix.tool_line}" if fix.tool_line else
        "the tool that made the artifact was not recognised: the JSON report's recipe holds the line for each tool")
    if fix.reached:
        return (f" Keeping {len(layers)} layer(s) in float was measured to reach {show(fix.measured)} "
                f"(from {show(fix.before)}): {lines}."), recipe
    limit = None if fix.stopped else _search_limit(model, fix, check, metric, batches, show)
    if limit is None:  # the fix budget stopped the search, or was spent before a wider one could be measured
        return (f" No set of up to {len(layers)} layer(s) kept in float that the search measured within the fix "
                f"budget reaches {show(target)}.{search_further(model)} The best found was measured at "
                f"{show(fix.measured)} (from {show(fix.before)}): {lines}."), recipe
    return (f" No set of up to {len(layers)} layer(s) kept in float reaches {show(target)} ({limit}); the best found "
            f"was measured at {show(fix.measured)} (from {show(fix.before)}): {lines}."), recipe


def _search_limit(model: ModelContext, fix: Any, check: str, metric: str, batches: list[Any],
                  show: Any) -> str | None:
    """Why the search stopped short of its target, and how to search further only where that was measured to reach
    it: twice as many of the layers with the largest own error, kept in float at once on the screen's batches
    (keeping more in float does not make the output worse, so a search among them can reach what they reach).
    None when the fix budget is spent before that could be measured."""
    from qcore.analysis import trials_allowed

    quantized = len(quantized_layer_names(model))
    chosen, searched = len(fix.float_layers), max(fix.searched, len(fix.float_layers))
    if chosen >= quantized - 1:
        return (f"keeping all {quantized} quantized layers in float would quantize nothing, so the threshold is "
                "above what this quantizer gives")
    if not trials_allowed():
        return None
    options = model.checks[check].options if check in model.checks else {}
    wider = min(2 * max(searched, max_float_layers(model, check)), quantized - 1)
    value, screened = model.analysis.largest_errors_in_float(metric, wider, options.get("batches", DEFAULT_BATCHES),
                                                             batches)
    among = f"among the {searched} layers with the largest own error"
    if fix.meets(value):
        return (f"the search chose {among}; keeping the {wider} with the largest own error in float at once measures "
                f"{show(value)} on the first {screened} batch(es): search among them with "
                f"qmodel(check_options={{{check!r}: {{'candidates': {wider}, 'max_float_layers': {wider}}}}})")
    return (f"the search chose {among}; even the {wider} with the largest own error kept in float at once measure "
            f"{show(value)} on the first {screened} batch(es), short of it: the threshold is above what keeping a "
            "few layers in float gives")
