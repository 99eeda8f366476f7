"""The fused native kernels (qcore/_fused.c) compute what their torch paths compute."""
import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcore.numeric.loggers import ActivationStash, StreamingComparator
from qcore.observe.qparams import (
    KeptRowArguments,
    fake_quantize_divided_rows,
    fake_quantize_per_channel,
    fake_quantize_per_tensor,
    fake_quantize_rows,
    fake_quantize_scaled_rows,
    scaled_row_extremes,
)
from qcore.runtime import native, scratch

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=f"no native kernel here: {native.status()}")
RANGES = [(-128, 127), (0, 255), (-8, 7), (-(2**31), 2**31 - 1)]


def _torch_path(function, *args):
    library = native.kernel()
    native._state["library"] = None
    try:
        return function(*args)
    finally:
        native._state["library"] = library


def _with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with NaN, infinities, signed zeros and exact half steps mixed in."""
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38])
    index = torch.randint(0, x.numel(), (min(x.numel(), 24),), generator=g)
    x.view(-1)[index] = specials[torch.randint(0, len(specials), index.shape, generator=g)]
    return x


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-6, 10.0), zp_frac=st.floats(0, 1),
       qrange=st.sampled_from(RANGES), numel=st.sampled_from([1, 7, 300, native.PARALLEL_MIN_NUMEL + 5]),
       strided=st.booleans())
def test_fake_quantize_per_tensor_is_bit_identical_to_the_torch_path(seed, scale, zp_frac, qrange, numel, strided):
    quant_min, quant_max = qrange
    zero_point = int(quant_min + zp_frac * (quant_max - quant_min))
    g = torch.Generator().manual_seed(seed)
    x = _with_specials(torch.randn(numel * (2 if strided else 1), generator=g) * scale * 150, seed)
    x = x[::2] if strided else x
    steps = torch.arange(min(numel, 16), dtype=torch.float32) + 0.5  # ties: round half to even
    x[: steps.numel()] = steps * scale
    ours = fake_quantize_per_tensor(x, scale, zero_point, quant_min, quant_max)
    reference = _torch_path(fake_quantize_per_tensor, x, scale, zero_point, quant_min, quant_max)
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert torch.equal(ours.nan_to_num(7.0), reference.nan_to_num(7.0))
    numbers = ~reference.isnan()  # a NaN's sign is no value: the torch path's NaN is clamp's, the kernel's x's
    assert torch.equal(torch.signbit(ours[numbers]), torch.signbit(reference[numbers]))  # no -0.0 where torch has 0.0


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 5, 64]), cols=st.sampled_from([1, 9, 300]),
       qrange=st.sampled_from(RANGES[:3]), symmetric=st.booleans(), strided=st.booleans())
def test_fake_quantize_per_channel_is_bit_identical_to_the_torch_path(seed, rows, cols, qrange, symmetric, strided):
    quant_min, quant_max = qrange
    g = torch.Generator().manual_seed(seed)
    x = _with_specials(torch.randn(rows, cols * (2 if strided else 1), generator=g) * 4, seed)
    x = x[:, ::2] if strided else x
    scale = torch.rand(rows, generator=g) * 0.1 + 1e-4
    zero_point = torch.zeros(rows, dtype=torch.int64) if symmetric else \
        torch.randint(quant_min, quant_max + 1, (rows,), generator=g)
    x[:, : min(cols, 8)] = (torch.arange(min(cols, 8)) + 0.5) * scale[:, None]  # ties: round half to even
    ours = fake_quantize_per_channel(x, scale, zero_point, 0, quant_min, quant_max)
    reference = _torch_path(fake_quantize_per_channel, x, scale, zero_point, 0, quant_min, quant_max)
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert torch.equal(ours.nan_to_num(7.0), reference.nan_to_num(7.0))
    assert torch.equal(torch.signbit(ours), torch.signbit(reference))


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 5, 64]), cols=st.sampled_from([1, 9, 300]),
       alphas=st.integers(1, 4), specials=st.booleans(), strided=st.booleans())
def test_scaled_rows_are_ranged_and_quantized_bit_identically_to_the_torch_path(seed, rows, cols, alphas, specials,
                                                                                  strided):
    """The smoothing alpha search's weight per alpha (x * s, each column scaled): its rows' ranges and its per-row
    fake quantization, as the torch path computes them from the scaled copy (NaN ranges where a product is NaN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols * (2 if strided else 1), generator=g) * 4
    x = _with_specials(x, seed) if specials else x
    x = x[:, ::2] if strided else x
    column_scales = torch.rand(alphas, cols, generator=g) * 3 + 1e-3
    low, high = scaled_row_extremes(x, column_scales)
    reference = _torch_path(scaled_row_extremes, x, column_scales)
    assert torch.equal(low.nan_to_num(7.0), reference[0].nan_to_num(7.0))
    assert torch.equal(high.nan_to_num(7.0), reference[1].nan_to_num(7.0))
    scale = torch.rand(alphas * rows, generator=g) * 0.1 + 1e-4  # each alpha's rows their own scales
    zero_point = torch.zeros(alphas * rows, dtype=torch.int64)
    ours = fake_quantize_scaled_rows(x, column_scales, scale, zero_point, -127, 127)
    expected = _torch_path(fake_quantize_scaled_rows, x, column_scales, scale, zero_point, -127, 127)
    assert len(ours) == len(expected) == alphas
    for mine, theirs in zip(ours, expected):
        assert mine.shape == theirs.shape and torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))
        assert torch.equal(torch.signbit(mine), torch.signbit(theirs))



