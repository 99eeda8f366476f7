"""Detector checks: ModelReport's detectors as items. torch.ao's heuristics name the layers; an item fails
only when the change its detector recommends was measured (pytest_qreport.fixes) to raise the layer's own SQNR by at
least the check's minimum gain: by the screen in the model's comparison pass where one ran (the verdict pass; the
fix's trial on the whole model is then a fix search within the fix budget), else by the fix's trial, which must not
lower the output SQNR either. Where heuristic and measurement disagree, the item passes with a note that names
both.

Wrapping a custom `qcore.report.DetectorBase` takes a few lines (without `fix_change`, its heuristic verdict
stands unmeasured)::

    class MyDetectorCheck(DetectorCheck):
        name, order, metric = "my_detector", 75, "my_metric"

        def make_detector(self, quantizer):
            return MyDetector(**self.options)

        def layer_finding(self, model, layer, entry, quantized):
            return self.finding(model, layer, entry["score"], 1.0, passed=entry["score"] < 1.0,
                                message=f"layer {layer}: ...", details=entry)
"""
from __future__ import annotations

import itertools
import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..core.experts import expert_items, expert_layers_of, not_measured_details, unreached_details
from ..core.findings import Finding
from ..core.numbers import format_bound
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, decibels
from ..fixes import Advice, FixSearch, fix_search

__all__ = ["DetectorCheck", "DynamicStaticCheck", "InputWeightEqualizationCheck", "OutlierCheck", "PerChannelCheck"]


