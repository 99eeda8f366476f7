"""Verified advice: every fix a built-in check prints, pasted back into qmodel(), improves what it claims to
improve, by the figures it claims, and never lowers the model's output SQNR. Where a torch.ao heuristic and the
measurement disagree, the item passes with a note that names both."""
import ast
import math
import re

import pytest
import torch
from torch import nn

from tests.helpers import analyze_with_checks, changed_layers, padded_token_batches


def _pasted(found):
    """The keyword and value of a fix: the one `Fix: qmodel(..., key=value).` at the end of a message (a string or
    a finding's), or, on the items that share one fix printed in full on the first of them, the fix its details
    carry."""
    message = found if isinstance(found, str) else found.message
    match = re.search(r"Fix: qmodel\(\.\.\., (\w+)=(.*)\)\.$", message)
    if match is None and not isinstance(found, str):
        assert "given on the item of" in message, message
        match = re.search(r"^qmodel\(\.\.\., (\w+)=(.*)\)$", found.details["fix"])
    key, value = match.groups()
    return {key: ast.literal_eval(value)}


def _claims(message):
    """(layer before, layer after, output before, output after) from 'measured with the fix: ...'."""
    found = re.search(r"measured with the fix: its [\w ()]*SQNR[\w ()]* ([\d.]+) -> ([\d.]+) dB \([+-][\d.]+ dB\), the "
                      r"model output ([\d.]+) -> ([\d.]+) dB", message)
    return tuple(float(v) for v in found.groups())


def _output_db(analysis):
    return analysis.sqnr.worst_output().sqnr_db


class MLP(nn.Module):
    def __init__(self, features=64, hidden=128, classes=10):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.layers(x)


def seeded_mlp():
    torch.manual_seed(0)
    return MLP().eval()


def wide_rows():
    torch.manual_seed(0)
    model = MLP().eval()
    with torch.no_grad():
        model.layers[2].weight *= torch.logspace(-2, 0, 128).unsqueeze(1)
    return model


def _features(seed=1, scales=None):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=g) * (1.0 if scales is None else s) for s in (scales or [1.0] * 8)]


def test_per_channel_fix_is_measured_and_works_when_pasted():
    batches = _features()
    found, before = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["per_channel", "sqnr"])
    verdicts = {layer: f.verdict for (check, layer), f in found.items() if check == "per_channel"}
    assert verdicts == {"layers.0": "pass", "layers.2": "fail", "layers.4": "pass", "layers.6": "pass"}
    # torch.ao's heuristic names all four; the three where the fix does not gain 1 dB pass with a note naming both
    for layer in ("layers.0", "layers.4", "layers.6"):
        note = found[("per_channel", layer)].note
        assert note.startswith("torch.ao's per_channel heuristic recommends per-channel weights (weights are "
                               "quantized per tensor but per-channel is supported); measured ") and \
            note.endswith("(the minimum gain is 1 dB): not recommended"), note
    message = found[("per_channel", "layers.2")].message
    fix = _pasted(message)
    assert fix == {"layer_overrides": {"layers.2": {"per_channel": True}}}
    own_before, own_after, out_before, out_after = _claims(message)
    assert own_after - own_before >= 1.0 and out_after > out_before
    assert out_before == pytest.approx(_output_db(before), abs=0.005)
    again, after = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["per_channel", "sqnr"],
                                       **fix)
    assert again[("per_channel", "layers.2")].verdict == "pass" and again[("per_channel", "layers.2")].value == 1.0
    assert changed_layers(before, after) == {"layers.2"}  # pasted as printed, it changes that layer and no other
    assert after.sqnr.layers["layers.2"].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
    assert _output_db(after) == pytest.approx(out_after, abs=0.005)
    # the advice it replaces, quantizer='int8' (per-channel everywhere), was worse than this verified fix
    _, everywhere = analyze_with_checks(wide_rows, batches, quantizer="int8", checks=["sqnr"])
    assert _output_db(everywhere) < _output_db(after)


