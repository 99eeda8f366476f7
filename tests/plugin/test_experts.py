"""The plugin's handling of mixture-of-experts items, on findings alone: grouping, the worst expert, the globs of a
fix, and the block x expert heat map of the HTML report."""
import math
import re
from dataclasses import dataclass

from pytest_qreport.core.experts import (
    compact_expert_layers,
    expert_items,
    item_members,
    merge_expert_findings,
    not_measured_details,
    unreached_details,
)
from pytest_qreport.core.findings import Finding
from pytest_qreport.reports.html import _expert_charts


@dataclass(frozen=True)
class Expert:  # what qcore's ExpertLayer holds
    block: str
    projection: str
    expert: int


BLOCK = "model.layers.0.mlp.experts"
EXPERTS = {f"{BLOCK}.{e}.{p}": Expert(BLOCK, f"{BLOCK}.{'down_proj' if p == 'down_proj' else 'gate_up_proj'}", e)
           for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}


def _finding(layer, value, threshold=20.0):
    """The sqnr finding of an expert's layer; nan: one no calibration token reached, as the sqnr check says it."""
    from pytest_qreport.checks.sqnr import UNREACHED

    verdict = "pass" if value >= threshold else "fail"
    message = f"layer {layer}: {UNREACHED}" if math.isnan(value) else f"layer {layer}: SQNR {value:.1f} dB."
    return Finding(model="m", check="sqnr", layer=layer, metric="sqnr_db", value=value, threshold=threshold,
                   verdict=verdict, message="" if verdict == "pass" else message,
                   details=unreached_details() if math.isnan(value) else {})


def test_expert_layers_become_one_item_per_projection_at_the_first_ones_place():
    layers = ["q_proj", *(f"{BLOCK}.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")),
              "lm_head"]
    items = expert_items(layers, EXPERTS)
    assert items == ["q_proj", f"{BLOCK}.gate_up_proj", f"{BLOCK}.down_proj", "lm_head"]
    members = item_members(items, reversed(layers), EXPERTS)
    assert members[f"{BLOCK}.down_proj"] == [f"{BLOCK}.{e}.down_proj" for e in range(4)]
    assert len(members[f"{BLOCK}.gate_up_proj"]) == 8


def test_a_projection_is_judged_on_its_worst_expert_and_names_the_worst_ones():
    values = {0: 25.0, 1: 12.5, 2: math.nan, 3: 18.0}
    found = {f"{BLOCK}.{e}.down_proj": _finding(f"{BLOCK}.{e}.down_proj", v) for e, v in values.items()}
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert merged.layer == f"{BLOCK}.down_proj" and merged.value == 12.5 and merged.verdict == "fail"
    assert merged.message.startswith(f"{BLOCK}.down_proj: 4 experts, 3 failing; judged on expert 1; worst: "
                                     "1 (12.50 dB), 3 (18.00 dB), 2 (not measured), 0 (25.00 dB).")
    assert "Not measured: expert(s) 2" in merged.message and f"layer {BLOCK}.1.down_proj" in merged.message
    assert merged.details["failing_experts"] == [1, 2, 3] and merged.details["worst_expert"] == 1
    assert merged.details["experts"]["0"] == 25.0 and merged.details["unmeasured_experts"] == [2]
    # a passing projection passes with every expert's value
    passing = {layer: _finding(layer, 30.0 + i) for i, layer in enumerate(found)}
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(passing), passing, EXPERTS, higher_is_better=True)
    assert merged.verdict == "pass" and merged.value == 30.0 and len(merged.details["experts"]) == 4


def test_a_fix_writes_a_projection_or_a_block_of_experts_as_a_glob():
    downs = [f"{BLOCK}.{e}.down_proj" for e in range(4)]
    assert compact_expert_layers(["q_proj", *downs, f"{BLOCK}.1.up_proj"], EXPERTS) == [
        "q_proj", f"{BLOCK}.*.down_proj", f"{BLOCK}.1.up_proj"]
    assert compact_expert_layers(list(EXPERTS), EXPERTS) == [BLOCK]
    assert compact_expert_layers(downs[:2], EXPERTS) == downs[:2]