class DetectorCheck(Check):
    """A check backed by one qcore.report detector; all of a model's detectors share one calibration pass."""

    needs = frozenset({"detectors"})
    default_options: ClassVar[dict[str, Any]] = {}
    threshold_is_setting = False  # its threshold is the heuristic's; its setting is the fix's minimum gain
    recommends: ClassVar[str] = ""  # what the heuristic recommends, for notes: "per-channel weights"
    fix_observes_activations: ClassVar[bool] = False  # the fix adds activation observers that must be calibrated

    @abstractmethod
    def make_detector(self, quantizer: Any) -> Any:
        """The detector instance for this model (options: default_options updated by check_options)."""

    @abstractmethod
    def layer_finding(self, model: ModelContext, layer: str, entry: dict[str, Any], quantized: Any) -> Finding:
        """The heuristic's finding of one layer from its raw detector entry and its QuantizedLayer record (a
        failure says what the heuristic sees; the measured claim and the fix are added to it)."""

    def fix_change(self, quantized: Any) -> dict[str, Any] | None:
        """The layer_overrides entry that applies the recommendation to one layer; None: no fix to measure, so
        the heuristic's verdict stands."""
        return None

    def host_keys(self) -> tuple[str, ...]:
        """The entry keys whose tensors layer_finding reads as numbers: read for all layers in one host copy (on a
        GPU, one wait instead of one per layer), as Python numbers (0-d) or lists."""
        return ()

    def min_gain(self, model: ModelContext) -> float:
        """The least gain, in dB of the layer's own SQNR, for which the fix is recommended."""
        return float(getattr(model.settings, self.min_gain_setting, 1.0))

    @property
    def min_gain_setting(self) -> str:
        """The setting of the least gain for which an item fails."""
        return f"{self.name}_min_gain_db"

    @property
    def merged_options(self) -> dict[str, Any]:
        """default_options updated by the model's check_options for this check."""
        return {**self.default_options, **self.options}

    def bind(self, model: ModelContext) -> None:
        """Make this model's detector (called once per model, at collection)."""
        self.detector = self.make_detector(model.analysis.quantizer)

    def layers(self, model: ModelContext) -> list[str]:
        quantized = {entry.layer for entry in model.analysis.layers}
        return [op.layer for op in self.detector.layers(model.analysis.float_gm) if op.layer in quantized]

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        report, results = read_to_host(model.detector_report(self.name), layers, self.host_keys()), []
        experts = expert_layers_of(model.analysis)
        for layer in layers:
            entry = report.get(layer)
            if entry is None and layer in experts:  # its projection's item names it; expert_coverage judges it
                results.append(Finding(model=model.name, check=self.name, layer=layer, metric=self.metric,
                                       value=math.nan, threshold=math.nan, verdict="skip", message=(
                                           f"layer {layer}: no calibration token reached this expert, so the "
                                           f"{self.name} detector saw nothing of it"), details=unreached_details()))
                continue
            if entry is None:
                results.append(self.finding(model, layer, math.nan, math.nan, passed=False, message=(
                    f"model {model.name!r}, layer {layer}: collected, but the {self.name} detector saw no data for it; "
                    "check that the calibration batches reach it.")))
                continue
            quantized = model.analysis.layer(layer)
            if quantized.format != "int8":
                why = (f"torch.ao's {self.name} heuristic and its fix concern int8 observers, so it is not judged "
                       "here")
                results.append(Finding(model=model.name, check=self.name, layer=layer, metric=self.metric,
                                       value=math.nan, threshold=math.nan, verdict="skip",
                                       message=f"layer {layer} is quantized as {quantized.format}: {why}",
                                       details=not_measured_details(f"quantized as {quantized.format}: {why}")))
                continue
            results.append(self.layer_finding(model, layer, entry, quantized))
        return self.verified(model, results)

    def verified(self, model: ModelContext, results: list[Finding]) -> list[Finding]:
        """The heuristic's failures judged on the fix's gain the verdict pass measured (the screen's): failing
        where it reaches the minimum gain, with the fix as far as the fix budget measured it, passing with a note
        where it does not. Where no screen measured the fix, the fix's trial judges (outside the budget)."""
        proposed = {f.layer: self.fix_change(model.analysis.layer(f.layer)) for f in results if f.verdict == "fail"}
        changes = {layer: change for layer, change in proposed.items() if change is not None}
        if not changes:
            return results
        search = fix_search(model)
        advice = self.advise(model, search, list(changes), changes)
        return [self.judged(f, advice, list(changes), model, search) if f.layer in changes else f for f in results]

    def screened_gains(self, model: ModelContext, layers: list[str], changes: dict[str, dict[str, Any]]
                       ) -> dict[str, tuple[float, float]] | None:
        """{layer: (own SQNR, own SQNR with the fix)} that the model's comparison pass measured through this check's
        screen (None when no screen made these changes: a blockwise or equalized model, a custom advise)."""
        screened = model.analysis.screened(self.name)
        if screened is None or {layer: dict(change) for layer, change in screened.changes.items()} != changes:
            return None
        before = model.analysis.sqnr.layers
        return {layer: (before[layer].shadow_sqnr_db, screened.own_sqnr_db.get(layer, math.nan)) for layer in layers}

    def advise(self, model: ModelContext, search: FixSearch, layers: list[str], changes: dict[str, dict[str, Any]]
               ) -> Advice:
        """The measured advice for the layers the heuristic names, from the model's fix search: their own SQNR
        with the fix from the comparison pass (the screen), and the fix's trial on the whole model within the fix
        budget; without a screen, the trial judges, outside the budget."""
        own = self.screened_gains(model, layers, changes)
        return search.verify(layers, lambda chosen: search.layer_overrides({c: changes[c] for c in chosen}),
                             self.min_gain(model), screened=own, verdict=own is None)

    def screen(self, model: ModelContext, layers: list[str]) -> Any | None:
        """The fix on the layers among `layers` whose heuristic verdict fails, measured in the comparison pass;
        None for a check whose advice is not a layer_overrides change."""
        if type(self).advise is not DetectorCheck.advise or type(self).fix_change is DetectorCheck.fix_change:
            return None
        from qcore.analysis import Screen

        ahead = {}
        if self.fix_observes_activations:  # every change the screen may make, its observers calibrated ahead
            quantized = [model.analysis.layer(layer) for layer in layers]
            ahead = {record.layer: change for record in quantized if record.format == "int8"
                     and (change := self.fix_change(record)) is not None}
        return Screen(self.name, lambda reports: self.proposed_changes(model, layers, reports.get(self.name, {})),
                      ahead)

    def proposed_changes(self, model: ModelContext, layers: list[str], report: Mapping[str, Any]
                         ) -> dict[str, dict[str, Any]]:
        """{layer: fix_change} of the layers among `layers` whose heuristic verdict fails on `report`."""
        changes = {}
        report = read_to_host(report, layers, self.host_keys())
        for layer in layers:
            entry, quantized = report.get(layer), model.analysis.layer(layer)
            if entry is None or quantized.format != "int8":
                continue
            change = self.fix_change(quantized)
            if change is not None and self.layer_finding(model, layer, entry, quantized).verdict == "fail":
                changes[layer] = change
        return changes

    def judged(self, found: Finding, advice: Advice, failing: Sequence[str] | None = None,
               model: ModelContext | None = None, search: FixSearch | None = None) -> Finding:
        """One heuristic failure after measurement. `failing`: the layers whose items fail this heuristic (default:
        those the advice recommends); the fix they share is printed in full on the first of them it helps. `model`
        and its fix `search`: what the verdict pass measured is read from them (without them, the advice judges)."""
        details = {**found.details, "measured_gain_db": advice.first.gain(found.layer),
                   "advised": advice.helps(found.layer)}
        measured = self.pass_gains(model, search, advice, [found.layer]) if model is not None and search is not None \
            else None
        before, after = (measured or {}).get(found.layer, (math.nan, math.nan))
        if model is not None and search is not None and after - before >= advice.min_gain \
                and not advice.helps(found.layer):
            # the verdict pass measured the gain: the item fails whatever the fix's trial found, or if it did not run
            return found.replace(message=self.unadvised(model, search, found, advice, failing, (before, after)),
                                 details=details)
        if advice.helps(found.layer):
            details["fix"] = advice.fix_text()
            # the items that keep the fix: the failing ones it helps (a model-wide fix may help passing layers too)
            kept = [layer for layer in (advice.recommended if failing is None else failing) if advice.helps(layer)]
            # an MoE model's expert layers are items by projection: the pointer names items, as the summary does
            experts = expert_layers_of(model.analysis) if model is not None else {}
            items = expert_items(kept, experts)
            if expert_items([found.layer], experts)[0] == items[0] or len(items) == 1:
                fix = f"Fix: {advice.fix_text()}."
            else:  # one fix for every item it helps: printed in full once, on the first one's item and the summary
                assert advice.trial is not None
                fix = (f"Fix: the one {advice.trial.fix.setting} fix for the {len(items)} failing {self.name} items, "
                       f"given on the item of {items[0]} and under the summary.")
            further = search.others_untried(advice) if search is not None else ""
            return found.replace(message=f"{found.message.rstrip('.')}; {advice.claim(found.layer)}.{further} {fix}",
                                 details=details)
        seen = found.message.removeprefix(f"layer {found.layer}: ")
        heuristic = f"torch.ao's {self.name} heuristic recommends {self.recommends} ({seen})"
        return found.replace(verdict="pass", message="", note=advice.note(found.layer, heuristic), details=details)

    def pass_gains(self, model: ModelContext, search: FixSearch, advice: Advice, layers: Sequence[str]
                   ) -> Mapping[str, tuple[float, float]] | None:
        """{layer: (own SQNR, own SQNR with the fix)} that the verdict pass measured (the screen's), of `layers` at
        least, or None where none did (the fix's trial then judges)."""
        return advice.first.own if advice.first.screened else None

    def measured_setting(self, model: ModelContext, search: FixSearch, layers: Sequence[str]) -> str:
        """The setting the verdict pass measured on `layers`, to paste (the screen's changes)."""
        screened = model.analysis.screened(self.name)
        changes = {layer: dict(screened.changes[layer]) for layer in layers} if screened is not None else {}
        return search.layer_overrides(changes).paste()

    def unadvised(self, model: ModelContext, search: FixSearch, found: Finding, advice: Advice,
                  failing: Sequence[str] | None, measured: tuple[float, float]) -> str:
        """The message of an item whose fix the comparison pass measured (`measured`: its own SQNR without and with
        it) to raise its own SQNR by the minimum gain, with what the fix budget measured of it on the whole model:
        not tried (and how to try it), or a trial that does not keep it (the output falls, or together with the
        others it gains less)."""
        layer, (before, after) = found.layer, measured
        claim = (f"{found.message.rstrip('.')}; in the comparison pass, with {self.recommends}, its own SQNR (float "
                 f"input) is {before:.2f} -> {after:.2f} dB ({after - before:+.2f} dB; the minimum gain is "
                 f"{advice.min_gain:g} dB)")
        if advice.stopped:
            named = list(failing or [layer])
            gains = self.pass_gains(model, search, advice, named) or {}
            gaining = [name for name in named
                       if (pair := gains.get(name)) is not None and pair[1] - pair[0] >= advice.min_gain]
            return (f"{claim}, and its effect on the model output was not measured: the model's fix budget was "
                    f"spent.{search.further()} The setting the comparison pass measured on these layers: "
                    f"qmodel(..., {self.measured_setting(model, search, gaining or [layer])}).")
        note = advice.notes.get(layer, "not measured")
        return (f"{claim}, but on the whole model {note}, so it is not advised: raise {self.min_gain_setting} "
                f"above {format_bound(after - before, 'gain_db', up=True)}, or set severity={{{self.name!r}: 'warn'}}, "
                "to accept the layer as it is.")