def test_a_detector_item_fails_on_its_screen_under_any_fix_budget_and_the_setting_it_prints_works():
    batches = _features()
    settings = {"quantizer": "int8_per_tensor", "checks": ["per_channel", "sqnr"]}
    found, _ = analyze_with_checks(wide_rows, batches, **settings, fix_budget=0.0)
    unlimited, _ = analyze_with_checks(wide_rows, batches, **settings, fix_budget=math.inf)
    # the verdicts come from the comparison pass's screen: the same with no fix search as with every one
    assert {key: (f.verdict, f.value) for key, f in found.items()} == \
        {key: (f.verdict, f.value) for key, f in unlimited.items()}
    message = found[("per_channel", "layers.2")].message
    assert found[("per_channel", "layers.2")].verdict == "fail" and "Fix:" not in message
    assert "its effect on the model output was not measured: the model's fix budget was spent" in message
    assert "No fix was searched: fix_budget is 0 (verdicts only)" in message
    own_after = float(re.search(r"its own SQNR \(float input\) is [\d.]+ -> ([\d.]+) dB", message).group(1))
    setting = ast.literal_eval(re.search(r"measured on these layers: qmodel\(\.\.\., layer_overrides=(\{.*\})\)\.$",
                                         message).group(1))
    assert setting == {"layers.2": {"per_channel": True}}
    # pasted, the setting gives the layer the own SQNR the comparison pass measured with it, and the item passes
    again, after = analyze_with_checks(wide_rows, batches, **settings, fix_budget=0.0, layer_overrides=setting)
    assert again[("per_channel", "layers.2")].verdict == "pass"
    assert after.sqnr.layers["layers.2"].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
    # the verdict is the screen's gain against the minimum: a minimum above it accepts the layer as it is
    gain = float(re.search(r"dB \(\+([\d.]+) dB; the minimum gain is 1 dB\)", message).group(1))
    accepted, _ = analyze_with_checks(wide_rows, batches, **settings, fix_budget=0.0,
                                      per_channel_min_gain_db=math.ceil(gain * 10) / 10 + 0.1)
    assert accepted[("per_channel", "layers.2")].verdict == "pass"


def test_dynamic_fix_is_measured_and_works_when_pasted():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()

    # batches whose scales differ by 75x: one static range is too coarse for the quiet ones
    batches = _features(0, [0.02, 0.05, 1, 0.1, 0.03, 0.2, 0.04, 1.5])
    found, before = analyze_with_checks(model, batches, checks=["dynamic_static"])
    failing = {layer: f for (check, layer), f in found.items() if f.verdict == "fail"}
    assert failing, {k: (f.verdict, f.note) for k, f in found.items()}
    assert len({str(_pasted(f)) for f in failing.values()}) == 1  # one fix for the model, listing the layers it helps
    assert sum("Fix: qmodel(" in f.message for f in failing.values()) == 1  # printed in full once
    fix = _pasted(next(iter(failing.values())))
    assert set(fix["layer_overrides"]) == set(failing)
    assert all(v == {"is_dynamic": True} for v in fix["layer_overrides"].values())
    again, after = analyze_with_checks(model, batches, checks=["dynamic_static"], **fix)
    assert changed_layers(before, after) == set(failing)
    for layer, finding in failing.items():
        own_before, own_after, out_before, out_after = _claims(finding.message)
        assert own_after - own_before >= 1.0
        assert after.sqnr.layers[layer].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
        assert again[("dynamic_static", layer)].verdict == "pass"
    assert _output_db(after) == pytest.approx(out_after, abs=0.005) and _output_db(after) > _output_db(before)


def test_outlier_heuristic_overruled_by_measurement_passes_with_a_note():
    batches = _features(3)
    for x in batches:
        x[5, 7] = 150.0  # rare spikes: clipping them costs more than the finer scale saves
    found, analysis = analyze_with_checks(seeded_mlp, batches, checks=["outlier"], layers=["layers.0"])
    finding = found[("outlier", "layers.0")]
    assert finding.verdict == "pass" and finding.details["advised"] is False
    assert re.match(r"torch\.ao's outlier heuristic recommends a clipping \(histogram\) activation observer \(input "
                    r"channels 7 have outliers .*\); measured ([+-][\d.]+) dB on this layer's own SQNR \(float input\) "
                    r"[\d.]+ -> [\d.]+ dB \(the minimum gain is 1 dB\): not recommended$", finding.note), finding.note
    # the note's figure is the measurement: the same fix, applied, gives it
    from qcore.quantization.quantizer import with_layer_overrides

    tried = analysis.variant(with_layer_overrides(analysis.quantizer, {"layers.0": {
        "activation_observer": "histogram"}})).sqnr.layers["layers.0"].shadow_sqnr_db
    gain = float(re.search(r"measured ([+-][\d.]+) dB", finding.note).group(1))
    assert tried - analysis.sqnr.layers["layers.0"].shadow_sqnr_db == pytest.approx(gain, abs=0.006)


def sensor_mlp():
    torch.manual_seed(0)
    return MLP(features=32, hidden=64, classes=8).eval()


def _sensor_batches():
    g = torch.Generator().manual_seed(4)
    spread = torch.logspace(-2, 2, 32)  # input channels span four orders of magnitude
    return [torch.randn(64, 32, generator=g) * spread for _ in range(8)]