def test_the_html_report_draws_a_block_by_expert_heat_map():
    rows = []
    for block in range(2):
        experts = {str(e): 20.0 + e + block for e in range(3)} | {"3": math.nan}
        why = {"unmeasured_experts": [3]} if block == 0 else {"error_experts": [3]}
        rows.append({"check": "sqnr", "layer": f"model.layers.{block}.mlp.experts.down_proj", "details":
                     {"experts": experts, **why}})
    charts = _expert_charts(rows)
    assert len(charts) == 1 and "sqnr of each expert&#x27;s down_proj (dB)" in charts[0]
    cells = re.findall(r'<rect [^>]*fill="(#[0-9a-f]{6})"><title>([^<]*)</title>', charts[0])
    assert len(cells) == 8
    assert ("#cccccc", "model.layers.0.mlp.experts, expert 3: no calibration token reached it") in cells
    assert ("#cccccc", "model.layers.1.mlp.experts, expert 3: error (see the item)") in cells
    assert any(title == "model.layers.1.mlp.experts, expert 2: 23.00 dB" for _, title in cells)


def _damaged_moe():
    """A tiny Qwen3-MoE whose expert 2 holds one outlier input column in its down_proj: its 4-bit groups lose the
    rest of their values, the other experts' do not."""
    import torch

    from tests.models import tiny_moe

    model = tiny_moe("qwen3_moe")[0]
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[2, :, 0] = 3.0
    return model


def test_the_float_layers_fix_of_a_damaged_expert_names_it_and_passes_when_pasted():
    import ast

    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks, changed_layers
    from tests.models import tiny_moe

    data = tiny_moe("qwen3_moe")[1]
    settings = {"quantizer": "W4A16", "checks": ["sqnr", "weight_sqnr", "model_sqnr"], "sqnr_min_db": 15.0,
                "weight_sqnr_min_db": 15.0, "model_sqnr_min_db": 8.0, "fix_budget": float("inf")}
    found, before = analyze_with_checks(_damaged_moe, data, **settings)
    failing = sorted(key for key, finding in found.items() if finding.verdict == "fail")
    item = found[("sqnr", f"{BLOCK}.down_proj")]
    assert item.verdict == "fail" and "judged on expert 2; worst: 2 (" in item.message, failing
    assert found[("weight_sqnr", f"{BLOCK}.down_proj")].details["failing_experts"] == [2]
    pasted = ast.literal_eval(item.message.split("float_layers=", 1)[1].split(")", 1)[0])
    assert f"{BLOCK}.2.down_proj" in pasted  # the expert by name: its siblings stay quantized
    # a layer after it that inherits its error points at the item that judges it
    pointer = f"is {BLOCK}.2.down_proj: fix that one (see the item {BLOCK}.down_proj)"
    assert pointer in found[("sqnr", "lm_head")].message
    fixed, after = analyze_with_checks(_damaged_moe, data, **settings, float_layers=pasted)
    assert changed_layers(before, after) == set(pasted)  # that expert and no other layer
    for check in ("sqnr", "weight_sqnr"):
        down = fixed[(check, f"{BLOCK}.down_proj")]
        assert sorted(down.details["experts"]) == ["0", "1", "3"] and down.verdict == "pass"
    assert fixed[("model_sqnr", "output")].value > found[("model_sqnr", "output")].value


