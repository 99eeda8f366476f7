"""The plugin's extension hooks and start-up checks: a custom check, quantizer name and waiver from a conftest,
fixtures that request fixtures at collection, and one UsageError line for a bad option."""
import re
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import TINY_SOURCE, outcomes, summary_section

EXTENDED = TINY_SOURCE + '''
import qcore
from pytest_qreport import Check


def _log(text):
    with open("fixture_log.txt", "a") as log:
        log.write(text + "\\n")


@pytest.fixture(scope="session")
def scale():
    _log("setup")
    yield 1.0
    _log("teardown")


@pytest.fixture
def batches(scale):
    g = torch.Generator().manual_seed(0)
    return [scale * torch.randn(16, 8, generator=g) for _ in range(4)]


class NormalizedL2(Check):
    """Normalized L2 error of each quantized layer's output against the float one (lower is better)."""

    name, order, metric, needs = "normalized_l2", 95, "normalized_l2", frozenset({"sqnr"})
    higher_is_better = False

    def findings(self, model, layers):
        maximum = self.options.get("max", 0.9)
        return [self.finding(model, layer, model.analysis.sqnr.layers[layer].normalized_l2, maximum,
                             message=f"layer {layer}: normalized L2 above {maximum}") for layer in layers]


def pytest_qreport_register_checks(registry):
    registry.register(NormalizedL2)


def pytest_qreport_make_quantizer(name):
    if name == "int8_float_head":
        return qcore.Int8StaticQuantizer(layer_overrides={"fc2": {"skip": True}})


def pytest_qreport_modify_findings(model, findings):
    for index, finding in enumerate(findings):
        if model == "tiny" and finding.check == "sqnr" and finding.layer == "fc1":
            findings[index] = finding.waive("accepted in review #7")


@qmodel(calibration="batches", checks="sqnr,normalized_l2", sqnr_min_db=90.0)
def tiny(scale):
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="batches", checks="sqnr", quantizer="int8_float_head")
def float_head():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def _extended(pytester):
    pytester.makeconftest(EXTENDED)
    return pytester


def test_custom_check_quantizer_and_waiver_from_a_conftest(pytester):
    _extended(pytester)
    result = pytester.runpytest("--qreport", "-v", "--qreport-table=all", "--junitxml=pytest.xml",
                                "--qreport-junitxml=qreport.xml")
    found = outcomes(result)
    assert found == {
        "conftest.py::qreport/tiny/sqnr/fc1": "PASSED",       # failed at 90 dB, waived by the hook
        "conftest.py::qreport/tiny/sqnr/fc2": "FAILED",
        "conftest.py::qreport/tiny/normalized_l2/fc1": "PASSED",
        "conftest.py::qreport/tiny/normalized_l2/fc2": "PASSED",
        "conftest.py::qreport/float_head/sqnr/fc1": "PASSED",  # fc2 is kept in float by the custom quantizer
    }
    summary = summary_section(result)
    assert re.search(r"tiny\s+sqnr\s+fc1\s+\S+ dB\s+90.0 dB\s+WAIVED\s+waived: accepted in review #7", summary)
    assert re.search(r"tiny\s+normalized_l2\s+fc2\s+0\.\d+\s+0.9\s+PASS", summary)
    assert "1 waived" in result.stdout.str()
    cases = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
             for c in ET.parse(pytester.path / "pytest.xml").getroot().iter("testcase")}
    assert cases["qreport/tiny/sqnr/fc1"]["waiver"] == "accepted in review #7"
    assert cases["qreport/tiny/normalized_l2/fc1"]["metric"] == "normalized_l2"
    suites = {s.get("name"): s for s in ET.parse(pytester.path / "qreport.xml").getroot().iter("testsuite")}
    tiny = {c.get("name"): c for c in suites["qreport.tiny"].iter("testcase")}
    assert set(tiny) == {"sqnr/fc1", "sqnr/fc2", "normalized_l2/fc1", "normalized_l2/fc2"}
    assert tiny["sqnr/fc1"].get("status") == "waived" and "waiver=accepted" in tiny["sqnr/fc1"].find("system-out").text
    assert suites["qreport.tiny"].get("failures") == "1"
    # the session-scoped generator fixture ran at collection and at run time, and was torn down both times
    log = (pytester.path / "fixture_log.txt").read_text().split()
    assert log == ["setup", "teardown"] * (len(log) // 2) and len(log) >= 4


def test_extensions_under_xdist_give_the_same_items_and_summary(pytester):
    _extended(pytester)
    args = ("--qreport", "-v", "--qreport-table=all", "-p", "no:cacheprovider")
    serial, parallel = pytester.runpytest(*args), pytester.runpytest(*args, "-n", "2")
    assert len(outcomes(serial)) == 5 and outcomes(serial) == outcomes(parallel)
    assert summary_section(serial) == summary_section(parallel)


def test_collect_only_prints_no_summary(pytester):
    _extended(pytester)
    result = pytester.runpytest("--qreport", "--collect-only", "-q")
    assert "qreport summary" not in result.stdout.str() and "all qreport checks passed" not in result.stdout.str()
    assert "qreport/tiny/normalized_l2/fc2" in result.stdout.str()


@pytest.mark.parametrize("args,ini,expected", [
    (["--qreport-severity", "outlier=loud"], "", "severity of outlier must be one of fail, warn, off, not 'loud'"),
    (["--qreport-checks", "sqrn"], "", "unknown qreport check 'sqrn' (did you mean 'sqnr'?)"),
    (["--qreport-checks", "normalised_l2"], "", "did you mean 'normalized_l2'?"),  # custom checks are known too
    (["--qreport-sqnr-min-db", "nan"], "", "sqnr_min_db must be a number of dB"),
    (["--qreport-equalization-min-gain-db", "-1"], "", "must be a non-negative number"),
    (["--qreport-quantizer", "int9"], "", "unknown quantizer 'int9'"),
    ([], "qreport_table = everything", "ini qreport_table: table must be one of failures, all"),
    ([], "qreport_severity = outlier=warn sqnr=never", "severity of sqnr must be one of"),
])
def test_a_bad_option_is_one_usage_error(pytester, args, ini, expected):
    _extended(pytester)
    if ini:
        pytester.makeini("[pytest]\n" + ini + "\n")
    result = pytester.runpytest("--qreport", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr.str()
    assert "collected" not in result.stdout.str()


def test_a_mistyped_qmodel_keyword_names_the_right_one(pytester):
    pytester.makeconftest(EXTENDED + '''

