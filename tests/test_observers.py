"""Observers against torch.ao's, and the streaming guarantees (no host copies, fixed memory)."""
import pytest
import torch
from torch.ao.quantization import observer as ao

from qcore.convert import fake_quantize_with
from qcore.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)


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
    draw = (lambda: torch.randn(4096, generator=g) ** 3) if distribution == "cube" else (lambda: laplace.sample((4096,)))
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
