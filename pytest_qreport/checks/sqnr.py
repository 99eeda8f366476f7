"""SQNR checks: per-layer propagated SQNR, weight SQNR, and the SQNR of the model's output."""
from __future__ import annotations

import math
from typing import Any

from ..core.experts import expert_layers_of
from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels
from .advice import (
    Fix,
    Trial,
    float_layers_fix,
    layer_overrides_fix,
    max_float_layers,
    quantized_layer_names,
    search_further,
    try_fix,
    verify,
)
from .artifact import is_artifact

UNREACHED = ("no calibration token was routed to it, so its error was not measured; the expert_coverage item of "
             "its block says how to reach it.")
# an artifact's expert_coverage item judges the checkpoint's weights: the gate's own batches are what miss it
UNREACHED_ARTIFACT = ("the reference routed no token of the calibration batches to it, so its output was not "
                      "measured (its weights are compared in its weight_sqnr item). Fix: calibrate on more or longer "
                      "batches, so that the reference's router reaches every expert.")

__all__ = ["ModelSqnrCheck", "SqnrCheck", "WeightSqnrCheck", "below", "below_resolution_advice", "best_proper_subset",
           "keep_in_float_hint", "measured_fixes", "output_label", "threshold_limit"]

# a fix for a failing layer is listed when it raises the layer's SQNR by at least this much (and not the output's)
MIN_FIX_GAIN_DB = 0.1


def keep_in_float_hint(model: ModelContext, layers: list[str]) -> str:
    """The setting that keeps layers unquantized (skip_layers only hides a layer from checks): float_layers, with
    the model's own. The layer name, unlike its module's FQN, names this one op."""
    return float_layers_fix(model, layers).paste()


def best_proper_subset(model: ModelContext, failing: list[str]) -> Trial | None:
    """When every quantized layer fails sqnr on its own error (so keeping the failing layers in float would quantize
    nothing): the model measured with the best proper subset kept in float, at most max_float_layers (default 8)
    of the layers with the largest own error, every layer's propagated SQNR read; else None. (A weight's SQNR is its
    own: keeping other layers in float never changes it, so weight_sqnr has no such subset.)"""
    quantized = quantized_layer_names(model)
    if len(quantized) < 2 or not set(quantized) <= set(failing):
        return None
    most = min(max_float_layers(model, "sqnr"), len(quantized) - 1)
    measured = model.analysis.sqnr.layers

    def own_error(layer: str) -> float:
        entry = measured[layer]
        return entry.sqnr_db if math.isnan(entry.shadow_sqnr_db) else entry.shadow_sqnr_db

    subset = sorted(failing, key=own_error)[:most]  # stable: graph order among equals
    fix = float_layers_fix(model, subset)
    return try_fix(model, Fix(fix.setting, fix.value, tuple(quantized)), reads=("propagated",))


def threshold_limit(model: ModelContext, layer: str, failing: list[str], trial: Trial | None) -> str:
    """Why no fix keeps every item of this check passing when every quantized layer fails on its own error, and
    what the best proper subset kept in float (`trial`: best_proper_subset) measures at this layer ('' when some
    layer passes)."""
    if trial is None:
        return ""
    from qcore.analysis import matches_layer

    setting, threshold = "sqnr_min_db", model.settings.sqnr_min_db
    subset = [name for name in trial.fix.layers if name in failing
              and any(matches_layer(kept, name) for kept in trial.fix.value)]
    text = (f" All {len(trial.fix.layers)} quantized layers fail {setting} {threshold:g} dB on their own error: the "
            "threshold is above what this quantizer gives, and keeping every failing layer in float would quantize "
            "nothing.")
    if layer in subset:
        return text
    after = trial.propagated.get(layer, (math.nan, math.nan))[1]
    if math.isnan(after):
        return text
    return text + (f" With the best subset of at most {len(subset)} layer(s) kept in float, qmodel(..., "
                   f"{trial.fix.paste()}), this layer measures {after:.2f} dB ({trial.output_claim()}): lower "
                   f"{setting} to {math.floor(after * 10) / 10:g} dB or below to pass it, or choose a finer quantizer.")


class MeasuredFixes(dict):
    """{failing layer: the fixes measured for it, as text}, and whether the fix budget stopped a search for them."""

    stopped: bool = False


