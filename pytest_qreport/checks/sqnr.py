"""SQNR checks: per-layer propagated SQNR, weight SQNR, and the SQNR of the model's output."""
from __future__ import annotations

import math
import weakref
from typing import Any

from ..core.experts import expert_items, expert_layers_of, not_measured_details, unreached_details
from ..core.findings import Finding
from ..core.pipeline import is_artifact
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels
from ..fixes import FixSearch, MeasuredFixes, fix_search

UNREACHED = ("no calibration token was routed to it, so its error was not measured; the expert_coverage item of "
             "its block says how to reach it.")
# an artifact's expert_coverage item judges the checkpoint's weights: the gate's own batches are what miss it
UNREACHED_ARTIFACT = ("the reference routed no token of the calibration batches to it, so its output was not "
                      "measured (its weights are compared in its weight_sqnr item). Fix: calibrate on more or longer "
                      "batches, so that the reference's router reaches every expert.")

__all__ = ["ModelSqnrCheck", "SqnrCheck", "WeightSqnrCheck", "below", "below_resolution_advice", "output_label",
           "unreached_expert_finding"]


def decibels_text(value: float) -> str:
    """'41.2 dB'."""
    return f"{value:.1f} dB"


def output_label(leaf: str) -> str:
    """'model output', naming the output leaf when the model has several ('model output logits')."""
    return "model output" if leaf in ("", "output") else f"model output {leaf}"


def below(value: float, threshold: float) -> str:
    """'value dB < threshold dB' with enough digits to show the difference (never '36.0 dB < 36.0 dB')."""
    digits = 1
    while digits < 6 and f"{value:.{digits}f}" == f"{threshold:.{digits}f}":
        digits += 1
    return f"{value:.{digits}f} dB < {threshold:.{digits}f} dB"


def below_resolution_advice(search: FixSearch, layer: str, limits: tuple) -> str:
    """Why a layer whose tensors are below int8's resolution fails, and the options that help (qcore.measure.diagnose
    ResolutionLimit records: role, observed_range, smallest_scale)."""
    ranges = " and ".join(f"{limit.role} range {limit.observed_range:.3g}" for limit in limits)
    verb, them = ("are", "them") if len(limits) > 1 else ("is", "it")
    return (f" Its {ranges} {verb} below the quantizer's resolution (smallest scale {limits[0].smallest_scale:.3g}), "
            f"so int8 rounds {them} to (nearly) all zeros. Per-channel weights or a clipping observer cannot help: "
            f"keep the layer in float with {search.keep_in_float([layer]).paste()}, or, if the model's output does not "
            f"depend on it (its model_sqnr item passes), hide it from the checks with skip_layers=[{layer!r}].")


def own_error_layers(measured: Any, layers: list[str], threshold: float) -> list[str]:
    """The layers below `threshold` because of their own error (shadow SQNR below it too), above int8's
    resolution: those a quantization setting may fix."""
    return [layer for layer in layers if (entry := measured.get(layer)) is not None and entry.sqnr_db < threshold
            and not entry.below_resolution and (math.isnan(entry.shadow_sqnr_db) or entry.shadow_sqnr_db < threshold)]


def _first_own_error_before(model: ModelContext, layer: str, threshold: float) -> str:
    """The first layer, in graph order before `layer`, whose own error (shadow SQNR) is below `threshold`."""
    positions, first = _first_own_error(model, threshold)
    if first is None:
        return ""
    position = positions.get(layer)
    return first[1] if position is None or first[0] < position else ""


# per model: every failing item of a model asks, and an MoE model has thousands of layers
_FIRST_OWN_ERRORS: weakref.WeakKeyDictionary[ModelContext, tuple[Any, float, dict[str, int], Any]] = \
    weakref.WeakKeyDictionary()


def _first_own_error(model: ModelContext, threshold: float) -> tuple[dict[str, int], tuple[int, str] | None]:
    """({layer: its graph position}, (position, name) of the first layer whose own error is below `threshold`, or
    None), read once per model's measurement and threshold."""
    measured = model.analysis.sqnr.layers
    held = _FIRST_OWN_ERRORS.get(model)
    if held is None or held[0] is not measured or held[1] != threshold:
        names = [entry.layer for entry in model.analysis.layers]
        first = next(((position, name) for position, name in enumerate(names)
                      if own_error_layers(measured, [name], threshold)), None)
        held = _FIRST_OWN_ERRORS[model] = (measured, threshold, {name: i for i, name in enumerate(names)}, first)
    return held[2], held[3]