def test_equalization_fix_names_only_the_layers_it_helps_and_works_when_pasted():
    batches = _sensor_batches()
    checks = ["equalization", "input_weight_equalization", "model_sqnr"]
    found, before = analyze_with_checks(sensor_mlp, batches, quantizer="int8_histogram", checks=checks,
                                        fix_budget=math.inf)  # every equalization fix measured
    failing = [layer for (check, layer), f in found.items() if check == "equalization" and f.verdict == "fail"]
    assert failing == ["layers.0"]
    message = found[("equalization", "layers.0")].message
    fix = _pasted(message)
    # of equalize=['layers.0'] (the only layer whose variant gains 1 dB), equalize=True and smoothing, measured on
    # the whole model, equalizing every layer raises the output most
    assert fix == {"equalize": True}
    # torch.ao's heuristic recommends every layer but the first: their variants gain under 1 dB in the comparison
    # pass, so they pass with a note
    for layer in ("layers.2", "layers.4", "layers.6"):
        iwe = found[("input_weight_equalization", layer)]
        assert iwe.details["recommended"] and iwe.verdict == "pass"  # the heuristic's verdict, overruled
        assert "measured" in iwe.note and "not recommended" in iwe.note and iwe.details["advised"] is False
    own_before, own_after, out_before, out_after = _claims(message)
    _, after = analyze_with_checks(sensor_mlp, batches, quantizer="int8_histogram", checks=checks, **fix)
    assert changed_layers(before, after) == set(after.equalized_layers) == set(before.equalizable_layers)
    assert _output_db(after) == pytest.approx(out_after, abs=0.005) and out_after > out_before
    assert after.sqnr.layers["layers.0"].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
    for other in (["layers.0"], "smooth:search"):
        _, alternative = analyze_with_checks(sensor_mlp, batches, quantizer="int8_histogram", checks=["model_sqnr"],
                                             equalize=other)
        assert _output_db(alternative) < _output_db(after)


def test_input_weight_equalization_items_fail_with_the_equalization_fix_when_it_helps():
    batches = _sensor_batches()
    checks = ["equalization", "input_weight_equalization"]
    found, _ = analyze_with_checks(sensor_mlp, batches, quantizer="int8_histogram", checks=checks,
                                   equalization_min_gain_db=0.3, fix_budget=math.inf)
    iwe = {layer: f for (check, layer), f in found.items() if check == "input_weight_equalization"}
    failing = [layer for layer, f in iwe.items() if f.verdict == "fail"]
    assert failing and all(f.note for layer, f in iwe.items() if layer not in failing and f.details["recommended"])
    fixes = {str(_pasted(iwe[layer])) for layer in failing}
    equalization = {str(_pasted(f)) for (check, _), f in found.items()
                    if check == "equalization" and f.verdict == "fail"}
    assert fixes == equalization  # both checks print the same measured fix
    fix = _pasted(iwe[failing[0]])
    _, after = analyze_with_checks(sensor_mlp, batches, quantizer="int8_histogram", checks=["model_sqnr"], **fix)
    for layer in failing:
        own_before, own_after, out_before, out_after = _claims(iwe[layer].message)
        assert own_after - own_before >= 0.3
        assert after.sqnr.layers[layer].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
        assert _output_db(after) == pytest.approx(out_after, abs=0.005) and out_after > out_before


def _fixes(message):
    """{label: (claims, settings)} of the fixes an sqnr or weight_sqnr message lists."""
    listed = {}
    pattern = (r"(per-channel weights|a clipping \(histogram\) activation observer|keeping it in float[\w ]*) "
               r"\((measured[^)]*\)?[^)]*)\): qmodel\(\.\.\., (\w+)=(.*?)\)(?:;|\.$)")
    for label, claim, key, value in re.findall(pattern, message):
        listed[label.split(" with")[0]] = (claim, {key: ast.literal_eval(value)})
    return listed


