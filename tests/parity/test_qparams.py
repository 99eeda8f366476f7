"""Fake quantization and qparams, cross-checked with torch's kernels and torch.ao's observers."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as ao

from qcore.observe import qparams
from qcore.observe.qparams import (
    calculate_qparams,
    default_quant_range,
    fake_quantize_dynamic,
    fake_quantize_finite_per_channel,
    fake_quantize_per_channel,
    fake_quantize_per_channel_steps,
    fake_quantize_per_tensor,
    per_channel_steps,
)

RANGES = [(-128, 127), (0, 255), (-8, 7), (-127, 127)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-4, 10.0), zp_frac=st.floats(0, 1),
       qrange=st.sampled_from(RANGES))
def test_per_tensor_matches_torch_kernel(seed, scale, zp_frac, qrange):
    quant_min, quant_max = qrange
    scale = float(torch.tensor(scale, dtype=torch.float32))
    zero_point = int(quant_min + zp_frac * (quant_max - quant_min))
    x = torch.randn(257, generator=torch.Generator().manual_seed(seed)) * scale * 100
    ours = fake_quantize_per_tensor(x, scale, zero_point, quant_min, quant_max)
    ref = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max)
    assert torch.equal(ours, ref)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), numel=st.integers(1, 80), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                                      torch.float16]),
       scale=st.floats(1e-3, 1.0), zp_frac=st.floats(0, 1), qrange=st.sampled_from(RANGES), strided=st.booleans())
def test_the_torch_paths_fake_quantization_is_torchs_kernel_with_nan_put_back(seed, numel, dtype, scale, zp_frac,
                                                                            qrange, strided):
    """The torch path (what a GPU runs) puts a NaN back in one op: the kernel's value to the bit elsewhere, sign of
    zero included, at every position (the CPU's vector lanes and its scalar tail), infinities clamped."""
    quant_min, quant_max = qrange
    zero_point = int(quant_min + zp_frac * (quant_max - quant_min))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel * (2 if strided else 1), generator=g) * scale * 100
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1e-30, 3e38, -3e38])
    index = torch.randint(0, x.numel(), (max(1, x.numel() // 3),), generator=g)
    x[index] = specials[torch.randint(0, len(specials), index.shape, generator=g)]
    x = (x[::2] if strided else x).to(dtype)
    with mock.patch.dict(qparams.native._state, {"library": None}):
        ours = fake_quantize_per_tensor(x, scale, zero_point, quant_min, quant_max)
    wide = x.float()
    kernel = torch.fake_quantize_per_tensor_affine(wide, qparams._float32(scale), zero_point, quant_min, quant_max)
    expected = torch.where(wide.isnan(), wide, kernel).to(dtype)
    assert torch.equal(ours.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours[numbers].view(bits), expected[numbers].view(bits))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), channels=st.integers(1, 8), axis=st.integers(0, 2),
       qrange=st.sampled_from(RANGES))
def test_per_channel_matches_torch_kernel(seed, channels, axis, qrange):
    quant_min, quant_max = qrange
    g = torch.Generator().manual_seed(seed)
    shape = [3, 5, 4]
    shape[axis] = channels
    x = torch.randn(shape, generator=g) * 4
    scale = torch.rand(channels, generator=g) * 0.1 + 1e-3
    zero_point = torch.randint(quant_min, quant_max + 1, (channels,), generator=g, dtype=torch.int32)
    ours = fake_quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max)
    ref = torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max)
    assert torch.equal(ours, ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), axis=st.integers(0, 2), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rows_at_a_time=st.integers(1, 40))
