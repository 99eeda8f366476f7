"""Output-level checks: what the model outputs, not an SQNR proxy. One item per model each.

kl_divergence, top1_agreement and perplexity compare the float and quantized output logits over the evaluation
batches (the calibration batches unless eval_batches is set), from the comparison pass that already runs both
models; a model whose output is not logits skips them with the reason. task_metric runs the user's own metric on
both models and gates on the recovery, quantized / float.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

from ..core.findings import Finding
from ..core.pipeline import is_artifact
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, fraction, function, number
from ..fixes import fix_search
from .sqnr import below, decibels_text, output_label

__all__ = ["KlDivergenceCheck", "OutputCheck", "PerplexityCheck", "TaskMetricCheck", "Top1AgreementCheck",
           "layer_search_pointer"]


def _skip(check: Check, model: ModelContext, threshold: float, why: str) -> Finding:
    return Finding(model=model.name, check=check.name, layer="output", metric=check.metric, value=math.nan,
                   threshold=threshold, verdict="skip", message=f"model {model.name!r}: not measured: {why}.")


def _where(model: ModelContext) -> str:
    return "the eval_batches" if model.settings.eval_batches is not None else "the calibration batches"


def layer_search_pointer(model: ModelContext) -> str:
    """Where this run measured the layers to keep in float, naming only items that measured them: the model_sqnr
    item when it fails (and the sensitivity ranking, which runs then), else the setting that runs the ranking."""
    analysis = model.analysis
    if analysis.blockwise:
        return ""
    worst, target = analysis.sqnr.worst_output(), model.settings.model_sqnr_min_db
    ranking = "sensitivity" in model.checks
    ranked = ranking and model.checks["sensitivity"].options.get("always")
    if "model_sqnr" in model.checks and worst is not None and worst.sqnr_db < target:
        # what the model_sqnr item says of its search (it runs first; its search and this read are one, cached)
        search = fix_search(model)
        advice = search.output_fix("model_sqnr", "output_sqnr_db", target, show=decibels_text)
        fails = f" The model_sqnr item fails too ({below(worst.sqnr_db, target)})"
        if advice.setting:
            what = "format moves" if advice.setting == "layer_formats" else "layers to keep in float"
            also = ", and the sensitivity item" if ranking else ""  # which ranks layers, or says why it did not
            return f"{fails}: see the {what} that it measured{also}."
        if advice.unsearched:  # the budget left no search: neither it nor the ranking measured
            return f"{fails}; within the fix budget it measured no fix, and it says how to search further."
        return f"{fails}{': see the sensitivity item' if ranking else ''}."
    if ranked:
        return " See the sensitivity item's ranking of the layers to keep in float."
    if worst is None:
        return ""
    passing = (f"model_sqnr passes ({worst.sqnr_db:.2f} dB >= {target:g} dB)" if "model_sqnr" in model.checks
               else "model_sqnr is off")
    setting = "check_options={'sensitivity': {'always': True}}" if ranking else \
        "severity={'sensitivity': 'warn'}, check_options={'sensitivity': {'always': True}}"
    return (f" No layer search ran for the output: {passing}. To rank the layers by the output SQNR each gains in "
            f"float, run the sensitivity ranking: qmodel(..., {setting}).")


class OutputCheck(Check):
    """A check of the model's output: one item per model, named `output`."""

    measures_artifacts = True
    points_to_layer_search: ClassVar[bool] = True

    def layers(self, model: ModelContext) -> list[str]:
        return ["output"]

    def fix_advice(self, model: ModelContext, measured_metric: str, threshold: float, failing: bool,
                   details: dict[str, Any], show: Any) -> str:
        """What to change, to end a failing item's message: in artifact mode the verified float_layers fix (and
        `details["recipe"]`), else where this run measured the layers to keep in float."""
        if not failing:
            return ""
        if not is_artifact(model.analysis):
            return layer_search_pointer(model) if self.points_to_layer_search else ""
        advice = fix_search(model).output_fix(self.name, measured_metric, threshold, model.eval_batches(), show)
        if advice.recipe is not None:
            details["recipe"] = advice.recipe
        return advice.text


