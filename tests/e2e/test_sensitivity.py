"""Per-layer sensitivity and the verified float_layers fix (issue: sensitivity)."""
import ast
import json
import re

import pytest

import qcore
from qcore.analysis import measure_sqnr
from qcore.search.sensitivity import SwitchableModel, find_float_layers, layer_sensitivity, with_float_layers
from tests.helpers import FRAGILE_SOURCE


def _fragile():
    namespace = {}
    exec(compile(FRAGILE_SOURCE.replace("from pytest_qreport import qmodel", ""), "fragile", "exec"), namespace)
    return namespace["MLP"]().eval(), namespace["batches"]()


def test_switches_agree_with_requantizing_each_layer_in_float():
    model, batches = _fragile()
    float_gm = qcore.capture(model, batches[0])
    quantizer = qcore.Int8StaticQuantizer()
    switchable = SwitchableModel(float_gm, batches, quantizer)
    result = layer_sensitivity(float_gm, batches, quantizer, model=switchable)
    exact = measure_sqnr(float_gm, batches, quantizer).worst_output().sqnr_db
    assert result.all_quantized_db == pytest.approx(exact, abs=1e-6)      # all switches on: the quantized model
    for entry in result.layers:   # one layer off: the model re-quantized with that layer skipped
        skipped = measure_sqnr(float_gm, batches, with_float_layers(quantizer, [entry.layer])).worst_output()
        assert entry.only_float_db == pytest.approx(skipped.sqnr_db, abs=0.25), entry
    assert [e.gain_db for e in result.layers] == sorted((e.gain_db for e in result.layers), reverse=True)


def test_the_fix_is_measured_and_needs_fewer_layers_than_the_naive_ranking():
    model, batches = _fragile()
    float_gm = qcore.capture(model, batches[0])
    fix = find_float_layers(float_gm, batches, None, target_db=30.0, compare_with_ranking=True)
    assert fix.reached and fix.measured_db >= 30.0 and set(fix.float_layers) == {"layers.2", "layers.4"}
    assert abs(fix.measured_db - fix.estimated_db) < 1.0
    assert fix.naive_top_k == 0 or fix.naive_top_k > len(fix.float_layers)


def test_with_float_layers_needs_layer_overrides():
    class Plain(qcore.Quantizer):
        def annotate(self, gm):
            return gm

    with pytest.raises(ValueError, match="has no layer_overrides"):
        with_float_layers(Plain(), ["fc"])
    base = qcore.Int8StaticQuantizer(layer_overrides={"fc": {"per_channel": False}})
    changed = with_float_layers(base, ["fc", "head*"])
    assert changed.layer_overrides == {"fc": {"per_channel": False, "skip": True}, "head*": {"skip": True}}
    assert base.layer_overrides == {"fc": {"per_channel": False}}     # the original is unchanged


def test_the_failing_model_sqnr_item_ends_with_a_fix_that_passes_when_pasted(pytester):
    pytester.makeconftest(FRAGILE_SOURCE + '''

@qmodel(calibration=batches, checks="model_sqnr,sensitivity", fix_budget="unlimited")
def fragile():
    return MLP().eval()
''')
    result = pytester.runpytest("--qreport", "--qreport-json=report.json", "--qreport-table=all")
    result.assert_outcomes(failed=1, passed=1, warnings=1)   # the sensitivity item is a warning
    result.stdout.fnmatch_lines(["sensitivity of fragile (* dB quantized; dB gained by keeping one layer in float): "
                                 "layers.4 +*"])
    rows = {(r["check"], r["layer"]): r for r in json.loads((pytester.path / "report.json").read_text())["rows"]}
    message = rows[("model_sqnr", "output")]["message"]
    found = re.search(r"was measured to reach ([\d.]+) dB: float_layers=(\[.*\])$", message)
    assert found, message
    pasted = ast.literal_eval(found.group(2))
    ranking = rows[("sensitivity", "model")]["details"]["ranking"]
    assert {entry["layer"] for entry in ranking} == {"layers.0", "layers.2", "layers.4", "layers.6"}
    # paste the line into qmodel: the item passes, at the SQNR the message announced
    pytester.makeconftest(FRAGILE_SOURCE + f'''

@qmodel(calibration=batches, checks="model_sqnr,sensitivity", float_layers={pasted!r})
def fragile():
    return MLP().eval()
''')
    result = pytester.runpytest("--qreport", "--qreport-json=report.json", "-n", "2", "-rs")
    result.assert_outcomes(passed=1, skipped=1)   # sensitivity runs only when model_sqnr fails
    rows = {(r["check"], r["layer"]): r for r in json.loads((pytester.path / "report.json").read_text())["rows"]}
    assert rows[("model_sqnr", "output")]["value"] == pytest.approx(float(found.group(1)), abs=0.05)
    result.stdout.fnmatch_lines(["*model_sqnr passes, so the sensitivity ranking did not run*"])


