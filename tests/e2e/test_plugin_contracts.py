"""The redesign's contracts: a check declares its own threshold setting, a model's pipeline moves through explicit
stages, and a reporter that cannot write raises ReportError without hiding the other reporters."""
import importlib
import json
import math

import pytest
import torch
from torch import nn

from tests.helpers import TINY_SOURCE, summary_section


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _registry():
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.registry import CheckRegistry

    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    return registry


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
    declaration = ModelDeclaration("m", _tiny, __file__, settings={"cosine_mn": 0.9})
    with pytest.raises(ValueError, match="'cosine_mn' \\(did you mean 'cosine_min'\\?\\)"):
        resolve_settings(session, declaration, _registry())


def test_a_pipeline_moves_through_explicit_stages(monkeypatch):
    import qcore
    from pytest_qreport.core import pipeline as pipelines
    from pytest_qreport.core import runtime
    from pytest_qreport.core.pipeline import ModelPipeline, Stage, collect_model
    from pytest_qreport.core.settings import ModelSettings

    mapped: list[int] = []
    monkeypatch.setattr(runtime, "_set_mmap_threshold", mapped.append)
    where_read: list[bool] = []
    converting = importlib.import_module("qcore.analysis")  # where the plugin reads it
    original = converting.quantize_weights_where_read

    def recorded_where_read(enabled=True):
        where_read.append(enabled)
        return original(enabled)

    monkeypatch.setattr(converting, "quantize_weights_where_read", recorded_where_read)

    registry = _registry()
    batches = [torch.randn(4, 8) for _ in range(2)]
    settings = ModelSettings.defaults(registry.checks(), checks=["sqnr", "model_sqnr"])
    pipeline = collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), _tiny(), batches[0])
    assert pipeline.stage is Stage.COLLECTED and not pipeline.needs_capture
    assert pipeline.checks_and_layers() == [("sqnr", "0"), ("sqnr", "2"), ("model_sqnr", "output")]
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.stage is Stage.ANALYSED and pipeline.facts().fingerprint["threads"] == 1
    assert pipeline.finding("model_sqnr", "output").value > 20 and pipeline.facts().error == ""
    assert mapped == []  # a small model's analysis allocates from the heap: no page faults per activation
    assert where_read == [False]  # and keeps its quantized weights as tensors: no dequantization per forward

    broken = collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), _tiny(), batches[0])
    broken.analyze(lambda: [torch.randn(4, 3)], lambda found: None)
    assert broken.stage is Stage.ANALYSIS_FAILED and broken.failed and "model 'tiny'" in broken.error
    assert broken.facts().error == broken.error
    assert mapped == []
    monkeypatch.setattr(pipelines, "LARGE_MODEL_BYTES", 0)  # as if the model were big: its peak matters more
    collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), _tiny(), batches[0]).analyze(
        lambda: batches, lambda found: None)
    assert mapped == [1 << 20, 32 << 20]
    assert where_read[-1] is True  # a big model's weights are quantized where read (tests/qcore/test_weights_where_read.py)
    broken.analyze(lambda: batches, lambda found: None)  # a failed stage is final
    assert broken.stage is Stage.ANALYSIS_FAILED
    assert ModelPipeline("m").collection_failed("why").stage is Stage.COLLECTION_FAILED


def test_a_reporter_that_cannot_write_fails_the_run_and_the_others_still_write(pytester):
    pytester.makeconftest(TINY_SOURCE + '''
from pytest_qreport import ReportError


@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr")
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


class Dashboard:
    def pytest_qreport_report(self, results):
        assert [row.check for row in results.rows] == ["sqnr", "sqnr"] and set(results.models) == {"tiny"}
        raise ReportError("qreport: could not write the team dashboard: disk full")


def pytest_configure(config):
    config.pluginmanager.register(Dashboard(), "dashboard")


def pytest_qreport_report(rows, config, outcome):   # the older signature still works
    return "qreport: old-style reporter saw %d rows" % len(rows)
''')
    result = pytester.runpytest("--qreport", "--qreport-json=r.json", "--qreport-junitxml=j.xml")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*qreport: could not write the team dashboard: disk full*"])
    text = result.stdout.str()
    assert "qreport: JSON report written to r.json" in text and "qreport: JUnit XML written to j.xml" in text
    assert "qreport: old-style reporter saw 2 rows" in text
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["models"]["tiny"]["capture"]["method"] == "export" and len(report["rows"]) == 2