@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 5, 64]), cols=st.sampled_from([1, 9, 300]),
       qrange=st.sampled_from(RANGES[:3]), symmetric=st.booleans(), specials=st.booleans(), strided=st.booleans(),
       flat=st.booleans())
def test_divided_rows_are_quantized_bit_identically_to_the_torch_path(seed, rows, cols, qrange, symmetric, specials,
                                                                      strided, flat):
    """An equalization variant's weight quantized where it is read (x / d, each column divided, quantized per row):
    what the torch path makes from the divided copy, NaN, infinities and zero divisors included."""
    quant_min, quant_max = qrange
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols * (2 if strided else 1), generator=g) * 4
    x = _with_specials(x, seed) if specials else x
    x = x[:, ::2] if strided else x
    divisor = torch.rand(cols, generator=g) * 3 + 1e-3
    if specials:
        divisor[0] = 0.0
    divisor = divisor if flat else divisor.reshape(1, cols)
    scale = torch.rand(rows, generator=g) * 0.1 + 1e-4
    zero_point = torch.zeros(rows, dtype=torch.int64) if symmetric else \
        torch.randint(quant_min, quant_max + 1, (rows,), generator=g)
    ours = fake_quantize_divided_rows(x, divisor, scale, zero_point, quant_min, quant_max)
    expected = _torch_path(fake_quantize_per_channel, x / divisor, scale, zero_point, 0, quant_min, quant_max)
    assert ours.shape == expected.shape and torch.equal(ours.nan_to_num(7.0), expected.nan_to_num(7.0))
    numbers = ~expected.isnan()
    assert torch.equal(torch.signbit(ours[numbers]), torch.signbit(expected[numbers]))
    assert torch.equal(_torch_path(fake_quantize_divided_rows, x, divisor, scale, zero_point, quant_min,
                                   quant_max).nan_to_num(7.0), expected.nan_to_num(7.0))


@contextlib.contextmanager
def _streaming_from(nbytes: int):
    """Within the block the per-row kernels stream every output of `nbytes` bytes or more (torch runs two threads
    at least: with one, nothing is streamed)."""
    kept, threads = native.STREAM_MIN_BYTES, torch.get_num_threads()
    native.STREAM_MIN_BYTES = nbytes
    torch.set_num_threads(max(2, threads))
    try:
        yield
    finally:
        native.STREAM_MIN_BYTES = kept
        torch.set_num_threads(threads)


def _same_values(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0)) and torch.equal(
        torch.signbit(ours[~theirs.isnan()]), torch.signbit(theirs[~theirs.isnan()]))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 5, 64]), cols=st.sampled_from([1, 9, 300, 515, 1031]),
       offset=st.sampled_from([0, 1, 3]), specials=st.booleans())
