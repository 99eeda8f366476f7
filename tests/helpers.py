"""What several test modules share: the models their pytester projects declare, the readers of a run's output,
and torchao's reference numerics of each preset."""
import re

import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_scale_float8,
    _dequantize_affine_float8,
    _quantize_affine_float8,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.pipeline import collect_model
from pytest_qreport.core.quantizers import model_quantizer, pytest_qreport_make_quantizer
from pytest_qreport.core.registry import CheckRegistry
from pytest_qreport.core.settings import ModelSettings

# the two-layer model most plugin tests declare; other test modules reuse it
TINY_SOURCE = '''
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
'''


def outcomes(result):
    """{node id: outcome} from -v output, serial ("id OUTCOME") or xdist ("OUTCOME id")."""
    text = result.stdout.str()
    found = dict(re.findall(r"(conftest\.py::qreport/\S+) (PASSED|FAILED|ERROR)", text))
    found.update({node: outcome for outcome, node in re.findall(r"(PASSED|FAILED|ERROR) (conftest\.py::qreport/\S+)", text)})
    return found


def summary_section(result):
    """The summary section, less its timing line (times differ from run to run)."""
    text = result.stdout.str()
    start = text.index("qreport summary")
    lines = text[start:text.index("\n=", start)].splitlines()
    return "\n".join(line for line in lines if not line.startswith("analysis time: "))


FRAGILE_SOURCE = '''
import torch
from torch import nn
from pytest_qreport import qmodel


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                    nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        with torch.no_grad():   # four loud hidden units, scaled back by the next layer: float-equivalent
            self.layers[2].weight[:4] *= 60.0
            self.layers[4].weight[:, :4] /= 60.0

    def forward(self, x):
        return self.layers(x)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=g) for _ in range(4)]
'''


BUDGET_CONFTEST = """
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 256, generator=g) for _ in range(2)]


@qmodel(calibration="batches", checks=["sqnr"])
def wide():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).eval()  # 514 KiB of weights


@qmodel(calibration="batches", checks=["sqnr"])
def narrow():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 4)).eval()  # 8.2 KiB
"""


PLUGIN_CONFTEST = TINY_SOURCE + '''

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(4)]


@pytest.fixture
def wrong_batches():
    return [torch.randn(16, 8), torch.randn(16, 5)]


@qmodel(calibration="batches", {options})
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
{extra}
'''

SQNR_ONLY = "qreport_checks = sqnr,weight_sqnr,model_sqnr\n"

BUDGET_EVENTS = """

import os
import time


def log(event):
    with open(os.path.join(os.path.dirname(__file__), "events.txt"), "a") as events:
        events.write(event + "\\n")


def pytest_qreport_modify_findings(model, findings):
    log(f"analysed {model}")
    return None
"""


class PluginHook:
    def pytest_qreport_make_quantizer(self, name):
        return pytest_qreport_make_quantizer(name)


def analyze_with_checks(factory, batches, **settings):
    """{(check, layer): Finding} of a model, as the plugin computes them, and the model's qcore analysis."""
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    resolved = ModelSettings.defaults(BUILTIN_CHECKS, calibration=batches, **settings)
    pipeline = collect_model("m", resolved, registry, model_quantizer(resolved, PluginHook()), factory(), batches[0])
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.findings is not None, pipeline.error
    return pipeline.findings, pipeline.context.analysis


# ---- torchao 0.18's reference numerics of each preset (tests/conftest.py imports torchao already)

E4M3 = torch.float8_e4m3fn


def _integer(x, block, bits, symmetric=True):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    mapping = MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC
    scale, zero_point = choose_qparams_affine(x, mapping, block, torch.int8, qmin, qmax)
    return dequantize_affine(quantize_affine(x, block, scale, zero_point, torch.int8, qmin, qmax), block, scale,
                             zero_point, torch.int8, qmin, qmax)


def _float8(x, block=None, scale=None):
    scale = _choose_scale_float8(x, list(block), E4M3) if scale is None else scale
    return _dequantize_affine_float8(_quantize_affine_float8(x, scale, E4M3), scale)


def _mx(x, elements):
    scale, data = to_mx(x.contiguous(), elements, 32, ScaleCalculationMode.FLOOR)
    return to_dtype(data, scale, elements, 32, torch.float32)


def _nvfp4(x, amax):
    rows = x.reshape(-1, x.shape[-1])
    global_scale = per_tensor_amax_to_scale(amax)
    scales, packed = nvfp4_quantize(rows, 16, global_scale)
    values = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(rows.shape[0], -1, 16)
    return (values * (global_scale * scales.to(torch.float32)).unsqueeze(-1)).reshape(x.shape)


CALIBRATION_AMAX = torch.tensor(97.0)  # a static activation scale's calibration amax


WEIGHT_REFERENCES = {
    "W8A8": lambda w: _integer(w, (1, w.shape[1]), 8),
    "W8A16": lambda w: _integer(w, (1, w.shape[1]), 8),
    "W4A16": lambda w: _integer(w, (1, 128), 4),
    "W4A16_ASYM": lambda w: _integer(w, (1, 128), 4, symmetric=False),
    "FP8": lambda w: _float8(w, w.shape),
    "FP8_DYNAMIC": lambda w: _float8(w, (1, w.shape[1])),
    "FP8_BLOCK": lambda w: _float8(w, (128, 128)),
    "MXFP8": lambda w: _mx(w, E4M3),
    "MXFP4": lambda w: _mx(w, torch.float4_e2m1fn_x2),
    "NVFP4": lambda w: _nvfp4(w, w.abs().amax()),
    "NVFP4A16": lambda w: _nvfp4(w, w.abs().amax()),
}


ACTIVATION_REFERENCES = {
    "W8A8": lambda x: _integer(x, (1, 1, x.shape[-1]), 8),
    "FP8": lambda x: _float8(x, scale=(CALIBRATION_AMAX / 448.0).reshape(1, 1, 1)),
    "FP8_DYNAMIC": lambda x: _float8(x, (1, 1, x.shape[-1])),
    "FP8_BLOCK": lambda x: _float8(x, (1, 1, 128)),
    "MXFP8": lambda x: _mx(x, E4M3),
    "MXFP4": lambda x: _mx(x, torch.float4_e2m1fn_x2),
    "NVFP4": lambda x: _nvfp4(x, CALIBRATION_AMAX),
}