class PerChannelCheck(DetectorCheck):
    """Per-channel weight quantization is supported but the quantizer quantizes per tensor."""

    name, order, metric = "per_channel", 40, "per_channel_used"
    recommends = "per-channel weights"
    settings = (Setting("per_channel_min_gain_db", decibels(non_negative=True), 1.0, "per_channel items fail when "
                        "per-channel weights were measured to raise the layer's own SQNR by at least this many dB",
                        metavar="DB"),)

    def make_detector(self, quantizer: Any) -> Any:
        from qcore.report import PerChannelDetector

        return PerChannelDetector(quantizer=quantizer, **self.merged_options)

    def layers(self, model: ModelContext) -> list[str]:
        weighted = {entry.layer for entry in model.analysis.layers if entry.weighted}
        return [op.layer for op in self.detector.layers(model.analysis.float_gm)
                if op.weight is not None and op.layer in weighted]

    def fix_change(self, quantized: Any) -> dict[str, Any] | None:
        return {"per_channel": True}

    def layer_finding(self, model, layer, entry, quantized) -> Finding:
        supported = bool(entry[self.detector.PER_CHAN_SUPPORTED_KEY])
        details = {"supported": supported, "used": bool(entry[self.detector.PER_CHAN_USED_KEY])}
        message = f"layer {layer}: weights are quantized per tensor but per-channel is supported"
        return self.finding(model, layer, float(quantized.per_channel), 1.0,
                            passed=not (supported and not quantized.per_channel), message=message, details=details)


