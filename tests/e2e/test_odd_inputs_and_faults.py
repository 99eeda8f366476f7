"""Faults and odd inputs land on the right item with the right message (issue: reliability)."""
import json
import re

import pytest

from tests.helpers import TINY_SOURCE, outcomes


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
    assert outcomes(result)["conftest.py::qreport/zero_head/weight_sqnr/fc2"] == "PASSED"
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
    assert set(outcomes(result).values()) == {"PASSED"}
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
    result = pytester.runpytest("--qreport", "--qreport-sqnr-min-db", "90", "-W", "always", "--qreport-table=all")
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


def test_one_shot_iterators_are_read_once_and_keep_every_batch(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

def _batches(count):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(count)]


SHARED = iter(_batches(3))   # two models read one iterator


@pytest.fixture(scope="session")
def one_batch():
    return (batch for batch in _batches(1))


@qmodel(calibration=_batches(3), checks="sqnr")
def as_list():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=(batch for batch in _batches(3)), checks="sqnr")
def as_generator():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=SHARED, checks="sqnr")
def shared_first():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=SHARED, checks="sqnr")
def shared_second():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration="one_batch", checks="sqnr")
def session_generator():
    torch.manual_seed(0)
    return Tiny().eval()
''')
    result, rows = _rows(pytester)
    assert set(outcomes(result).values()) == {"PASSED"}
    reference = rows[("as_list", "sqnr", "fc1")]
    for model in ("as_generator", "shared_first", "shared_second"):
        row = rows[(model, "sqnr", "fc1")]
        assert row["details"]["batches"] == 3 and row["value"] == reference["value"]  # no batch lost to collection
    assert rows[("session_generator", "sqnr", "fc1")]["details"]["batches"] == 1


def test_tied_weights_skip_equalization_of_those_layers_only(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.shared(x))
        return self.fc2(torch.relu(self.shared(x)))   # one Linear called twice: one weight, two ops


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr,model_sqnr,equalization")
def tied():
    torch.manual_seed(0)
    return Tied().eval()


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], equalize=True,
        checks="sqnr,model_sqnr,equalization,equalization_equivalence,input_weight_equalization")
def tied_equalized():
    torch.manual_seed(0)
    return Tied().eval()
''')
    result, rows = _rows(pytester, "-rs")
    found = outcomes(result)
    for model in ("tied", "tied_equalized"):
        for layer in ("shared.linear", "shared.linear_1"):
            row = rows[(model, "equalization", layer)]
            assert row["verdict"] == "skip" and "weight is shared" in row["message"]
        assert rows[(model, "sqnr", "shared.linear")]["verdict"] == "pass"  # the model's other checks are unaffected
        assert found[f"conftest.py::qreport/{model}/model_sqnr/output"] == "PASSED"
    assert rows[("tied_equalized", "equalization_equivalence", "output")]["verdict"] == "pass"
    assert rows[("tied_equalized", "equalization", "fc1")]["details"]["applied"] is True
    iwe = rows[("tied_equalized", "input_weight_equalization", "shared.linear")]
    assert iwe["verdict"] == "skip" and "cannot be equalized" in iwe["message"]  # no advice that cannot work
    assert "ERROR" not in found.values()
    result.stdout.fnmatch_lines(["SKIPPED*layer shared.linear: not equalized: its weight is shared*"])


