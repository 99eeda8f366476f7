"""Baselines: the file format, the comparison rules, and the regression gate end to end with pytester."""
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest

from pytest_qreport.core.baseline import (
    Baseline,
    BaselineError,
    compare_findings,
    dumps_baseline,
    fingerprint_differences,
    load_baseline,
    write_baseline,
)
from pytest_qreport.core.findings import Finding
from tests.helpers import TINY_SOURCE, outcomes, summary_section

FINGERPRINT = {"torch": "2.13.0", "qcore": "0.1.0", "quantizer": {"class": "Q"}, "calibration": "sha256:1",
               "equalize": None, "threads": 1}


def _finding(check="sqnr", layer="fc1", value=40.0, verdict="pass", metric="sqnr_db", threshold=20.0):
    return Finding(model="m", check=check, layer=layer, metric=metric, value=value, threshold=threshold,
                   verdict=verdict)


def test_file_is_sorted_one_entry_per_line_rounded_and_round_trips(tmp_path):
    entries = {("sqnr", "fc2"): (38.4567, "pass"), ("outlier", "fc1"): (math.inf, "fail"),
               ("model_sqnr", "output"): (-0.0, "pass"), ("outlier", "fc2"): (3e38, "pass"),
               ("kl_divergence", "output"): (7.12345e-06, "pass")}
    text = dumps_baseline("m", FINGERPRINT, entries)
    lines = text.splitlines()
    assert lines[2:7] == ['    "kl_divergence/output": {"value": 7.123e-06, "verdict": "pass"},',
                          '    "model_sqnr/output": {"value": 0.0, "verdict": "pass"},',
                          '    "outlier/fc1": {"value": "inf", "verdict": "fail"},',
                          '    "outlier/fc2": {"value": "inf", "verdict": "pass"},',
                          '    "sqnr/fc2": {"value": 38.46, "verdict": "pass"}']
    assert json.loads(text)["schema"] == 1 and list(json.loads(text)) == sorted(json.loads(text))
    write_baseline(tmp_path / "m.json", "m", FINGERPRINT, entries)
    loaded = load_baseline(tmp_path / "m.json")
    assert loaded.entries[("sqnr", "fc2")] == (38.46, "pass") and loaded.entries[("outlier", "fc1")][0] == math.inf
    assert load_baseline(tmp_path / "missing.json") is None


