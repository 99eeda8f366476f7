"""Where the model's error comes from: the per-layer sensitivity ranking, with the model_sqnr item's measured fix."""
from __future__ import annotations

import math
from typing import Any

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..fixes import BLOCKWISE_NOTE, DEFAULT_BATCHES, DEFAULT_MAX_LAYERS, fix_search
from .sqnr import decibels_text

__all__ = ["SensitivityCheck"]


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
        search = fix_search(model)
        listed = "; ".join(f"{entry.layer} {entry.gain_db:+.1f} dB in float" + (
            "" if math.isnan(entry.only_quantized_db) else
            f" (the output {entry.only_quantized_db:.1f} dB with this layer the only one quantized)") for entry in top)
        skipped = (f" {len(result.skipped)} layer(s) past the budget of {max_layers} were not measured "
                   f"(check_options={{'sensitivity': {{'max_layers': N}}}})." if result.skipped else "")
        if result.unmeasured:
            skipped += (f" {len(result.unmeasured)} layer(s) within it were not measured: the model's fix budget was "
                        "spent." + search.further())
        details: dict[str, Any] = {
            "all_quantized_db": result.all_quantized_db, "batches": result.batches, "skipped": list(result.skipped),
            "ranking": [{"layer": e.layer, "gain_db": e.gain_db, "only_quantized_db": e.only_quantized_db,
                         "only_float_db": e.only_float_db, "batches": e.batches} for e in result.layers]}
        fix = search.output_fix("model_sqnr", "output_sqnr_db", target, show=decibels_text).text
        further = search.further()
        if further and skipped.endswith(further) and further in fix:  # both stopped by the budget: say it once
            fix = fix.replace(further, "", 1)
        ranked = f" (on {result.batches} batch(es)); the layers that help most when kept in float: {listed}." if top \
            else "; no layer was ranked."
        message = f"model output SQNR {result.all_quantized_db:.1f} dB with every layer quantized{ranked}" + \
            skipped + fix
        value = top[0].gain_db if top else math.nan
        return [self.finding(model, "model", value, math.nan, passed=False, message=message, details=details)]