class DynamicStaticCheck(DetectorCheck):
    """The layer's output range varies so much per batch that dynamic quantization is recommended."""

    name, order, metric = "dynamic_static", 50, "output_batch_to_epoch_ratio"
    recommends = "dynamic activation quantization"
    default_options = {"tolerance": 0.5}
    settings = (Setting("dynamic_static_min_gain_db", decibels(non_negative=True), 1.0, "dynamic_static items fail "
                        "when dynamic activations were measured to raise the layer's own SQNR by at least this many "
                        "dB", metavar="DB"),)

    def make_detector(self, quantizer: Any) -> Any:
        from qcore.report import DynamicStaticDetector

        return DynamicStaticDetector(**self.merged_options)

    def fix_change(self, quantized: Any) -> dict[str, Any] | None:
        return {"is_dynamic": True}

    def host_keys(self) -> tuple[str, ...]:
        d = self.detector
        return d.DEFAULT_DYNAMIC_REC_KEY, d.PRE_OBS_COMP_STAT_KEY, d.POST_OBS_COMP_STAT_KEY

    def layer_finding(self, model, layer, entry, quantized) -> Finding:
        d = self.detector
        details = {"recommended": bool(entry[d.DEFAULT_DYNAMIC_REC_KEY]),
                   "input_s": float(entry[d.PRE_OBS_COMP_STAT_KEY]), "output_s": float(entry[d.POST_OBS_COMP_STAT_KEY]),
                   "output_class": entry[d.POST_OBS_DATA_DIST_KEY], "tolerance": float(d.tolerance)}
        message = (f"layer {layer}: its output is {details['output_class']} (S={details['output_s']:.3f} <= tolerance "
                   f"{details['tolerance']}) and the quantizer is static")
        return self.finding(model, layer, details["output_s"], details["tolerance"],
                            passed=not (details["recommended"] and not quantized.dynamic), message=message,
                            details=details)


