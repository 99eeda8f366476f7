"""A sign of life during an analysis, each model's time per stage in every report, and numbers that show why a
value fails its threshold."""
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import TINY_SOURCE

PROJECT = TINY_SOURCE + '''

@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(4)]


@qmodel(calibration="batches", sqnr_min_db=90.0)
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def test_a_slow_analysis_shows_its_stage_and_its_time(pytester, monkeypatch):
    monkeypatch.setenv("QREPORT_PROGRESS_AFTER", "0")  # as if every analysis were slow
    pytester.makeconftest(PROJECT)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-checks=sqnr")
    result.stdout.fnmatch_lines(["qreport: tiny: calibration (*s)", "qreport: tiny analysed in * s*",
                                 "conftest.py F*"])
    quiet = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-checks=sqnr", "-q")
    assert "qreport: tiny:" not in quiet.stdout.str()


def test_a_fast_analysis_prints_no_progress(pytester):
    pytester.makeconftest(PROJECT)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-checks=sqnr")
    assert "qreport: tiny:" not in result.stdout.str()


def test_the_stage_times_reach_the_summary_json_junit_and_html(pytester):
    pytester.makeconftest(PROJECT)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json",
                                "--qreport-junitxml=r.xml", "--qreport-html=r.html", "-n", "2")
    result.stdout.fnmatch_lines(["analysis time: * s for 1 model(s); per model: tiny * s (capture *)"])
    seconds = json.loads((pytester.path / "r.json").read_text())["models"]["tiny"]["seconds"]
    assert {"capture", "calibration", "comparison", "other"} <= set(seconds)
    assert all(value >= 0 for value in seconds.values()) and seconds["capture"] > 0
    suite = ET.parse(pytester.path / "r.xml").getroot().find("testsuite")
    properties = {p.get("name"): float(p.get("value")) for p in suite.iter("property")}
    assert properties["analysis_capture_seconds"] == pytest.approx(seconds["capture"], abs=1e-3)
    cases = sum(float(case.get("time") or 0) for case in suite.iter("testcase"))
    assert float(suite.get("time")) == pytest.approx(sum(seconds.values()) + cases, abs=2e-3)
    assert "analysis time" in (pytester.path / "r.html").read_text()


def test_values_show_the_digits_that_tell_them_from_their_threshold():
    from pytest_qreport.core.findings import Finding
    from pytest_qreport.reports.terminal import render_summary

    rows = [Finding(model="m", check="sqnr", layer="a", metric="sqnr_db", value=35.97, threshold=36.0,
                    verdict="fail"),
            Finding(model="m", check="sqnr", layer="b", metric="sqnr_db", value=35.44, threshold=20.0,
                    verdict="fail", baseline=35.46, delta=-0.02, baseline_status="regressed"),
            Finding(model="m", check="per_channel", layer="c", metric="per_channel_used", value=0.0, threshold=1.0,
                    verdict="fail")]
    text = render_summary(rows, "failures")
    assert "35.97 dB" in text and "36.00 dB" in text  # not '36.0 dB 36.0 dB'
    assert "35.44 dB" in text and "35.46 dB" in text and "-0.02 dB" in text  # not 'delta 0 dB'
    assert "per_channel: per_channel_used, 1 = per-channel weights, 0 = per-tensor" in text
    # one metric, one number of decimals down its column: the row that needs none extra shows as many
    rows.append(Finding(model="m", check="sqnr", layer="d", metric="sqnr_db", value=12.5, threshold=36.0,
                        verdict="fail"))
    text = render_summary(rows, "failures")
    assert "12.50 dB" in text and "36.0 dB" not in text.replace("36.00 dB", "")


def test_distinguishing_decimals_stop_at_four():
    from pytest_qreport.core.numbers import distinguishing_decimals, format_value

    assert distinguishing_decimals("sqnr_db", 30.0, 20.0) == 1
    assert distinguishing_decimals("sqnr_db", 30.00001, 30.0) == 4
    assert distinguishing_decimals("sqnr_db", math.inf, 30.0) == 1
    assert format_value(30.004, "sqnr_db", distinguishing_decimals("sqnr_db", 30.004, 30.0)) == "30.004 dB"
    # a value and a baseline shown alike need no more digits for their small delta; shown apart, they do
    assert distinguishing_decimals("sqnr_db", 32.6903, 20.0, 32.69, 0.0003) == 1
    assert distinguishing_decimals("sqnr_db", 35.446, 20.0, 35.45, -0.004) == 2


def test_xdist_workers_print_plain_progress_lines(pytester, monkeypatch):
    monkeypatch.setenv("QREPORT_PROGRESS_AFTER", "0")  # workers inherit it: as if every analysis were slow
    pytester.makeconftest(PROJECT)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-checks=sqnr", "-n", "2")
    output = result.stdout.str() + result.stderr.str()
    assert re.search(r"\[gw[01]\] qreport: tiny: calibration \(\d+\.\d s\)", output), output
    assert re.search(r"\[gw[01]\] qreport: tiny analysed in \d+\.\d s \(capture", output), output