@qmodel(calibration="batches", sqnr_min=30.0)
def typo():
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "-v", "-k", "typo")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*qreport/typo/capture ERROR*",
                                 "*model 'typo': qmodel() got unknown keyword argument(s) 'sqnr_min' "
                                 "(did you mean 'sqnr_min_db'?)*"])


def test_a_missing_fixture_of_a_fixture_names_it(pytester):
    pytester.makeconftest(EXTENDED + '''

@pytest.fixture
def token_batches(tokenizer):
    return []


@qmodel(calibration="token_batches")
def needs_tokenizer():
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "-v", "-k", "needs_tokenizer")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*model 'needs_tokenizer': fixture 'tokenizer' not found*"])


def test_a_failing_calibration_fixture_shows_the_users_frame_first(pytester):
    pytester.makeconftest(EXTENDED + """

def _load_batches():
    raise FileNotFoundError("no calibration files in ./data")


@pytest.fixture
def broken_batches():
    return _load_batches()


@qmodel(calibration="broken_batches", example_inputs=torch.randn(16, 8), checks="sqnr")
def picky():
    return Tiny().eval()
""")
    result = pytester.runpytest("--qreport", "-k", "picky")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*model 'picky': loading the calibration batches failed in *conftest.py:* "
                                 "(_load_batches): FileNotFoundError: no calibration files in ./data*"])


def test_the_keep_in_float_hint_works_when_pasted(pytester):
    _extended(pytester)
    failing = pytester.runpytest("--qreport", "-k", "float_head", "--qreport-sqnr-min-db", "60")
    hint = re.search(r"keeping it in float \(measured: the model output [\d.]+ -> inf dB\): qmodel\(\.\.\., "
                     r"(float_layers=\[.*?\])\)", failing.stdout.str()).group(1)
    pytester.makeconftest(EXTENDED + f'''

@qmodel(calibration="batches", checks="sqnr", {hint})
def pasted():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    assert "'fc1'" in hint
    result = pytester.runpytest("--qreport", "-v", "-k", "pasted")
    assert outcomes(result) == {"conftest.py::qreport/pasted/sqnr/fc2": "PASSED"}  # fc1 now stays in float