def test_experts_held_as_modules_get_one_item_per_projection_with_the_fused_forms_values():
    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks
    from tests.models import linearized_moe, tiny_moe

    model, data = tiny_moe("qwen3_moe")
    settings = {"quantizer": "W4A16", "checks": ["sqnr", "weight_sqnr", "expert_coverage", "routing_agreement"],
                "sqnr_min_db": 15.0, "weight_sqnr_min_db": 15.0}
    fused, _ = analyze_with_checks(lambda: model, data, **settings)
    linear, _ = analyze_with_checks(lambda: linearized_moe(model), data, **settings)
    items = {key: finding for key, finding in linear.items() if BLOCK in key[1]}
    assert sorted(items) == sorted([(check, f"{BLOCK}.{p}") for check in ("sqnr", "weight_sqnr")
                                    for p in ("gate_proj", "up_proj", "down_proj")] +
                                   [("expert_coverage", BLOCK), ("routing_agreement", BLOCK)])
    for (check, layer), finding in items.items():
        fused_layer = {f"{BLOCK}.gate_proj": f"{BLOCK}.gate_up_proj", f"{BLOCK}.up_proj": f"{BLOCK}.gate_up_proj"}
        twin = fused[(check, fused_layer.get(layer, layer))]
        if layer.endswith(("down_proj", "experts")):  # the same members: the same worst expert and value
            assert finding.value == pytest.approx(twin.value, abs=1e-6) and finding.verdict == twin.verdict, layer
            assert finding.details.get("experts") == pytest.approx(twin.details.get("experts"), abs=1e-6) \
                if check in ("sqnr", "weight_sqnr") else finding.details == twin.details
        else:  # gate_proj and up_proj apart: the fused item is the worse of the two
            assert finding.value >= twin.value - 1e-6
    worst_of_two = min(items[("sqnr", f"{BLOCK}.gate_proj")].value, items[("sqnr", f"{BLOCK}.up_proj")].value)
    assert worst_of_two == pytest.approx(fused[("sqnr", f"{BLOCK}.gate_up_proj")].value, abs=1e-6)


def test_a_checkpoint_holding_its_experts_as_modules_gets_one_item_per_projection_and_names_its_zero_expert():
    import copy

    import pytest

    pytest.importorskip("transformers")
    import torch
    from torchao.quantization import Int8WeightOnlyConfig

    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import builtin_registry, torchao_artifact
    from tests.models import linearized_moe, tiny_moe

    model, data = tiny_moe("qwen3_moe")
    reference = linearized_moe(model)
    damaged = copy.deepcopy(reference)
    with torch.no_grad():  # as GPTQ writes an expert that no calibration token reached
        damaged.model.layers[0].mlp.experts[3].down_proj.weight.zero_()
    quantized = torchao_artifact(damaged, Int8WeightOnlyConfig())
    settings = ModelSettings.defaults(BUILTIN_CHECKS, calibration=data, quantized=lambda: quantized,
                                      checks=["sqnr", "weight_sqnr", "expert_coverage"])
    pipeline = collect_model("m", settings, builtin_registry(), None, reference, data[0], quantized=quantized)
    pipeline.analyze(lambda: data, lambda found: None)
    found = pipeline.findings  # {(check, item): Finding}
    items = sorted(key for key in found if BLOCK in key[1])
    assert items == sorted([(check, f"{BLOCK}.{p}") for check in ("sqnr", "weight_sqnr")
                            for p in ("gate_proj", "up_proj", "down_proj")] + [("expert_coverage", BLOCK)])
    down = found[("sqnr", f"{BLOCK}.down_proj")]
    assert down.verdict == "fail" and down.details["worst_expert"] == 3 and "judged on expert 3" in down.message
    assert found[("weight_sqnr", f"{BLOCK}.down_proj")].details["failing_experts"] == [3]
    coverage = found[("expert_coverage", BLOCK)]
    assert coverage.verdict == "fail" and "as zeros: expert(s) 3" in coverage.message, coverage.message


def test_a_projection_whose_experts_are_in_error_says_so_and_claims_no_unreached_expert():
    refused = Finding(model="m", check="sqnr", layer="", metric="sqnr_db", value=math.nan, threshold=math.nan,
                      verdict="error", message="layer refused: it cannot be quantized as W4A16.")
    found = {f"{BLOCK}.{e}.down_proj": refused.replace(layer=f"{BLOCK}.{e}.down_proj") for e in range(4)}
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert merged.verdict == "error" and merged.message.startswith(
        f"{BLOCK}.down_proj: 4 experts, 4 in error; judged on expert 0; worst: 0 (error), 1 (error)")
    assert "no calibration token" not in merged.message and merged.details["unmeasured_experts"] == []
    assert merged.details["error_experts"] == [0, 1, 2, 3]  # the heat map's cells say so
    found[f"{BLOCK}.1.down_proj"] = _finding(f"{BLOCK}.1.down_proj", 12.0)
    found[f"{BLOCK}.2.down_proj"] = _finding(f"{BLOCK}.2.down_proj", math.nan)  # an expert no token reached
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert f"{BLOCK}.down_proj: 4 experts, 2 failing, 2 in error;" in merged.message
    assert "Not measured: expert(s) 2, which no calibration token reached" in merged.message


