"""Each deployed preset's fake quantization equals the same format computed with torchao 0.18's reference
functions, bit for bit, on a Linear weight with loud input channels and an activation with an outlier channel."""
import pytest
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

from qcore.formats.presets import PRESETS, TensorFormat, preset

E4M3 = torch.float8_e4m3fn


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