def test_large_tensors_are_fake_quantized_a_few_rows_at_a_time_with_the_same_values(seed, axis, dtype,
                                                                                     rows_at_a_time):
    """An LM head's weight is fake-quantized in slices of rows, not through float32 copies of all of it."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(9, 5, 4, generator=g) * 4).to(dtype)
    channels = x.shape[axis]
    scale = torch.rand(channels, generator=g) * 0.1 + 1e-3
    zero_point = torch.randint(-128, 128, (channels,), generator=g, dtype=torch.int32)
    with mock.patch.object(qparams, "_ROWS_ELEMENTS", rows_at_a_time), \
            mock.patch.object(qparams, "_HOST_ROWS_ELEMENTS", rows_at_a_time):  # the torch path's and the CPU's
        per_channel = fake_quantize_per_channel(x, scale, zero_point, axis, -128, 127)
        per_tensor = fake_quantize_per_tensor(x, 0.05, 3, -128, 127)
    wide = x.float()  # what the half dtypes are quantized in
    assert per_channel.dtype == per_tensor.dtype == dtype
    assert torch.equal(per_channel, torch.fake_quantize_per_channel_affine(wide, scale, zero_point, axis, -128,
                                                                           127).to(dtype))
    assert torch.equal(per_tensor, torch.fake_quantize_per_tensor_affine(wide, 0.05, 3, -128, 127).to(dtype))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), axis=st.integers(0, 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), qrange=st.sampled_from(RANGES),
       spread=st.floats(1e-3, 1e3))
def test_the_fused_per_channel_kernel_gives_the_torch_paths_values_where_convert_takes_it(seed, axis, dtype, qrange,
                                                                                        spread):
    """Finite weights, zero points 0, scales from their own range: one op of torch's kernel, bit for bit the torch
    path's values (sign of zero included), in the weight's own dtype."""
    quant_min, quant_max = qrange
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 40, generator=g) * spread).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, -1e-30]).to(dtype)
    wide = x.float()
    amax = wide.abs().amax(dim=1 - axis)
    scale = torch.clamp(amax / ((quant_max - quant_min) / 2), min=torch.finfo(torch.float32).eps)
    zero_point = torch.zeros(x.shape[axis], dtype=torch.int64)
    with mock.patch.dict(qparams.native._state, {"library": None}):
        expected = fake_quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max)
    ours = fake_quantize_finite_per_channel(x, scale, zero_point.int(), axis, quant_min, quant_max)
    assert ours.dtype == dtype
    assert torch.equal(ours, expected) and torch.equal(ours.signbit(), expected.signbit())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       scale=st.floats(1e-3, 1.0), zp=st.integers(-128, 127), torch_path=st.booleans())
def test_half_tensors_are_fake_quantized_as_their_float32_values_then_rounded_back(seed, dtype, scale, zp,
                                                                                  torch_path):
    """fp16/bf16 activations, through torch's kernel in their own dtype (the torch path) or in float32 (the CPU):
    what float32 gives, rounded back, NaN kept, sign of zero included."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * 40
    x[:5] = torch.tensor([float("nan"), -0.0, -1e-4, float("inf"), -float("inf")])
    x = x.to(dtype)
    with mock.patch.dict(qparams.native._state, {"library": None} if torch_path else {}):
        assert qparams.fused_kernels_preferred(x) == (torch_path or qparams.native.kernel() is None)
        ours = fake_quantize_per_tensor(x, scale, zp, -128, 127)
    wide = x.float()
    expected = torch.fake_quantize_per_tensor_affine(wide, qparams._float32(scale), zp, -128, 127)
    expected = torch.where(wide.isnan(), wide, expected).to(dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(expected))
    numbers = ~expected.isnan()  # a NaN's sign is no value
    assert torch.equal(ours[numbers].signbit(), expected[numbers].signbit())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), axis=st.integers(0, 2),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), zero=st.booleans(),
       rows_at_a_time=st.sampled_from([1, 7, 1 << 22]), special=st.booleans())