def measured_fixes(model: ModelContext, failing: list[str], kind: str = "propagated") -> MeasuredFixes:
    """Per failing layer, the fixes measured on the model to raise its `kind` SQNR ("propagated" or "weight")
    without lowering the output SQNR, as text to print: per-channel weights, a clipping observer, and keeping
    the failing layers in float (when that leaves some layer quantized; else the best proper subset). Once the
    fix budget is spent, the searches not yet run are not (`stopped`)."""
    layers = {layer: model.analysis.layer(layer) for layer in failing}
    # the fix budget goes to the fixes most sure to help first: the model output's float_layers search, keeping the
    # failing layers in float (or, when every layer fails, the best proper subset), then the quantizer settings
    output_target, output_fix = _output_float_layers(model) if failing else (None, None)
    # a weight's SQNR depends on its own quantization only: keeping other layers in float leaves it as it is
    subset = best_proper_subset(model, failing) if failing and kind == "propagated" else None
    uncovered = [layer for layer in failing if output_fix is None or layer not in output_fix.float_layers]
    # every weight failing: keeping them all in float would quantize nothing, and changes no weight that stays
    every_weight = kind == "weight" and set(quantized_layer_names(model)) <= set(failing)
    in_float = try_fix(model, float_layers_fix(model, failing), reads=()) \
        if uncovered and subset is None and not every_weight else None
    options = []
    per_tensor = [layer for layer, q in layers.items() if q.weighted and not q.per_channel]
    if per_tensor:
        options.append(("per-channel weights", verify(model, per_tensor, lambda chosen: layer_overrides_fix(
            model, {c: {"per_channel": True} for c in chosen}), MIN_FIX_GAIN_DB, kind)))
    not_clipping = [layer for layer, q in layers.items() if not q.clipping] if kind == "propagated" else []
    if not_clipping:
        options.append(("a clipping (histogram) activation observer", verify(
            model, not_clipping, lambda chosen: layer_overrides_fix(
                model, {c: {"activation_observer": "histogram"} for c in chosen}), MIN_FIX_GAIN_DB, kind)))
    fixes = MeasuredFixes()
    fixes.stopped = any(advice.stopped for _, advice in options) or any(
        trial is not None and trial.stopped for trial in (subset, in_float)) or bool(
        failing and _output_search_stopped(model))
    if subset is not None and subset.stopped:
        subset = None
    if in_float is not None and in_float.stopped:
        in_float = None
    for layer in failing:
        found = [f"{label} ({advice.claim(layer)}): {advice.fix_text()}" for label, advice in options
                 if advice.helps(layer)]
        if output_fix is not None and layer in output_fix.float_layers:
            # the model's output fails too: the one fix its model_sqnr item advises, not a second one
            worst = model.analysis.sqnr.worst_output()
            before = worst.sqnr_db if worst is not None else math.nan
            reach = "reaching" if output_fix.reached else "still below"
            found.append(f"keeping it in float with the layers the model_sqnr item names (measured: the model output "
                         f"{before:.2f} -> {output_fix.measured_db:.2f} dB, {reach} model_sqnr_min_db "
                         f"{output_target:g} dB): qmodel(..., "
                         f"{float_layers_fix(model, output_fix.float_layers).paste()})")
        elif subset is not None and layer in subset.fix.value:
            left = [name for name in subset.fix.layers if name not in subset.fix.value]
            still = ", ".join(f"{name} at {getattr(subset, kind).get(name, (math.nan, math.nan))[1]:.2f} dB"
                              for name in left)
            found.append(f"keeping it in float with the best subset of at most {len(subset.fix.layers) - 1} "
                         f"layer(s), which leaves {still} (measured: {subset.output_claim()}): "
                         f"qmodel(..., {subset.fix.paste()})")
        elif in_float is not None and in_float.output_kept and not math.isnan(in_float.output[0]):
            together = " with the other failing layers" if len(failing) > 1 else ""
            short = (f", still below model_sqnr_min_db {output_target:g} dB" if output_target is not None
                     and in_float.output[1] < output_target else "")
            found.append(f"keeping it in float{together} (measured: {in_float.output_claim()}{short}): "
                         f"qmodel(..., {in_float.fix.paste()})")
        fixes[layer] = found
    return fixes


def _output_search(model: ModelContext) -> tuple[float | None, Any]:
    """(model_sqnr_min_db where the model_sqnr check runs, the float_layers search its item advises when the model's
    output fails it, as it ended (stopped by the fix budget, or empty), else None)."""
    if "model_sqnr" not in model.checks:
        return None, None
    from .sensitivity import output_float_layers_fix

    target = float(model.settings.model_sqnr_min_db)
    worst = model.analysis.sqnr.worst_output()
    if worst is None or not worst.sqnr_db < target:
        return target, None
    return target, output_float_layers_fix(model, target)


