"""qcore.formats.numerics against torchao 0.18's reference functions, bit for bit, on random and adversarial tensors:
NaN, inf, all-zero blocks, subnormals, values at the saturation points, and shapes that do not fit the block."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_scale_float8,
    _dequantize_affine_float8,
    _get_reduction_params,
    _quantize_affine_float8,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)

from qcore.formats import numerics as formats

SPECIAL = [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 6.0, -6.0, 5.0, 2.5, 0.25, 0.75, 1.25, 1e-40, -1e-45, 1e-30,
           3.4e38, -3.4e38, 57344.0, math.inf, -math.inf, math.nan]
FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True, min_value=-1e6,
                   max_value=1e6)
ANY = st.one_of(FINITE, st.sampled_from(SPECIAL))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern, so that NaN == NaN and -0.0 != 0.0."""
    tensor = tensor.contiguous()
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def _same(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    assert torch.equal(_bits(ours), _bits(reference)), (ours, reference)


@st.composite
def tensors(draw, columns=(16, 32, 64, 96, 128, 256), values=ANY, zero_block=True):
    """A [rows, columns] float32 tensor of drawn values, some rows with a loud channel or an all-zero block."""
    rows, width = draw(st.integers(1, 3)), draw(st.sampled_from(columns))
    data = draw(st.lists(values, min_size=rows * width, max_size=rows * width))
    tensor = torch.tensor(data, dtype=torch.float32).reshape(rows, width)
    if zero_block and draw(st.booleans()):
        tensor[0, :16] = 0.0
    return tensor


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(shape), st.tuples(*[st.sampled_from(sorted({1, size})) for size in shape]))))
def test_the_reduction_layout_is_torchaos(case):
    shape, block = case
    assert formats.reduction_layout(shape, block) == tuple(_get_reduction_params(list(block), list(shape)))


@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, True), (4, False), (8, False)])
@settings(max_examples=40, deadline=None)
@given(x=tensors(columns=(128, 256), values=FINITE), group=st.sampled_from([None, 128, 32]))
def test_integers_match_choose_quantize_dequantize_affine(bits, symmetric, x, group):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    block = (1, x.shape[1] if group is None else group)
    mapping = MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC
    scale, zero_point = choose_qparams_affine(x, mapping, block, torch.int8, qmin, qmax)
    our_scale, our_zero_point = formats.choose_qparams_affine(x, block, qmin, qmax, symmetric=symmetric)
    _same(our_scale.reshape(scale.shape), scale)  # torchao drops the reduced dimensions (keepdim=False)
    assert torch.equal(our_zero_point.reshape(zero_point.shape).to(torch.float32), zero_point.to(torch.float32))
    codes = quantize_affine(x, block, scale, zero_point, torch.int8, qmin, qmax)
    our_codes = formats.quantize_affine(x, block, our_scale, our_zero_point, qmin, qmax)
    assert torch.equal(our_codes, codes.to(torch.float32))
    values = dequantize_affine(codes, block, scale, zero_point, torch.int8, qmin, qmax)
    _same(formats.dequantize_affine(our_codes, block, our_scale, our_zero_point), values)
    if symmetric:  # the symmetric scale: amax / ((qmax - qmin) / 2), e.g. amax / 127.5 for int8, amax / 7.5 for int4
        amax = x[:, :block[1]].abs().amax(1).clamp(min=1.1754944e-38)
        assert torch.allclose(our_scale[:, 0], amax / ((qmax - qmin) / 2))


@settings(max_examples=60, deadline=None)
@given(x=tensors(), granularity=st.sampled_from(["tensor", "row", "block"]),
       dtype=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]))
def test_float8_matches_choose_scale_quantize_dequantize(x, granularity, dtype):
    block = {"tensor": tuple(x.shape), "row": (1, x.shape[1]), "block": (1, 16)}[granularity]
    scale = _choose_scale_float8(x, list(block), dtype)
    _same(formats.choose_scale_float8(x, block, dtype), scale)
    q = _quantize_affine_float8(x, scale, dtype)
    _same(formats.quantize_float8(x, scale, dtype), q)
    _same(formats.dequantize_float8(q, scale), _dequantize_affine_float8(q, scale))


