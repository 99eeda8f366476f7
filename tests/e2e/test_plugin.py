"""The plugin end to end with pytester: items, verdicts, errors, summary, JUnit, settings, and xdist."""
import re
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import PLUGIN_CONFTEST, SQNR_ONLY, outcomes, summary_section

BROKEN_CAPTURE = '''

@qmodel(calibration="batches")
def branchy():
    return Branchy().eval()
'''

BROKEN_CALIBRATION = '''

@qmodel(calibration="wrong_batches", example_inputs=torch.randn(16, 8))
def tiny_bad_data():
    torch.manual_seed(0)
    return Tiny().eval()
'''




def _project(pytester, options="", extra="", ini=SQNR_ONLY):
    pytester.makeconftest(PLUGIN_CONFTEST.replace("{options}", options).replace("{extra}", extra))
    if ini:
        pytester.makeini("[pytest]\n" + ini)
    return pytester






def test_items_per_model_check_layer(pytester):
    _project(pytester)
    result = pytester.runpytest("--qreport", "--collect-only", "-q")
    names = [line.split("::")[1] for line in result.outlines if "::qreport/" in line]
    assert names == ["qreport/tiny/sqnr/fc1", "qreport/tiny/sqnr/fc2", "qreport/tiny/weight_sqnr/fc1",
                     "qreport/tiny/weight_sqnr/fc2", "qreport/tiny/model_sqnr/output"]


COUNTING = """

import qcore.analysis as _runner
_real_measure = _runner.measure_model


def _counting_measure(*args, **kwargs):
    with open("analyses.txt", "a") as log:
        log.write("x")
    return _real_measure(*args, **kwargs)


_runner.measure_model = _counting_measure
"""


def test_collection_does_not_calibrate_and_analysis_runs_once(pytester):
    _project(pytester, extra=COUNTING)
    pytester.runpytest("--qreport", "--collect-only")
    assert not (pytester.path / "analyses.txt").exists()
    pytester.runpytest("--qreport").assert_outcomes(passed=5)
    assert (pytester.path / "analyses.txt").read_text() == "x"


def test_passing_run_prints_summary(pytester):
    _project(pytester)
    result = pytester.runpytest("--qreport")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*qreport summary*", "all qreport checks passed", "5 pass"])


def test_failing_threshold_fails_with_value_threshold_and_shadow(pytester):
    _project(pytester)
    result = pytester.runpytest("--qreport", "--qreport-sqnr-min-db", "90", "-v")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*SQNR * dB < 90.0 dB (shadow SQNR * dB)*"])
    summary = summary_section(result)
    assert re.search(r"tiny\s+sqnr\s+fc1\s+\S+ dB\s+90.0 dB\s+FAIL", summary)
    assert "weight_sqnr" not in summary  # passing rows are not listed by default
    assert "weight_sqnr" in summary_section(pytester.runpytest("--qreport", "--qreport-table=all"))


@pytest.mark.parametrize("options,ini,cli,failed", [
    ("sqnr_min_db=90.0", SQNR_ONLY, [], 2),                                 # qmodel argument
    ("sqnr_min_db=90.0", SQNR_ONLY, ["--qreport-sqnr-min-db", "1"], 0),     # CLI beats qmodel
    ("", SQNR_ONLY + "qreport_sqnr_min_db = 90", [], 2),                    # ini default
    ("sqnr_min_db=1.0", SQNR_ONLY + "qreport_sqnr_min_db = 90", [], 0),     # qmodel beats ini
    ("model_sqnr_min_db=90.0", SQNR_ONLY, [], 1),
    ("layers=['fc2']", SQNR_ONLY, [], 0),
])
def test_settings_precedence(pytester, options, ini, cli, failed):
    _project(pytester, options=options, ini=ini)
    result = pytester.runpytest("--qreport", *cli)
    assert result.parseoutcomes().get("failed", 0) == failed


def test_help_gives_each_options_default_and_what_it_overrides(pytester):
    lines = pytester.runpytest("--help").outlines
    text = " ".join(" ".join(lines).split())   # argparse wraps lines
    options, current = {}, None
    for line in lines:   # each option's text: from its flag to the next flag
        if line.startswith("  -"):
            current = line.split()[0].split("=")[0]
            options[current] = line
        elif current and line.startswith("    "):
            options[current] += " " + line.strip()
        else:
            current = None
    assert "the command line overrides qmodel(...), which overrides the ini file, which overrides the default" in text
    assert "minimum per-layer SQNR in dB (propagated error) (default: 20.0); overrides qmodel(sqnr_min_db=...)" in text
    assert "(default: all fail); merged key by key over qmodel(severity=...)" in text
    assert "--qreport-json=PATH write every row" in text and "(schema 1) (default: none)" in text
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import SESSION_SETTINGS, model_schema

    for setting in (*model_schema(BUILTIN_CHECKS).values(), *SESSION_SETTINGS):
        if setting.flag:
            shown = " ".join(options[setting.flag].split())
            assert "default" in shown, shown
            assert ("qmodel" not in setting.places) or f"qmodel({setting.name}=...)" in shown, shown


