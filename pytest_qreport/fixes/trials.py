"""Trials: a check prints a fix only after measuring it on the model.

A fix is one qmodel() keyword with its whole value, merged with the model's own (`Fix.paste()` is the text to
paste). `try_fix` measures the model with it, exactly as the pasted settings would, in one more calibration and
comparison pass (kept per configuration by the qcore analysis), of the layers the fix concerns and the outputs:
a trial's other layers are nan, and so are the kinds of SQNR it was not asked for (a check reads one). The
comparison pass compares the quantized outputs with the float outputs the model's own pass kept, and runs the
float graph only as far as the layer values it measures. `verify` tries a fix on the layers a heuristic names (or
takes their own SQNR with it from the model's comparison pass: qcore.measure.screens), keeps the layers where it
helps by at least the check's minimum gain, measures that smaller fix again, and recommends it only when the
model's output SQNR does not fall.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.experts import compact_expert_layers, expert_layers_of

__all__ = ["DEFAULT_MAX_FLOAT_LAYERS", "KINDS", "NOT_TRIED", "VERDICT_TRIALS", "Advice", "Fix", "SearchScope",
           "Searcher", "Trial", "equalize_fix", "expert_globs", "float_layers_fix", "float_search_limit",
           "layer_overrides_fix", "max_float_layers", "nothing_left_quantized", "quantized_layer_names",
           "others_untried", "search_further", "try_fix", "verify"]


@dataclass(frozen=True)
class SearchScope:
    """What a fix search reads of one model: its name, settings, qcore analysis, and its checks (for their
    check_options), taken from the plugin's ModelContext once, where a check asks for its fix search."""

    name: str
    settings: Any
    analysis: Any
    checks: Mapping[str, Any]

    def options(self, check: str) -> Mapping[str, Any]:
        """The model's check_options for `check` ({} where the check does not run)."""
        return self.checks[check].options if check in self.checks else {}


@dataclass(frozen=True)
class Fix:
    """One qmodel() keyword and its whole value (the model's own value merged with the change)."""

    setting: str
    value: Any
    layers: tuple[str, ...]  # the layers the change concerns

    def paste(self) -> str:
        """The text to paste into qmodel(...)."""
        return f"{self.setting}={self.value!r}"


KINDS = ("own", "propagated", "weight")  # a layer's SQNRs a trial can measure


@dataclass(frozen=True)
class Trial:
    """The model measured with a fix, against the model as it is: per layer (own SQNR with float inputs,
    propagated SQNR, weight SQNR; a kind the trial was not asked for is nan after the fix) and at its output (the
    worst output leaf)."""

    fix: Fix
    output: tuple[float, float]
    own: Mapping[str, tuple[float, float]]
    propagated: Mapping[str, tuple[float, float]]
    weight: Mapping[str, tuple[float, float]]
    screened: bool = False  # own SQNR only, from the model's comparison pass (qcore.measure.screens): no output
    stopped: bool = False  # not run: the model's fix budget was spent (every "after" is nan)

    @property
    def output_gain(self) -> float:
        """How much the fix raises the model's output SQNR (nan when the model has no floating output)."""
        return self.output[1] - self.output[0]

    @property
    def output_kept(self) -> bool:
        """Whether the fix does not lower the output SQNR (raises it; or there is no floating output to judge)."""
        return math.isnan(self.output[0]) or self.output[1] > self.output[0]

    def gain(self, layer: str, kind: str = "own") -> float:
        """How much the fix raises one layer's `kind` SQNR ("own", "propagated" or "weight"); nan if unmeasured."""
        before, after = getattr(self, kind).get(layer, (math.nan, math.nan))
        if before == after:  # inf to inf is no gain
            return 0.0
        return after - before

    def output_claim(self) -> str:
        """'the model output 41.2 -> 43.0 dB'."""
        return f"the model output {self.output[0]:.2f} -> {self.output[1]:.2f} dB"

    def layer_claim(self, layer: str, kind: str = "own", whose: str = "its") -> str:
        """'its own SQNR (float input) 30.10 -> 35.20 dB'."""
        before, after = getattr(self, kind).get(layer, (math.nan, math.nan))
        what = {"own": "own SQNR (float input)", "propagated": "SQNR", "weight": "weight SQNR"}[kind]
        return f"{whose} {what} {before:.2f} -> {after:.2f} dB"