def test_sqnr_fixes_are_listed_only_when_measured_and_work_when_pasted():
    batches = _features()
    # every kind of fix is searched to its end (the fix budget's own tests are tests/e2e/test_fix_budget.py)
    found, before = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["sqnr", "weight_sqnr"],
                         sqnr_min_db=45, weight_sqnr_min_db=45, layers=["layers.2"], fix_budget=math.inf)
    message = found[("sqnr", "layers.2")].message
    listed = _fixes(message)
    assert "per-channel weights" in listed and "keeping it in float" in listed, message
    claim, fix = listed["per-channel weights"]
    layer_before, layer_after = (float(v) for v in re.search(r"its SQNR ([\d.]+) -> ([\d.]+) dB", claim).groups())
    out_before, out_after = (float(v) for v in re.search(r"model output ([\d.]+) -> ([\d.]+) dB", claim).groups())
    assert layer_after > layer_before and out_after > out_before
    _, after = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["sqnr"], **fix)
    assert changed_layers(before, after) == {"layers.2"}
    assert after.sqnr.layers["layers.2"].sqnr_db == pytest.approx(layer_after, abs=0.005)
    assert _output_db(after) == pytest.approx(out_after, abs=0.005)
    claim, fix = listed["keeping it in float"]
    assert fix == {"float_layers": ["layers.2"]}
    out_before, out_after = (float(v) for v in re.search(r"model output ([\d.]+) -> ([\d.]+) dB", claim).groups())
    _, in_float = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["sqnr"], **fix)
    assert "layers.2" not in [entry.layer for entry in in_float.layers]
    assert changed_layers(before, in_float) == {"layers.2"}
    assert _output_db(in_float) == pytest.approx(out_after, abs=0.005)
    assert out_after > out_before
    # weight_sqnr lists per-channel weights with the weight SQNR they reach
    weight = _fixes(found[("weight_sqnr", "layers.2")].message)
    claim, fix = weight["per-channel weights"]
    weight_after = float(re.search(r"its weight SQNR [\d.]+ -> ([\d.]+) dB", claim).group(1))
    _, after = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["weight_sqnr"], **fix)
    assert changed_layers(before, after) == {"layers.2"}
    assert after.sqnr.layers["layers.2"].weight_sqnr_db == pytest.approx(weight_after, abs=0.005)


def test_a_fix_keeps_the_models_own_settings_and_pasted_changes_only_the_layer_it_names():
    batches = _features()
    own = {"layer_overrides": {"layers.6": {"activation_observer": "histogram"}}, "float_layers": ["layers.4"]}
    settings = {"quantizer": "int8_per_tensor", "checks": ["per_channel", "sqnr"], "sqnr_min_db": 45,
                "layers": ["layers.2"], "fix_budget": math.inf, **own}
    found, before = analyze_with_checks(wide_rows, batches, **settings)
    per_channel = _pasted(found[("per_channel", "layers.2")].message)
    assert per_channel == {"layer_overrides": {"layers.6": {"activation_observer": "histogram"},
                                               "layers.2": {"per_channel": True}}}
    in_float = _fixes(found[("sqnr", "layers.2")].message)["keeping it in float"][1]
    assert in_float == {"float_layers": ["layers.4", "layers.2"]}
    for fix in (per_channel, in_float):
        _, after = analyze_with_checks(wide_rows, batches, **{**settings, **fix})
        assert changed_layers(before, after) == {"layers.2"}, fix


def test_a_weight_that_fails_with_every_other_weight_is_offered_no_other_layers_and_its_threshold_passes_it():
    """A weight's SQNR depends on its own quantization only: when every weight fails, no message offers a set of
    other layers in float (it would leave this one as it is); the threshold it names passes the layer, pasted."""
    batches = _features()
    found, _ = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["weight_sqnr"],
                                   weight_sqnr_min_db=80)
    messages = {layer: f.message for (check, layer), f in found.items() if check == "weight_sqnr"}
    assert len(messages) > 1 and {f.verdict for f in found.values()} == {"fail"}
    for layer, message in messages.items():
        assert "float_layers" not in message and not re.search(r"leaves \S+ at", message), message
        assert "depends on its own quantization only" in message, message
        lowered = float(re.search(r"Lower weight_sqnr_min_db to ([\d.]+) dB or below", message).group(1))
        again, _ = analyze_with_checks(wide_rows, batches, quantizer="int8_per_tensor", checks=["weight_sqnr"],
                                       weight_sqnr_min_db=lowered, layers=[layer])
        assert again[("weight_sqnr", layer)].verdict == "pass", (layer, lowered)


def test_a_fix_that_lowers_the_output_is_not_printed():
    from pytest_qreport.fixes import Fix, Trial

    lowering = Trial(Fix("layer_overrides", {}, ("fc",)), (30.0, 29.0), {"fc": (20.0, 25.0)}, {}, {})
    assert not lowering.output_kept and lowering.gain("fc") == 5.0
    assert Trial(Fix("equalize", True, ()), (math.nan, math.nan), {}, {}, {}).output_kept  # no float output
    assert Trial(Fix("float_layers", [], ()), (30.0, 30.5), {"fc": (math.inf, math.inf)}, {}, {}).gain("fc") == 0.0