def test_layer_globs_and_checks_select_items(pytester):
    _project(pytester, options="skip_layers='fc1'")
    result = pytester.runpytest("--qreport", "--collect-only", "-q", "--qreport-checks", "sqnr,model_sqnr")
    names = [line.split("::")[1] for line in result.outlines if "::qreport/" in line]
    assert names == ["qreport/tiny/sqnr/fc2", "qreport/tiny/model_sqnr/output"]


def test_keyword_selection(pytester):
    _project(pytester)
    result = pytester.runpytest("--qreport", "-k", "tiny and weight_sqnr")
    result.assert_outcomes(passed=2)


def test_uncapturable_model_errors_and_others_run_on(pytester):
    _project(pytester, extra=BROKEN_CAPTURE)
    result = pytester.runpytest("--qreport", "-v")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(["*qreport/branchy/capture ERROR*", "*model 'branchy' could not be captured*"])
    assert re.search(r"branchy\s+capture\s+.*ERROR", summary_section(result))


def test_calibration_failure_errors_that_model_only(pytester):
    _project(pytester, extra=BROKEN_CALIBRATION)
    result = pytester.runpytest("--qreport")
    result.assert_outcomes(passed=5, errors=5)
    # the stage and the batch before the cause, what the batch holds beside the first, and the fix
    text = result.stdout.str()
    assert "model 'tiny_bad_data': calibration batch 1 of 2 failed: RuntimeError: mat1 and mat2" in text
    assert ("(batch 1: arg 0: float32 [16, 5]; batch 0, which the model was captured with: arg 0: float32 [16, 8])\n"
            "Fix the calibration batches: each must be an input forward() takes, like the first") in text
    # one whole report; every other item of the model points to it, and none carries a traceback
    first = re.search(r"ERROR at setup of (qreport/tiny_bad_data/\S+)", result.stdout.str()).group(1)
    # counted in the errors section: pytest's short summary repeats whole messages only where CI is set
    errors_section = text.split("= ERRORS =", 1)[1].split("= qreport summary =", 1)[0]
    assert errors_section.count(f"(the whole report is on conftest.py::{first})") == 4
    assert "Traceback" not in result.stdout.str() and "items.py" not in result.stdout.str()
    assert "CalibrationError" not in result.stdout.str()


def test_a_models_error_items_cost_what_their_message_costs(pytester):
    """A model of 30 layers whose calibration fails errors its 200-odd items in a few seconds (pytest's traceback
    of each cost 0.6 s: minutes)."""
    pytester.makeconftest(PLUGIN_CONFTEST.replace("{options}", "").replace("{extra}", """

@qmodel(calibration="wrong_batches")
def deep_bad_data():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)]).eval()
"""))
    result = pytester.runpytest("--qreport", "-k", "deep_bad_data", "-p", "no:xdist")
    errors = result.parseoutcomes()["errors"]
    assert errors >= 200
    seconds = float(re.search(r"errors? in ([\d.]+)s", result.stdout.str()).group(1))
    assert seconds < 30, seconds


def test_bad_setting_is_reported_on_the_model(pytester):
    _project(pytester, options="sqnr_min_db='loud'")
    result = pytester.runpytest("--qreport", "-v")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*sqnr_min_db must be a number*"])


def test_junit_outputs(pytester):
    _project(pytester, extra=BROKEN_CAPTURE)
    result = pytester.runpytest("--qreport", "--qreport-sqnr-min-db", "90", "--junitxml=pytest.xml",
                                "--qreport-junitxml=reports/qreport.xml")
    assert result.ret == 1
    cases = ET.parse(pytester.path / "pytest.xml").getroot().iter("testcase")
    props = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")} for c in cases}
    assert props["qreport/tiny/sqnr/fc1"]["threshold"] == "90.0"
    assert set(props["qreport/tiny/sqnr/fc1"]) >= {"model", "check", "layer", "metric", "value", "threshold"}
    root = ET.parse(pytester.path / "reports" / "qreport.xml").getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"qreport.tiny", "qreport.branchy"}
    assert suites["qreport.tiny"].get("failures") == "2" and suites["qreport.branchy"].get("errors") == "1"
    assert not list((pytester.path / "reports").glob(".qreport-*"))  # no temporary file left behind


