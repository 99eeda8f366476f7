"""The deployed formats through the plugin: preset names wherever a quantizer name goes, layer_formats on top, and a
layer whose shape cannot take its format erroring on its own items with a fix that, pasted back, passes."""
import json
import re

import pytest
from torch import nn
from torchao.prototype.mx_formats.inference_workflow import NVFP4WeightOnlyConfig  # at import: see conftest.py
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from tests.helpers import LADDER_NET, TINY_SOURCE

MIXED = TINY_SOURCE + '''

class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(128, 40)
        self.head = nn.Linear(40, 8)
        with torch.no_grad():
            for layer in (self.up, self.odd, self.head):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)

    def forward(self, x):
        return self.head(torch.relu(self.odd(torch.relu(self.up(x)))))


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=g) for _ in range(3)]


@qmodel(calibration="batches", quantizer="NVFP4", checks="sqnr,weight_sqnr,model_sqnr,per_channel",
        sqnr_min_db=5, weight_sqnr_min_db=5, model_sqnr_min_db=5{extra})
def mixed():
    torch.manual_seed(0)  # the biases
    return Mixed().eval()
'''


def test_a_layer_that_cannot_take_its_format_errors_and_the_pasted_fix_passes(pytester):
    pytester.makeconftest(MIXED.replace("{extra}", ""))
    failing = pytester.runpytest("--qreport", "-p", "no:cacheprovider")
    failing.assert_outcomes(passed=5, skipped=2, errors=3)
    text = failing.stdout.str()
    assert ("model 'mixed', layer head: it cannot be quantized as NVFP4: its weight [8, 40]: its last dimension (40) "
            "is not a multiple of the format's block of 16") in text
    fix = re.search(r"give it a format that fits with (layer_formats=\{.*?\})", text).group(1)
    pytester.makeconftest(MIXED.replace("{extra}", ", " + fix))
    fixed = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json")
    fixed.assert_outcomes(passed=7, skipped=3)  # per_channel skips: not an int8 question under NVFP4 or FP8
    rows = json.loads((pytester.path / "r.json").read_text())["rows"]
    formats = {r["layer"]: r["details"]["format"] for r in rows if r["check"] == "sqnr"}
    assert formats == {"up": "NVFP4", "odd": "NVFP4", "head": "FP8_DYNAMIC"}  # the others stay NVFP4


def test_format_names_are_qcores_presets_and_unknown_ones_name_the_closest(pytester):
    from pytest_qreport.core.quantizers import FORMAT_NAMES
    from qcore.formats.presets import PRESETS

    assert FORMAT_NAMES == tuple(PRESETS)
    pytester.makeconftest(MIXED.replace("{extra}", ""))
    result = pytester.runpytest("--qreport", "--qreport-quantizer", "nvfp5")
    assert result.ret == 4 and "unknown quantizer 'nvfp5' (did you mean 'NVFP4'?)" in result.stderr.str()
    result = pytester.runpytest("--qreport", "--qreport-layer-formats", "head=FP9")
    assert result.ret == 4 and "unknown format 'FP9' for 'head' (did you mean 'FP8'?)" in result.stderr.str()


def test_layer_formats_on_the_command_line_and_on_an_int8_quantizer(pytester):
    pytester.makeconftest(MIXED.replace("{extra}", ""))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-layer-formats", "head=float,odd=W8A8")
    result.assert_outcomes(passed=5, skipped=2)  # head in float: no items; per_channel skips for the formats
    int8 = MIXED.replace("{extra}", ", layer_formats={'head': 'FP8'}").replace('quantizer="NVFP4"', 'quantizer="int8"')
    pytester.makeconftest(int8)
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    assert "Int8StaticQuantizer cannot give layers the formats ['FP8']; choose a format as the model's quantizer" in (
        result.stdout.str())


LADDER = TINY_SOURCE + "\n" + LADDER_NET + '''

@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 128, generator=g) for _ in range(4)]


@qmodel(calibration="batches", quantizer="NVFP4", checks="model_sqnr", model_sqnr_min_db=14.0{extra})
def net():
    torch.manual_seed(0)  # the biases
    return Net().eval()
'''


def test_an_nvfp4_model_below_its_threshold_gets_a_format_fix_that_pasted_back_passes(pytester):
    pytester.makeconftest(LADDER.replace("{extra}", ""))
    # the search runs to its end: at the default fix budget it stops after one move on this small model
    failing = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json",
                                 "--qreport-fix-budget=unlimited")
    failing.assert_outcomes(failed=1)
    text = failing.stdout.str()
    measured = re.search(r"up the format ladder was measured to reach ([\d.]+) dB: (layer_formats=\{.*?\})", text)
    assert measured and float(measured.group(1)) >= 14.0, text
    fix = measured.group(2)
    recipe = json.loads((pytester.path / "r.json").read_text())["rows"][0]["details"]["recipe"]
    assert recipe["default"] == "NVFP4" and f"layer_formats={recipe['layers']!r}" == fix
    assert 0 < len(recipe["layers"]) < 4  # some layers stay NVFP4
    pytester.makeconftest(LADDER.replace("{extra}", ", " + fix))
    fixed = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json")
    fixed.assert_outcomes(passed=1)
    row = json.loads((pytester.path / "r.json").read_text())["rows"][0]
    assert row["value"] == pytest.approx(float(measured.group(1)), abs=0.05)  # what the message promised


def test_the_recipe_applied_with_torchao_gives_exactly_the_named_layers_their_formats(pytester):
    source = LADDER.replace('quantizer="NVFP4"', 'quantizer="NVFP4A16"').replace("model_sqnr_min_db=14.0",
                                                                               "model_sqnr_min_db=17.0")
    pytester.makeconftest(source.replace("{extra}", ""))
    pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json").assert_outcomes(failed=1)
    recipe = json.loads((pytester.path / "r.json").read_text())["rows"][0]["details"]["recipe"]
    assert recipe["default"] == "NVFP4A16" and 0 < len(recipe["layers"]) < 4, recipe
    namespace: dict = {}
    exec(source.split("@pytest.fixture")[0], namespace)  # the conftest's Net, built as its model function does
    torch = namespace["torch"]
    torch.manual_seed(0)
    model = namespace["Net"]().eval().to(torch.bfloat16)
    configs = {"NVFP4A16": NVFP4WeightOnlyConfig(), "W8A16": Int8WeightOnlyConfig()}  # torchao's, on CPU
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    chosen = {name: recipe["layers"].get(name, recipe["default"]) for name in linears}
    for name, format_name in chosen.items():
        if format_name != "float":
            quantize_(model, configs[format_name], filter_fn=lambda module, fqn, name=name: fqn == name)
    kinds = {"NVFP4A16": "NVFP4Tensor", "W8A16": "Int8Tensor", "float": "Parameter"}
    assert {name: type(model.get_submodule(name).weight).__name__ for name in linears} == {
        name: kinds[format_name] for name, format_name in chosen.items()}


def test_the_html_report_shows_the_recipe(pytester):
    pytester.makeconftest(LADDER.replace("{extra}", ""))
    pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-html=r.html")
    page = (pytester.path / "r.html").read_text()
    assert "<h3>recipe</h3>" in page and "default <code>NVFP4</code>" in page and "layer_formats={" in page