class InputWeightEqualizationCheck(DetectorCheck):
    """torch.ao's input-weight equalization detector recommends equalizing the layer. Its fix is the
    equalization check's, measured the same way (minimum gain: equalization_min_gain_db)."""

    # the fraction of channels for which equalization is recommended: more is worse
    name, order, metric, higher_is_better = "input_weight_equalization", 60, "equalization_channel_fraction", False
    needs = frozenset({"detectors", "equalization"})
    recommends = "input-weight equalization"
    default_options = {"ratio_threshold": 0.5}

    def make_detector(self, quantizer: Any) -> Any:
        from qcore.report import InputWeightEqualizationDetector

        return InputWeightEqualizationDetector(**self.merged_options)

    def fix_change(self, quantized: Any) -> dict[str, Any] | None:
        return {}  # equalization is a model setting: see advise

    def advise(self, model: ModelContext, search: FixSearch, layers: list[str], changes: dict[str, dict[str, Any]]
               ) -> Advice:
        return search.equalization(layers, smooth=False)

    @property
    def min_gain_setting(self) -> str:
        return "equalization_min_gain_db"

    def pass_gains(self, model: ModelContext, search: FixSearch, advice: Advice, layers: Sequence[str]
                   ) -> Mapping[str, tuple[float, float]] | None:
        return search.variant_gains("input_weight", list(layers))  # those only: an MoE model has thousands

    def measured_setting(self, model: ModelContext, search: FixSearch, layers: Sequence[str]) -> str:
        return search.equalize(list(layers), layers).paste()

    def layer_finding(self, model, layer, entry, quantized) -> Finding:
        flags = entry[self.detector.RECOMMENDED_KEY]
        details = {"fraction": sum(flags) / len(flags) if flags else 0.0, "channels": len(flags),
                   "recommended": self.detector.is_layer_recommended(entry),
                   "threshold": float(self.detector.ratio_threshold)}
        equalized = layer in model.analysis.equalized_layers
        message = (f"layer {layer}: {details['fraction']:.0%} of its {details['channels']} channels have balanced "
                   "enough input and weight ranges to equalize (>= 40%), and the model is not equalized")
        passed = not (details["recommended"] and not equalized)
        found = self.finding(model, layer, details["fraction"], 0.4, passed=passed, message=message, details=details)
        refusal = model.analysis.layer(layer).equalization_refusal
        if refusal and not passed:  # the fix cannot work for this layer: say why instead
            return found.replace(verdict="skip", message=(
                f"layer {layer}: input-weight equalization is recommended for {details['fraction']:.0%} of its "
                f"channels, but the layer cannot be equalized: {refusal}."))
        return found


