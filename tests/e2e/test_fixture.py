"""The `qreport` fixture: calibration fixtures by name, assertion errors that explain, no torch trace log."""


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