def test_the_refusal_of_every_expert_of_a_projection_writes_its_fix_as_one_glob():
    from types import SimpleNamespace

    from pytest_qreport.core.pipeline import refusal_globs

    def refusal(layer, width):
        return SimpleNamespace(layer=layer, format="W4A16", format_refusal=f"W4A16: its weight [128, {width}]")

    refused = {f"{BLOCK}.{e}.down_proj": refusal(f"{BLOCK}.{e}.down_proj", 64) for e in range(4)}
    refused["lm_head"] = refusal("lm_head", 64)
    refused[f"{BLOCK}.1.up_proj"] = refusal(f"{BLOCK}.1.up_proj", 96)
    written = refusal_globs(refused, EXPERTS)
    assert {written[f"{BLOCK}.{e}.down_proj"] for e in range(4)} == {f"{BLOCK}.*.down_proj"}
    assert written["lm_head"] == "lm_head" and written[f"{BLOCK}.1.up_proj"] == f"{BLOCK}.1.up_proj"


def test_an_expert_projection_its_format_refuses_is_an_error_whose_glob_fix_runs_when_pasted():
    import ast

    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks
    from tests.models import tiny_moe

    def narrow_experts():  # a down_proj of 64 input features: not a multiple of W4A16's group of 128
        return tiny_moe("qwen3_moe", width=64)[0]

    data = tiny_moe("qwen3_moe", width=64)[1]
    settings = {"quantizer": "W4A16", "checks": ["sqnr", "weight_sqnr"]}
    found, _ = analyze_with_checks(narrow_experts, data, **settings)
    item = found[("sqnr", f"{BLOCK}.down_proj")]
    assert item.verdict == "error" and item.message.startswith(f"{BLOCK}.down_proj: 4 experts, 4 in error;")
    assert "no calibration token" not in item.message and "cannot be quantized as W4A16" in item.message
    assert found[("sqnr", f"{BLOCK}.gate_up_proj")].verdict != "error"
    pasted = ast.literal_eval(item.message.split("give it a format that fits with layer_formats=", 1)[1]
                              .split(", or keep it", 1)[0])
    assert pasted == {f"{BLOCK}.*.down_proj": "W8A16"}
    fixed, analysis = analyze_with_checks(narrow_experts, data, **settings, layer_formats=pasted)
    for check in ("sqnr", "weight_sqnr"):
        down = fixed[(check, f"{BLOCK}.down_proj")]
        assert down.verdict != "error" and sorted(down.details["experts"]) == ["0", "1", "2", "3"], down.message
    assert {analysis.layer(f"{BLOCK}.{e}.down_proj").format for e in range(4)} == {"W8A16"}


