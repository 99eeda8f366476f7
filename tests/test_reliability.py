"""Faults and odd inputs land on the right item with the right message (issue: reliability)."""
import json

from tests.test_plugin import TINY_SOURCE, _outcomes


def _rows(pytester, *args):
    result = pytester.runpytest("--qreport", "-v", "--qreport-json=report.json", *args)
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    return result, {(r["model"], r["check"], r["layer"]): r for r in rows}


def test_an_all_zero_weight_is_an_exact_reconstruction_not_nan(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="weight_sqnr")
def zero_head():
    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():
        model.fc2.weight.zero_()   # as torchvision's ViT initializes its head
    return model
''')
    result, rows = _rows(pytester)
    assert _outcomes(result)["conftest.py::qreport/zero_head/weight_sqnr/fc2"] == "PASSED"
    assert rows[("zero_head", "weight_sqnr", "fc2")]["value"] == "inf"


def test_one_tensor_or_one_dict_given_as_calibration_is_one_batch(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

class Keyword(Tiny):
    def forward(self, *, features):
        return super().forward(features)


@qmodel(calibration=torch.randn(64, 8), checks="sqnr")
def one_tensor():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration={"features": torch.randn(64, 8)}, checks="sqnr")
def one_dict():
    torch.manual_seed(0)
    return Keyword().eval()
''')
    result, rows = _rows(pytester)
    assert set(_outcomes(result).values()) == {"PASSED"}
    assert rows[("one_tensor", "sqnr", "fc1")]["details"]["batches"] == 1  # not 64 one-row batches
    assert rows[("one_dict", "sqnr", "fc1")]["details"]["batches"] == 1


def test_an_outlier_over_a_zero_percentile_says_so_instead_of_printing_flt_max(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@pytest.fixture
def sparse():
    batches = []
    for index in range(4):
        x = torch.zeros(64, 8)
        x[:, :4] = torch.randn(64, 4, generator=torch.Generator().manual_seed(index))
        x[index, 6] = 5.0   # channel 6 is zero but for one value per batch
        batches.append(x)
    return batches


@qmodel(calibration="sparse", checks="outlier", layers="fc1")
def sparse_inputs():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*input channels * have outliers (their 97.5% percentile is 0, since most of their "
                                 "values are zero*"])
    assert "340282346638528859811704183484516925440" not in result.stdout.str()