def test_the_sqnr_fix_search_can_be_turned_off_for_big_models():
    found, analysis = analyze_with_checks(wide_rows, _features(), quantizer="int8_per_tensor",
                                          checks=["sqnr", "weight_sqnr"], sqnr_min_db=45, weight_sqnr_min_db=45,
                                          layers=["layers.2"],
                                          check_options={"sqnr": {"fix": False}, "weight_sqnr": {"fix": False}})
    assert found[("sqnr", "layers.2")].message.endswith("(no fix was measured: check_options={'sqnr': {'fix': "
                                                         "False}}).")
    assert "No fix was measured" in found[("weight_sqnr", "layers.2")].message
    assert not analysis.context.variants  # no other configuration was measured


def test_outlier_fix_is_printed_when_measured_to_help_and_works_when_pasted():
    batches = _features(5)
    for x in batches:
        x[5, 7] = 10.0  # a moderate spike: clipping it costs less than the finer scale saves (+0.27 dB)
    settings = {"checks": ["outlier", "sqnr"], "layers": ["layers.0"], "outlier_min_gain_db": 0.1}
    found, before = analyze_with_checks(seeded_mlp, batches, **settings)
    finding = found[("outlier", "layers.0")]
    assert finding.verdict == "fail", finding.note
    fix = _pasted(finding.message)
    assert fix == {"layer_overrides": {"layers.0": {"activation_observer": "histogram"}}}
    own_before, own_after, out_before, out_after = _claims(finding.message)
    assert own_after - own_before >= 0.1 and out_after > out_before
    again, after = analyze_with_checks(seeded_mlp, batches, **settings, **fix)
    assert again[("outlier", "layers.0")].verdict == "pass"  # the layer's observer clips now
    assert changed_layers(before, after) == {"layers.0"}  # its input's observer, not the next layer's
    assert after.sqnr.layers["layers.0"].shadow_sqnr_db == pytest.approx(own_after, abs=0.005)
    assert _output_db(after) == pytest.approx(out_after, abs=0.005)


def test_a_fix_keeps_a_quantizer_subclass_and_its_settings():
    import qcore
    from qcore.quantization.quantizer import with_layer_overrides
    from qcore.search.sensitivity import with_float_layers

    class Mine(qcore.Int8StaticQuantizer):
        """A team's own quantizer: the measured fixes must measure it, not the base class."""

    for changed in (with_layer_overrides(Mine(per_channel=False), {"fc": {"per_channel": True}}),
                    with_float_layers(Mine(per_channel=False), ["fc"])):
        assert type(changed) is Mine and changed.per_channel is False
    with pytest.raises(ValueError, match="unknown key"):
        with_layer_overrides(Mine(), {"fc": {"bogus": 1}})


def test_screened_fixes_give_the_same_findings_with_one_trial_fewer(monkeypatch):
    import json

    from pytest_qreport.checks.detectors import DetectorCheck
    from pytest_qreport.core import pipeline as pipelines

    batches = _features()
    settings = {"quantizer": "int8_per_tensor", "checks": ["per_channel", "dynamic_static", "outlier", "sqnr"]}
    screened, with_screens = analyze_with_checks(wide_rows, batches, **settings)
    assert {s.name for s in with_screens.plan.screens} == {"per_channel", "dynamic_static", "outlier"}
    # only the outlier fix adds activation observers: they watch the model's calibration pass ahead of its verdict
    ahead = {s.name: dict(s.ahead) for s in with_screens.plan.screens}
    assert ahead["per_channel"] == ahead["dynamic_static"] == {}
    assert ahead["outlier"] and \
        all(change == {"activation_observer": "histogram"} for change in ahead["outlier"].values())
    as_text = {key: json.dumps(f.to_dict(), sort_keys=True) for key, f in screened.items()}
    with monkeypatch.context() as patched:  # as a big model is: weights quantized where read, screens still on
        patched.setattr(pipelines, "LARGE_MODEL_BYTES", 0)
        large, with_large_screens = analyze_with_checks(wide_rows, batches, **settings)
    assert {s.name for s in with_large_screens.plan.screens} == {"per_channel", "dynamic_static", "outlier"}
    assert as_text == {key: json.dumps(f.to_dict(), sort_keys=True) for key, f in large.items()}
    monkeypatch.setattr(DetectorCheck, "screen", lambda self, model, layers: None)  # each fix tried in a trial
    tried, without = analyze_with_checks(wide_rows, batches, **settings)
    assert not without.plan.screens
    assert as_text == {key: json.dumps(f.to_dict(), sort_keys=True) for key, f in tried.items()}
    assert screened[("per_channel", "layers.2")].verdict == "fail"  # advised, and measured by its trial
    assert screened[("per_channel", "layers.0")].note.endswith("not recommended")
    # each screened check measured its heuristic's whole list in the comparison pass, not in a trial
    assert len(with_screens.context.variants) < len(without.context.variants)


