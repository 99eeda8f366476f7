"""The `device` setting on any machine: parsed at start-up, a device that cannot be used errors on its own model's
items (naming the model, the device and the fix) while the others run, and baselines record the device's kind.
What runs on a GPU is in test_cuda.py."""
import json

import pytest

from pytest_qreport.core.baseline import fingerprint_differences
from pytest_qreport.core.schema import device_value
from tests.test_plugin import TINY_SOURCE

FINGERPRINT = {"torch": "2.13.0", "qcore": "0.1.0", "quantizer": {"class": "Q"}, "calibration": "sha256:1",
               "equalize": None, "threads": 1}


def test_a_device_is_a_torch_device_or_auto():
    assert device_value("cuda", []) == "cuda" and device_value(" cuda:1 ", []) == "cuda:1"
    assert device_value("cpu", []) == "cpu" and device_value("auto", []) is None and device_value(None, []) is None
    with pytest.raises(ValueError, match="torch device such as cuda"):
        device_value("gpu0", [])


def test_a_baseline_written_before_devices_were_recorded_was_recorded_on_the_cpu():
    assert fingerprint_differences(FINGERPRINT, dict(FINGERPRINT, device="cpu")) == []
    assert fingerprint_differences(FINGERPRINT, dict(FINGERPRINT, device="cuda")) == ["device: 'cpu' -> 'cuda'"]


def test_a_device_that_cannot_be_used_errors_on_its_model_and_the_others_run(pytester):
    pytester.makeconftest(TINY_SOURCE + '''

def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(2)]


@qmodel(calibration=_batches, checks="sqnr", device="cuda:99")
def far_away():
    return Tiny().eval()


@qmodel(calibration=_batches, checks="sqnr")
def here():
    return Tiny().eval()
''')
    result = pytester.runpytest("--qreport", "--qreport-json=r.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    output = result.stdout.str()
    assert "model 'far_away': device='cuda:99' cannot be used here" in output
    assert "Fix: --qreport-device=cpu" in output
    # the hint works: the command line wins over qmodel(...), and the model runs on the CPU
    fixed = pytester.runpytest("--qreport", "--qreport-json=r.json", "-p", "no:cacheprovider", "--qreport-device=cpu")
    fixed.assert_outcomes(passed=4)
    report = json.loads((pytester.path / "r.json").read_text())
    assert {model["fingerprint"]["device"] for model in report["models"].values()} == {"cpu"}