def _not_measured(check: Check, model: ModelContext, layer: str, threshold: float) -> Finding:
    why = "the model's graph changed between collection and run. Re-run pytest"
    return check.finding(model, layer, math.nan, threshold, passed=False,
                         message=f"model {model.name!r}, layer {layer}: collected but not measured: {why}.",
                         details=not_measured_details(why))


def unreached_expert_finding(check: Check, model: ModelContext, layer: str, threshold: float) -> Finding:
    """The finding of an expert layer that no calibration token was routed to: no value, and why."""
    unreached = UNREACHED_ARTIFACT if is_artifact(model.analysis) else UNREACHED
    return check.finding(model, layer, math.nan, threshold, passed=False, message=f"layer {layer}: {unreached}",
                         details=unreached_details())


def _failing_sqnr_items(model: ModelContext) -> list[str]:
    """The sqnr items that fail on this run, in graph order (none when the check is off): a layer's, or an MoE
    projection's where one of its experts fails."""
    if "sqnr" not in model.checks:
        return []
    threshold, measured = model.settings.sqnr_min_db, model.analysis.sqnr.layers
    return expert_items([entry.layer for entry in model.analysis.layers
                         if (found := measured.get(entry.layer)) is not None and found.sqnr_db < threshold],
                        expert_layers_of(model.analysis))


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
        searched = self.options.get("fix", True)  # check_options={'sqnr': {'fix': False}}: no fix is measured
        own_errors = own_error_layers(measured, layers, threshold)
        search = fix_search(model)
        fixes = search.layer_fixes(own_errors) if searched else None
        subset = search.best_proper_subset(own_errors) if searched and own_errors else None
        if subset is not None and subset.stopped:  # the fix budget was spent before it was measured
            subset = None
        for layer in layers:
            entry = measured.get(layer)
            if entry is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            if entry.batches == 0 and math.isnan(entry.sqnr_db):  # an expert no calibration token was routed to
                results.append(unreached_expert_finding(self, model, layer, threshold))
                continue
            quantized = model.analysis.layer(layer)
            not_comparable = getattr(model.analysis, "not_comparable", {}).get(layer, "")
            limit = search.threshold_limit(layer, own_errors, subset) if layer in own_errors else ""
            message = self.message(model, layer, entry.sqnr_db, threshold, entry.shadow_sqnr_db,
                                   entry.below_resolution, None if fixes is None else fixes.get(layer, []),
                                   not_comparable, limit, stopped=fixes is not None and fixes.stopped, search=search)
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
                limit: str = "", stopped: bool = False, *, search: FixSearch) -> str:
        """Explain a low propagated SQNR, telling inherited error from the layer's own, with the fixes measured
        to help it (FixSearch.layer_fixes; None: none was searched). `not_comparable`: why the layer's own error was
        not measured (an artifact that rescales its input); `limit`: why no proper subset in float passes every
        item (FixSearch.threshold_limit); `stopped`: the fix budget stopped a search for its fixes; `search`: the
        model's fix search, which the other advice comes from."""
        own = f"({not_comparable})" if not_comparable else f"(shadow SQNR {shadow:.1f} dB)"
        text = f"layer {layer}: SQNR {below(value, threshold)} {own}."
        if below_resolution:
            return text + below_resolution_advice(search, layer, below_resolution)
        if not math.isnan(shadow) and shadow >= threshold:
            text += " With float inputs the layer is fine: it inherits its error from the layers before it."
            source = _first_own_error_before(model, layer, threshold)
            if source:
                experts = expert_layers_of(model.analysis)
                item = "its item" if source not in experts else f"the item {experts[source].projection}"
                return text + (f" The first layer before it that fails on its own is {source}: fix that one (see "
                               f"{item}), or hide this layer from the checks with skip_layers=[{layer!r}].")
            return text + " No layer before it fails on its own: the error builds up over many layers." + \
                _built_up_error_advice(model, search, layer)
        whose = "The layer's own quantization error is too large" if not not_comparable else \
            "Its own error or the error it inherits is too large"
        if fixes is None:
            return text + (f" {whose} (no fix was measured: check_options={{'sqnr': {{'fix': False}}}}).")
        further = search.further() if stopped else ""  # before the fixes: a printed fix ends its message
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


