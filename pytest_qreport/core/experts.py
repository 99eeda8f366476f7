"""Items of mixture-of-experts models: one item per expert projection of a block, judged on its worst expert.

qcore measures every expert as the Linear it stands for (`model.layers.3.mlp.experts.5.down_proj`); a 128-expert
model would make tens of thousands of items that way. Here a check's expert layers become one item named by the
projection's parameter (`model.layers.3.mlp.experts.down_proj`): the worst expert's finding, its message naming the
worst experts with their values, and every expert's value in the details (JSON and HTML reports).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .findings import Finding

__all__ = ["NOT_MEASURED_KEY", "UNREACHED_KEY", "compact_expert_layers", "expert_item_names", "expert_items",
           "expert_label", "expert_layers_of", "item_members", "merge_expert_findings", "not_measured_details",
           "unreached_details"]

_VERDICT_RANK = {"skip": 0, "pass": 1, "waived": 2, "warn": 3, "fail": 4, "error": 5}
_NAMED_EXPERTS = 4  # the worst experts a message names
# the details keys of a finding without a value: that no calibration token reached its expert (the reference's
# router, in artifact mode), or why else it has none, in words
UNREACHED_KEY, NOT_MEASURED_KEY = "unreached", "not_measured"


def unreached_details() -> dict[str, Any]:
    """The details of an expert's finding without a value because no calibration token reached the expert."""
    return {UNREACHED_KEY: True}


def not_measured_details(reason: str) -> dict[str, Any]:
    """The details of a finding without a value for another reason, `reason` in words (merge_expert_findings names
    its experts with it)."""
    return {NOT_MEASURED_KEY: reason}


def _unmeasured_reason(finding: Finding) -> str:
    """Why a finding has no value, from its details; a finding of a check that gives no reason there (a user's own)
    is read from its message, after the layer it names."""
    reason = finding.details.get(NOT_MEASURED_KEY)
    if reason is not None:
        return str(reason)
    return finding.message.split(": ", 1)[-1].removeprefix("not measured: ").rstrip(".") if finding.message else ""


def expert_layers_of(analysis: Any) -> Mapping[str, Any]:
    """{layer: qcore ExpertLayer} of a model's analysis (empty for a model without experts)."""
    return getattr(analysis, "expert_layers", None) or {}


def expert_item_names(experts: Mapping[str, Any]) -> dict[str, str]:
    """{expert layer: the name of its item, its projection's path}: what a layer glob may name it by."""
    return {layer: entry.projection for layer, entry in experts.items()}


def expert_items(layers: Iterable[str], experts: Mapping[str, Any]) -> list[str]:
    """Item names for a check's layers: each expert projection's layers become one item, at its first layer's place."""
    items: list[str] = []
    seen: set[str] = set()
    for layer in layers:
        name = experts[layer].projection if layer in experts else layer
        if name not in seen:
            seen.add(name)
            items.append(name)
    return items


def item_members(items: Sequence[str], layers: Iterable[str], experts: Mapping[str, Any]) -> dict[str, list[str]]:
    """{item: its expert layers, by expert} for the items among `items` that stand for an expert projection; `layers`
    are the check's layers once the model's layer globs applied."""
    wanted = set(items)
    members: dict[str, list[str]] = {}
    for layer in layers:
        entry = experts.get(layer)
        if entry is not None and entry.projection in wanted:
            members.setdefault(entry.projection, []).append(layer)
    for names in members.values():
        names.sort(key=lambda layer: experts[layer].expert)
    return members


def _badness(finding: Finding, higher_is_better: bool) -> tuple[int, float]:
    value = finding.value
    if math.isnan(value):
        return _VERDICT_RANK.get(finding.verdict, 0), -math.inf
    return _VERDICT_RANK.get(finding.verdict, 0), -value if higher_is_better else value


def _shown(finding: Finding, metric: str) -> str:
    if finding.verdict == "error":
        return "error"
    if math.isnan(finding.value):
        return "not measured"
    return f"{finding.value:.2f} dB" if metric.endswith("_db") else f"{finding.value:.4g}"


