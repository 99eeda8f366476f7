"""Observers against torch.ao's, and the streaming guarantees (no host copies, fixed memory)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as ao

from qcore.observe.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)
from qcore.quantization.convert import fake_quantize_with


def _batches(n=6, shape=(16, 32)):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=g) * (i + 1) for i in range(n)]


def test_minmax_matches_torch_ao():
    ours = MinMaxObserver(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
    ref = ao.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    for batch in _batches():
        ours(batch)
        ref(batch)
    assert float(ours.min_val) == float(ref.min_val) and float(ours.max_val) == float(ref.max_val)
    for a, b in zip(ours.calculate_qparams(), ref.calculate_qparams()):
        torch.testing.assert_close(a.reshape(-1).to(b.dtype), b.reshape(-1))


def test_moving_average_matches_torch_ao():
    ours = MovingAverageMinMaxObserver(averaging_constant=0.1)
    ref = ao.MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.qint8)
    for batch in _batches():
        ours(batch)
        ref(batch)
    torch.testing.assert_close(ours.min_val, ref.min_val)
    torch.testing.assert_close(ours.max_val, ref.max_val)


@pytest.mark.parametrize("axis", [0, 1])
def test_per_channel_matches_torch_ao(axis):
    ours = PerChannelMinMaxObserver(ch_axis=axis, quant_min=-127, quant_max=127)
    ref = ao.PerChannelMinMaxObserver(ch_axis=axis, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                      quant_min=-127, quant_max=127)
    for batch in _batches():
        ours(batch)
        ref(batch)
    torch.testing.assert_close(ours.min_val, ref.min_val)
    scale, zp = ours.calculate_qparams()
    ref_scale, ref_zp = ref.calculate_qparams()
    torch.testing.assert_close(scale, ref_scale)
    assert torch.equal(zp.to(ref_zp.dtype), ref_zp)


def _mse(observer, data):
    return float(((fake_quantize_with(observer, data) - data) ** 2).mean())


@pytest.mark.parametrize("qscheme,ao_qscheme", [(torch.per_tensor_affine, torch.per_tensor_affine),
                                                (torch.per_tensor_symmetric, torch.per_tensor_symmetric)])
@pytest.mark.parametrize("distribution", ["cube", "laplace"])
def test_histogram_error_at_most_minmax_and_torch_ao(distribution, qscheme, ao_qscheme):
    g = torch.Generator().manual_seed(0)
    laplace = torch.distributions.Laplace(0.0, 1.0)
    draw = ((lambda: torch.randn(4096, generator=g) ** 3) if distribution == "cube"
            else (lambda: laplace.sample((4096,))))
    batches = [draw() for _ in range(8)]
    data = torch.cat(batches)
    histogram, minmax = HistogramObserver(qscheme=qscheme), MinMaxObserver(qscheme=qscheme)
    reference = ao.HistogramObserver(dtype=torch.qint8, qscheme=ao_qscheme)
    for batch in batches:
        histogram(batch)
        minmax(batch)
        reference(batch)
    ours = _mse(histogram, data)
    assert ours <= _mse(minmax, data)
    ref_scale, ref_zp = reference.calculate_qparams()
    ref_q = torch.fake_quantize_per_tensor_affine(data, float(ref_scale), int(ref_zp), -128, 127)
    assert ours <= 1.05 * float(((ref_q - data) ** 2).mean())


def test_histogram_range_growth_keeps_counts():
    observer = HistogramObserver(bins=64)
    observer(torch.linspace(0, 1, 1000))
    observer(torch.linspace(-3, 5, 1000))
    assert float(observer.histogram.sum()) == pytest.approx(2000, rel=1e-6)
    assert float(observer.min_val) == -3 and float(observer.max_val) == 5


@pytest.mark.parametrize("make", [MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver,
                                  HistogramObserver])
def test_observers_stream_without_host_copies_or_growth(make, forbid_host_sync):
    observer = make()
    sizes = None
    for batch in _batches(n=5):
        observer(batch)
        current = [tuple(b.shape) for b in observer.buffers()]
        assert sizes is None or current == sizes
        sizes = current


def _every_pair_clipping_range(histogram, min_val, max_val, levels):
    """The affine search over every (lo, hi) pair of bin edges, as a plain matrix (the definition)."""
    bins, counts = histogram.numel(), histogram.double()
    width = (max_val - min_val).double() / bins
    centers = min_val.double() + width * (torch.arange(bins, dtype=torch.float64) + 0.5)
    edges = min_val.double() + width * torch.arange(bins + 1, dtype=torch.float64)
    n, s1, s2 = (torch.cat([counts.new_zeros(1), t.cumsum(0)]) for t in (counts, counts * centers, counts * centers**2))
    total_n, total_s1, total_s2 = n[-1], s1[-1], s2[-1]
    below = s2 - 2 * edges * s1 + edges**2 * n
    above = (total_s2 - s2) - 2 * edges * (total_s1 - s1) + edges**2 * (total_n - n)
    lo, hi = edges[:, None], edges[None, :]
    span = torch.clamp(hi, min=0.0) - torch.clamp(lo, max=0.0)
    inside = total_n - n[:, None] - (total_n - n)[None, :]
    error = below[:, None] + above[None, :] + torch.clamp(inside, min=0.0) * (span / levels) ** 2 / 12
    flat = torch.argmin(torch.where(lo < hi, error, torch.full_like(error, float("inf"))))
    return edges[flat // (bins + 1)].float(), edges[flat % (bins + 1)].float()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["normal", "relu", "offset", "heavy", "spike", "uniform"]),
       st.sampled_from([64, 256, 2048]))
def test_histogram_clipping_search_equals_the_search_over_every_pair(seed, kind, bins):
    from qcore.observe.observers import HistogramObserver, _best_clipping_range

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3000, generator=g)
    heavy = x / (torch.rand(3000, generator=g) + 1e-3)
    x = {"normal": x, "relu": torch.relu(x), "offset": x * 0.01 + 3, "heavy": heavy,
         "spike": torch.cat([x, torch.tensor([150.0])]), "uniform": torch.rand(3000, generator=g) - 0.9}[kind]
    observer = HistogramObserver(bins=bins)
    observer(x)
    expected = _every_pair_clipping_range(observer.histogram, observer.min_val, observer.max_val, 255)
    found = _best_clipping_range(observer.histogram, observer.min_val, observer.max_val, 255, False)
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.sampled_from(["normal", "relu", "offset", "heavy", "flat"])),
                min_size=1, max_size=5), st.sampled_from([16, 32, 256]), st.booleans(), st.sampled_from([1, 2, 8]))
def test_histograms_searched_together_get_each_its_search_alone(rows, bins, symmetric, rows_at_a_time):
    from unittest import mock

    from qcore.observe import observers as observers_module
    from qcore.observe.observers import HistogramObserver, _best_clipping_range, best_clipping_ranges

    observers = []
    for seed, kind in rows:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2000, generator=g)
        x = {"normal": x, "relu": torch.relu(x), "offset": x * 0.01 + 3, "flat": torch.full((50,), 0.5),
             "heavy": x / (torch.rand(2000, generator=g) + 1e-3)}[kind]
        observer = HistogramObserver(bins=bins)
        observer(x)
        observers.append(observer)
    with mock.patch.object(observers_module, "_AFFINE_ROWS", rows_at_a_time):  # the CPU's rows at a time
        low, high = best_clipping_ranges(torch.stack([o.histogram for o in observers]),
                                         torch.stack([o.min_val for o in observers]),
                                         torch.stack([o.max_val for o in observers]), 255, symmetric)
    for row, observer in enumerate(observers):
        alone = _best_clipping_range(observer.histogram, observer.min_val, observer.max_val, 255, symmetric)
        assert torch.equal(low[row], alone[0]) and torch.equal(high[row], alone[1])
        if not symmetric:
            expected = _every_pair_clipping_range(observer.histogram, observer.min_val, observer.max_val, 255)
            assert torch.equal(low[row], expected[0]) and torch.equal(high[row], expected[1])