def test_numbers_have_one_spelling():
    from pytest_qreport.core.numbers import format_delta, format_value

    assert format_value(3.4028234663852886e38, "sqnr_db") == format_value(math.inf, "sqnr_db") == "inf dB"
    assert format_value(3.4028234663852886e38, "max_percentile_ratio") == "inf"
    assert format_delta(-0.0009639, "sqnr_db") == "0 dB" and format_delta(-0.0009639, "ratio") == "-0.000964"
    assert format_delta(-3.04, "sqnr_db") == "-3.0 dB" and format_delta(None) == "-"


NESTED = TINY_SOURCE + '''

class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x)


def spiky():
    batch = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    batch[0, 3] = 50.0   # one loud value in input channel 3: an outlier for body.0
    return [batch]


@qmodel(calibration=spiky(), checks="sqnr,outlier", sqnr_min_db=60, severity={"sqnr": "warn"})
def nested():
    torch.manual_seed(0)
    return Nested().eval()
'''


def test_what_verbose_prints_is_a_node_id_to_paste_back(pytester):
    pytester.makeconftest(NESTED)
    result = pytester.runpytest("--qreport", "-v", "-p", "no:cacheprovider")
    printed = [line.split()[0] for line in result.stdout.lines if line.startswith("conftest.py::qreport/")]
    assert "conftest.py::qreport/nested/sqnr/body.0" in printed, printed
    again = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "conftest.py::qreport/nested/sqnr/body.0")
    again.assert_outcomes(passed=1)


def test_a_failing_qreport_fixture_test_shows_no_torch_trace_log(pytester):
    pytester.makepyfile(test_fixture='''
import torch
from torch import nn


def test_too_strict(qreport):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    qreport.analyze(model, [torch.randn(4, 8) for _ in range(2)], checks="sqnr").assert_sqnr(90.0)
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "torch.__trace" not in result.stdout.str() and "2 of 2 layers below 90.0 dB" in result.stdout.str()


def test_warnings_point_at_the_declaring_conftest(pytester):
    pytester.makeconftest(NESTED)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "-W", "always")
    warned = [line for line in result.stdout.lines if "QReportWarning" in line]
    assert warned and all(line.strip().startswith(str(pytester.path / "conftest.py") + ":") for line in warned), warned


def test_the_checks_needs_are_the_analysis_plan():
    import qcore
    from pytest_qreport.core import registry
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from qcore.analysis import MEASUREMENTS, AnalysisPlan

    assert registry.MEASUREMENTS == MEASUREMENTS
    with pytest.raises(ValueError, match="unknown measurement"):
        AnalysisPlan(measurements=frozenset({"speed"}))
    checks = _registry()
    batch = torch.randn(4, 8)
    settings = ModelSettings.defaults(checks.checks(), checks=["sqnr", "outlier", "equalization"])
    plan = collect_model("tiny", settings, checks, qcore.Int8StaticQuantizer(), _tiny(), batch).context.analysis.plan
    assert plan.measurements == {"sqnr", "detectors", "equalization"} and list(plan.detectors) == ["outlier"]
    with pytest.raises(TypeError):
        plan.detectors["other"] = None  # immutable
    sqnr_only = ModelSettings.defaults(checks.checks(), checks=["sqnr"])
    plan = collect_model("tiny", sqnr_only, checks, qcore.Int8StaticQuantizer(), _tiny(), batch).context.analysis.plan
    assert plan.measurements == {"sqnr"} and not plan.detectors and not plan.equalization


def test_a_quantizer_states_its_own_clipping_and_per_channel_behaviour():
    import qcore
    from qcore.analysis import quantized_layers
    from qcore.observe.observers import HistogramObserver, MinMaxObserver

    assert HistogramObserver.clips_outliers and not MinMaxObserver.clips_outliers
    gm = qcore.capture(_tiny(), torch.randn(2, 8))
    described = {name: [(entry.per_channel, entry.clipping) for entry in quantized_layers(gm, quantizer)]
                 for name, quantizer in [("int8", qcore.Int8StaticQuantizer()),
                                         ("per_tensor", qcore.Int8StaticQuantizer(per_channel=False)),
                                         ("histogram", qcore.Int8StaticQuantizer(activation_observer="histogram"))]}
    assert described == {"int8": [(True, False)] * 2, "per_tensor": [(False, False)] * 2,
                         "histogram": [(True, True)] * 2}


def test_the_fixture_takes_a_calibration_fixture_by_name(pytester):
    pytester.makepyfile(test_named='''
import pytest
import torch
from torch import nn


@pytest.fixture
def batches():
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(0))]


