"""A worker that dies, a run that is interrupted: no result is lost without a word (issue: reliability)."""
import re
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import TINY_SOURCE

CRASHING = TINY_SOURCE + '''
import os


@pytest.fixture
def dying_batches():
    os._exit(3)   # as a segfault or the out-of-memory killer would end the worker


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr,model_sqnr")
def alpha():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="dying_batches", example_inputs=torch.randn(4, 8), checks="sqnr,model_sqnr")
def crashy():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr,model_sqnr")
def omega():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def _cases(path):
    root = ET.parse(path).getroot()
    return {(case.get("classname"), case.get("name")): case for case in root.iter("testcase")}


@pytest.mark.parametrize("dist", ["load", "loadgroup"])
def test_a_crashing_worker_costs_one_restart_and_every_item_keeps_a_row(pytester, dist):
    pytester.makeconftest(CRASHING)
    result = pytester.runpytest("--qreport", "-n", "2", "--dist", dist, "--qreport-junitxml=q.xml",
                                "--junitxml=j.xml", "-v")
    text = result.stdout.str()
    assert "INTERNALERROR" not in text
    assert text.count("replacing crashed worker") == 1  # not one restart per item of the model
    result.assert_outcomes(passed=6, failed=1, errors=2)
    ours, pytests = _cases(pytester.path / "q.xml"), _cases(pytester.path / "j.xml")
    assert len(ours) == len(pytests) == 9  # 3 models x (fc1, fc2, output)
    crashed = [case for (suite, _), case in ours.items() if suite.startswith("qreport.crashy")]
    assert len(crashed) == 3 and all(case.find("error") is not None for case in crashed)
    assert any("died before the analysis finished" in (case.find("error").text or "") for case in crashed)
    summary = text[text.index("qreport summary"):]
    assert len(re.findall(r"^crashy ", summary, re.M)) == 3 and "6 pass, 3 error" in summary  # its table rows


INTERRUPTED = TINY_SOURCE + '''

@pytest.fixture
def interrupted_batches():
    raise KeyboardInterrupt   # Ctrl-C during the second model's calibration


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr")
def first():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="interrupted_batches", example_inputs=torch.randn(4, 8), checks="sqnr")
def second():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def test_ctrl_c_says_the_run_is_incomplete_and_keeps_the_last_complete_reports(pytester):
    pytester.makeconftest(INTERRUPTED)
    (pytester.path / "q.xml").write_text("<testsuites/>")  # the last complete report
    result = pytester.runpytest("--qreport", "--qreport-junitxml=q.xml", "--qreport-json=r.json")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([
        "*qreport summary*",
        "the run stopped early (interrupted): these results are incomplete",
        "no qreport item failed before the run stopped",
        "2 pass; 2 of 4 qreport items did not run",
        "qreport: the run stopped early (interrupted), so --qreport-json r.json was not written",
        "qreport: the run stopped early (interrupted), so --qreport-junitxml q.xml was not written; the previous "
        "file is unchanged",
    ])
    assert "all qreport checks passed" not in result.stdout.str()
    assert (pytester.path / "q.xml").read_text() == "<testsuites/>"
    assert not (pytester.path / "r.json").exists()


def test_stopping_at_the_first_failure_is_an_incomplete_run_too(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr", sqnr_min_db=99.0)
def strict():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "-x", "--qreport-junitxml=q.xml")
    result.stdout.fnmatch_lines(["the run stopped early (stopping after 1 failures)*",
                                 "1 fail; 1 of 2 qreport items did not run"])
    assert not (pytester.path / "q.xml").exists()


def test_a_model_declared_twice_in_one_conftest_is_an_error_not_a_silent_replacement(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr")
def tiny():
    return Tiny().eval()


@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr", name="tiny")
def tiny_again():
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*model 'tiny' is declared twice in *conftest.py (lines * and *)*"])


def test_models_of_one_name_in_two_conftests_stay_apart_in_summary_xml_json_and_baselines(pytester):
    model = TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr", sqnr_min_db={threshold})
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
'''
    for folder, threshold in (("vision", 99.0), ("text", 0.0)):
        pytester.mkpydir(folder).joinpath("conftest.py").write_text(model.format(threshold=threshold))
    args = ("--qreport", "--qreport-table=all", "--qreport-junitxml=q.xml", "--qreport-json=r.json")
    result = pytester.runpytest(*args, "--qreport-update-baseline")
    result.assert_outcomes(passed=4, failed=2)  # two sqnr items and a baseline item per model
    summary = result.stdout.str()[result.stdout.str().index("qreport summary"):]
    assert "vision/conftest.py::tiny  sqnr" in summary and "text/conftest.py::tiny    sqnr" in summary
    suites = {s.get("name"): s for s in ET.parse(pytester.path / "q.xml").getroot().iter("testsuite")}
    assert set(suites) == {"qreport.vision/conftest.py::tiny", "qreport.text/conftest.py::tiny"}
    assert all(len(list(suite.iter("testcase"))) == 3 for suite in suites.values())
    import json

    report = json.loads((pytester.path / "r.json").read_text())
    assert set(report["models"]) == {"vision/conftest.py::tiny", "text/conftest.py::tiny"}
    for folder in ("vision", "text"):  # each baseline written from its own model's rows
        baseline = json.loads((pytester.path / folder / "__qreport__" / "tiny.json").read_text())
        assert baseline["model"] == "tiny"
        verdicts = {entry["verdict"] for entry in baseline["entries"].values()}
        assert verdicts == ({"fail"} if folder == "vision" else {"pass"})
    shared = pytester.runpytest("--qreport", "--qreport-baseline-dir=baselines")
    shared.stdout.fnmatch_lines(["*would share the baseline file *tiny.json (--qreport-baseline-dir)*"])