def _built_up_error_advice(model: ModelContext, search: FixSearch, layer: str) -> str:
    """For error that builds up over many layers: the model_sqnr item's measured float_layers fix when the output
    fails and one was found, else what the output measures; never a pointer to an item that measured nothing."""
    hide = f"hide this layer from the checks with skip_layers=[{layer!r}]"
    target, fix = search.output_float_layers()
    if fix is not None:
        reach = "reaching" if fix.reached else "still below"
        return (f" The model_sqnr item's measured fix keeps {len(fix.float_layers)} layer(s) in float (the model "
                f"output {fix.measured_db:.2f} dB, {reach} model_sqnr_min_db {target:g} dB): qmodel(..., "
                f"{search.keep_in_float(fix.float_layers).paste()}); or {hide}.")
    worst = model.analysis.sqnr.worst_output()
    if target is not None and worst is not None and worst.sqnr_db >= target:
        return (f" The model output measures {worst.sqnr_db:.2f} dB, passing model_sqnr_min_db {target:g} dB, so the "
                f"error that reaches it is within bounds: lower sqnr_min_db, or {hide}.")
    if search.output_search_stopped():
        return f" Lower sqnr_min_db, or {hide}." + search.further()
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
        searched = self.options.get("fix", True) and not artifact  # check_options={'weight_sqnr': {'fix': False}}
        search = fix_search(model)
        fixes = search.layer_fixes(failing, kind="weight") if searched else MeasuredFixes()
        further = search.further() if fixes.stopped else ""
        every_fails = bool(failing) and set(search.quantized_layers()) <= set(failing)
        for layer in layers:
            entry = measured.get(layer)
            if entry is None or entry.weight_sqnr_db is None:
                results.append(_not_measured(self, model, layer, threshold))
                continue
            weight_limits = tuple(limit for limit in entry.below_resolution if limit.role == "weight")
            if weight_limits:
                message = (f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}."
                           + below_resolution_advice(search, layer, weight_limits))
                results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
                continue
            found = fixes.get(layer, [])
            limit = _weight_threshold_limit(search, entry.weight_sqnr_db, threshold) \
                if every_fails and layer in failing else ""
            rescaled = getattr(model.analysis, "not_comparable", {}).get(layer)
            scaled = ", compared up to its input channels' scales" if rescaled else ""
            advice = (f" It is the artifact's own weight{scaled}: GPTQ and AWQ lower weight SQNR on purpose to "
                      "raise the output's, so in artifact mode this "
                      f"check warns; this layer's sqnr item and the output items judge what it computes." if artifact
                      else " (No fix was measured: check_options={'weight_sqnr': {'fix': False}}.)" if not searched else
                      limit + further + (" Measured fixes: " + "; or ".join(found) + "." if found else "") if limit
                      else further + " Measured fixes: " + "; or ".join(found) + "." if found else
                      " No fix was measured to raise it within the fix budget." + further if further else
                      " Neither per-channel weights nor keeping it in float was measured to help without lowering "
                      f"the model's output SQNR: hide it from the checks with skip_layers=[{layer!r}], or lower "
                      "weight_sqnr_min_db.")
            message = f"layer {layer}: weight SQNR {below(entry.weight_sqnr_db, threshold)}." + advice
            results.append(self.finding(model, layer, entry.weight_sqnr_db, threshold, message=message))
        return results


def _weight_threshold_limit(search: FixSearch, value: float, threshold: float) -> str:
    """Why no fix keeps every weight_sqnr item passing when every quantized weight fails: a weight's SQNR depends on
    its own quantization only, so only the threshold or the quantizer can change it."""
    count = len(search.quantized_layers())
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
        search = fix_search(model)
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
            starts = _failing_sqnr_items(model) if entry.sqnr_db < threshold else []
            if starts:
                message += (f" {len(starts)} per-layer sqnr item(s) fail too, the first {starts[0]}: see them for the "
                            "layer where the error starts.")
            details: dict = {"cosine": entry.cosine, "normalized_l2": entry.normalized_l2, "leaf": entry.name}
            formats = search.recipe()
            if entry.sqnr_db < threshold:
                advice = search.output_fix(self.name, "output_sqnr_db", threshold, show=decibels_text)
                message, formats = message + advice.text, advice.recipe
            if formats is not None:  # the formats to deploy (with the fix when it fails): {"default", "layers"}
                details["recipe"] = formats
            results.append(self.finding(model, name, entry.sqnr_db, threshold, message=message, details=details))
        return results
