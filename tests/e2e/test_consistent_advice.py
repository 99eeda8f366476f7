"""One model gets one consistent fix: the sqnr items of a model whose output fails advise the model_sqnr item's
fix, an inherited error names the layer it comes from, and a fix shared by many items is printed once."""
import json
import math
import pathlib

from pytest_qreport.checks.detectors import OutlierCheck
from pytest_qreport.core.findings import Finding
from pytest_qreport.fixes import Advice, Fix, Trial
from pytest_qreport.reports.terminal import render_summary
from tests.helpers import run_examples

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fragile_gets_one_fix_on_every_item(pytester, monkeypatch):
    report = pytester.path / "r.json"
    run_examples(pytester, monkeypatch, "-k", "fragile", f"--qreport-json={report}", failing=True)
    rows = {(r["check"], r["layer"]): r for r in json.loads(report.read_text())["rows"] if r["model"] == "fragile"}
    output = rows[("model_sqnr", "output")]["message"]
    fix = output[output.index("float_layers="):].rstrip(".")
    assert "was measured to reach" in output
    own = rows[("sqnr", "layers.4")]["message"]
    assert f"qmodel(..., {fix})" in own and "reaching model_sqnr_min_db" in own
    assert "keeping it in float with the layers the model_sqnr item names (measured: the model output" in own
    inherited = rows[("sqnr", "layers.6")]["message"]
    assert "The first layer before it that fails on its own is layers.4" in inherited
    assert "upstream" not in inherited


def _trial(fix, layers):
    return Trial(fix, (30.0, 31.0), {layer: (10.0, 20.0) for layer in layers}, {}, {})


def test_a_fix_shared_by_many_items_is_printed_once():
    layers = ("a", "b", "c")
    fix = Fix("layer_overrides", {layer: {"activation_observer": "histogram"} for layer in layers}, layers)
    advice = Advice(_trial(fix, layers), _trial(fix, layers), layers, 1.0, "own")
    check = OutlierCheck()
    found = [check.judged(Finding(model="m", check="outlier", layer=layer, metric="max_percentile_ratio", value=9.0,
                                  threshold=3.5, verdict="fail", message=f"layer {layer}: outliers."), advice)
             for layer in layers]
    assert found[0].message.count("layer_overrides=") == 1
    assert all("layer_overrides=" not in f.message and "given on the item of a" in f.message for f in found[1:])
    assert all(f.details["fix"] == advice.fix_text() for f in found)
    text = render_summary(found, "failures")
    assert text.count(advice.fix_text()) == 1
    assert f"fix for m's 3 failing outlier items: {advice.fix_text()}" in text
    assert not math.isnan(found[0].details["measured_gain_db"])
