"""Where the model's error comes from: the per-layer sensitivity ranking, and a verified float_layers fix."""
from __future__ import annotations

import math
from typing import Any

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from .advice import float_search_limit, max_float_layers, search_further
from .artifact import DEFAULT_CANDIDATES, artifact_fix, artifact_fix_advice, is_artifact

__all__ = ["BLOCKWISE_NOTE", "SensitivityCheck", "float_layers_advice", "output_fix", "output_float_layers_fix",
           "recipe"]

BLOCKWISE_NOTE = ("No {search} ran: the model is analysed one block at a time (blockwise), and the {search} "
                  "measures the whole quantized model; it runs with qmodel(blockwise=False) where the whole model's "
                  "analysis fits in memory.")
DEFAULT_MAX_LAYERS = 32
DEFAULT_BATCHES = 2


def recipe(model: ModelContext) -> dict[str, Any] | None:
    """The formats in force, {"default": format, "layers": {glob: format}}, for a model in deployed formats."""
    quantizer: Any = model.analysis.quantizer
    if getattr(quantizer, "layer_preset", None) is None:
        return None
    return {"default": quantizer.preset.name, "layers": dict(model.settings.layer_formats or {})}


def output_fix(model: ModelContext, target_db: float) -> tuple[str, dict[str, Any] | None]:
    """The verified fix for a low model output SQNR and, for a model in deployed formats, its recipe
    ({"default": format, "layers": {layer: format}}): a format_fix under a format quantizer, else float_layers."""
    if is_artifact(model.analysis):
        return artifact_fix_advice(model, "model_sqnr", "output_sqnr_db", target_db, model.analysis.batches,
                                   lambda value: f"{value:.1f} dB")
    formats = recipe(model)
    if formats is None:
        return float_layers_advice(model, target_db), None
    options = model.checks["model_sqnr"].options if "model_sqnr" in model.checks else {}
    if options.get("fix") is False:
        return "", formats
    if model.analysis.blockwise:
        return f" ({BLOCKWISE_NOTE.format(search='format search')})", formats
    fix = model.analysis.format_fix(target_db, int(options.get("max_moves", 16)),
                                    options.get("batches", DEFAULT_BATCHES))
    if not fix.layer_formats:
        return search_further(model) if fix.stopped else "", formats
    formats["layers"].update(fix.layer_formats)
    layers = formats["layers"]
    if fix.reached:
        return (f" Moving {len(fix.layer_formats)} layer(s) up the format ladder was measured to reach "
                f"{fix.measured_db:.1f} dB: layer_formats={layers!r}"), formats
    within = " that the search measured within the fix budget" if fix.stopped else ""
    return (f" No set of up to {len(fix.layer_formats)} format moves{within} reaches {target_db:.1f} dB"
            + (f".{search_further(model)} The best found" if fix.stopped else "; the best found")
            + f", layer_formats={layers!r}, was measured at {fix.measured_db:.1f} dB."), formats


def output_float_layers_fix(model: ModelContext, target_db: float) -> Any | None:
    """The float_layers fix model_sqnr advises for a low output SQNR (qcore's FloatLayersFix, searched once per
    model and kept), or None where model_sqnr searches none (its fix is off, a format quantizer, blockwise)."""
    if is_artifact(model.analysis):
        return artifact_fix(model, "model_sqnr", "output_sqnr_db", target_db, model.analysis.batches)
    options = model.checks["model_sqnr"].options if "model_sqnr" in model.checks else {}
    if options.get("fix") is False or model.analysis.blockwise or recipe(model) is not None:
        return None
    if not isinstance(getattr(model.analysis.quantizer, "layer_overrides", None), dict):
        return None
    ranked = model.checks["sensitivity"].options if "sensitivity" in model.checks else {}
    return model.analysis.float_layers_fix(target_db, max_float_layers(model, "model_sqnr"),
                                           options.get("batches", DEFAULT_BATCHES),
                                           int(options.get("candidates", DEFAULT_CANDIDATES)),
                                           int(ranked.get("max_layers", DEFAULT_MAX_LAYERS)))