def test_an_equalize_fix_writes_a_projection_of_experts_as_a_glob_points_at_items_and_runs_when_pasted():
    import ast
    import re

    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks
    from tests.models import tiny_moe

    def moe():
        return tiny_moe("qwen3_moe", layers=2, experts=8)[0]

    data = tiny_moe("qwen3_moe", layers=2, experts=8, n=4)[1]
    checks = ["input_weight_equalization", "equalization", "model_sqnr"]
    found, _ = analyze_with_checks(moe, data, checks=checks)
    pointers = 0
    for (check, _), finding in found.items():
        pointer = re.search(r"given on the item of (\S+) and under the summary", finding.message)
        if pointer:  # an item of this check, by its name, that prints the fix in full
            pointers += 1
            target = found[(check, pointer.group(1))]
            assert target.verdict == "fail" and "Fix: qmodel(..., equalize=" in target.message, target.message
            assert re.search(r"the one equalize fix for the (\d+) failing", finding.message).group(1) == str(
                sum(f.verdict == "fail" and "Fix" in f.message for (c, _), f in found.items() if c == check))
    assert pointers
    message = found[("equalization", "model.layers.0.mlp.experts.down_proj")].message
    pasted = ast.literal_eval(message.split("Fix: qmodel(..., equalize=", 1)[1].rsplit(")", 1)[0])
    assert "model.layers.0.mlp.experts.*.down_proj" in pasted  # every expert of it, one glob
    assert not any(re.fullmatch(r"model\.layers\.0\.mlp\.experts\.\d+\.down_proj", name) for name in pasted)
    claimed = float(re.search(r"the model output [\d.]+ -> ([\d.]+) dB", message).group(1))
    fixed, analysis = analyze_with_checks(moe, data, checks=checks, equalize=pasted)
    assert {f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(8)} <= set(analysis.equalized_layers)
    assert fixed[("equalization", "model.layers.0.mlp.experts.down_proj")].verdict == "pass"
    assert fixed[("model_sqnr", "output")].value == pytest.approx(claimed, abs=0.01)


def test_a_layer_overrides_fix_writes_the_experts_taking_one_same_change_as_one_glob():
    from types import SimpleNamespace

    from pytest_qreport.fixes.trials import SearchScope, equalize_fix, layer_overrides_fix

    own = {"lm_head": {"skip": True}}
    scope = SearchScope("m", SimpleNamespace(layer_overrides=own), SimpleNamespace(expert_layers=EXPERTS), {})
    change = {f"{BLOCK}.{e}.down_proj": {"per_channel": True} for e in range(4)}
    change |= {f"{BLOCK}.{e}.up_proj": {"per_channel": True} for e in range(2)}
    change[f"{BLOCK}.3.up_proj"] = {"activation_observer": "histogram"}
    change["q_proj"] = {"per_channel": True}
    fix = layer_overrides_fix(scope, change)
    assert fix.value == {"lm_head": {"skip": True}, f"{BLOCK}.*.down_proj": {"per_channel": True},
                         f"{BLOCK}.0.up_proj": {"per_channel": True}, f"{BLOCK}.1.up_proj": {"per_channel": True},
                         "q_proj": {"per_channel": True}, f"{BLOCK}.3.up_proj": {"activation_observer": "histogram"}}
    assert fix.layers == tuple(change)  # the layers it concerns, by name
    every = {layer: {"per_channel": True} for layer in EXPERTS}
    assert layer_overrides_fix(scope, every).value == {**own, BLOCK: {"per_channel": True}}
    assert equalize_fix([f"{BLOCK}.{e}.down_proj" for e in range(4)], [], scope).value == [f"{BLOCK}.*.down_proj"]
    assert equalize_fix(True, [], scope).value is True


def test_an_expert_without_a_value_for_another_reason_than_no_token_is_named_with_that_reason():
    found = {f"{BLOCK}.{e}.down_proj": _finding(f"{BLOCK}.{e}.down_proj", 10.0 + e) for e in range(4)}
    found[f"{BLOCK}.3.down_proj"] = Finding(
        model="m", check="equalization", layer=f"{BLOCK}.3.down_proj", metric="gain_db", value=math.nan,
        threshold=1.0, verdict="skip", message=f"layer {BLOCK}.3.down_proj: not measured: the variants missed it.")
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert "Not measured: expert(s) 3 (the variants missed it)." in merged.message
    assert "no calibration token" not in merged.message and merged.details["unmeasured_experts"] == []
    # each reason with its own experts; a finding that gives none is not said to be unreached
    found[f"{BLOCK}.1.down_proj"] = found[f"{BLOCK}.3.down_proj"].replace(layer=f"{BLOCK}.1.down_proj", message=(
        f"layer {BLOCK}.1.down_proj: not measured: its producer was refused."))
    found[f"{BLOCK}.0.down_proj"] = found[f"{BLOCK}.3.down_proj"].replace(layer=f"{BLOCK}.0.down_proj", message="")
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert "Not measured: expert(s) 0. Not measured: expert(s) 1 (its producer was refused). Not measured: " \
        "expert(s) 3 (the variants missed it)." in merged.message, merged.message
    assert "no calibration token" not in merged.message