def test_streamed_rows_are_the_plain_rows_bit_for_bit(seed, rows, cols, offset, specials):
    """Each per-row kernel's output written with streaming stores holds the values plain stores write, the torch
    path's, whatever the row length (tile and vector tails) and the output's alignment (written in place at an
    offset of `offset` floats)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 4
    x = _with_specials(x, seed) if specials else x
    scale = torch.rand(rows, generator=g) * 0.1 + 1e-4
    zero_point = torch.randint(-20, 21, (rows,), generator=g)
    divisor = torch.rand(cols, generator=g) * 3 + 1e-3
    column_scales = torch.rand(2, cols, generator=g) * 3 + 1e-3
    expected = _torch_path(fake_quantize_per_channel, x, scale, zero_point, 0, -128, 127)
    divided = _torch_path(fake_quantize_divided_rows, x, divisor, scale, zero_point, -128, 127)
    scaled = _torch_path(fake_quantize_scaled_rows, x, column_scales, scale.repeat(2), zero_point.repeat(2) * 0, -127,
                         127)
    arguments = KeptRowArguments().arguments(x, scale, zero_point, 0, -128, 127)
    for threshold in (0, 1 << 40):  # every output streamed, then none
        with _streaming_from(threshold):
            assert native.streams(x.numel() * 4) == (threshold == 0)
            assert _same_values(fake_quantize_per_channel(x, scale, zero_point, 0, -128, 127), expected)
            assert _same_values(fake_quantize_divided_rows(x, divisor, scale, zero_point, -128, 127), divided)
            for ours, theirs in zip(fake_quantize_scaled_rows(x, column_scales, scale.repeat(2),
                                                              zero_point.repeat(2) * 0, -127, 127), scaled):
                assert _same_values(ours, theirs)
            at_offset = torch.empty(x.numel() + offset)[offset:].view(rows, cols)
            at_offset.copy_(x)
            assert at_offset.data_ptr() % 64 == (at_offset.untyped_storage().data_ptr() + 4 * offset) % 64
            assert _same_values(fake_quantize_rows(at_offset, arguments, in_place=True), expected)


@needs_kernel
def test_a_weight_larger_than_a_cores_cache_is_streamed_with_the_same_values_where_torch_runs_threads():
    x = torch.randn(768, 512) * 0.02  # 1.5 MiB
    scale, zero_point = x.abs().amax(dim=1) / 127.5, torch.zeros(768, dtype=torch.int64)
    expected = _torch_path(fake_quantize_per_channel, x, scale, zero_point, 0, -128, 127)
    threads = torch.get_num_threads()
    try:
        for torch_threads, streamed in ((2, 1), (1, 0)):
            torch.set_num_threads(torch_threads)
            assert native.streams(x.numel() * 4) == streamed
            assert native.streams(native.STREAM_MIN_BYTES - 4) == 0
            assert torch.equal(fake_quantize_per_channel(x, scale, zero_point, 0, -128, 127), expected)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_divided_rows_quantized_for_a_brief_read_go_into_a_reused_buffer():
    x = torch.randn(512, 1024)
    divisor, scale = torch.rand(1024) + 0.5, torch.rand(512) * 0.01 + 1e-3
    zero_point = torch.zeros(512, dtype=torch.int64)
    expected = fake_quantize_per_channel(x / divisor, scale, zero_point, 0, -128, 127)
    with scratch.reused_outputs():
        first = fake_quantize_divided_rows(x, divisor, scale, zero_point, -128, 127, reuse_output=True)
        assert torch.equal(first, expected)
        pointer = first.data_ptr()
        del first
        again = fake_quantize_divided_rows(x, divisor, scale, zero_point, -128, 127, reuse_output=True)
        assert again.data_ptr() == pointer and torch.equal(again, expected)

@needs_kernel
def test_fake_quantize_keeps_the_torch_path_where_autograd_needs_it():
    x = torch.randn(64, requires_grad=True)
    y = fake_quantize_per_tensor(x, 0.05, 0, -128, 127)
    assert y.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(fake_quantize_per_tensor(x, 0.05, 0, -128, 127), y.detach())


def _sums(reference: torch.Tensor, actual: torch.Tensor, batches: int = 2) -> torch.Tensor:
    comparator = StreamingComparator()
    for _ in range(batches):
        comparator.update(reference, actual)
    assert comparator.batches == batches
    return comparator.sums


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), numel=st.sampled_from([1, 9, 1000, native.PARALLEL_MIN_NUMEL + 3]),
       noise=st.floats(1e-6, 1.0), transposed=st.booleans())
def test_comparator_sums_match_the_torch_path(seed, numel, noise, transposed):
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(numel, 4, generator=g) * 10
    actual = reference + noise * torch.randn(numel, 4, generator=g)
    if transposed:  # a non-contiguous layer output
        reference, actual = reference.t(), actual.t()
    ours = _sums(reference, actual)
    expected = _torch_path(_sums, reference, actual)
    assert torch.allclose(ours, expected, rtol=1e-12, atol=0.0)


def _lane_ordered_sums(reference: torch.Tensor, actual: torch.Tensor, lanes: int = 8) -> torch.Tensor:
    """The four float64 sums added as the kernel's one-thread loop adds them: lane j takes the values j, j + lanes,
    ... in order, the tail's values go to lanes 0, 1, ... after them, and the lanes are added 0 to lanes - 1."""
    r, a = reference.double(), actual.double()
    terms = torch.stack([r * r, a * a, r * a, (r - a) * (r - a)])  # each product exact in float64
    full = r.numel() - r.numel() % lanes
    body = terms[:, :full].reshape(4, -1, lanes)
    sums = torch.zeros(4, lanes, dtype=torch.float64)
    for row in range(body.shape[1]):  # row by row: the kernel's order, not a reduction tree's
        sums += body[:, row]
    sums[:, : r.numel() - full] += terms[:, full:]
    total = torch.zeros(4, dtype=torch.float64)
    for lane in range(lanes):
        total += sums[:, lane]
    return total


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), numel=st.sampled_from([1, 7, 8, 9, 31, 1000, 4099]), noise=st.floats(1e-6, 1.0))
def test_comparator_kernel_adds_each_lane_in_order_bit_for_bit(seed, numel, noise):
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(numel, generator=g) * 10
    actual = reference + noise * torch.randn(numel, generator=g)
    sums = torch.zeros(4, dtype=torch.float64)
    native.kernel().qcore_compare_sums(reference.data_ptr(), actual.data_ptr(), numel, 1, sums.data_ptr())
    assert torch.equal(sums, _lane_ordered_sums(reference, actual))