def test_named(qreport):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    result = qreport.analyze(model, "batches", checks="sqnr")
    assert [f.layer for f in result.findings] == ["0", "2"]
''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_failing_assertion_is_an_assertion_error_with_the_whole_explanation(pytester):
    pytester.makepyfile(test_assertions='''
import pytest
import torch
from torch import nn


def _result(qreport):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    return qreport.analyze(model, [torch.randn(4, 8, generator=torch.Generator().manual_seed(0))], checks="sqnr")


def test_caught(qreport):
    result = _result(qreport)
    with pytest.raises(AssertionError, match="2 of 2 layers below 90.0 dB"):
        result.assert_sqnr(90.0)
    try:
        result.assert_model_sqnr(200.0)
    except AssertionError as error:
        assert "output SQNR" in str(error)


def test_shown(qreport):
    _result(qreport).assert_sqnr(90.0)
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([">       _result(qreport).assert_sqnr(90.0)",
                                 "E       pytest_qreport.QReportAssertionError: model 'test_shown': 2 of 2 layers "
                                 "below 90.0 dB"])
    assert "fixture.py" not in result.stdout.str()  # the plugin's own frames are hidden


def test_the_scheduler_keeps_a_models_items_together_and_can_queue_a_crashed_item_again():
    from pytest_qreport.xdist.scheduling import ModelGroupScheduling, work_unit

    class Node:
        def __init__(self, name):
            self.gateway, self.shutting_down, self.sent = type("G", (), {"id": name})(), False, []

        def send_runtest_some(self, indices):
            self.sent += indices

        def shutdown(self):
            self.shutting_down = True

    class Config:  # what xdist's parse_tx_spec_config reads: two local workers
        def getvalue(self, name):
            return ["2*popen"] if name == "tx" else None

    ids = ["c.py::qreport/a/sqnr/fc1", "c.py::qreport/a/sqnr/fc2", "c.py::qreport/b/sqnr/fc1", "t.py::test_x"]
    assert work_unit(ids[0]) == work_unit(ids[1]) == "c.py::qreport/a" and work_unit(ids[3]) == "t.py::test_x"
    scheduler = ModelGroupScheduling(Config())
    assert scheduler.numnodes == 2
    first, second = Node("gw0"), Node("gw1")
    for node in (first, second):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, ids)
    scheduler.schedule()
    assert sorted(first.sent + second.sent) == [0, 1, 2, 3]
    holder = first if 0 in first.sent else second
    assert 1 in holder.sent  # both of model a's items went to the same worker
    crashed = scheduler.remove_node(holder)
    assert crashed == ids[0] and ids[1] in scheduler.workqueue.get("c.py::qreport/a", {})
    scheduler.mark_test_pending(crashed)
    assert scheduler.workqueue["c.py::qreport/a"][crashed] is False