def test_an_experts_reason_and_whether_a_token_reached_it_are_read_from_the_findings_details_not_its_words():
    found = {f"{BLOCK}.{e}.down_proj": _finding(f"{BLOCK}.{e}.down_proj", 10.0 + e) for e in range(4)}
    # a message that words it otherwise (or quotes another expert's) changes nothing: the details say it
    found[f"{BLOCK}.1.down_proj"] = Finding(
        model="m", check="equalization", layer=f"{BLOCK}.1.down_proj", metric="gain_db", value=math.nan,
        threshold=1.0, verdict="skip", message="layer x: not equalized: nothing routed: no token: at all.",
        details=unreached_details())
    found[f"{BLOCK}.2.down_proj"] = found[f"{BLOCK}.1.down_proj"].replace(
        layer=f"{BLOCK}.2.down_proj", message="layer x: no calibration token reached it (said of expert 0)",
        details=not_measured_details("its producer: was refused"))
    merged = merge_expert_findings(f"{BLOCK}.down_proj", list(found), found, EXPERTS, higher_is_better=True)
    assert "Not measured: expert(s) 1, which no calibration token reached" in merged.message, merged.message
    assert "Not measured: expert(s) 2 (its producer: was refused)." in merged.message, merged.message
    assert merged.details["unmeasured_experts"] == [1]
    assert "unreached" not in merged.details and "not_measured" not in merged.details  # the experts', not the item's


def test_an_expert_routed_tokens_only_after_the_variant_batches_is_not_said_to_be_unreached():
    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks
    from tests.models import routed_tokens, tiny_moe

    def moe():
        return tiny_moe("qwen2_moe", layers=2, experts=8)[0]

    data = tiny_moe("qwen3_moe", layers=2, experts=8, n=4)[1]
    # block 1's expert 3 gets its 20 tokens in the last batch; the variants measure the first 2
    assert [len(chunk) for chunk in routed_tokens(moe(), data, layer=1)[3]] == [0, 0, 0, 20]
    found, _ = analyze_with_checks(moe, data, checks=["equalization", "expert_coverage"])
    message = found[("equalization", "model.layers.1.mlp.experts.down_proj")].message
    assert ("Not measured: expert(s) 3 (the equalization variants are measured on the first 2 calibration batches, "
            "and none of them reached its input).") in message
    assert "which no calibration token reached" not in message
    assert "3 (20)" in found[("expert_coverage", "model.layers.1.mlp.experts")].message


def test_a_proper_subset_reads_its_expert_globs_and_names_the_lowest_layers_it_leaves_quantized():
    import re

    import pytest

    pytest.importorskip("transformers")
    from pytest_qreport.fixes.search import _kept_in_float
    from pytest_qreport.fixes.trials import Fix
    from tests.helpers import analyze_with_checks
    from tests.models import tiny_moe

    layers = (f"{BLOCK}.0.down_proj", f"{BLOCK}.1.down_proj", f"{BLOCK}.0.up_proj", "q_proj", "lm_head")
    assert _kept_in_float(Fix("float_layers", [f"{BLOCK}.*.down_proj", "q_proj"], layers)) == {
        f"{BLOCK}.0.down_proj", f"{BLOCK}.1.down_proj", "q_proj"}
    data = tiny_moe("qwen3_moe", layers=2, experts=8, n=4)[1]
    found, analysis = analyze_with_checks(lambda: tiny_moe("mixtral", layers=2, experts=8)[0], data,
                                          quantizer="NVFP4", checks=["sqnr", "model_sqnr"])
    claims = [re.search(r"best subset of at most (\d+) layer\(s\), which leaves (\d+) layer\(s\) quantized, the "
                        r"lowest (\S+) at ([\d.]+) dB", f.message) for f in found.values()]
    claims = [claim for claim in claims if claim]
    assert claims  # every layer fails on its own error under NVFP4: a proper subset is measured
    for claim in claims:  # what it keeps and what it leaves: every quantized layer, once
        assert int(claim.group(1)) + int(claim.group(2)) == len(analysis.layers) and int(claim.group(1)) <= 8