def test_without_flag_nothing_is_collected_and_torch_is_not_imported(pytester):
    pytester.makeconftest('''
from pytest_qreport import qmodel

@qmodel(calibration="batches")
def lazy():
    import torch
    return torch.nn.Linear(2, 2)
''')
    pytester.makepyfile(test_probe='''
import sys

def test_probe():
    assert "torch" not in sys.modules and "qcore" not in sys.modules
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_xdist_gives_same_items_outcomes_and_summary(pytester):
    _project(pytester, extra=BROKEN_CAPTURE)
    args = ("--qreport", "--qreport-sqnr-min-db", "45", "--qreport-table=all", "-v", "-p", "no:cacheprovider")
    serial = pytester.runpytest_subprocess(*args)
    parallel = pytester.runpytest_subprocess(*args, "-n", "2")
    assert outcomes(serial) and outcomes(serial) == outcomes(parallel)
    counts = ("passed", "failed", "errors")
    assert [serial.parseoutcomes().get(k) for k in counts] == [parallel.parseoutcomes().get(k) for k in counts]
    assert summary_section(serial) == summary_section(parallel)


CALLABLE_CALIBRATION = '''

def _make_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=g) for _ in range(3)]


@qmodel(calibration=_make_batches, checks="model_sqnr")
def from_callable():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=_make_batches(), checks=["model_sqnr"], name="from_list")
def from_iterable():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def test_calibration_as_callable_or_iterable(pytester):
    _project(pytester, extra=CALLABLE_CALIBRATION)
    result = pytester.runpytest("--qreport", "-v", "-k", "from_")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*qreport/from_callable/model_sqnr/output PASSED*",
                                 "*qreport/from_list/model_sqnr/output PASSED*"])


DETECTOR_NAMES = ["per_channel", "dynamic_static", "input_weight_equalization", "outlier"]


def test_detector_items_per_model_and_layer(pytester):
    _project(pytester, ini="")
    result = pytester.runpytest("--qreport", "--collect-only", "-q")
    names = [line.split("::")[1] for line in result.outlines if "::qreport/" in line]
    for check in DETECTOR_NAMES:
        assert [n for n in names if f"/{check}/" in n] == [f"qreport/tiny/{check}/fc1", f"qreport/tiny/{check}/fc2"]


def test_detector_failure_says_what_to_change(pytester):
    # per-channel weights raise fc1's own SQNR by 0.77 dB and fc2's by 0.07 dB, and the output's by 0.73 dB
    _project(pytester, options="quantizer='int8_per_tensor', checks='per_channel', per_channel_min_gain_db=0.05",
             ini="")
    result = pytester.runpytest("--qreport")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*weights are quantized per tensor but per-channel is supported; measured with the "
                                 "fix: its own SQNR (float input) 40.30 -> 41.07 dB (+0.77 dB), the model output "
                                 "37.64 -> 38.36 dB. Fix: qmodel(..., layer_overrides={'fc1': {'per_channel': True}, "
                                 "'fc2': {'per_channel': True}})*"])
    assert re.search(r"tiny\s+per_channel\s+fc1\s+0\s+1\s+FAIL", summary_section(result))


@pytest.mark.parametrize("options,ini,cli,outcome", [
    ("", "qreport_severity = per_channel=warn", [], {"passed": 2, "warnings": 2}),
    ("severity={'per_channel': 'warn'}", "qreport_severity = per_channel=fail", [], {"passed": 2, "warnings": 2}),
    ("severity={'per_channel': 'warn'}", "", ["--qreport-severity", "per_channel=fail"], {"failed": 2}),
    ("", "", ["--qreport-severity", "per_channel=off"], {}),
])
def test_severity_fail_warn_off(pytester, options, ini, cli, outcome):
    _project(pytester, options="quantizer='int8_per_tensor', checks='per_channel', per_channel_min_gain_db=0.05"
             + (", " + options if options else ""), ini=ini)
    result = pytester.runpytest("--qreport", *cli)
    counts = {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "failed", "warnings")}
    assert counts == outcome
    if outcome.get("warnings"):  # counted under the default table, listed under --qreport-table=all
        assert "2 warn (2 warning(s) not listed: --qreport-table=all lists them)" in summary_section(result)
        listed = pytester.runpytest("--qreport", "--qreport-table=all", *cli)
        assert re.search(r"tiny\s+per_channel\s+fc1\s+.*WARN", summary_section(listed))