@needs_kernel
def test_comparator_results_from_both_paths_agree_in_sqnr():
    g = torch.Generator().manual_seed(3)
    reference = torch.randn(4, 64, 384, generator=g)
    actual = reference + 1e-3 * torch.randn(4, 64, 384, generator=g)
    results = []
    for use_torch in (False, True):
        comparator = StreamingComparator()
        for _ in range(3):
            if use_torch:
                _torch_path(comparator.update, reference, actual)
            else:
                comparator.update(reference, actual)
        results.append(comparator.result())
    assert results[0]["batches"] == results[1]["batches"] == 3
    for key in ("sqnr_db", "normalized_l2", "cosine"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-10, abs=1e-12)


def test_a_comparator_cast_to_float32_takes_the_torch_path_and_keeps_float64_sums():
    comparator = StreamingComparator().float()  # Module.float() casts every floating buffer, float64 ones too
    assert comparator.sums.dtype == torch.float32
    reference = torch.randn(100)
    comparator.update(reference, reference * 0.5)
    assert comparator.sums.dtype == torch.float64
    assert comparator.result()["sqnr_db"] == pytest.approx(20 * math.log10(2), rel=1e-9)


def test_the_stash_keeps_a_contiguous_copy_in_the_values_own_dtype():
    stash = ActivationStash()
    x = torch.randn(3, 5).t()
    value = stash(x)
    assert value.dtype == torch.float32 and value.is_contiguous() and torch.equal(value, x.reshape(-1))
    x.mul_(2.0)  # an in-place op after the layer must not rewrite the stashed reference
    assert not torch.equal(value, x.reshape(-1))
    following = torch.randn(5, 3)
    assert stash(following).data_ptr() == value.data_ptr() and torch.equal(stash.value, following.reshape(-1))
    assert stash(torch.randn(4, dtype=torch.bfloat16)).dtype == torch.bfloat16  # not float64: 4x the bytes


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), bins=st.sampled_from([1, 7, 64, 2048]),
       sizes=st.lists(st.sampled_from([1, 5, 300, native.PARALLEL_MIN_NUMEL * 3 + 1]), min_size=1, max_size=4),
       spread=st.floats(1e-30, 1e4), constant=st.booleans(), strided=st.booleans())
def test_histogram_observer_update_is_bit_identical_to_the_torch_path(seed, bins, sizes, spread, constant, strided):
    from qcore.observe.observers import HistogramObserver

    g = torch.Generator().manual_seed(seed)
    native_path, torch_path = HistogramObserver(bins=bins), HistogramObserver(bins=bins)
    calls = []
    update = native_path._update_native
    native_path._update_native = lambda x: calls.append(update(x)) or calls[-1]
    for step, numel in enumerate(sizes):
        x = torch.full((numel * 2,), 1.5) if constant else torch.randn(numel * 2, generator=g) * spread * (step + 1)
        x = x[::2] if strided else x[:numel]
        native_path(x)
        _torch_path(torch_path, x)
        for ours, reference in ((native_path.histogram, torch_path.histogram),
                                (native_path.min_val, torch_path.min_val), (native_path.max_val, torch_path.max_val)):
            assert ours.dtype == reference.dtype and torch.equal(ours, reference), step
    assert calls == [True] * len(sizes)  # every batch took the kernel
    assert torch.equal(native_path.calculate_qparams()[0], torch_path.calculate_qparams()[0])


@needs_kernel
def test_a_histogram_batch_holding_nan_or_inf_takes_the_torch_path():
    from qcore.observe.observers import HistogramObserver

    observer = HistogramObserver(bins=16)
    observer(torch.tensor([0.0, 1.0]))
    before = observer.histogram.clone()
    for special in (math.inf, -math.inf, math.nan):
        assert not observer._update_native(torch.tensor([0.5, special]))
        assert torch.equal(observer.histogram, before)  # the kernel touched nothing
    assert observer._update_native(torch.tensor([0.25, 0.75], dtype=torch.float32))
    assert not observer._update_native(torch.tensor([0.25], dtype=torch.float64))  # float32 batches only