def test_an_items_name_selects_hides_and_keeps_in_float_its_experts_in_every_layer_setting():
    """An MoE projection's item name (`mlp.experts.down_proj`) works where a layer glob goes: layers and skip_layers
    select and hide its item, float_layers and layer_formats act on each of its experts (the numbers the glob over
    the experts gives), the qreport fixture's assert_sqnr(layers=) reaches its experts, and a name that matches
    nothing is told the items' names, not every expert layer's."""
    import pytest

    pytest.importorskip("transformers")
    from pytest_qreport.adapter.fixture import QReportResult
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.errors import QReportModelError
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.quantizers import model_quantizer
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import PluginHook, analyze_with_checks, builtin_registry
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", layers=2, experts=4)  # two blocks: a stack to analyse block by block
    down, gate_up = f"{BLOCK}.down_proj", f"{BLOCK}.gate_up_proj"
    checks = {"checks": ["sqnr", "weight_sqnr", "model_sqnr"], "quantizer": "W4A16", "fix_budget": 0}
    selected, _ = analyze_with_checks(lambda: model, data, layers=[down], **checks)
    assert sorted(selected) == [("sqnr", down), ("weight_sqnr", down)]
    hidden, _ = analyze_with_checks(lambda: model, data, skip_layers=[down], **checks)
    assert ("sqnr", gate_up) in hidden and not [key for key in hidden if key[1] == down]
    settings = ModelSettings.defaults(BUILTIN_CHECKS, calibration=data, **checks)
    pipeline = collect_model("m", settings, builtin_registry(), model_quantizer(settings, PluginHook()), model, data[0])
    pipeline.analyze(lambda: data, lambda found: None)
    plain = pipeline.findings
    for setting, by_name, by_glob, blockwise in (
            ("float_layers", [down], [f"{BLOCK}.*.down_proj"], False),
            ("float_layers", [down], [f"{BLOCK}.*.down_proj"], True),  # quantized block by block
            ("layer_formats", {gate_up: "FP8"}, {f"{BLOCK}.*.gate_proj": "FP8", f"{BLOCK}.*.up_proj": "FP8"}, False)):
        named, analysis = analyze_with_checks(lambda: model, data, **{setting: by_name}, blockwise=blockwise, **checks)
        globbed, _ = analyze_with_checks(lambda: model, data, **{setting: by_glob}, blockwise=blockwise, **checks)
        assert analysis.blockwise == blockwise and not [f for f in named.values() if f.verdict == "error"]
        assert {key: f.value for key, f in named.items()} == {key: f.value for key, f in globbed.items()}, setting
        assert named[("model_sqnr", "output")].value != plain[("model_sqnr", "output")].value, setting
        assert (("sqnr", down) in named) == (setting != "float_layers")  # no item for a layer kept in float
    result = QReportResult(pipeline, list(pipeline.findings.values()), {}, "t")
    with pytest.raises(AssertionError, match=r"4 of 4 layers below 99"):
        result.assert_sqnr(99.0, layers=down)
    with pytest.raises(QReportModelError) as error:
        analyze_with_checks(lambda: model, data, skip_layers=[f"{BLOCK}.down"], **checks)
    assert f"mlp.gate, {gate_up}, {down}, model.layers.1.self_attn.q_proj" in str(error.value), str(error.value)
    assert f"{BLOCK}.0." not in str(error.value)