def _output_float_layers(model: ModelContext) -> tuple[float | None, Any]:
    """(model_sqnr_min_db where the model_sqnr check runs, the float_layers fix it advises when the model's output
    fails it, else None)."""
    target, fix = _output_search(model)
    return target, fix if fix is not None and fix.float_layers else None


def _output_search_stopped(model: ModelContext) -> bool:
    """Whether the fix budget stopped the float_layers search the model_sqnr item advises (False where none runs)."""
    fix = _output_search(model)[1]
    return bool(fix is not None and fix.stopped)


def output_label(leaf: str) -> str:
    """'model output', naming the output leaf when the model has several ('model output logits')."""
    return "model output" if leaf in ("", "output") else f"model output {leaf}"


def below(value: float, threshold: float) -> str:
    """'value dB < threshold dB' with enough digits to show the difference (never '36.0 dB < 36.0 dB')."""
    digits = 1
    while digits < 6 and f"{value:.{digits}f}" == f"{threshold:.{digits}f}":
        digits += 1
    return f"{value:.{digits}f} dB < {threshold:.{digits}f} dB"


def below_resolution_advice(model: ModelContext, layer: str, limits: tuple) -> str:
    """Why a layer whose tensors are below int8's resolution fails, and the options that help (qcore.measure.diagnose
    ResolutionLimit records: role, observed_range, smallest_scale)."""
    ranges = " and ".join(f"{limit.role} range {limit.observed_range:.3g}" for limit in limits)
    verb, them = ("are", "them") if len(limits) > 1 else ("is", "it")
    return (f" Its {ranges} {verb} below the quantizer's resolution (smallest scale {limits[0].smallest_scale:.3g}), "
            f"so int8 rounds {them} to (nearly) all zeros. Per-channel weights or a clipping observer cannot help: "
            f"keep the layer in float with {keep_in_float_hint(model, [layer])}, or, if the model's output does not "
            f"depend on it (its model_sqnr item passes), hide it from the checks with skip_layers=[{layer!r}].")


def own_error_layers(measured: Any, layers: list[str], threshold: float) -> list[str]:
    """The layers below `threshold` because of their own error (shadow SQNR below it too), above int8's
    resolution: those a quantization setting may fix."""
    return [layer for layer in layers if (entry := measured.get(layer)) is not None and entry.sqnr_db < threshold
            and not entry.below_resolution and (math.isnan(entry.shadow_sqnr_db) or entry.shadow_sqnr_db < threshold)]


def _first_own_error_before(model: ModelContext, layer: str, threshold: float) -> str:
    """The first layer, in graph order before `layer`, whose own error (shadow SQNR) is below `threshold`."""
    measured = model.analysis.sqnr.layers
    for entry in model.analysis.layers:
        if entry.layer == layer:
            break
        if own_error_layers(measured, [entry.layer], threshold):
            return entry.layer
    return ""


def _not_measured(check: Check, model: ModelContext, layer: str, threshold: float) -> Finding:
    return check.finding(model, layer, math.nan, threshold, passed=False,
                         message=f"model {model.name!r}, layer {layer}: collected but not measured: the model's graph "
                                 "changed between collection and run. Re-run pytest.")


