"""Report files survive what XML cannot carry, lone surrogates and unwritable paths."""
import pytest

from tests.helpers import TINY_SOURCE

BAD_TEXT_CHECK = '''
from pytest_qreport import Check


class Noisy(Check):
    name, order, metric = "noisy", 99, "score"

    def layers(self, model):
        return ["fc1"]

    def findings(self, model, layers):
        text = "file cafe.bin\\x01 broke"  # a control character
        return [self.finding(model, layer, 0.0, 1.0, message=text) for layer in layers]


def pytest_qreport_register_checks(registry):
    registry.register(Noisy)


@qmodel(calibration=[torch.randn(16, 8)], checks="noisy")
def noisy_model():
    return Tiny().eval()


@qmodel(calibration=[torch.randn(16, 8)], checks="model_sqnr")
def quiet_model():
    return Tiny().eval()
'''


def test_text_xml_cannot_carry_and_an_unwritable_report_path_do_not_lose_the_session(pytester):
    import xml.etree.ElementTree as ET

    pytester.makeconftest(TINY_SOURCE + BAD_TEXT_CHECK)
    result = pytester.runpytest("--qreport", "--qreport-junitxml=q.xml")
    result.assert_outcomes(failed=1, passed=1)
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    case = next(ET.parse(pytester.path / "q.xml").getroot().iter("testcase"))
    assert "cafe.bin\\x01 broke" in case.find("failure").text  # the control character, escaped: XML cannot carry it
    (pytester.path / "blocked").write_text("a file, not a folder")
    unwritable = pytester.runpytest("--qreport", "--qreport-junitxml=blocked/q.xml", "-k", "not noisy")
    unwritable.stdout.fnmatch_lines(["*qreport summary*", "qreport: could not write --qreport-junitxml blocked/q.xml*"])
    assert unwritable.ret == pytest.ExitCode.TESTS_FAILED


def test_a_lone_surrogate_does_not_lose_the_dedicated_xml(tmp_path):
    import xml.etree.ElementTree as ET

    from pytest_qreport.core.findings import Finding
    from pytest_qreport.reports.junit import write_junit

    row = Finding(model="m", check="sqnr", layer="fc1", metric="sqnr_db", value=1.0, threshold=2.0, verdict="fail",
                  message="weights from caf\udce9.bin")  # a non-UTF-8 file name decoded with surrogateescape
    write_junit(str(tmp_path / "q.xml"), [row])
    # written as its escape, so the byte that was not UTF-8 stays visible
    assert "caf\\udce9.bin" in next(ET.parse(tmp_path / "q.xml").getroot().iter("failure")).text