def expert_label(layer: str, experts: Mapping[str, Any]) -> str:
    """How a message names one expert's layer: its index, with the half of a fused gate_up projection ("3.up_proj")."""
    entry = experts[layer]
    leaf = layer.rsplit(".", 1)[-1]
    return str(entry.expert) if entry.projection.rsplit(".", 1)[-1] == leaf else f"{entry.expert}.{leaf}"


def merge_expert_findings(item: str, members: Sequence[str], found: Mapping[str, Finding], experts: Mapping[str, Any],
                          higher_is_better: bool, artifact: bool = False) -> Finding:
    """One finding for an expert projection: the worst expert's, named `item`, its message naming the worst
    experts, every expert's value in details["experts"]. `artifact`: the model is a checkpoint, whose
    expert_coverage item judges its weights, not the calibration tokens."""
    ordered = sorted(members, key=lambda layer: _badness(found[layer], higher_is_better), reverse=True)
    worst = found[ordered[0]]
    failing = [layer for layer in members if found[layer].verdict in ("fail", "warn", "error")]
    count = len({experts[layer].expert for layer in members})
    failing_experts = sorted({experts[layer].expert for layer in failing})
    in_error = {experts[layer].expert for layer in members if found[layer].verdict == "error"}
    named = ", ".join(f"{expert_label(layer, experts)} ({_shown(found[layer], worst.metric)})"
                      for layer in ordered[:_NAMED_EXPERTS])
    # an error item says itself why it has no value; of the others without one, those that say no calibration
    # token reached them are named as such, the rest with their own reason
    valueless = [layer for layer in members if math.isnan(found[layer].value) and found[layer].verdict != "error"]
    unmeasured = sorted({experts[layer].expert for layer in valueless if found[layer].details.get(UNREACHED_KEY)})
    reasons: dict[str, set[int]] = {}  # {the finding's own reason: its experts}, for the others
    for layer in valueless:
        if experts[layer].expert not in unmeasured:
            reasons.setdefault(_unmeasured_reason(found[layer]), set()).add(experts[layer].expert)
    failed = set(failing_experts) - in_error
    tally = [f"{len(failed)} failing"] if failed or not in_error else []
    tally += [f"{len(in_error)} in error"] if in_error else []
    if len(valueless) == len(members):  # no expert to judge it on: the reasons say why
        summary = f"{item}: {count} experts, none measured."
    else:
        summary = (f"{item}: {count} experts, {', '.join(tally)}; judged on expert "
                   f"{expert_label(ordered[0], experts)}; worst: {named}.")
    if unmeasured:
        summary += (f" Not measured: expert(s) {', '.join(map(str, unmeasured))}, which no calibration token reached "
                    + ("(more or longer calibration batches reach them)." if artifact
                       else "(see the block's expert_coverage item)."))
    for reason, which in reasons.items():
        summary += f" Not measured: expert(s) {', '.join(map(str, sorted(which)))}" + (f" ({reason})." if reason
                                                                                       else ".")
    # a valueless expert's own message is its reason, given above
    message = f"{summary} {worst.message}" if worst.message and ordered[0] not in valueless else summary
    details = {key: value for key, value in worst.details.items() if key not in (UNREACHED_KEY, NOT_MEASURED_KEY)}
    details.update({
        "experts": {expert_label(layer, experts): found[layer].value for layer in members},
        "failing_experts": failing_experts,
        "unmeasured_experts": unmeasured,
        "error_experts": sorted(in_error),
        "worst_expert": experts[ordered[0]].expert,
        "worst_layer": ordered[0],
    })
    return worst.replace(layer=item, message=message, details=details)


def compact_expert_layers(layers: Iterable[str], experts: Mapping[str, Any]) -> list[str]:
    """`layers` with each block's expert layers written as globs where they cover every expert (qcore's
    compact_expert_layers): all of one projection as `block.*.down_proj`, all of a block's as `block`."""
    from qcore.analysis import compact_expert_layers as compacted

    return compacted(layers, experts)