def _failing_sqnr_layers(model: ModelContext) -> list[str]:
    """The layers whose sqnr item fails on this run, in graph order (none when the check is off)."""
    if "sqnr" not in model.checks:
        return []
    threshold, measured = model.settings.sqnr_min_db, model.analysis.sqnr.layers
    return [entry.layer for entry in model.analysis.layers
            if (found := measured.get(entry.layer)) is not None and found.sqnr_db < threshold]


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
    measures_artifacts = True
    settings = (Setting("sqnr_min_db", decibels(), 20.0, "minimum per-layer SQNR in dB (propagated error)",
                        metavar="DB"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured, results = model.settings.sqnr_min_db, model.analysis.sqnr.layers, []
        search = self.options.get("fix", True)  # check_options={'sqnr': {'fix': False}}: no fix is measured
        own_errors = own_error_layers(measured, layers, threshold)
        fixes = measured_fixes(model, own_errors) if search else None
        subset = best_proper_subset(model, own_errors) if search and own_errors else None
        if subset is not None and subset.stopped:  # the fix budget was spent before it was measured
            subset = None
        for layer in layers:
            entry = measured.get(layer)
            if entry is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            if entry.batches == 0 and math.isnan(entry.sqnr_db):  # an expert no calibration token was routed to
                results.append(self.finding(model, layer, math.nan, threshold, passed=False, message=(
                    f"layer {layer}: {UNREACHED_ARTIFACT if is_artifact(model.analysis) else UNREACHED}")))
                continue
            quantized = model.analysis.layer(layer)
            not_comparable = getattr(model.analysis, "not_comparable", {}).get(layer, "")
            limit = threshold_limit(model, layer, own_errors, subset) if layer in own_errors else ""
            message = self.message(model, layer, entry.sqnr_db, threshold, entry.shadow_sqnr_db,
                                   entry.below_resolution, None if fixes is None else fixes.get(layer, []),
                                   not_comparable, limit, stopped=fixes is not None and fixes.stopped)
            details = {"shadow_sqnr_db": entry.shadow_sqnr_db, "normalized_l2": entry.normalized_l2,
                       "cosine": entry.cosine, "batches": entry.batches, "op": entry.op, "fqn": entry.fqn,
                       "format": quantized.format}
            if not_comparable:
                details["shadow_not_comparable"] = not_comparable
            results.append(self.finding(model, layer, entry.sqnr_db, threshold, message=message, details=details))
        return results

    @staticmethod
    def message(model: ModelContext, layer: str, value: float, threshold: float, shadow: float,
                below_resolution: tuple = (), fixes: list[str] | None = None, not_comparable: str = "",
                limit: str = "", stopped: bool = False) -> str:
        """Explain a low propagated SQNR, telling inherited error from the layer's own, with the fixes measured
        to help it (measured_fixes; None: none was searched). `not_comparable`: why the layer's own error was not
        measured (an artifact that rescales its input); `limit`: why no proper subset in float passes every
        item (threshold_limit); `stopped`: the fix budget stopped a search for its fixes."""
        own = f"({not_comparable})" if not_comparable else f"(shadow SQNR {shadow:.1f} dB)"
        text = f"layer {layer}: SQNR {below(value, threshold)} {own}."
        if below_resolution:
            return text + below_resolution_advice(model, layer, below_resolution)
        if not math.isnan(shadow) and shadow >= threshold:
            text += " With float inputs the layer is fine: it inherits its error from the layers before it."
            source = _first_own_error_before(model, layer, threshold)
            if source:
                experts = expert_layers_of(model.analysis)
                item = "its item" if source not in experts else f"the item {experts[source].projection}"
                return text + (f" The first layer before it that fails on its own is {source}: fix that one (see "
                               f"{item}), or hide this layer from the checks with skip_layers=[{layer!r}].")
            return text + " No layer before it fails on its own: the error builds up over many layers." + \
                _built_up_error_advice(model, layer)
        whose = "The layer's own quantization error is too large" if not not_comparable else \
            "Its own error or the error it inherits is too large"
        if fixes is None:
            return text + (f" {whose} (no fix was measured: check_options={{'sqnr': {{'fix': False}}}}).")
        further = search_further(model) if stopped else ""  # before the fixes: a printed fix ends its message
        if limit:
            return text + f" {whose}." + limit + further + \
                (" Measured fixes: " + "; or ".join(fixes) + "." if fixes else "")
        if not fixes and stopped:
            return text + f" {whose}, and no fix was measured to raise it within the fix budget." + further
        if not fixes:
            tried = "keeping the failing layers in float" if is_artifact(model.analysis) else \
                "per-channel weights, a clipping observer, nor keeping the failing layers in float"
            return text + (f" {whose}, and neither {tried} was measured to raise it "
                           "without lowering the model's output SQNR: the output does not depend on it. Hide it "
                           f"from the checks with skip_layers=[{layer!r}], or lower sqnr_min_db.")
        return text + f" {whose}." + further + " Measured fixes: " + "; or ".join(fixes) + "."


def _built_up_error_advice(model: ModelContext, layer: str) -> str:
    """For error that builds up over many layers: the model_sqnr item's measured float_layers fix when the output
    fails and one was found, else what the output measures; never a pointer to an item that measured nothing."""
    hide = f"hide this layer from the checks with skip_layers=[{layer!r}]"
    target, fix = _output_float_layers(model)
    if fix is not None:
        reach = "reaching" if fix.reached else "still below"
        return (f" The model_sqnr item's measured fix keeps {len(fix.float_layers)} layer(s) in float (the model "
                f"output {fix.measured_db:.2f} dB, {reach} model_sqnr_min_db {target:g} dB): qmodel(..., "
                f"{float_layers_fix(model, fix.float_layers).paste()}); or {hide}.")
    worst = model.analysis.sqnr.worst_output()
    if target is not None and worst is not None and worst.sqnr_db >= target:
        return (f" The model output measures {worst.sqnr_db:.2f} dB, passing model_sqnr_min_db {target:g} dB, so the "
                f"error that reaches it is within bounds: lower sqnr_min_db, or {hide}.")
    if _output_search_stopped(model):
        return f" Lower sqnr_min_db, or {hide}." + search_further(model)
    return f" Lower sqnr_min_db, or {hide}."


class WeightSqnrCheck(Check):
    """SQNR of each quantized weight."""

    name, order, metric, needs = "weight_sqnr", 20, "weight_sqnr_db", frozenset({"sqnr"})
    # GPTQ and AWQ lower a weight's SQNR on purpose to raise its output's: in artifact mode this check informs
    measures_artifacts, artifact_severity = True, "warn"
    settings = (Setting("weight_sqnr_min_db", decibels(), 30.0, "minimum SQNR of each quantized weight in dB",
                        metavar="DB"),)

    def layers(self, model: ModelContext) -> list[str]:
        return [entry.layer for entry in model.analysis.layers if entry.weighted]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured, results = model.settings.weight_sqnr_min_db, model.analysis.sqnr.layers, []
        failing = [layer for layer in layers if (entry := measured.get(layer)) is not None
                   and entry.weight_sqnr_db is not None and entry.weight_sqnr_db < threshold
                   and not any(limit.role == "weight" for limit in entry.below_resolution)]
        artifact = is_artifact(model.analysis)
        search = self.options.get("fix", True) and not artifact  # check_options={'weight_sqnr': {'fix': False}}
        fixes = measured_fixes(model, failing, kind="weight") if search else MeasuredFixes()
        further = search_further(model) if fixes.stopped else ""
        every_fails = bool(failing) and set(quantized_layer_names(model)) <= set(failing)
        for layer in layers:
            entry = measured.get(layer)
            if entry is None or entry.weight_sqnr_db is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            weight_limits = tuple(limit for limit in entry.below_resolution if limit.role == "weight")
            if weight_limits:
                message = (f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}."
                           + below_resolution_advice(model, layer, weight_limits))
                results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
                continue
            found = fixes.get(layer, [])
            limit = _weight_threshold_limit(model, entry.weight_sqnr_db, threshold) \
                if every_fails and layer in failing else ""
            rescaled = getattr(model.analysis, "not_comparable", {}).get(layer)
            scaled = ", compared up to its input channels' scales" if rescaled else ""
            advice = (f" It is the artifact's own weight{scaled}: GPTQ and AWQ lower weight SQNR on purpose to "
                      "raise the output's, so in artifact mode this "
                      f"check warns; this layer's sqnr item and the output items judge what it computes." if artifact
                      else " (No fix was measured: check_options={'weight_sqnr': {'fix': False}}.)" if not search else
                      limit + further + (" Measured fixes: " + "; or ".join(found) + "." if found else "") if limit
                      else further + " Measured fixes: " + "; or ".join(found) + "." if found else
                      " No fix was measured to raise it within the fix budget." + further if further else
                      " Neither per-channel weights nor keeping it in float was measured to help without lowering "
                      f"the model's output SQNR: hide it from the checks with skip_layers=[{layer!r}], or lower "
                      "weight_sqnr_min_db.")
            message = f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}." + advice
            results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
        return results


