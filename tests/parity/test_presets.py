"""Each deployed preset's fake quantization equals the same format computed with torchao 0.18's reference
functions, bit for bit, on a Linear weight with loud input channels and an activation with an outlier channel."""
import pytest
import torch

from qcore.formats.presets import PRESETS, TensorFormat, preset
from tests.helpers import ACTIVATION_REFERENCES, CALIBRATION_AMAX, WEIGHT_REFERENCES


def _weight():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, generator=g) * 0.05
    weight[:, [3, 77, 200]] *= 40.0  # loud input channels
    return weight


def _activation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 256, generator=g)
    x[..., 5] *= 30.0  # an outlier channel
    return x













def _bits(tensor):
    return tensor.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_is_torchaos_format_bit_for_bit(name):
    chosen = PRESETS[name]
    weight, activation = _weight(), _activation()
    ours = chosen.weight.fake_quantize(weight, weight=True)
    assert torch.equal(_bits(ours), _bits(WEIGHT_REFERENCES[name](weight))), name
    assert (chosen.activation is None) == (name not in ACTIVATION_REFERENCES)
    if chosen.activation is not None:
        ours = chosen.activation.fake_quantize(activation, CALIBRATION_AMAX)
        assert torch.equal(_bits(ours), _bits(ACTIVATION_REFERENCES[name](activation))), name


def test_a_shape_that_cannot_take_a_format_says_why_and_names_are_checked():
    assert PRESETS["W4A16"].weight.refusal((64, 200), weight=True) == (
        "its last dimension (200) is not a multiple of the format's block of 128")
    assert PRESETS["NVFP4"].weight.refusal((64, 3, 5, 5), weight=True) == (  # a conv weight, read as [64, 75]
        "its last dimension (75) is not a multiple of the format's block of 16")
    assert PRESETS["NVFP4"].weight.refusal((64, 3, 4, 4), weight=True) == ""
    assert PRESETS["W8A8"].weight.refusal((64, 200), weight=True) == ""
    with pytest.raises(ValueError, match="cannot take this format: its last dimension"):
        PRESETS["MXFP4"].weight.fake_quantize(torch.randn(8, 40), weight=True)
    with pytest.raises(ValueError, match="unknown format 'nvfp5' \\(did you mean 'NVFP4'\\?\\)"):
        preset("nvfp5")
    with pytest.raises(ValueError, match="granularity must be one of"):
        TensorFormat("int8", "per_channel")


def test_fake_quantization_keeps_the_weights_dtype_shape_and_device():
    weight = _weight().to(torch.bfloat16)
    for chosen in PRESETS.values():
        out = chosen.weight.fake_quantize(weight, weight=True)
        assert out.dtype == torch.bfloat16 and out.shape == weight.shape and out.device == weight.device