def test_per_channel_steps_made_once_give_what_each_call_computes(seed, axis, dtype, zero, rows_at_a_time, special):
    """A weight quantized where it is read takes its qparams laid out once (and no zero point when all are 0): the
    same values, bit for bit, sign of zero and NaN included, as fake_quantize_per_channel and torch's kernel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 5, 4, generator=g) * 4
    if special:
        x.view(-1)[:5] = torch.tensor([float("nan"), -0.0, -1e-4, float("inf"), -float("inf")])
    x = x.to(dtype)
    channels = x.shape[axis]
    scale = torch.rand(channels, generator=g) * 0.1 + 1e-3
    zero_point = torch.zeros(channels, dtype=torch.int64) if zero else torch.randint(-128, 128, (channels,),
                                                                                      generator=g)
    with mock.patch.dict(qparams.native._state, {"library": None}), \
            mock.patch.object(qparams, "_ROWS_ELEMENTS", rows_at_a_time), \
            mock.patch.object(qparams, "_HOST_ROWS_ELEMENTS", rows_at_a_time):
        expected = fake_quantize_per_channel(x, scale, zero_point, axis, -128, 127)
        steps = list(per_channel_steps(scale, zero_point, axis, x))
        if zero:
            steps[2] = None
        ours = fake_quantize_per_channel_steps(x.clone(), *steps, axis, -128, 127, in_place=True)
    assert ours.dtype == dtype
    assert torch.equal(ours.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(expected))
    assert torch.equal(torch.nan_to_num(ours).signbit(), torch.nan_to_num(expected).signbit())
    if not special:  # torch's per-channel kernel makes inf the lowest level
        reference = torch.fake_quantize_per_channel_affine(x.float(), scale, zero_point.int(), axis, -128, 127)
        assert torch.equal(ours, reference.to(dtype))
        assert torch.equal(ours.signbit(), reference.to(dtype).signbit())


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=64),
       qrange=st.sampled_from(RANGES), symmetric=st.booleans())
def test_roundtrip_error_at_most_half_a_step(values, qrange, symmetric):
    """Every observed value moves by at most scale/2 (clipping at the range ends included)."""
    quant_min, quant_max = qrange
    x = torch.tensor(values, dtype=torch.float32)
    scale, zero_point = calculate_qparams(x.min(), x.max(), quant_min, quant_max, symmetric)
    y = fake_quantize_per_tensor(x, float(scale), int(zero_point), quant_min, quant_max)
    tolerance = float(scale) / 2 * (1 + 1e-5) + 1e-6 * float(x.abs().max())
    assert float((x - y).abs().max()) <= tolerance


@pytest.mark.parametrize("dtype,qscheme", [
    (torch.qint8, torch.per_tensor_affine), (torch.quint8, torch.per_tensor_affine),
    (torch.qint8, torch.per_tensor_symmetric), (torch.quint8, torch.per_tensor_symmetric),
])
def test_qparams_match_torch_ao_minmax(dtype, qscheme):
    x = torch.randn(1000) * 3 + 0.5
    reference = ao.MinMaxObserver(dtype=dtype, qscheme=qscheme)
    reference(x)
    ref_scale, ref_zp = reference.calculate_qparams()
    ours_dtype = torch.int8 if dtype == torch.qint8 else torch.uint8
    quant_min, quant_max = default_quant_range(ours_dtype)
    scale, zp = calculate_qparams(x.min(), x.max(), quant_min, quant_max, qscheme == torch.per_tensor_symmetric)
    torch.testing.assert_close(scale.reshape(-1), ref_scale.reshape(-1), rtol=1e-6, atol=0)
    assert int(zp) == int(ref_zp)


def test_dynamic_fake_quant_uses_own_range():
    x = torch.linspace(-2, 6, 101)
    y = fake_quantize_dynamic(x, -128, 127, symmetric=False)
    scale = 8 / 255
    assert (x - y).abs().max() <= scale / 2 + 1e-6


def test_bad_range_is_rejected():
    from qcore.observe.qparams import resolve_quant_range

    with pytest.raises(ValueError, match="does not fit"):
        resolve_quant_range(torch.int8, -200, 127)