def _weight_threshold_limit(model: ModelContext, value: float, threshold: float) -> str:
    """Why no fix keeps every weight_sqnr item passing when every quantized weight fails: a weight's SQNR depends on
    its own quantization only, so only the threshold or the quantizer can change it."""
    count = len(quantized_layer_names(model))
    return (f" All {count} quantized layers fail weight_sqnr_min_db {threshold:g} dB: the threshold is above what this "
            "quantizer gives, and a weight's SQNR depends on its own quantization only (keeping other layers in "
            f"float leaves it as it is). Lower weight_sqnr_min_db to {math.floor(value * 10) / 10:g} dB or below to "
            "pass this layer, or choose a finer quantizer.")


class ModelSqnrCheck(Check):
    """SQNR of the model's output (the worst output leaf when there are several)."""

    name, order, metric, needs = "model_sqnr", 30, "sqnr_db", frozenset({"sqnr"})
    measures_artifacts = True
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
            label = output_label(entry.name if name == "output" else name)
            message = f"{label}: SQNR {below(entry.sqnr_db, threshold)}."
            starts = _failing_sqnr_layers(model) if entry.sqnr_db < threshold else []
            if starts:
                message += (f" {len(starts)} per-layer sqnr item(s) fail too, the first {starts[0]}: see them for the "
                            "layer where the error starts.")
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
