"""Names are safe: a model name that could leave the baseline directory is an error on its own item, and hostile
layer and model names are escaped in the terminal, the HTML and the JUnit XML."""
import xml.etree.ElementTree as ET

import pytest
import torch

from tests.helpers import TINY_SOURCE

HOSTILE = '<script>alert("x")</script>\x07\'\ud800'


@pytest.mark.parametrize("name", ["../../../escaped", "a/b", ".", "..", "with space", ""])
def test_bad_model_names_are_refused_with_the_fix(name):
    from pytest_qreport.core.declare import model_name_problem

    problem = model_name_problem(name)
    assert "is not allowed" in problem and "qmodel(name='...')" in problem
    assert model_name_problem("llama-3.2_1b") == ""


def test_the_baseline_path_cannot_leave_its_directory(tmp_path):
    from pytest_qreport.core.baseline import baseline_path

    assert baseline_path(tmp_path, "fine").parent == tmp_path / "__qreport__"
    with pytest.raises(ValueError, match="outside the baseline directory"):
        baseline_path(tmp_path, "../../escaped")


def test_an_escaping_qmodel_name_errors_on_its_own_item_and_writes_nothing(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr", name="../../../escaped")
def bad():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr")
def good():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-update-baseline")
    result.assert_outcomes(passed=3, errors=1)  # good: two sqnr items and its baseline item
    assert "the model name '../../../escaped' is not allowed" in result.stdout.str()
    written = sorted(p.relative_to(pytester.path.parent.parent) for p in pytester.path.parent.parent.rglob("*.json")
                     if "escaped" in p.name)
    assert written == [] and (pytester.path / "__qreport__" / "good.json").exists()


def test_the_fixture_refuses_an_escaping_name_and_a_parametrized_id(pytester):
    pytester.makepyfile(test_names='''
import pytest
import torch
from torch import nn


@pytest.mark.parametrize("variant", ["model/v2"])
def test_x(qreport, request, variant):
    model = nn.Linear(8, 4).eval()
    with pytest.raises(ValueError, match="is not allowed"):
        qreport.analyze(model, [torch.randn(4, 8)], name="../../../escaped", checks="sqnr")
    with pytest.raises(ValueError, match="is not allowed.*qreport.analyze"):
        qreport.analyze(model, [torch.randn(4, 8)], name=request.node.name, checks="sqnr")
''')
    pytester.runpytest("-p", "no:cacheprovider", "--qreport-update-baseline").assert_outcomes(passed=1)
    assert not list(pytester.path.parent.rglob("escaped.json"))


def test_hostile_names_are_escaped_in_the_terminal_the_html_and_the_junit_xml():
    from pytest_qreport.core.findings import Finding, RunOutcome
    from pytest_qreport.core.results import ModelFacts
    from pytest_qreport.reports.html import build_html
    from pytest_qreport.reports.jsonfile import build_report
    from pytest_qreport.reports.junit import junit_text
    from pytest_qreport.reports.terminal import render_summary

    rows = [Finding(model=HOSTILE, check="sqnr", layer=HOSTILE, metric="sqnr_db", value=10.0, threshold=20.0,
                    verdict="fail", message=f"layer {HOSTILE}: too low")]
    models = {HOSTILE: ModelFacts(HOSTILE)}
    text = render_summary(rows, "all")
    assert "\x07" not in text and "\\x07" in text and "\\ud800" in text
    text.encode("utf-8")  # a terminal can write it
    page = build_html(build_report(rows, models))
    assert '<script>alert("x")' not in page and "&lt;script&gt;" in page
    assert "\ud800" not in page and "\x07" not in page and "\\ud800" in page
    page.encode("utf-8")  # a lone surrogate would not encode
    root = ET.fromstring(junit_text(rows, models).encode("utf-8"))
    case = root.find(".//testcase")
    assert case is not None and "<script>" in case.get("name") and "\x07" not in case.get("name")
    assert RunOutcome(1, 1).not_run == 0


SEQUENTIAL_HEAD = TINY_SOURCE + '''

class Headed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.head(self.body(x))


@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr", {options})
def headed():
    torch.manual_seed(0)
    return Headed().eval()
'''


def test_a_module_name_reaches_the_layers_inside_it_and_a_name_that_matches_nothing_is_an_error(pytester):
    from torch import nn

    import qcore
    from qcore.analysis import quantized_layers

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    float_gm = qcore.capture(model.eval(), torch.randn(4, 8))
    kept = {entry.layer for entry in quantized_layers(float_gm, qcore.Int8StaticQuantizer(
        layer_overrides={"1": {"skip": True}}))}
    assert kept == {"0"}  # "1" is the inner Sequential: both of its linears stay in float
    pytester.makeconftest(SEQUENTIAL_HEAD.replace("{options}", "float_layers='head'"))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json")
    result.assert_outcomes(passed=1)  # only body is quantized: head.1 and head.3 stay in float
    settings = {"float_layers": "float_layers='heads'", "skip_layers": "skip_layers='heads'",
                "layers": "layers='heads'", "equalize": "equalize=['heads']",
                "layer_overrides": "quantizer=qcore.Int8StaticQuantizer(layer_overrides={'heads': {'skip': True}})"}
    source = SEQUENTIAL_HEAD.replace("{options}", settings["float_layers"]).replace(
        "from pytest_qreport import qmodel", "from pytest_qreport import qmodel\nimport qcore")
    for index, setting in enumerate(list(settings.values())[1:], start=1):  # one model per setting, one run
        source += (f"\n\n@qmodel(calibration=[torch.randn(16, 8)], checks='sqnr', {setting})\ndef headed_{index}():\n"
                   "    torch.manual_seed(0)\n    return Headed().eval()\n")
    pytester.makeconftest(source)
    failing = pytester.runpytest("--qreport", "-p", "no:cacheprovider")
    failing.assert_outcomes(errors=5)
    for index, key in enumerate(settings):
        name = "headed" if index == 0 else f"headed_{index}"
        assert f"model '{name}': {key} ['heads'] match no layer, nor a module holding one; layers: body, head.1, " \
               "head.3" in failing.stdout.str(), key
