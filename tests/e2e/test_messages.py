"""Messages that fit the numbers: advice for the quantizer and severity in force, enough digits near a threshold,
ranges below the quantizer's resolution and zero percentiles said in words."""
import re

from tests.helpers import TINY_SOURCE, run_with_rows

TINY_ACTIVATION_SOURCE = TINY_SOURCE + '''


class Gated(Tiny):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)   # a faint branch: its output is ~1e-12, too small to matter
        with torch.no_grad():
            self.gate.weight.mul_(1e-12)
            self.gate.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.gate(x)


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(3)]


@qmodel(calibration=batches, checks="sqnr,weight_sqnr,model_sqnr")
def faint():
    torch.manual_seed(0)
    return Gated().eval()


# each option of the advice, pasted
@qmodel(calibration=batches, checks="sqnr,weight_sqnr,model_sqnr", float_layers=['gate'])
def faint_in_float():
    torch.manual_seed(0)
    return Gated().eval()


@qmodel(calibration=batches, checks="sqnr,weight_sqnr,model_sqnr", skip_layers=['gate'])
def faint_hidden():
    torch.manual_seed(0)
    return Gated().eval()
'''


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
    result = pytester.runpytest("--qreport", "--qreport-table=all")
    result.assert_outcomes(passed=1)  # a histogram observer was measured not to help: the note says why it passes
    result.stdout.fnmatch_lines(["*torch.ao's outlier heuristic recommends a clipping (histogram) activation observer "
                                 "(input channels * have outliers (their 97.5% percentile is 0, since most of their "
                                 "values are zero*); measured * dB on this layer's own SQNR*: not recommended*"])
    assert "340282346638528859811704183484516925440" not in result.stdout.str()


def test_advice_fits_the_quantizer_and_severity_in_force(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(3)]


@qmodel(calibration=batches, checks="sqnr", layers="fc1")
def per_channel():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=batches, checks="sqnr", layers="fc1", quantizer="int8_histogram")
def histogram():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=batches, checks="sqnr", layers="fc1", quantizer="int8_per_tensor")
def per_tensor():
    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():  # rows two orders of magnitude apart: per-channel weights help
        model.fc1.weight *= torch.logspace(-2, 0, 16).unsqueeze(1)
    return model


@qmodel(calibration=batches, checks="input_weight_equalization", layers="fc1",
        severity={"input_weight_equalization": "warn"})
def advisory():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    # every fix that applies is searched (the fix budget's own tests are tests/e2e/test_fix_budget.py)
    result = pytester.runpytest("--qreport", "--qreport-sqnr-min-db", "90", "-W", "always", "--qreport-table=all",
                                "--qreport-fix-budget=unlimited")
    text = result.stdout.str()
    blocks = {name: text[text.index(f"qreport/{name}/sqnr/fc1  _"):].split("\n")[1] for name in
              ("per_channel", "histogram", "per_tensor")}
    # only the fixes that apply and were measured to help are listed, each with what it was measured to do
    assert "per-channel weights" not in blocks["per_channel"] and "per-channel weights" not in blocks["histogram"]
    assert "clipping (histogram)" not in blocks["histogram"]
    assert re.search(r"per-channel weights \(measured with the fix: its SQNR [\d.]+ -> [\d.]+ dB \(\+[\d.]+ dB\), "
                     r"the model output [\d.]+ -> [\d.]+ dB\): qmodel\(\.\.\., layer_overrides=\{'fc1': "
                     r"\{'per_channel': True\}\}\)", blocks["per_tensor"]), blocks["per_tensor"]
    assert all(re.search(r"keeping it in float \(measured: the model output [\d.]+ -> [\d.]+ dB\): qmodel\(\.\.\., "
                         r"float_layers=\['fc1'\]\)", block) for block in blocks.values()), blocks
    # torch.ao's equalization heuristic is measured too: it does not help fc1 enough, so no warning, and a note
    assert "input-weight equalization is recommended" not in text
    assert re.search(r"advisory\s+input_weight_equalization\s+fc1 .*PASS\s+torch\.ao's input_weight_equalization "
                     r"heuristic recommends input-weight equalization", text)


def test_a_value_just_below_its_threshold_prints_enough_digits():
    from pytest_qreport.checks.sqnr import below

    assert below(35.96, 36.0) == "35.96 dB < 36.00 dB"
    assert below(18.3, 25.0) == "18.3 dB < 25.0 dB"


def test_a_range_below_the_quantizers_resolution_says_so_with_options_that_work(pytester):
    pytester.makeconftest("import qcore\n" + TINY_ACTIVATION_SOURCE)
    result, rows = run_with_rows(pytester)
    sqnr, weight = rows[("faint", "sqnr", "gate")], rows[("faint", "weight_sqnr", "gate")]
    assert sqnr["verdict"] == weight["verdict"] == "fail" and sqnr["value"] == weight["value"] == 0.0
    assert re.search(r"Its weight range \d\.\d+e-13 and output range \d\.\d+e-1[23] are below the quantizer's "
                     r"resolution \(smallest scale 1.19e-07\), so int8 rounds them to \(nearly\) all zeros",
                     sqnr["message"]), sqnr["message"]
    assert re.search(r"Its weight range \d\.\d+e-13 is below", weight["message"]), weight["message"]
    for message in (sqnr["message"], weight["message"]):
        assert "(quantizer='int8')" not in message and "int8_histogram" not in message
        assert "keep the layer in float with float_layers=['gate']" in message
        assert "skip_layers=['gate']" in message
    assert rows[("faint", "model_sqnr", "output")]["verdict"] == "pass"
    for model in ("faint_in_float", "faint_hidden"):
        assert {key[2] for key in rows if key[0] == model} == {"fc1", "fc2", "output"}
        assert {row["verdict"] for key, row in rows.items() if key[0] == model} == {"pass"}