def test_in_artifact_mode_an_items_name_keeps_its_experts_in_float_and_hides_its_item():
    """A checkpoint holding its experts as modules: float_layers and skip_layers take a projection's item name as
    the glob over its experts, and a name that matches nothing is told the items' names."""
    import pytest

    pytest.importorskip("transformers")
    from torchao.quantization import Int8WeightOnlyConfig

    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.errors import QReportModelError
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import builtin_registry, torchao_artifact
    from tests.models import linearized_moe, tiny_moe

    model, data = tiny_moe("qwen3_moe")
    reference = linearized_moe(model)
    quantized = torchao_artifact(reference, Int8WeightOnlyConfig())
    down = f"{BLOCK}.down_proj"

    def findings(**settings):
        resolved = ModelSettings.defaults(BUILTIN_CHECKS, calibration=data, quantized=lambda: quantized,
                                          checks=["sqnr", "model_sqnr"], **settings)
        pipeline = collect_model("m", resolved, builtin_registry(), None, reference, data[0], quantized=quantized)
        pipeline.analyze(lambda: data, lambda found: None)
        return {key: finding.value for key, finding in pipeline.findings.items()}

    named, globbed, plain = findings(float_layers=[down]), findings(float_layers=[f"{BLOCK}.*.down_proj"]), findings()
    assert named == globbed and ("sqnr", down) in plain and ("sqnr", down) not in named
    assert named[("model_sqnr", "output")] != plain[("model_sqnr", "output")]
    hidden = findings(skip_layers=[down])
    assert ("sqnr", down) not in hidden and ("sqnr", f"{BLOCK}.gate_proj") in hidden
    with pytest.raises(QReportModelError, match=rf"its layers: .*{BLOCK}\.gate_proj, {BLOCK}\.up_proj, "
                                                rf"{BLOCK}\.down_proj, lm_head$"):
        findings(float_layers=[f"{BLOCK}.down"])


def test_the_outlier_check_judges_an_expert_on_its_batches_of_enough_tokens_and_says_when_it_had_none():
    """An expert's batch is what its router sent it. Over fewer than 120 tokens the heuristic's 97.5th percentile is
    one of the batch's few largest values, so such batches give no ratio: with a few tokens an expert a batch, the
    expert projections' outlier items say that no expert was measured and why, and the screen measures the fix on
    no expert; with the longer batches the message asks for, every expert is judged."""
    import pytest

    pytest.importorskip("transformers")
    from tests.helpers import analyze_with_checks
    from tests.models import tiny_moe

    model, short = tiny_moe("qwen3_moe", experts=4, batch=2, tokens=16, n=3)  # 16 tokens an expert a batch
    found, analysis = analyze_with_checks(lambda: model, short, checks=["outlier"])
    for projection in ("gate_up_proj", "down_proj"):
        item = found[("outlier", f"{BLOCK}.{projection}")]
        assert item.verdict == "skip" and item.message.startswith(f"{BLOCK}.{projection}: 4 experts, none measured. "
                                                                  "Not measured: expert(s) 0, 1, 2, 3 (every "
                                                                  "calibration batch routed the expert fewer than 120 "
                                                                  "tokens"), item.message
        assert "more tokens per calibration batch (longer or more sequences)" in item.message
        assert all(math.isnan(value) for value in item.details["experts"].values())
    screened = analysis.screened("outlier")
    assert screened is None or not any(".experts." in layer for layer in screened.changes)
    model, long = tiny_moe("qwen3_moe", experts=4, batch=8, tokens=64, n=3)  # 256 tokens an expert a batch
    found, _ = analyze_with_checks(lambda: model, long, checks=["outlier"])
    for projection in ("gate_up_proj", "down_proj"):
        item = found[("outlier", f"{BLOCK}.{projection}")]
        assert "Not measured" not in item.message and item.verdict in ("pass", "fail")
        assert all(math.isfinite(value) for value in item.details["experts"].values())
    # torch.ao's rule, every batch, on request: the short batches' experts are judged too
    found, _ = analyze_with_checks(lambda: model, short, checks=["outlier"],
                                   check_options={"outlier": {"expert_min_batch_tokens": 0}})
    assert all(math.isfinite(value) for value in found[("outlier", f"{BLOCK}.down_proj")].details["experts"].values())