def _outlier_screened(*other_screens):
    """(float graph, batches, its analysis with an outlier screen of layers 0, 2 and 4 and `other_screens`, the
    screen's change): an input channel far out in every batch."""
    import qcore
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.measure.screens import Screen
    from qcore.report import OutlierDetector

    batches = _features(5)
    for x in batches:
        x[5, 7] = 10.0
    change = {"activation_observer": "histogram"}
    float_gm = qcore.capture(seeded_mlp(), batches[0])
    screen = Screen("outlier", lambda reports: {layer: change for layer in SCREENED if layer in reports["outlier"]})
    analysis = ModelAnalysis(float_gm, batches=batches, plan=AnalysisPlan(
        frozenset({"sqnr", "detectors"}), {"outlier": OutlierDetector()}, (screen, *other_screens)))
    return float_gm, batches, analysis, change


SCREENED = ["layers.0", "layers.2", "layers.4"]


def test_a_screen_measures_each_layer_as_a_trial_of_the_same_fix_would():
    import qcore
    from qcore.analysis import ModelAnalysis
    from qcore.measure.screens import Screen

    broken = Screen("broken", lambda reports: 1 / 0)  # a screen only saves a trial: the measurement goes on
    float_gm, batches, analysis, change = _outlier_screened(broken)
    found = analysis.screened("outlier")
    assert analysis.screened("broken") is None
    assert dict(found.changes) == {layer: change for layer in SCREENED}
    fix = qcore.quantization.quantizer.with_layer_overrides(analysis.quantizer, dict(found.changes))
    trial = ModelAnalysis(float_gm, batches=batches).variant(fix)  # a model of its own: every shadow runs
    assert found.own_sqnr_db == {layer: trial.sqnr.layers[layer].shadow_sqnr_db for layer in SCREENED}  # exactly
    assert found.own_sqnr_db != {layer: analysis.sqnr.layers[layer].shadow_sqnr_db for layer in SCREENED}


def test_a_trial_takes_the_screens_own_sqnr_of_each_layer_it_quantizes_the_same_way():
    from qcore.analysis import ModelAnalysis
    from qcore.quantization.quantizer import with_layer_overrides
    from tests.helpers import count_op_calls

    float_gm, batches, analysis, change = _outlier_screened()
    layers = SCREENED
    assert dict(analysis.screened("outlier").changes) == {layer: change for layer in layers}

    def trials(changes, focus):
        fix = with_layer_overrides(analysis.quantizer, changes)
        fresh = ModelAnalysis(float_gm, batches=batches).variant(fix, layers=focus, layer_kinds={"own"}).sqnr
        linears, taken = count_op_calls(lambda: analysis.variant(fix, layers=focus, layer_kinds={"own"}).sqnr,
                                        torch.ops.aten.addmm)
        assert taken == fresh  # the same numbers, to the bit, as a trial that runs every shadow
        return linears

    # the screen's fix: every shadow is the screen's, and the trial runs the quantized graph alone (4 linears)
    assert trials({layer: change for layer in layers}, layers) == 4 * len(batches)
    # a layer's observer observes what it reads: without layers.0's change, layers.2's shadow is still the screen's
    assert trials({"layers.2": change, "layers.4": change}, ["layers.2"]) == 4 * len(batches)
    # with per-tensor weights too, layers.2 is quantized otherwise than in the screen's copy: its shadow runs, on
    # layers.2's float input that the model's comparison pass kept for the screened layers, and compares with
    # layers.4's kept input (layers.2's float value): no float layer
    other = {"layers.2": {**change, "per_channel": False}, "layers.4": change}
    assert trials(other, ["layers.2"]) == (4 + 1) * len(batches)
    # layers.4's shadow is the screen's: the quantized graph alone
    assert trials(other, ["layers.4"]) == 4 * len(batches)


