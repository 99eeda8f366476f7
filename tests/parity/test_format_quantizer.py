"""qcore's FormatQuantizer puts each preset's formats into the graph: a layer's weight_sqnr and sqnr equal the same
quantities computed with torchao's reference functions (to 0.02 dB), on a Linear with loud input channels."""
import math

import pytest
import torch
from torch import nn

import qcore
from qcore.analysis import ModelAnalysis
from qcore.formats.presets import PRESETS
from qcore.quantization.format_quantizer import FORMAT_REFUSAL_KEY, FormatQuantizer
from tests.helpers import ACTIVATION_REFERENCES, WEIGHT_REFERENCES


class Loud(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(256, 128)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(128, 256, generator=g) * 0.05)
            self.fc.weight[:, [3, 77, 200]] *= 40.0

    def forward(self, x):
        return self.fc(x)


def _batches():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, 256, generator=g) for _ in range(3)]
    for batch in batches:
        batch[..., 5] *= 30.0
    return batches


def _sqnr(reference_sum: float, error_sum: float) -> float:
    return math.inf if error_sum == 0 else 10 * math.log10(reference_sum / error_sum)


@pytest.mark.parametrize("name", list(PRESETS))
def test_weight_sqnr_and_sqnr_equal_torchaos_reference(name, monkeypatch):
    model, batches = Loud().eval(), _batches()
    analysis = ModelAnalysis(qcore.capture(model, batches[0]), FormatQuantizer(name), batches)
    measured = analysis.sqnr.layers["fc"]
    weight = model.fc.weight.detach()
    reference_weight = WEIGHT_REFERENCES[name](weight)
    assert measured.weight_sqnr_db == pytest.approx(
        _sqnr(float((weight.double() ** 2).sum()), float(((weight - reference_weight).double() ** 2).sum())), abs=0.02)
    chosen = PRESETS[name]
    if chosen.activation is not None:  # a static scale's amax is the calibration's
        import tests.helpers as references

        monkeypatch.setattr(references, "CALIBRATION_AMAX", torch.stack([b.abs().amax() for b in batches]).amax())
    signal = noise = 0.0
    with torch.no_grad():
        for batch in batches:
            expected = model(batch)
            inputs = batch if chosen.activation is None else ACTIVATION_REFERENCES[name](batch)
            got = nn.functional.linear(inputs, reference_weight, model.fc.bias)
            signal += float((expected.double() ** 2).sum())
            noise += float(((expected - got).double() ** 2).sum())
    assert measured.sqnr_db == pytest.approx(_sqnr(signal, noise), abs=0.02), name


def test_layer_overrides_choose_formats_and_float_and_a_shape_that_cannot_take_its_format_is_named():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 8)).eval()
    batches = [torch.randn(4, 64) for _ in range(2)]
    quantizer = FormatQuantizer("NVFP4", layer_overrides={"2": {"format": "FP8_DYNAMIC"}, "4": {"skip": True}})
    float_gm = qcore.capture(model, batches[0])
    annotated = qcore.prepare(float_gm, quantizer)
    formats = {node.name: node.meta.get(FORMAT_REFUSAL_KEY) for node in annotated.graph.nodes}
    assert not any(formats.values())
    layers = {entry.layer: entry for entry in qcore.analysis.quantized_layers(float_gm, quantizer)}
    assert set(layers) == {"0", "2"}  # layer 4 stays in float
    annotated = FormatQuantizer("NVFP4").annotate(qcore.capture(model, batches[0]))
    refusals = [node.meta[FORMAT_REFUSAL_KEY] for node in annotated.graph.nodes if FORMAT_REFUSAL_KEY in node.meta]
    assert refusals == ["NVFP4: its weight [8, 40]: its last dimension (40) is not a multiple of the format's "
                        "block of 16"]
    with pytest.raises(ValueError, match="did you mean 'FP8'"):
        FormatQuantizer("FP9")


@pytest.mark.parametrize("name,static", [("NVFP4", True), ("FP8", True), ("FP8_DYNAMIC", False), ("MXFP4", False),
                                         ("W8A8", False)])
def test_a_static_activation_scale_is_the_calibration_amax_and_dynamic_ones_keep_nothing(name, static):
    from qcore.quantization.format_quantizer import FormatFakeQuantize

    model, batches = Loud().eval(), _batches()
    _float_gm, quant_gm = qcore.quantize(model, batches[0], batches, FormatQuantizer(name))
    applied = [m for m in quant_gm.modules() if isinstance(m, FormatFakeQuantize)]
    assert len(applied) == 1
    expected = torch.stack([b.abs().amax() for b in batches]).amax()
    assert (applied[0].amax is not None and torch.equal(applied[0].amax, expected)) if static else (
        applied[0].amax is None)


def test_the_sensitivity_ranking_switches_a_formats_quantizers_layer_by_layer():
    from qcore.measure.passes import measure_sqnr
    from qcore.search.sensitivity import layer_sensitivity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    batches = [torch.randn(16, 64) for _ in range(2)]
    float_gm = qcore.capture(model, batches[0])
    ranking = layer_sensitivity(float_gm, batches, FormatQuantizer("NVFP4"))
    assert ranking.all_quantized_db == pytest.approx(
        measure_sqnr(float_gm, batches, FormatQuantizer("NVFP4"), shadow=False).worst_output().sqnr_db, abs=1e-6)
    assert {entry.layer for entry in ranking.layers} == {"0", "2", "4"}
    assert all(entry.gain_db > 0 for entry in ranking.layers)  # keeping any layer in float helps