def test_buffers_updated_in_forward_are_compared_from_the_same_state(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

class Running(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, x):
        h = self.fc1(x)
        self.mean.mul_(0.5).add_(h.mean(0), alpha=0.5)   # running statistics, updated by every forward
        return self.fc2(torch.relu(h - self.mean))


@qmodel(calibration=[torch.randn(32, 8) + 3 for _ in range(4)], checks="sqnr,model_sqnr", model_sqnr_min_db=30)
def running():
    torch.manual_seed(0)
    return Running().eval()
''')
    result, rows = _rows(pytester)
    assert set(outcomes(result).values()) == {"PASSED"}
    assert rows[("running", "model_sqnr", "output")]["value"] > 30  # not the false -5 to 5 dB of a stale state


def test_quantize_returns_models_in_the_same_state():
    import torch

    import qcore

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.fc(x) * self.calls

    data = [torch.randn(8, 4) for _ in range(3)]
    float_gm, quant_gm = qcore.quantize(Counter().eval(), data[0], data)
    assert dict(float_gm.named_buffers())["calls"] == dict(quant_gm.named_buffers())["calls"]


def test_fp16_bf16_and_float64_models_run_in_their_own_dtype(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

torch.manual_seed(0)  # the calibration data: unseeded, 1 run in 15 put float16's top-1 agreement at 93.75% < 95%
for dtype in ("float16", "bfloat16", "float64"):
    def factory(dtype=dtype):
        torch.manual_seed(0)
        return Tiny().eval().to(getattr(torch, dtype))

    factory.__name__ = dtype
    globals()[dtype] = qmodel(calibration=[torch.randn(16, 8, dtype=getattr(torch, dtype)) for _ in range(2)],
                              equalize=True, severity="outlier=off,input_weight_equalization=off")(factory)
''')
    result, rows = _rows(pytester)
    assert set(outcomes(result).values()) == {"PASSED"}
    for dtype in ("float16", "bfloat16", "float64"):
        assert rows[(dtype, "model_sqnr", "output")]["value"] > 30
        assert rows[(dtype, "equalization_equivalence", "output")]["verdict"] == "pass"


def test_nan_names_the_first_op_that_computes_it_and_a_non_float_output_says_so(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

class Logs(Tiny):
    def forward(self, x):
        return self.fc2(torch.log(self.fc1(x)))   # negative inputs: NaN


class Argmax(Tiny):
    def forward(self, x):
        return super().forward(x).argmax(-1), 3, None


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr")
def logs():
    return Logs().eval()


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="model_sqnr")
def argmax():
    return Argmax().eval()
''')
    result, rows = _rows(pytester)
    message = rows[("logs", "sqnr", "fc1")]["message"]
    assert "NaN or inf at node log" in message and "calibration batch 0" in message
    assert "observed no data" not in message
    message = rows[("argmax", "model_sqnr", "output")]["message"]
    assert "holds no floating-point tensor (output.0: int64 tensor; output.1: int (not a tensor)" in message
    assert "severity={'model_sqnr': 'off'}" in message and "changed between collection" not in message


def test_an_error_in_a_custom_op_points_at_the_users_frame(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

@torch.library.custom_op("qreport_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 4:
        raise ValueError("scaled() only takes up to 4 rows")
    return x * 2


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


class Custom(Tiny):
    def forward(self, x):
        return scaled(self.fc1(x))


@qmodel(calibration=[torch.randn(16, 8)], example_inputs=torch.randn(2, 8), checks="sqnr")
def custom():
    return Custom().eval()
''')
    result, rows = _rows(pytester)
    message = rows[("custom", "sqnr", "fc1")]["message"]
    first = message.splitlines()[0]
    assert "conftest.py:" in first and "(scaled): " in first and "ValueError: scaled() only takes" in first
    assert "functools" not in message and "/qcore/" not in message
    assert message.rstrip().endswith('raise ValueError("scaled() only takes up to 4 rows")')


