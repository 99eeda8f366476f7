"""What the run prints and writes: one spelling per number, node ids to paste back, warnings that point at the
conftest, and a reporter that cannot write fails the run without hiding the others."""
import json
import math

import pytest

from tests.helpers import TINY_SOURCE

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


def test_what_verbose_prints_is_a_node_id_to_paste_back(pytester):
    pytester.makeconftest(NESTED)
    result = pytester.runpytest("--qreport", "-v", "-p", "no:cacheprovider")
    printed = [line.split()[0] for line in result.stdout.lines if line.startswith("conftest.py::qreport/")]
    assert "conftest.py::qreport/nested/sqnr/body.0" in printed, printed
    again = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "conftest.py::qreport/nested/sqnr/body.0")
    again.assert_outcomes(passed=1)


def test_warnings_point_at_the_declaring_conftest(pytester):
    pytester.makeconftest(NESTED)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "-W", "always")
    warned = [line for line in result.stdout.lines if "QReportWarning" in line]
    assert warned and all(line.strip().startswith(str(pytester.path / "conftest.py") + ":") for line in warned), warned