def float_layers_advice(model: ModelContext, target_db: float) -> str:
    """The verified fix for a low model output SQNR: a float_layers line to paste and the SQNR it reached."""
    options = model.checks["model_sqnr"].options if "model_sqnr" in model.checks else {}
    if options.get("fix") is False:
        return ""
    if not isinstance(getattr(model.analysis.quantizer, "layer_overrides", None), dict):
        return (" (No float_layers fix is searched: this quantizer has no layer_overrides to keep layers in "
                "float.)")
    if model.analysis.blockwise:
        return f" ({BLOCKWISE_NOTE.format(search='float_layers search')})"
    fix = output_float_layers_fix(model, target_db)
    if fix is None or not fix.float_layers:
        return search_further(model) if fix is not None and fix.stopped else ""
    layers = list(model.settings.float_layers or []) + list(fix.float_layers)
    if fix.reached:
        return (f" Keeping {len(fix.float_layers)} layer(s) in float was measured to reach {fix.measured_db:.1f} dB: "
                f"float_layers={layers!r}")
    if fix.stopped:
        return (f" No set of up to {len(fix.float_layers)} layers kept in float that the search measured within the "
                f"fix budget reaches {target_db:.1f} dB.{search_further(model)} The best found, "
                f"float_layers={layers!r}, was measured at {fix.measured_db:.1f} dB.")
    return (f" No set of up to {len(fix.float_layers)} layers kept in float reaches {target_db:.1f} dB "
            f"({float_search_limit(model, len(fix.float_layers), 'model_sqnr')}); the best found, "
            f"float_layers={layers!r}, was measured at {fix.measured_db:.1f} dB.")


class SensitivityCheck(Check):
    """The layers whose float-ification helps the model's output most (one item per model).

    Runs when model_sqnr fails, or always with check_options={'sensitivity': {'always': True}}. Options:
    max_layers (default 32, graph order), batches (default 2 calibration batches), top (default 5 listed),
    confirmed (default twice top). Each layer is screened on the first batch; the `confirmed` best are measured
    on every batch, and the ranking lists them first (the layers it prints among them).
    """

    name, order, metric, needs, default_severity = "sensitivity", 35, "gain_db", frozenset({"sqnr"}), "warn"

    def layers(self, model: ModelContext) -> list[str]:
        return ["model"]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        worst = model.analysis.sqnr.worst_output()
        target = model.settings.model_sqnr_min_db
        if not self.options.get("always") and (worst is None or worst.sqnr_db >= target):
            return [Finding(model=model.name, check=self.name, layer="model", metric=self.metric, value=math.nan,
                            threshold=math.nan, verdict="skip", message=(
                                "model_sqnr passes, so the sensitivity ranking did not run; run it anyway with "
                                "qmodel(check_options={'sensitivity': {'always': True}})"))]
        if model.analysis.blockwise:
            return [Finding(model=model.name, check=self.name, layer="model", metric=self.metric, value=math.nan,
                            threshold=math.nan, verdict="skip",
                            message=BLOCKWISE_NOTE.format(search="sensitivity ranking"))]
        max_layers = int(self.options.get("max_layers", DEFAULT_MAX_LAYERS))
        listed_count = int(self.options.get("top", 5))
        confirmed = max(listed_count, int(self.options.get("confirmed", 2 * listed_count)))
        # "the only one quantized" is measured for the listed layers alone
        result = model.analysis.sensitivity(max_layers, self.options.get("batches", DEFAULT_BATCHES), listed_count,
                                            confirmed)
        top = result.layers[:listed_count]
        listed = "; ".join(f"{entry.layer} {entry.gain_db:+.1f} dB in float" + (
            "" if math.isnan(entry.only_quantized_db) else
            f" (the output {entry.only_quantized_db:.1f} dB with this layer the only one quantized)") for entry in top)
        skipped = (f" {len(result.skipped)} layer(s) past the budget of {max_layers} were not measured "
                   f"(check_options={{'sensitivity': {{'max_layers': N}}}})." if result.skipped else "")
        if result.unmeasured:
            skipped += (f" {len(result.unmeasured)} layer(s) within it were not measured: the model's fix budget was "
                        "spent." + search_further(model))
        details: dict[str, Any] = {
            "all_quantized_db": result.all_quantized_db, "batches": result.batches, "skipped": list(result.skipped),
            "ranking": [{"layer": e.layer, "gain_db": e.gain_db, "only_quantized_db": e.only_quantized_db,
                         "only_float_db": e.only_float_db, "batches": e.batches} for e in result.layers]}
        fix = output_fix(model, target)[0]
        further = search_further(model)
        if skipped.endswith(further) and fix.endswith(further):  # both stopped by the budget: say it once
            fix = fix[:-len(further)]
        ranked = f" (on {result.batches} batch(es)); the layers that help most when kept in float: {listed}." if top \
            else "; no layer was ranked."
        message = f"model output SQNR {result.all_quantized_db:.1f} dB with every layer quantized{ranked}" + \
            skipped + fix
        value = top[0].gain_db if top else math.nan
        return [self.finding(model, "model", value, math.nan, passed=False, message=message, details=details)]