def layer_overrides_fix(scope: SearchScope, change: Mapping[str, Mapping[str, Any]]) -> Fix:
    """layer_overrides with `change` merged into the model's own, glob by glob; the experts of an MoE block that
    take the same change are written as one glob (expert_globs)."""
    own = dict(scope.settings.layer_overrides or {})
    alike: dict[str, tuple[dict[str, Any], list[str]]] = {}  # the layers that take one same change
    for layer, values in change.items():
        alike.setdefault(repr(sorted(dict(values).items())), (dict(values), []))[1].append(layer)
    written = {glob: values for values, layers in alike.values() for glob in expert_globs(scope, layers)}
    merged = {**own, **{glob: {**own.get(glob, {}), **values} for glob, values in written.items()}}
    return Fix("layer_overrides", merged, tuple(change))


def float_layers_fix(scope: SearchScope, layers: Iterable[str]) -> Fix:
    """float_layers with `layers` added to the model's own."""
    layers = list(layers)
    own = list(scope.settings.float_layers or [])
    added = expert_globs(scope, [layer for layer in layers if layer not in own])
    return Fix("float_layers", own + [layer for layer in added if layer not in own], tuple(layers))


def expert_globs(scope: SearchScope, layers: Iterable[str]) -> list[str]:
    """`layers` with an MoE block's experts written as a glob where they are every expert of a projection or of the
    block, not one name per expert (a 128-expert block would print 128)."""
    experts = expert_layers_of(scope.analysis)
    return compact_expert_layers(layers, experts) if experts else list(layers)


def equalize_fix(value: Any, layers: Iterable[str], scope: SearchScope | None = None) -> Fix:
    """equalize=value (True, a list of layers, or a smoothing recipe); given the model's `scope`, a list writes its
    experts by glob (expert_globs)."""
    if scope is not None and isinstance(value, (list, tuple)):
        value = expert_globs(scope, value)
    return Fix("equalize", value, tuple(layers))


def quantized_layer_names(scope: SearchScope) -> list[str]:
    """The layers the model quantizes as declared, in graph order: not those its own float_layers keep in float,
    nor layers whose format refused their shapes."""
    analysis = scope.analysis
    kept = set(getattr(analysis, "float_layers", ()) or ())
    return [entry.layer for entry in analysis.layers
            if not getattr(entry, "format_refusal", "") and entry.layer not in kept]


DEFAULT_MAX_FLOAT_LAYERS = 8


def max_float_layers(scope: SearchScope, check: str) -> int:
    """The most layers a float_layers search of `check` may keep in float: check_options={check: {'max_float_layers':
    N}}, default DEFAULT_MAX_FLOAT_LAYERS."""
    options = scope.options(check)
    return int(options.get("max_float_layers", DEFAULT_MAX_FLOAT_LAYERS))


def nothing_left_quantized(quantized: int) -> str:
    """Why a float_layers search that reached every quantized layer but one stops there."""
    return (f"keeping all {quantized} quantized layers in float would quantize nothing, so the threshold is above "
            "what this quantizer gives")


def float_search_limit(scope: SearchScope, chosen: int, check: str) -> str:
    """Why a float_layers search of `check` stopped at `chosen` layers short of its target: every layer but one is
    in float (the threshold is above what the quantizer gives), its max_float_layers budget, or no other layer was
    measured to help."""
    quantized, most = len(quantized_layer_names(scope)), max_float_layers(scope, check)
    if chosen >= quantized - 1:
        return nothing_left_quantized(quantized)
    if chosen >= most:
        return (f"max_float_layers is {most}: search further with "
                f"qmodel(check_options={{{check!r}: {{'max_float_layers': {min(2 * most, quantized - 1)}}}}})")
    return "no other layer was measured to help when kept in float"


class Searcher(Protocol):
    """What runs a trial: the model's scope, and the analysis a fix gives it, measured as the pasted setting would
    be (FixSearch: the simulation's and the artifact's each build their own)."""

    scope: SearchScope

    def variant(self, fix: Fix, reads: Collection[str]) -> Any:
        """The model's analysis with `fix` applied, measuring the layers it concerns and of their SQNRs `reads`."""


