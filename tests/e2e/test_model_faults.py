"""A model that computes NaN, raises in a custom op, falls back to FX or is non-deterministic gets an error that
names the op and the fix, on its own items."""
import json

import pytest

from tests.helpers import TINY_SOURCE, run_with_rows

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
    result, rows = run_with_rows(pytester)
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
    result, rows = run_with_rows(pytester)
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
    result, rows = run_with_rows(pytester, "--junitxml=j.xml")
    assert "capture" not in rows[("fallback", "sqnr", "fc1")]["details"]  # a model's facts are sent once, not per row
    capture = json.loads((pytester.path / "report.json").read_text())["models"]["fallback"]["capture"]
    assert capture["method"] == "fx" and "numpy" in capture["export_error"].lower()
    properties = {p.get("name"): p.get("value") for p in ET.parse(pytester.path / "j.xml").getroot().iter("property")}
    assert properties["capture_method"] == "fx" and properties["capture_export_error"] == capture["export_error"]
    result.stdout.fnmatch_lines(["qreport: model 'fallback' was captured with torch.fx.symbolic_trace, because "
                                 "torch.export failed: *"])


def test_a_non_deterministic_model_is_named_with_its_first_random_op(pytester):
    pytester.makeconftest(RANDOM_SOURCE)
    result, rows = run_with_rows(pytester)
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