def test_outlier_items_for_spiky_inputs_pass_with_a_note_when_clipping_was_measured_not_to_help(pytester):
    spiky = """

@pytest.fixture
def spiky():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        x = torch.randn(64, 8, generator=g)
        x[3, 2] = 200.0
        out.append(x)
    return out


@qmodel(calibration="spiky", checks="outlier", layers="fc1")
def spiky_default():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="spiky", checks="outlier", layers="fc1", quantizer="int8_histogram")
def spiky_histogram():
    torch.manual_seed(0)
    return Tiny().eval()
"""
    _project(pytester, extra=spiky, ini="")
    result = pytester.runpytest("--qreport", "-v", "-k", "spiky", "--qreport-table=all")
    result.assert_outcomes(passed=2)
    assert outcomes(result) == {"conftest.py::qreport/spiky_default/outlier/fc1": "PASSED",
                                 "conftest.py::qreport/spiky_histogram/outlier/fc1": "PASSED"}
    # the heuristic flags channel 2 under the min/max observer; a histogram observer there was measured, and the
    # note names both (the model with a histogram observer already clips: nothing to recommend)
    summary = " ".join(summary_section(result).split())
    assert re.search(r"spiky_default outlier fc1 .* PASS torch\.ao's outlier heuristic recommends a clipping "
                     r"\(histogram\) activation observer \(input channels 2 have outliers "
                     r"\(q100/q_ref up to [\d.]+ > 3\.5\) and the "
                     r"activation observer does not clip\); measured [+-]\d\.\d\d dB on this layer's own SQNR "
                     r"\(float input\) [\d.]+ -> [\d.]+ dB \(the minimum gain is 1 dB\): not recommended", summary)
    assert re.search(r"spiky_histogram outlier fc1 \S+ \S+ PASS(?! torch)", summary)


SKEWED = """

@pytest.fixture
def skewed():
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-2, 2, 8)
    return [torch.randn(64, 8, generator=g) * spread for _ in range(4)]


@qmodel(calibration="skewed", checks="equalization,equalization_equivalence")
def plain_model():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="skewed", checks="equalization,equalization_equivalence,sqnr", equalize=True)
def equalized_model():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="skewed", checks="equalization_equivalence", equalize="cross_layer")
def cross_layer_model():
    torch.manual_seed(0)
    return Tiny().eval()
"""


def test_equalization_checks(pytester):
    _project(pytester, extra=SKEWED, ini="")
    result = pytester.runpytest("--qreport", "-v", "-k", "model and not tiny", "--qreport-table=all")
    found = outcomes(result)
    assert found["conftest.py::qreport/plain_model/equalization/fc1"] == "FAILED"
    assert "conftest.py::qreport/plain_model/equalization_equivalence/output" not in found  # not equalized
    assert found["conftest.py::qreport/equalized_model/equalization/fc1"] == "PASSED"
    assert found["conftest.py::qreport/equalized_model/equalization_equivalence/output"] == "PASSED"
    assert found["conftest.py::qreport/cross_layer_model/equalization_equivalence/output"] == "PASSED"
    result.stdout.fnmatch_lines(["*layer fc1: input-weight equalization raises its own SQNR (float input) by * dB*"
                                 "measured with the fix: its own SQNR*the model output*"
                                 "Fix: qmodel(..., equalize=*fc1*"])
    assert re.search(r"equalized_model\s+equalization\s+fc1\s+\d+\.\d dB\s+1.0 dB\s+PASS", summary_section(result))
    relaxed = pytester.runpytest("--qreport", "-k", "plain_model", "--qreport-equalization-min-gain-db", "60")
    relaxed.assert_outcomes(passed=2)


def test_unknown_calibration_fixture_names_the_model_and_the_fix(pytester):
    _project(pytester, extra="""

@qmodel(calibration="no_such_fixture")
def orphan():
    return Tiny().eval()
""")
    result = pytester.runpytest("--qreport", "-v")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(["*qreport/orphan/capture ERROR*",
                                 "*model 'orphan': fixture 'no_such_fixture' not found*"])


def test_workers_share_the_cores(monkeypatch):
    import torch

    from pytest_qreport.adapter.session import share_cores

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share_cores(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    share_cores(4)
    assert calls == [2]