@pytest.mark.parametrize("text,expected", [
    ('{"entries": {\n  "sqnr/fc1": {"value": 1.0, "verdict": "pass"},\n}', "line 3: invalid JSON"),
    ('{"schema": 7, "model": "m", "fingerprint": {}, "entries": {}}', "unknown schema version 7"),
    ('{\n"schema": 1,\n"model": "m",\n"fingerprint": {},\n"entries": {\n"sqnr/fc1": {"value": "high", '
     '"verdict": "pass"}}}', "line 6: entry 'sqnr/fc1': a value must be a number"),
    ('{"schema": 1, "model": "m", "fingerprint": {}, "entries": {"fc1": {"value": 1, "verdict": "pass"}}}',
     "an entry key is 'check/layer'"),
    ('{"schema": 1, "model": "m", "fingerprint": [], "entries": {}}', "'fingerprint' must be a JSON object"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_a_bad_file_names_the_file_and_the_line(tmp_path, text, expected):
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(BaselineError) as error:
        load_baseline(path)
    assert str(path) in str(error.value) and expected in str(error.value)
    assert "--qreport-update-baseline" in str(error.value)


def test_fingerprints_compare_versions_by_major_and_minor():
    assert fingerprint_differences(FINGERPRINT, dict(FINGERPRINT, torch="2.13.1+cpu")) == []
    assert fingerprint_differences(FINGERPRINT, dict(FINGERPRINT, torch="2.14.0", calibration="sha256:2")) == [
        "torch: '2.13.0' -> '2.14.0'", "calibration: 'sha256:1' -> 'sha256:2'"]


def _baseline(entries):
    return Baseline("b.json", "m", FINGERPRINT, entries)


def _compare(findings, entries, strict=False, enforce=True, lower_is_better=("outlier",)):
    return compare_findings(findings, _baseline(entries), lambda check: 0.5, lambda check: check not in lower_is_better,
                            strict, enforce)


def test_regressions_in_each_metric_direction_fail_with_value_baseline_delta_and_tolerance():
    sqnr, outlier = _compare([_finding(value=38.0), _finding("outlier", value=5.0, metric="max_percentile_ratio",
                                                             threshold=30.0)],
                             {("sqnr", "fc1"): (41.0, "pass"), ("outlier", "fc1"): (4.0, "pass")})
    assert sqnr.verdict == "fail" and sqnr.baseline_status == "regressed" and sqnr.delta == pytest.approx(-3.0)
    assert "38.0 dB now, 41.0 dB in b.json (delta -3.0 dB, tolerance 0.5)" in sqnr.message
    assert outlier.verdict == "fail" and outlier.delta == pytest.approx(1.0)  # lower is better: +1 is worse
    within, improved = _compare([_finding(value=40.7), _finding("outlier", value=2.0, metric="ratio")],
                                {("sqnr", "fc1"): (41.0, "pass"), ("outlier", "fc1"): (4.0, "pass")})
    assert within.verdict == "pass" and within.baseline_status == "ok"
    assert improved.verdict == "pass" and improved.baseline_status == "improved"


def test_a_verdict_that_flips_from_pass_to_fail_is_a_regression_within_tolerance():
    (flipped,) = _compare([_finding("per_channel", value=0.0, verdict="fail", metric="per_channel_used")],
                          {("per_channel", "fc1"): (0.0, "pass")})
    assert flipped.baseline_status == "regressed" and "passed in the baseline" in flipped.message


def test_new_layers_pass_unless_strict_and_update_runs_never_fail():
    entries = {("sqnr", "fc1"): (41.0, "pass")}
    (new,) = _compare([_finding(layer="fc9")], entries)
    assert new.verdict == "pass" and new.baseline_status == "new"
    (strict,) = _compare([_finding(layer="fc9")], entries, strict=True)
    assert strict.verdict == "fail" and "no entry in the baseline" in strict.message
    (updating,) = _compare([_finding(value=10.0)], entries, enforce=False)
    assert updating.verdict == "pass" and updating.baseline_status == "regressed"


MODEL = '''
import os
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(int(os.environ.get("SEED", "0")))
    return [torch.randn(32, 8, generator=g) for _ in range(4)]


@qmodel(calibration="batches", checks="sqnr,weight_sqnr")
def three():
    torch.manual_seed(0)
    model = Three().eval()
    if os.environ.get("PERTURB"):  # one outlier weight per output row of fc3: its quantization gets coarse
        with torch.no_grad():
            model.fc3.weight[:, 5] *= 30.0
    return model
'''


def _project(pytester):
    pytester.makeconftest(MODEL)
    return pytester.path / "__qreport__" / "three.json"


def test_a_perturbed_layer_fails_against_its_baseline_and_passes_the_absolute_thresholds(pytester, monkeypatch):
    path = _project(pytester)
    pytester.runpytest("--qreport", "--qreport-update-baseline").assert_outcomes(passed=7)
    monkeypatch.setenv("PERTURB", "1")
    result = pytester.runpytest("--qreport", "-v", "--junitxml=junit.xml", "--qreport-json=report.json")
    failed = {node for node, outcome in outcomes(result).items() if outcome == "FAILED"}
    assert failed == {"conftest.py::qreport/three/sqnr/fc3", "conftest.py::qreport/three/weight_sqnr/fc3"}
    result.stdout.fnmatch_lines(["*weight_sqnr/fc3 regressed against the baseline: * dB now, * dB in *three.json "
                                 "(delta -*, tolerance 0.5). Fix the regression, or accept it with pytest --qreport "
                                 "--qreport-update-baseline."])
    assert re.search(r"three\s+weight_sqnr\s+fc3\s+\S+ dB\s+30.0 dB\s+\S+ dB\s+-\d+\.\d dB\s+FAIL\s+regressed",
                     summary_section(result))
    assert re.search(r"baselines: 6 items of 1 model\(s\) compared with \S*__qreport__ \(\d within tolerance, "
                     r"\d regressed\)", summary_section(result))
    cases = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
             for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    assert cases["qreport/three/weight_sqnr/fc3"]["baseline_status"] == "regressed"
    assert float(cases["qreport/three/weight_sqnr/fc3"]["delta"]) < -0.5
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["schema"] == 1 and report["versions"]["torch"].startswith("2.")
    assert report["models"]["three"]["baseline_path"] == str(path)
    assert report["models"]["three"]["fingerprint"]["threads"] == 1
    rows = {(r["check"], r["layer"]): r for r in report["rows"]}
    assert rows[("weight_sqnr", "fc3")]["baseline_status"] == "regressed"
    assert abs(rows[("sqnr", "fc1")]["delta"]) < 0.006
    path.unlink()
    alone = pytester.runpytest("--qreport")
    alone.assert_outcomes(passed=6)  # the absolute thresholds alone pass it
    assert "baselines:" not in alone.stdout.str()


def test_update_round_trips_byte_for_byte_also_under_xdist(pytester):
    path = _project(pytester)
    pytester.runpytest("--qreport", "--qreport-update-baseline").assert_outcomes(passed=7)
    first = path.read_bytes()
    pytester.runpytest("--qreport").assert_outcomes(passed=7)
    pytester.runpytest("--qreport", "--qreport-update-baseline", "-n", "2").assert_outcomes(passed=7)
    assert path.read_bytes() == first
    assert not list(path.parent.glob(".qreport-*"))


def test_stale_new_and_strict(pytester):
    path = _project(pytester)
    pytester.runpytest("--qreport", "--qreport-update-baseline")
    data = json.loads(path.read_text())
    data["entries"]["sqnr/fc0"] = {"value": 30.0, "verdict": "pass"}   # a layer that no longer exists
    del data["entries"]["sqnr/fc2"]                                     # a layer the baseline does not know
    path.write_text(json.dumps(data))
    result = pytester.runpytest("--qreport", "-v")
    result.assert_outcomes(passed=7)
    summary = summary_section(result)
    assert re.search(r"three\s+sqnr\s+fc2\s+.*PASS\s+new: not in the baseline", summary)
    assert re.search(r"three\s+baseline\s+.*PASS\s+stale: sqnr/fc0", summary)
    strict = pytester.runpytest("--qreport", "-v", "--qreport-baseline-strict")
    assert {n for n, o in outcomes(strict).items() if o == "FAILED"} == {
        "conftest.py::qreport/three/sqnr/fc2", "conftest.py::qreport/three/baseline"}


def test_another_calibration_set_is_one_fingerprint_failure_not_n_layer_failures(pytester, monkeypatch):
    _project(pytester)
    pytester.runpytest("--qreport", "--qreport-update-baseline")
    monkeypatch.setenv("SEED", "1")
    result = pytester.runpytest("--qreport", "-v")
    assert {n for n, o in outcomes(result).items() if o != "PASSED"} == {"conftest.py::qreport/three/baseline"}
    result.stdout.fnmatch_lines(["*recorded under other conditions*calibration: 'sha256:*' -> 'sha256:*'*"
                                 "run pytest --qreport --qreport-update-baseline*"])
    other_threads = pytester.runpytest("--qreport", "--qreport-threads", "2")
    other_threads.stdout.fnmatch_lines(["*threads: 1 -> 2*"])


def test_a_corrupt_baseline_errors_its_item_and_is_only_rewritten_on_request(pytester):
    path = _project(pytester)
    path.parent.mkdir()
    path.write_text('{"schema": 1,\n "entries": {oops}\n}')
    result = pytester.runpytest("--qreport", "-v")
    result.assert_outcomes(passed=6, errors=1)
    result.stdout.fnmatch_lines([f"*model 'three': baseline {path}, line 2: invalid JSON*"])
    assert path.read_text().startswith('{"schema": 1,\n "entries": {oops}')
    pytester.runpytest("--qreport", "--qreport-update-baseline").assert_outcomes(passed=7)
    assert load_baseline(path).model == "three"


def test_an_unwritable_baseline_dir_fails_the_update_with_the_path(pytester):
    _project(pytester)
    (pytester.path / "blocked").write_text("a file, not a folder")
    result = pytester.runpytest("--qreport", "--qreport-update-baseline", "--qreport-baseline-dir", "blocked/sub")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"qreport: could not write the baseline of 'three' to {pytester.path}/blocked/sub/"
                                 "three.json*"])


def test_per_check_tolerance_from_qmodel(pytester, monkeypatch):
    path = _project(pytester)
    pytester.runpytest("--qreport", "--qreport-update-baseline")
    pytester.makeconftest(MODEL.replace('checks="sqnr,weight_sqnr"',
                                        'checks="sqnr,weight_sqnr", baseline_tolerance_db={"weight_sqnr": 40.0}'))
    monkeypatch.setenv("PERTURB", "1")
    result = pytester.runpytest("--qreport", "-v")
    assert {n for n, o in outcomes(result).items() if o == "FAILED"} == {"conftest.py::qreport/three/sqnr/fc3"}
    assert path.exists()


FIXTURE_TESTS = TINY_SOURCE + '''

@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    return Tiny().eval()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(32, 8, generator=g) for _ in range(3)]


def test_quality(qreport, trained, data):
    result = qreport.analyze(trained, data, checks="sqnr,weight_sqnr,model_sqnr", name="two")
    assert result.model_sqnr_db > 20 and set(result.layer("fc1")) == {"sqnr", "weight_sqnr"}
    result.assert_sqnr(20.0, layers="fc*")
    result.assert_model_sqnr(20.0)
    result.assert_checks()
    result.assert_baseline()


def test_too_strict(qreport, trained, data):
    qreport.analyze(trained, data, checks="sqnr", name="two_strict").assert_sqnr(90.0)
'''


def test_the_qreport_fixture_with_and_without_the_flag_and_under_xdist(pytester):
    pytester.makepyfile(test_model=FIXTURE_TESTS)
    pytester.runpytest("-k", "quality").assert_outcomes(failed=1)  # no baseline file yet
    pytester.runpytest("-k", "quality", "--qreport-update-baseline").assert_outcomes(passed=1)
    path = pytester.path / "__qreport__" / "two.json"
    first = path.read_bytes()
    plain = pytester.runpytest("-v")
    plain.assert_outcomes(passed=1, failed=1)
    plain.stdout.fnmatch_lines(["*model 'two_strict': 2 of 2 layers below 90.0 dB*", "*check*layer*value*",
                                "*sqnr*fc2*", "*sqnr*fc1*", "*- sqnr/fc2: layer fc2: SQNR * dB < 90.0 dB*"])
    gated = pytester.runpytest("--qreport", "--qreport-table=all", "--junitxml=junit.xml", "-n", "2",
                               "--qreport-junitxml=qreport.xml")
    gated.assert_outcomes(passed=1, failed=1)
    summary = summary_section(gated)
    assert re.search(r"two\s+sqnr\s+fc1\s+\S+ dB\s+20.0 dB\s+\S+ dB\s+0 dB\s+PASS", summary)
    assert re.search(r"two_strict\s+sqnr\s+fc1\s+\S+ dB\s+20.0 dB", summary)
    cases = {c.get("name"): {p.get("name") for p in c.iter("property")}
             for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    assert set(cases) == {"test_quality", "test_too_strict"} and "qreport/two/sqnr/fc1" in cases["test_quality"]
    suites = {s.get("name") for s in ET.parse(pytester.path / "qreport.xml").getroot().iter("testsuite")}
    assert suites == {"qreport.two", "qreport.two_strict"}
    pytester.runpytest("--qreport", "-k", "quality", "--qreport-update-baseline", "-n", "2")
    assert path.read_bytes() == first


def test_a_stricter_threshold_is_a_threshold_failure_not_a_regression():
    stricter, crossing = compare_findings(
        [_finding(value=35.5, verdict="fail", threshold=36.0), _finding(layer="fc2", value=35.9, verdict="fail",
                                                                         threshold=36.0)],
        _baseline({("sqnr", "fc1"): (35.5, "pass"), ("sqnr", "fc2"): (36.1, "pass")}), lambda check: 0.5,
        lambda check: True, False, True, lambda check: "sqnr_min_db / --qreport-sqnr-min-db")
    assert stricter.baseline_status == "ok" and stricter.verdict == "fail"
    assert ("is below its threshold 36.0 dB (sqnr_min_db / --qreport-sqnr-min-db), and so was its baseline value "
            "35.5 dB" in stricter.message and "lower sqnr_min_db / --qreport-sqnr-min-db below 35.50 dB" in
            stricter.message)
    assert "updating the baseline would not fix this" in stricter.message and "regress" not in stricter.message
    assert crossing.baseline_status == "regressed" and "passed in the baseline" in crossing.message  # a real drop


def test_checks_where_less_is_better_compare_in_their_own_direction():
    from pytest_qreport.checks import EqualizationCheck, InputWeightEqualizationCheck

    assert not EqualizationCheck.higher_is_better and not InputWeightEqualizationCheck.higher_is_better
    # a louder weight column: equalization is recommended for fewer channels, which is better by the check's rule
    fewer, = _compare([_finding("input_weight_equalization", value=0.0078, metric="equalization_channel_fraction",
                                threshold=0.4)], {("input_weight_equalization", "fc1"): (1.0, "fail")},
                      lower_is_better=("input_weight_equalization",))
    assert fewer.baseline_status == "improved" and fewer.verdict == "pass"