@pytest.mark.parametrize("where_read", [False, True])  # a large model's weights are quantized where they are read
def test_a_shadow_signature_tells_the_same_computation_from_another(where_read):
    import qcore
    from qcore.graph.capture import clone_graph_module
    from qcore.graph.ops import find_quantizable_ops
    from qcore.measure.passes import calibrate_and_convert, compare_quantized
    from qcore.numeric.instrument import shadow_signature
    from qcore.quantization.convert import quantize_weights_where_read
    from qcore.quantization.prepare import prepare
    from qcore.quantization.quantizer import with_layer_overrides

    batches = _features(3)
    for x in batches:
        x[5, 7] = 10.0
    float_gm = qcore.capture(seeded_mlp(), batches[0])

    def measured(quantizer):
        prepared = prepare(clone_graph_module(float_gm, share_parameters=True), quantizer)
        with quantize_weights_where_read(where_read):
            quantized = calibrate_and_convert(prepared, float_gm, batches, keep_float_weights=False)
        signatures = {op.layer: shadow_signature(quantized, op) for op in find_quantizable_ops(quantized)}
        sqnr, _ = compare_quantized(float_gm, quantized, batches, [], {})
        return signatures, {layer: entry.shadow_sqnr_db for layer, entry in sqnr.layers.items()}

    base = qcore.Int8StaticQuantizer(per_channel=False)
    plain, again = measured(base), measured(base)
    assert all(signature is not None for signature in plain[0].values())
    assert plain == again  # another quantized copy, made the same way
    for changes in ({"layers.2": {"per_channel": True}}, {"layers.2": {"activation_observer": "histogram"}},
                    {"layers.4": {"activation_observer": "histogram"}, "layers.6": {"per_channel": True}}):
        other = measured(with_layer_overrides(base, changes))
        assert all(other[0][layer] != plain[0][layer] for layer in changes)  # quantized otherwise
        same = [layer for layer in plain[0] if other[0][layer] == plain[0][layer]]
        assert same and all(other[1][layer] == plain[1][layer] for layer in same)  # the same shadow, the same value



def test_a_screens_observers_calibrated_ahead_give_the_same_measurement_without_a_pass_of_its_own(monkeypatch):
    import qcore
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.measure.screens import Screen
    from qcore.quantization import calibrated as calibrated_module
    from qcore.report import OutlierDetector

    batches = _features(5)
    for x in batches:
        x[5, 7] = 10.0
    change = {"activation_observer": "histogram"}
    float_gm = qcore.capture(seeded_mlp(), batches[0])
    every = {layer: change for layer in ("layers.0", "layers.2", "layers.4")}
    named = ["layers.0", "layers.4"]  # the screen changes fewer layers than it may
    passes = []
    calibrate = calibrated_module.calibrate  # the screen's copy calibrates through calibrate_kept
    monkeypatch.setattr(calibrated_module, "calibrate", lambda *args: passes.append(1) or calibrate(*args))

    def screened(ahead):
        screen = Screen("outlier", lambda reports: {layer: change for layer in named}, ahead)
        analysis = ModelAnalysis(float_gm, batches=batches, plan=AnalysisPlan(
            frozenset({"sqnr", "detectors"}), {"outlier": OutlierDetector()}, (screen,)))
        return analysis.screened("outlier"), analysis.sqnr

    (alone, sqnr_alone), without_ahead = screened({}), len(passes)
    graph_before = [(node.format_node(), set(node.meta)) for node in float_gm.graph.nodes]
    modules_before = {name: type(module) for name, module in float_gm.named_modules()}
    (ahead, sqnr_ahead), with_ahead = screened(every), len(passes) - without_ahead
    assert (without_ahead, with_ahead) == (1, 0)  # the screen's copy took every observer's state
    # the observers ahead come from a view of the float graph (qcore.graph.capture.graph_view): it is left as it was
    assert [(node.format_node(), set(node.meta)) for node in float_gm.graph.nodes] == graph_before
    assert {name: type(module) for name, module in float_gm.named_modules()} == modules_before
    assert dict(ahead.own_sqnr_db) == dict(alone.own_sqnr_db) and set(ahead.own_sqnr_db) == set(named)
    assert sqnr_ahead == sqnr_alone  # the model's own measurement does not see the observers ahead
    before = len(passes)
    broken, _ = screened({"layers.0": {"bogus": 1}})  # refused by with_layer_overrides: the screen calibrates itself
    assert len(passes) - before == 1 and dict(broken.own_sqnr_db) == dict(alone.own_sqnr_db)


def _ladder():
    from tests.helpers import LADDER_NET

    namespace = {"torch": torch, "nn": nn}
    exec(LADDER_NET, namespace)
    torch.manual_seed(0)
    return namespace["Net"]().eval()