class OutlierCheck(DetectorCheck):
    """Input channels whose maximum is far above their reference percentile, under a non-clipping observer."""

    name, order, metric, higher_is_better = "outlier", 70, "max_percentile_ratio", False
    recommends = "a clipping (histogram) activation observer"
    fix_observes_activations = True
    default_options = {"ratio_threshold": 3.5, "reference_percentile": 0.975, "fraction_batches_used_threshold": 0.95}
    settings = (Setting("outlier_min_gain_db", decibels(non_negative=True), 1.0, "outlier items fail when a "
                        "histogram (clipping) observer was measured to raise the layer's own SQNR by at least this "
                        "many dB", metavar="DB"),)

    def make_detector(self, quantizer: Any) -> Any:
        from qcore.report import OutlierDetector, percentile_estimate_tokens

        options = self.merged_options
        # an expert's batch is what its router sent it, often a few tokens, over which the heuristic's ratio
        # compares two of the top values: such a batch gives none (0 in check_options: every batch, as torch.ao)
        options.setdefault("expert_min_batch_tokens", percentile_estimate_tokens(options["reference_percentile"]))
        return OutlierDetector(**options)

    def fix_change(self, quantized: Any) -> dict[str, Any] | None:
        return {"activation_observer": "histogram"}

    def host_keys(self) -> tuple[str, ...]:
        return self.detector.COMP_METRIC_KEY, self.detector.CONSTANT_COUNTS_KEY

    def layer_finding(self, model, layer, entry, quantized) -> Finding:
        d = self.detector
        ratios, flags = numbers(entry[d.COMP_METRIC_KEY]), numbers(entry[d.OUTLIER_KEY])
        counts = numbers(entry[d.CONSTANT_COUNTS_KEY])
        fewest = d.expert_min_batch_tokens
        if fewest and all(map(math.isnan, ratios)) and layer in expert_layers_of(model.analysis):
            reference = f"{d.reference_percentile:.1%}".replace(".0%", "%")
            why = (f"every calibration batch routed the expert fewer than {fewest} tokens (with a nonzero input), "
                   f"too few to estimate the {reference} percentile the heuristic compares the maximum with; more "
                   "tokens per calibration batch (longer or more sequences) reach that")
            return Finding(model=model.name, check=self.name, layer=layer, metric=self.metric, value=math.nan,
                           threshold=float(d.ratio_threshold), verdict="skip",
                           message=f"layer {layer}: not judged: {why}", details=not_measured_details(why))
        # the channels' positions in C (itertools): an MoE's experts have hundreds of thousands of channels
        outliers = list(itertools.compress(range(len(flags)), flags))
        finite = list(itertools.filterfalse(math.isnan, ratios))
        details = {"outlier_channels": outliers, "max_ratio": max(finite) if finite else math.nan,
                   "threshold": float(d.ratio_threshold), "channels": len(ratios),
                   "constant_channels": list(itertools.compress(range(len(counts)), counts))}
        shown = ", ".join(str(c) for c in outliers[:8])
        more = "" if len(outliers) <= 8 else f" and {len(outliers) - 8} more"
        reference = f"{d.reference_percentile:.1%}".replace(".0%", "%")
        ratio = (f"their {reference} percentile is 0, since most of their values are zero (after a ReLU, say), "
                 "so the maximum is unboundedly far above it" if finite and max(finite) >= 1e30 else
                 f"q100/q_ref up to {details['max_ratio']:.1f} > {details['threshold']}")
        message = (f"layer {layer}: input channels {shown}{more} have outliers ({ratio}) and the activation observer "
                   "does not clip")
        return self.finding(model, layer, max(finite) if finite else math.nan, float(d.ratio_threshold),
                            passed=not (outliers and not quantized.clipping), message=message, details=details)


def read_to_host(report: Mapping[str, dict[str, Any]], layers: list[str], keys: tuple[str, ...]
                 ) -> Mapping[str, dict[str, Any]]:
    """The report with the tensors under `keys` of the `layers`' entries read to the host together
    (qcore.numeric.metrics.read_to_host): a 0-d tensor becomes a Python number, a 1-d one a list; the rest is as it
    was."""
    import torch

    from qcore.numeric.metrics import read_to_host as tensors_to_host

    places = [(layer, key) for layer in layers if report.get(layer) is not None for key in keys
              if isinstance(report[layer].get(key), torch.Tensor) and report[layer][key].dim() <= 1]
    if not places:
        return report
    read = {layer: dict(report[layer]) for layer, _ in places}
    for (layer, key), value in zip(places, tensors_to_host([report[layer][key] for layer, key in places])):
        read[layer][key] = value
    return {**report, **read}


def numbers(value: Any) -> list[Any]:
    """A 1-d tensor's values, or a list's (read_to_host's)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)
