"""The check registry and settings: a check owns its threshold, an unknown setting names the closest one, the
checks' needs make the analysis plan, and a quantizer states its own clipping and per-channel behaviour."""
import json

import pytest
import torch

from tests.helpers import TINY_SOURCE, builtin_registry, summary_section, tiny_sequential


def test_the_cosine_check_owns_its_threshold_and_measures_the_numeric_suites_cosine(pytester):
    from pytest_qreport.checks import CosineCheck
    from pytest_qreport.core.settings import model_schema

    assert [s.name for s in CosineCheck.settings] == ["cosine_min"] and "cosine_min" in model_schema([CosineCheck])
    pytester.makeconftest(TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="cosine,sqnr", severity={"cosine": "fail"},
        cosine_min=0.99999)
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "--qreport-json=r.json", "--qreport-table=all")
    report = json.loads((pytester.path / "r.json").read_text())
    rows = {(r["check"], r["layer"]): r for r in report["rows"]}
    for layer in ("fc1", "fc2"):
        cosine, sqnr = rows[("cosine", layer)], rows[("sqnr", layer)]
        assert cosine["threshold"] == 0.99999 and cosine["value"] == pytest.approx(sqnr["details"]["cosine"])
        assert cosine["verdict"] == ("pass" if cosine["value"] >= 0.99999 else "fail")
    assert "cosine" in summary_section(result)
    # the threshold is a command-line option too, and the command line wins over qmodel(...)
    loose = pytester.runpytest("--qreport", "--qreport-json=r.json", "--qreport-cosine-min", "0.5")
    assert {r["threshold"] for r in json.loads((pytester.path / "r.json").read_text())["rows"]
            if r["check"] == "cosine"} == {0.5}
    loose.assert_outcomes(passed=4)


def test_an_unknown_setting_names_the_closest_one():
    from pytest_qreport.core.declare import ModelDeclaration
    from pytest_qreport.core.settings import resolve_settings

    session = {"cli": {}, "ini": {}}
    declaration = ModelDeclaration("m", tiny_sequential, __file__, settings={"cosine_mn": 0.9})
    with pytest.raises(ValueError, match="'cosine_mn' \\(did you mean 'cosine_min'\\?\\)"):
        resolve_settings(session, declaration, builtin_registry())


def test_the_checks_needs_are_the_analysis_plan():
    import qcore
    from pytest_qreport.core import registry
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from qcore.analysis import MEASUREMENTS, AnalysisPlan

    assert registry.MEASUREMENTS == MEASUREMENTS
    with pytest.raises(ValueError, match="unknown measurement"):
        AnalysisPlan(measurements=frozenset({"speed"}))
    checks = builtin_registry()
    batch = torch.randn(4, 8)
    settings = ModelSettings.defaults(checks.checks(), checks=["sqnr", "outlier", "equalization"])
    plan = collect_model("tiny", settings, checks, qcore.Int8StaticQuantizer(), tiny_sequential(),
                         batch).context.analysis.plan
    assert plan.measurements == {"sqnr", "detectors", "equalization"} and list(plan.detectors) == ["outlier"]
    with pytest.raises(TypeError):
        plan.detectors["other"] = None  # immutable
    sqnr_only = ModelSettings.defaults(checks.checks(), checks=["sqnr"])
    plan = collect_model("tiny", sqnr_only, checks, qcore.Int8StaticQuantizer(), tiny_sequential(),
                         batch).context.analysis.plan
    assert plan.measurements == {"sqnr"} and not plan.detectors and not plan.equalization


def test_a_quantizer_states_its_own_clipping_and_per_channel_behaviour():
    import qcore
    from qcore.analysis import quantized_layers
    from qcore.observe.observers import HistogramObserver, MinMaxObserver

    assert HistogramObserver.clips_outliers and not MinMaxObserver.clips_outliers
    gm = qcore.capture(tiny_sequential(), torch.randn(2, 8))
    described = {name: [(entry.per_channel, entry.clipping) for entry in quantized_layers(gm, quantizer)]
                 for name, quantizer in [("int8", qcore.Int8StaticQuantizer()),
                                         ("per_tensor", qcore.Int8StaticQuantizer(per_channel=False)),
                                         ("histogram", qcore.Int8StaticQuantizer(activation_observer="histogram"))]}
    assert described == {"int8": [(True, False)] * 2, "per_tensor": [(False, False)] * 2,
                         "histogram": [(True, True)] * 2}



def test_detector_entries_are_read_to_the_host_together():
    """A detector check reads the numbers its findings need for all layers in one copy per dtype and rank (on a GPU,
    one wait instead of one per layer); keys and layers it does not read stay as they were."""
    from pytest_qreport.checks.detectors import read_to_host
    from tests.helpers import count_aten_ops

    report = {f"layer{i}": {"stat": torch.tensor(0.25 * i), "flag": torch.tensor(i % 2 == 0),
                            "ratios": torch.arange(3.0) + i, "other": torch.ones(2)} for i in range(5)}
    ops, read = count_aten_ops(lambda: read_to_host(report, ["layer1", "layer2", "layer3"], ("stat", "flag", "ratios")))
    assert ops <= 3 * 2  # a stack or cat, and one read to the host, for each of the 3 groups
    assert read["layer2"]["stat"] == 0.5 and read["layer2"]["flag"] is True and read["layer3"]["ratios"] == [3, 4, 5]
    assert isinstance(read["layer1"]["other"], torch.Tensor) and isinstance(read["layer4"]["stat"], torch.Tensor)
    assert isinstance(report["layer2"]["stat"], torch.Tensor)  # the report itself is left as it was


def test_a_calibration_failure_in_what_qcore_adds_to_the_model_does_not_blame_the_batches():
    from torch import nn

    import qcore
    from pytest_qreport.core.explain import explain
    from qcore.rewrites.equalize import equalize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    batches = [torch.randn(8) for _ in range(2)]  # 1-d inputs, which the equalization observer does not take
    with pytest.raises(qcore.CalibrationError) as raised:
        equalize(qcore.capture(model, batches[0]), ["0", "2"], batches)
    text = explain("m", "the analysis", raised.value)
    assert text.startswith("model 'm': calibration batch 0 of 2 failed in qcore's InputEqualizationObserver.forward "
                           "(equalize.py:")
    assert "supports linear and conv inputs" in text and "The batch is not at fault" in text
    assert "Fix the calibration batches" not in text
    # a batch the model itself cannot take is still the batches' to fix
    with pytest.raises(qcore.CalibrationError) as raised:
        qcore.calibrate(qcore.capture(model, torch.randn(2, 8)), [torch.randn(2, 8), torch.randn(2, 5)])
    assert "Fix the calibration batches" in explain("m", "the analysis", raised.value)