class KlDivergenceCheck(OutputCheck):
    """Mean over output positions of KL(float || quantized) between the softmax of the output logits, in nats."""

    name, order, metric, needs, higher_is_better = "kl_divergence", 31, "kl_nats", frozenset({"sqnr", "logits"}), False
    baseline_tolerance = 0.005
    settings = (Setting("kl_max_nats", number("nats", non_negative=True), 0.02, "maximum mean KL(float || "
                        "quantized) of the output logits' softmax, in nats", metavar="NATS"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured = model.settings.kl_max_nats, model.logits()
        if measured.reason:
            return [_skip(self, model, threshold, measured.reason)]
        message = (f"{output_label(measured.leaf)}: mean KL(float || quantized) {measured.kl_nats:.4g} nats > "
                   f"{threshold:g} over {measured.positions} positions of {_where(model)}.")
        details: dict[str, Any] = {"positions": measured.positions, "leaf": measured.leaf}
        message += self.fix_advice(model, "kl_nats", threshold, measured.kl_nats > threshold, details,
                                   lambda value: f"KL {value:.4g} nats")
        return [self.finding(model, "output", measured.kl_nats, threshold, message=message, details=details)]


class Top1AgreementCheck(OutputCheck):
    """The share of output positions whose argmax is the same for the float and the quantized model."""

    name, order, metric, needs = "top1_agreement", 32, "agreement", frozenset({"sqnr", "logits"})
    baseline_tolerance = 0.01
    settings = (Setting("top1_agreement_min", fraction(), 0.95, "minimum share of output positions whose argmax "
                        "the quantized model keeps", metavar="FRACTION"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured = model.settings.top1_agreement_min, model.logits()
        if measured.reason:
            return [_skip(self, model, threshold, measured.reason)]
        message = (f"{output_label(measured.leaf)}: the quantized model keeps the top-1 prediction at "
                   f"{measured.top1_agreement:.2%} of {measured.positions} positions of {_where(model)} "
                   f"(< {threshold:.2%}).")
        details: dict[str, Any] = {"positions": measured.positions, "leaf": measured.leaf}
        message += self.fix_advice(model, "top1_agreement", threshold, measured.top1_agreement < threshold, details,
                                   lambda value: f"top-1 agreement {value:.2%}")
        return [self.finding(model, "output", measured.top1_agreement, threshold, message=message, details=details)]


class PerplexityCheck(OutputCheck):
    """For causal LMs: how much higher the quantized model's next-token perplexity is than the float model's, in %."""

    name, order, metric, needs, higher_is_better = "perplexity", 33, "perplexity_increase_pct", \
        frozenset({"sqnr", "logits"}), False
    points_to_layer_search = False
    baseline_tolerance = 0.5
    settings = (Setting("perplexity_max_increase_pct", number("%", non_negative=True), 5.0, "maximum relative "
                        "increase of the next-token perplexity (causal LMs), in %", metavar="PCT"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured = model.settings.perplexity_max_increase_pct, model.logits()
        if measured.reason or measured.perplexity_reason or not measured.tokens:
            why = measured.reason or measured.perplexity_reason or "no token to predict (every mask is 0?)"
            return [_skip(self, model, threshold, why)]
        increase = measured.perplexity_increase_pct
        message = (f"{output_label(measured.leaf)}: next-token perplexity {measured.float_perplexity:.3f} (float) -> "
                   f"{measured.quantized_perplexity:.3f} (quantized), +{increase:.2f}% > {threshold:g}% over "
                   f"{measured.tokens} tokens of {_where(model)}.")
        details: dict[str, Any] = {"float_perplexity": measured.float_perplexity,
                                   "quantized_perplexity": measured.quantized_perplexity, "tokens": measured.tokens}
        message += self.fix_advice(model, "perplexity_increase_pct", threshold, increase > threshold, details,
                                   lambda value: f"+{value:.2f}% perplexity")
        return [self.finding(model, "output", increase, threshold, message=message, details=details)]


class TaskMetricCheck(OutputCheck):
    """The user's own metric, `task_metric(model, batches) -> float` (higher is better), on the float and the
    quantized model: the item's value is the recovery, quantized / float."""

    name, order, metric, needs = "task_metric", 34, "recovery", frozenset({"sqnr"})
    baseline_tolerance = 0.01
    settings = (Setting("task_recovery_min", fraction(), 0.99, "minimum recovery of task_metric, quantized / float",
                        metavar="FRACTION"),
                Setting("task_metric", function, None, "fn(model, batches) -> float, higher is better (accuracy, F1, "
                        "exact match) run on the float and the quantized model over the evaluation batches (in "
                        "qmodel: the function; elsewhere 'module:attribute')", metavar="MODULE:FN",
                        shown_default="—"))

    def applies(self, model: ModelContext) -> bool:
        return model.settings.task_metric is not None

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, metric = model.settings.task_recovery_min, model.settings.task_metric
        float_value, quantized_value = model.analysis.task_metric(metric, model.eval_batches())
        name = getattr(metric, "__qualname__", repr(metric))
        details: dict[str, Any] = {"float": float_value, "quantized": quantized_value, "metric": name}
        if not (math.isfinite(float_value) and float_value > 0):
            return [self.finding(model, "output", math.nan, threshold, passed=False, details=details, message=(
                f"model {model.name!r}: task_metric {name} gave {float_value!r} for the float model; the recovery "
                "quantized / float needs a positive, finite float value (higher is better)."))]
        recovery = quantized_value / float_value
        message = (f"model {model.name!r}: task_metric {name} {float_value:.4g} (float) -> {quantized_value:.4g} "
                   f"(quantized) on {_where(model)}: recovery {recovery:.2%} < {threshold:.2%}.")
        return [self.finding(model, "output", recovery, threshold, message=message, details=details)]