@settings(max_examples=60, deadline=None)
@given(x=tensors(columns=(32, 64, 96, 128)), elements=st.sampled_from(["e4m3", "e2m1"]))
def test_mx_matches_to_mx_floor_and_to_dtype(x, elements):
    reference_dtype = torch.float8_e4m3fn if elements == "e4m3" else torch.float4_e2m1fn_x2
    ours_dtype = torch.float8_e4m3fn if elements == "e4m3" else "e2m1"
    scale, data = to_mx(x, reference_dtype, 32, ScaleCalculationMode.FLOOR)
    exponents, our_elements = formats.to_mx(x, ours_dtype)
    _same(exponents, scale.view(torch.uint8))
    if elements == "e2m1":
        assert torch.equal(our_elements, unpack_uint4(data).reshape(x.shape))
    else:
        _same(our_elements, data)
    _same(formats.from_mx(exponents, our_elements, ours_dtype), to_dtype(data, scale, reference_dtype, 32,
                                                                          torch.float32))


@settings(max_examples=60, deadline=None)
@given(x=tensors(columns=(16, 32, 64, 128)), amax_from=st.sampled_from(["tensor", "calibration"]))
def test_nvfp4_matches_per_tensor_amax_to_scale_and_nvfp4_quantize(x, amax_from):
    amax = x.abs().amax() if amax_from == "tensor" else torch.tensor(3.5)  # a static, calibrated global scale
    global_scale = per_tensor_amax_to_scale(amax)
    _same(formats.nvfp4_global_scale(amax), global_scale)
    scales, packed = nvfp4_quantize(x, 16, global_scale)
    our_scales, codes = formats.nvfp4_quantize(x, global_scale)
    _same(our_scales, scales)
    unpacked = unpack_uint4(packed).reshape(x.shape)
    assert torch.equal(codes, unpacked)
    reference = (f4_unpacked_to_f32(unpacked).reshape(x.shape[0], -1, 16)
                 * (global_scale * scales.to(torch.float32)).unsqueeze(-1)).reshape(x.shape)
    _same(formats.nvfp4_dequantize(our_scales, codes, global_scale), reference)


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.25, -5.0, -0.0])
    assert formats.e2m1_decode(formats.e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
                                                                     -0.0, -4.0, -0.0]


@settings(max_examples=60, deadline=None)
@given(x=tensors(columns=(32, 64), values=FINITE, zero_block=False))
def test_quantize_dequantize_error_is_at_most_half_a_step(x):
    scale, zero_point = formats.choose_qparams_affine(x, (1, 32), -8, 7, symmetric=True)
    codes = formats.quantize_affine(x, (1, 32), scale, zero_point, -8, 7)
    error = (formats.dequantize_affine(codes, (1, 32), scale, zero_point) - x).abs().reshape(x.shape[0], -1, 32)
    # the amax itself lands exactly half a step past 7 (scale = amax / 7.5): allow float rounding there
    assert bool((error <= scale.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-30).all())


def test_shapes_that_do_not_fit_the_block_are_refused():
    with pytest.raises(ValueError, match="not a multiple of its block of 128"):
        formats.choose_qparams_affine(torch.randn(4, 200), (1, 128), -8, 7, symmetric=True)
    with pytest.raises(ValueError, match="not a multiple of the MX block of 32"):
        formats.to_mx(torch.randn(4, 40), "e2m1")
    with pytest.raises(ValueError, match="not a multiple of the NVFP4 block of 16"):
        formats.nvfp4_quantize(torch.randn(4, 40), torch.tensor(1.0))


@pytest.mark.skipif(__import__("qcore.runtime.native").runtime.native.kernel() is None,
                    reason="no C compiler: torch path only")
@settings(max_examples=80, deadline=None)
@given(x=tensors(columns=(32, 64, 96, 128)), elements=st.sampled_from(["e4m3", "e2m1"]),
       amax_from=st.sampled_from(["tensor", "calibration"]))
def test_the_fused_native_kernels_equal_the_torch_path_bit_for_bit(x, elements, amax_from):
    """Every bit, but a NaN's payload (which NaN a multiplication returns is the CPU's business)."""
    def same(ours, reference):
        nan = torch.isnan(reference)
        assert torch.equal(torch.isnan(ours), nan)
        _same(torch.where(nan, 0.0, ours), torch.where(nan, 0.0, reference))

    elem = torch.float8_e4m3fn if elements == "e4m3" else "e2m1"
    exponents, data = formats.to_mx(x, elem)
    same(formats.fake_quantize_mx(x, elem), formats.from_mx(exponents, data, elem))
    global_scale = formats.nvfp4_global_scale(x.abs().amax() if amax_from == "tensor" else torch.tensor(3.5))
    scales, codes = formats.nvfp4_quantize(x, global_scale)
    same(formats.fake_quantize_nvfp4(x, global_scale), formats.nvfp4_dequantize(scales, codes, global_scale))