def try_fix(searcher: Searcher, fix: Fix, reads: Collection[str] = KINDS, *, budgeted: bool = True,
            verdict: bool = False) -> Trial:
    """The model measured with `fix`, against the model as it is: its output, and of the layers the fix concerns
    the SQNRs in `reads` (of KINDS; the others are nan). A budgeted trial is not run once the model's fix budget
    is spent, nor when the budget left does not hold a whole-model trial (StageTimes.whole_trial_runs; its
    `stopped` is then True); budgeted=False runs it all the same (the confirmation of a fix about to be printed).
    verdict=True: a trial a check's verdict waits for, timed as its own stage ("verdict trials") and
    neither limited by the fix budget nor counted in it."""
    from qcore.analysis import stage, trial_step, trials_allowed

    before = searcher.scope.analysis.sqnr
    variant = searcher.variant(fix, reads)  # kept per configuration: a trial measured before costs nothing
    stopped = budgeted and not verdict and "sqnr" not in vars(variant) and not trials_allowed(whole=True)
    if not stopped:
        with stage(VERDICT_TRIALS if verdict else "trials"), trial_step():
            after = variant.sqnr
    worst_before = before.worst_output()
    worst_after = None if stopped else after.worst_output()
    output = (worst_before.sqnr_db if worst_before else math.nan, worst_after.sqnr_db if worst_after else math.nan)

    def pairs(value: Callable[[Any], float | None]) -> dict[str, tuple[float, float]]:
        found = {}
        for layer, entry in before.layers.items():
            other = None if stopped else after.layers.get(layer)
            a, b = value(entry), value(other) if other is not None else None
            found[layer] = (math.nan if a is None else a, math.nan if b is None else b)
        return found

    return Trial(fix, output, pairs(lambda e: e.shadow_sqnr_db), pairs(lambda e: e.sqnr_db),
                 pairs(lambda e: e.weight_sqnr_db), stopped=stopped)


VERDICT_TRIALS = "verdict trials"  # the stage of the trials a verdict waits for (outside the fix budget)
NOT_TRIED = "not measured: the model's fix budget was spent before this fix was tried"


def search_further(scope: SearchScope) -> str:
    """What a check whose fix search the budget stopped says: the setting that searches further, and the one that
    gives verdicts only."""
    budget = scope.settings.fix_budget
    if budget == 0:
        return (" No fix was searched: fix_budget is 0 (verdicts only); measure fixes with qmodel(fix_budget=1), or "
                "run every search to its end with qmodel(fix_budget='unlimited').")
    larger = _larger_budget(budget)
    return (f" The fix search stopped at the model's fix budget (fix_budget={budget:g}: its searches may run "
            f"{budget:g} times as many graph runs as its verdict pass): search further with "
            f"qmodel(fix_budget={larger:g}), or to the end with qmodel(fix_budget='unlimited'); fix_budget=0 gives the "
            "verdicts only.")


def _larger_budget(budget: float) -> float:
    """A fix budget that lets the searches go further than this one did: twice what they spent (a step may overrun
    the budget once), at least twice the budget and at least 1; whole above 1."""
    from qcore.analysis import fix_budget_use

    use = fix_budget_use()
    spent = use.trial_runs / use.verdict_runs if use is not None and use.verdict_runs else budget
    larger = max(1.0, 2 * budget, 2 * spent)
    return float(math.ceil(larger)) if 1 < larger < math.inf else larger


def others_untried(scope: SearchScope, advice: Advice) -> str:
    """What an item whose printed fix was measured says before it when the fix budget left other fixes of its search
    untried (one of which might have raised the output more); '' when every one was measured."""
    if not advice.stopped:
        return ""
    return " Other fixes of this search were not measured: the model's fix budget was spent." + search_further(scope)


