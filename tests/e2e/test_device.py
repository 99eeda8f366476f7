"""The `device` setting on any machine: parsed at start-up, a device that cannot be used errors on its own model's
items (naming the model, the device and the fix) while the others run, baselines record the device's kind, and
the host's memory budget does not hold a model on an accelerator. What runs on a GPU is in test_cuda.py."""
import json

import pytest
import torch
from torch import nn

from pytest_qreport.core.baseline import fingerprint_differences
from pytest_qreport.core.explain import explain
from pytest_qreport.core.memory import on_accelerator
from pytest_qreport.core.schema import device_value
from tests.helpers import BUDGET_CONFTEST, TINY_SOURCE

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


def test_a_model_is_on_an_accelerator_when_its_parameters_are():
    assert not on_accelerator(nn.Linear(2, 2)) and on_accelerator(nn.Linear(2, 2, device="meta"))


def test_a_model_on_an_accelerator_is_not_held_to_the_host_memory_budget(pytester):
    # the budget covers the host: a model whose weights and activations are on a GPU is not refused for it (an
    # out-of-memory on the GPU is an error on its items). No GPU here: the check that the model is on one says so
    # for every model, and the CPU runs the analysis.
    pytester.makeconftest(BUDGET_CONFTEST + '''

import pytest_qreport.adapter.items

pytest_qreport.adapter.items.on_accelerator = lambda float_gm: True
''')
    pytester.runpytest("--qreport", "-p", "no:randomly", "--qreport-memory-budget=1MiB").assert_outcomes(passed=4)


def test_running_out_of_a_devices_memory_names_the_model_and_the_fixes():
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
    message = explain("llama", "calibration/analysis", error)
    assert message.startswith("model 'llama': calibration/analysis ran out of memory on its device: CUDA out of")
    assert "--qreport-device=cpu" in message and "covers the host" in message