def test_float_layers_from_the_command_line_and_its_errors(pytester):
    pytester.makeconftest(FRAGILE_SOURCE + '''
import qcore


class Plain(qcore.Int8StaticQuantizer):
    def __init__(self):
        super().__init__()
        del self.layer_overrides


@qmodel(calibration=batches, checks="sqnr,model_sqnr")
def fragile():
    return MLP().eval()


@qmodel(calibration=batches, checks="model_sqnr", quantizer=Plain())
def plain():
    return MLP().eval()
''')
    result = pytester.runpytest("--qreport", "--qreport-float-layers", "layers.[24]", "--qreport-json=report.json")
    report = json.loads((pytester.path / "report.json").read_text())
    rows = {(r["model"], r["check"], r["layer"]): r for r in report["rows"]}
    assert {key[2] for key in rows if key[:2] == ("fragile", "sqnr")} == {"layers.0", "layers.6"}   # in float
    assert rows[("fragile", "model_sqnr", "output")]["verdict"] == "pass"
    assert ("model 'plain': float_layers=['layers.[24]']: Plain has no layer_overrides, so it cannot keep layers "
            "in float") in result.stdout.str()
    result = pytester.runpytest("--qreport", "--qreport-float-layers", "layer.9", "-k", "fragile")
    assert ("model 'fragile': float_layers ['layer.9'] match no layer, nor a module holding one; layers: layers.0, "
            "layers.2, layers.4, layers.6") in result.stdout.str()


def test_a_confirmed_ranking_measures_its_best_estimates_on_every_batch_and_lists_them_first():
    model, batches = _fragile()
    float_gm = qcore.capture(model, batches[0])
    switchable = SwitchableModel(float_gm, batches, qcore.Int8StaticQuantizer())
    every = {e.layer: e for e in layer_sensitivity(float_gm, batches, model=switchable, max_batches=2).layers}
    first = {e.layer: e for e in layer_sensitivity(float_gm, batches, model=switchable, max_batches=1).layers}
    estimates = sorted(first.values(), key=lambda e: (-e.gain_db, e.layer))
    screened = layer_sensitivity(float_gm, batches, model=switchable, max_batches=2, confirmed=2)
    best = {e.layer for e in estimates[:2]}
    head, rest = screened.layers[:2], screened.layers[2:]
    # the two best estimates (first batch), measured on both batches to the same values as a full ranking's, first
    assert {e.layer for e in head} == best and [e.gain_db for e in head] == sorted((e.gain_db for e in head),
                                                                                   reverse=True)
    assert all((e.only_float_db, e.gain_db, e.only_quantized_db, e.batches) == (
        every[e.layer].only_float_db, every[e.layer].gain_db, every[e.layer].only_quantized_db, 2) for e in head)
    # the others keep their first-batch estimate, in its order
    assert [(e.layer, e.only_float_db, e.gain_db, e.batches) for e in rest] == \
        [(e.layer, e.only_float_db, e.gain_db, 1) for e in estimates[2:]]
    assert screened.all_quantized_db == every[head[0].layer].only_float_db - every[head[0].layer].gain_db
    assert screened.batches == 2


def test_a_layer_budget_bounds_the_ranking_and_names_what_it_skipped():
    model, batches = _fragile()
    float_gm = qcore.capture(model, batches[0])
    result = layer_sensitivity(float_gm, batches, max_layers=2, max_batches=1)
    assert {e.layer for e in result.layers} == {"layers.0", "layers.2"}
    assert result.skipped == ("layers.4", "layers.6") and result.batches == 1


def test_the_float_layers_search_ranks_with_one_pass_per_layer_and_the_same_order():
    model, batches = _fragile()
    float_gm = qcore.capture(model, batches[0])
    switchable = SwitchableModel(float_gm, batches, qcore.Int8StaticQuantizer())
    runs = []
    original_run, original_record = switchable.run, switchable.record
    switchable.run = lambda subset: runs.append("run") or original_run(subset)
    switchable.record = lambda subset: runs.append("record") or original_record(subset)
    both = layer_sensitivity(float_gm, batches, model=switchable)
    # each ranking records its starting points (all quantized; all float for only_quantized_db), then one run per
    # layer and figure, from those
    count = len(both.layers)
    assert runs == ["record"] + ["run"] * count + ["record"] + ["run"] * count
    runs.clear()
    gains_only = layer_sensitivity(float_gm, batches, model=switchable, only_quantized=False)
    assert runs == ["record"] + ["run"] * count
    assert [(e.layer, e.only_float_db, e.gain_db) for e in gains_only.layers] == \
        [(e.layer, e.only_float_db, e.gain_db) for e in both.layers]
    assert all(e.only_quantized_db != e.only_quantized_db for e in gains_only.layers)  # nan: not measured
    # a report lists the top two: only theirs is measured, to the same value
    runs.clear()
    listed = layer_sensitivity(float_gm, batches, model=switchable, only_quantized=2)
    assert runs == ["record"] + ["run"] * count + ["record"] + ["run"] * 2
    assert [(e.layer, e.only_quantized_db) for e in listed.layers[:2]] == \
        [(e.layer, e.only_quantized_db) for e in both.layers[:2]]
    assert all(e.only_quantized_db != e.only_quantized_db for e in listed.layers[2:])