@dataclass(frozen=True)
class Advice:
    """A verified fix: `recommended` are the layers where the measured fix helps by at least `min_gain` (and the
    output SQNR does not fall); `trial` measured the fix that is printed, `first` the heuristic's whole list."""

    first: Trial
    trial: Trial | None
    recommended: tuple[str, ...]
    min_gain: float
    kind: str
    notes: Mapping[str, str] = field(default_factory=dict)

    stopped: bool = False  # the fix budget was spent before the fix was tried on the whole model

    def helps(self, layer: str) -> bool:
        """Whether the printed fix was measured to help this layer (and not to hurt the output)."""
        return layer in self.recommended

    def claim(self, layer: str) -> str:
        """What the printed fix was measured to do: 'measured with the fix: its own SQNR ..., the model output ...'."""
        assert self.trial is not None
        return (f"measured with the fix: {self.trial.layer_claim(layer, self.kind)} "
                f"({self.trial.gain(layer, self.kind):+.2f} dB), {self.trial.output_claim()}")

    def fix_text(self) -> str:
        """'qmodel(..., layer_overrides={...})'."""
        assert self.trial is not None
        return f"qmodel(..., {self.trial.fix.paste()})"

    def note(self, layer: str, heuristic: str) -> str:
        """Why a layer the heuristic names gets no fix: '<heuristic>; measured -1.5 dB ...: not recommended'."""
        return f"{heuristic}; {self.notes.get(layer, 'not measured')}: not recommended"


def verify(searcher: Searcher, candidates: Iterable[str], make_fix: Callable[[list[str]], Fix], min_gain: float,
           kind: str = "own", screened: Mapping[str, tuple[float, float]] | None = None,
           verdict: bool = False) -> Advice:
    """Try the fix on every candidate layer, keep those it raises by at least `min_gain` dB (`kind` SQNR), try
    that smaller fix, and recommend it for the layers it still raises by `min_gain` when the output SQNR does
    not fall. `screened`: {layer: (own SQNR, own SQNR with the fix on every candidate)} measured already (a
    screen's): the first trial is then not run, and the fix is always tried for the output. The search tries
    nothing once the model's fix budget is spent (the advice is then `stopped`, with no fix); the trial of the fix
    it prints always runs, so that every printed fix is measured on every batch. verdict=True: the check's verdict
    waits for the advice, whose trials are then outside the budget (try_fix)."""
    candidates = list(candidates)
    if screened is not None and kind == "own":
        first = Trial(make_fix(candidates), (math.nan, math.nan), dict(screened), {}, {}, screened=True)
    else:
        first = try_fix(searcher, make_fix(candidates), (kind,), verdict=verdict)
    if first.stopped:
        return Advice(first, None, (), min_gain, kind, {layer: NOT_TRIED for layer in candidates}, stopped=True)
    notes: dict[str, str] = {}
    whose = "this layer's"

    def measured(trial: Trial, layer: str) -> str:
        return f"measured {trial.gain(layer, kind):+.2f} dB on {trial.layer_claim(layer, kind, whose)}"

    helpful = [layer for layer in candidates if first.gain(layer, kind) >= min_gain]
    for layer in candidates:
        if layer not in helpful:
            notes[layer] = measured(first, layer) + f" (the minimum gain is {min_gain:g} dB)"
    if not helpful:
        return Advice(first, None, (), min_gain, kind, notes)
    # after a screen, the trial of the fix on the whole model is the search's first (within the budget); after a
    # trial, the confirmation of the fix it prints (always run)
    trial = first if helpful == candidates and not first.screened else \
        try_fix(searcher, make_fix(helpful), (kind,), budgeted=first.screened, verdict=verdict)
    if trial.stopped:
        notes.update({layer: NOT_TRIED for layer in helpful})
        return Advice(first, None, (), min_gain, kind, notes, stopped=True)
    if not trial.output_kept:
        for layer in helpful:
            notes[layer] = (f"{measured(trial, layer)}, but with {trial.fix.paste()} the model output falls "
                            f"{trial.output[0]:.2f} -> {trial.output[1]:.2f} dB")
        return Advice(first, trial, (), min_gain, kind, notes)
    recommended = tuple(layer for layer in helpful if trial.gain(layer, kind) >= min_gain)
    for layer in helpful:
        if layer not in recommended:  # together with the others, the fix no longer helps it enough
            notes[layer] = measured(trial, layer) + f" with {trial.fix.paste()} (the minimum gain is {min_gain:g} dB)"
    return Advice(first, trial, recommended, min_gain, kind, notes)