def test_an_fx_fallback_is_recorded_with_the_export_error(pytester):
    import xml.etree.ElementTree as ET

    pytester.makeconftest(TINY_SOURCE + '''

def numpy_scale(x):
    return x / float(x.detach().numpy().std())   # numpy needs real values: torch.export's fake tensors fail


torch.fx.wrap("numpy_scale")   # FX keeps the call as one opaque node


class NumpyInside(Tiny):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(numpy_scale(x))))


@qmodel(calibration=[torch.randn(16, 8)], checks="sqnr")
def fallback():
    return NumpyInside().eval()
''')
    result, rows = _rows(pytester, "--junitxml=j.xml")
    assert "capture" not in rows[("fallback", "sqnr", "fc1")]["details"]  # a model's facts are sent once, not per row
    capture = json.loads((pytester.path / "report.json").read_text())["models"]["fallback"]["capture"]
    assert capture["method"] == "fx" and "numpy" in capture["export_error"].lower()
    properties = {p.get("name"): p.get("value") for p in ET.parse(pytester.path / "j.xml").getroot().iter("property")}
    assert properties["capture_method"] == "fx" and properties["capture_export_error"] == capture["export_error"]
    result.stdout.fnmatch_lines(["qreport: model 'fallback' was captured with torch.fx.symbolic_trace, because "
                                 "torch.export failed: *"])


RANDOM_SOURCE = TINY_SOURCE + '''
import torch.nn.functional as F


class Noisy(Tiny):
    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.5, training=True))


class Fixed(Tiny):   # the advice, pasted: random ops follow the eval mode qcore captures in
    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.5, training=self.training))


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(3)]


@qmodel(calibration=batches, checks="sqnr,model_sqnr,per_channel")
def noisy():
    torch.manual_seed(0)
    return Noisy().eval()


@qmodel(calibration=batches, checks="sqnr,model_sqnr,per_channel")
def fixed():
    torch.manual_seed(0)
    return Fixed().eval()
'''


def test_a_non_deterministic_model_is_named_with_its_first_random_op(pytester):
    pytester.makeconftest(RANDOM_SOURCE)
    result, rows = _rows(pytester)
    for layer in ("fc1", "fc2"):
        assert rows[("noisy", "sqnr", layer)]["verdict"] == "error"
    message = rows[("noisy", "model_sqnr", "output")]["message"]
    assert message.startswith("model 'noisy': the model is non-deterministic: two float runs on calibration batch 0 "
                              "differ")
    assert "first at node dropout (aten.dropout.default)" in message
    assert "inherits its error" not in result.stdout.str()
    assert rows[("noisy", "per_channel", "fc1")]["verdict"] == "pass"  # detector statistics are still valid
    assert {row["verdict"] for key, row in rows.items() if key[0] == "fixed"} == {"pass"}


def test_a_model_whose_buffers_change_in_forward_is_not_called_non_deterministic():
    import torch
    from torch import nn

    from qcore import capture
    from qcore.measure.diagnose import first_nondeterministic

    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("mean", torch.zeros(8))

        def forward(self, x):
            self.mean.mul_(0.5).add_(x.mean(0))
            return self.fc(x - self.mean)

    batch = torch.randn(4, 8)
    assert first_nondeterministic(capture(Running().eval(), batch), batch) is None


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


def test_a_range_below_the_quantizers_resolution_says_so_with_options_that_work(pytester):
    pytester.makeconftest("import qcore\n" + TINY_ACTIVATION_SOURCE)
    result, rows = _rows(pytester)
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


@pytest.mark.parametrize("elements", [10 ** 6, 7])  # all at once, then 7 elements at a time (an LM's logits)
def test_two_runs_outputs_are_compared_a_bounded_number_of_elements_at_a_time(monkeypatch, elements):
    import torch

    from qcore.measure import diagnose

    monkeypatch.setattr(diagnose, "_COMPARED_ELEMENTS", elements)
    first = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    first[0, 0], first[2, 3] = float("nan"), float("inf")
    second = first.clone()
    assert not diagnose._differs(first, second, 1e-5)  # nan against nan and inf against inf agree
    second[5, 9] += 1e-3 * float(first[1:].nan_to_num(posinf=0).abs().max())  # the last part differs
    assert diagnose._differs(first, second, 1e-5) and not diagnose._differs(first, second, 1e-2)
    second[5, 9] = float("nan")
    assert diagnose._differs(first, second, 1e-2)