def test_a_format_fix_pasted_changes_the_formats_of_the_layers_it_names_and_no_other():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 128, generator=g) for _ in range(4)]
    settings = {"quantizer": "NVFP4", "checks": ["model_sqnr"], "model_sqnr_min_db": 14.0, "fix_budget": math.inf}
    found, before = analyze_with_checks(_ladder, batches, **settings)
    fix = ast.literal_eval(re.search(r"layer_formats=(\{.*?\})", found[("model_sqnr", "output")].message).group(1))
    assert 0 < len(fix) < 4
    again, after = analyze_with_checks(_ladder, batches, **settings, layer_formats=fix)
    assert changed_layers(before, after) == set(fix) and again[("model_sqnr", "output")].verdict == "pass"


def test_an_equalization_item_whose_fix_the_whole_model_does_not_keep_fails_and_says_how_to_accept_it():
    """The examples' tiny_encoder: smoothing gains 1.2-1.3 dB on two attention projections in the comparison pass
    (the verdict), under 1 dB on the whole smoothed model (its trial). The items fail, say what the trial measured,
    and name the setting that accepts them, which does when pasted."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    from models import TinyEncoder, seeded

    batches = padded_token_batches(6, 8, 32, padded_from=24, vocabulary=1000, seed=2)  # the examples' token_batches
    settings = {"quantizer": "int8_histogram", "checks": ["equalization", "model_sqnr"], "fix_budget": math.inf}
    found, _ = analyze_with_checks(lambda: seeded(TinyEncoder), batches, **settings)
    failing = {layer: f for (check, layer), f in found.items() if check == "equalization" and f.verdict == "fail"}
    assert failing, found
    hints = {}
    for layer, finding in failing.items():
        assert finding.value >= 1.0 and "on the whole model measured" in finding.message, finding.message
        hint = re.search(r"raise equalization_min_gain_db above ([\d.]+) dB", finding.message)
        assert hint and finding.value <= float(hint.group(1)) < finding.value + 0.01, finding.message
        hints[layer] = float(hint.group(1))
    accepted, _ = analyze_with_checks(lambda: seeded(TinyEncoder), batches, **settings,
                                      equalization_min_gain_db=max(hints.values()) + 0.001)
    assert all(accepted[("equalization", layer)].verdict == "pass" for layer in failing)


def test_the_first_layer_failing_on_its_own_is_found_once_per_model_not_once_per_item(monkeypatch):
    import torch
    from torch import nn

    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.checks import sqnr as sqnr_check
    from pytest_qreport.core.registry import ModelContext
    from pytest_qreport.core.settings import ModelSettings
    from qcore.analysis import ModelAnalysis

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(12)]
    with torch.no_grad():  # a wide row in layer 3: its own error and the next one's, inherited by the layers after
        layers[3].weight[0] *= 400.0
    model = nn.Sequential(*layers).eval()
    batches = [torch.randn(8, 16) for _ in range(3)]
    analysis = ModelAnalysis(qcore.capture(model, batches[0]), qcore.Int8StaticQuantizer(), batches)
    context = ModelContext("mlp", ModelSettings.defaults(BUILTIN_CHECKS), analysis)
    threshold, measured = 35.0, analysis.sqnr.layers
    names = [entry.layer for entry in analysis.layers]

    def brute_force(layer: str) -> str:
        for name in names:
            if name == layer:
                return ""
            if sqnr_check.own_error_layers(measured, [name], threshold):
                return name
        return ""

    expected = {layer: brute_force(layer) for layer in names}
    assert sum(bool(found) for found in expected.values()) >= 6  # most layers inherit an error from one before
    calls = []
    original = sqnr_check.own_error_layers
    monkeypatch.setattr(sqnr_check, "own_error_layers", lambda *args: calls.append(1) or original(*args))
    assert {layer: sqnr_check._first_own_error_before(context, layer, threshold) for layer in names} == expected
    assert len(calls) <= len(names)  # one walk over the layers for every item, not one per item


def test_each_equalization_item_reads_the_comparison_pass_gain_of_its_own_layer_not_of_every_layer(monkeypatch):
    """An item's verdict reads what the verdict pass measured of its own layer: reading every layer's for each item
    is quadratic in the layers (an MoE model has thousands of expert projections)."""
    from pytest_qreport.fixes import equalize

    asked = []
    original = equalize.variant_gains
    monkeypatch.setattr(equalize, "variant_gains", lambda scope, method, layers=None: asked.append(
        len(scope.analysis.equalizable_layers) if layers is None else len(layers)) or original(scope, method, layers))
    found, analysis = analyze_with_checks(sensor_mlp, _sensor_batches(), quantizer="int8_histogram",
                                          checks=["input_weight_equalization"], fix_budget=math.inf)
    items = [f for (check, _), f in found.items() if check == "input_weight_equalization"]
    assert len(items) >= 4 and asked
    assert sum(asked) <= len(items) + len(analysis.equalizable_layers)  # one each, and the advice's candidates
