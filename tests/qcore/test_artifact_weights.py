"""qcore.artifact.weights: a weight's numbers against the reference's, from one pass of float32 products summed in
float64, against the same quantities computed directly in float64."""
import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from qcore.artifact.weights import weight_fit


def _db(signal, noise):
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _direct(reference, weight):
    r, w = reference.double(), weight.double()
    signal, noise = float((r * r).sum()), float(((w - r) ** 2).sum())
    factor = float((r * w).sum()) / signal
    fitted = float(((w / factor - r) ** 2).sum())
    scales = (r * w).sum(0) / (r * r).sum(0)
    channel = float(((w / scales - r) ** 2).sum())
    return _db(signal, noise), factor, _db(signal, fitted), _db(signal, channel) - _db(signal, noise)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(2, 40), columns=st.integers(2, 40), scale=st.floats(0.5, 2e4), noise=st.floats(1e-3, 0.5),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
# a column whose weight is a fiftieth of the reference's: its per-channel fit subtracts nearly equal float32 sums
@example(rows=2, columns=2, scale=0.5, noise=0.5, seed=1203, dtype=torch.float32)
# bfloat16 rounds the error away: exact scaled copies, whole (4 x 4) and of every column (2 x 20), fit exactly
@example(rows=4, columns=4, scale=0.5, noise=0.001, seed=1829, dtype=torch.bfloat16)
@example(rows=2, columns=20, scale=0.5, noise=0.001, seed=1, dtype=torch.bfloat16)
def test_weight_fit_is_the_direct_float64_computation(rows, columns, scale, noise, seed, dtype):
    """SQNR, the whole-tensor factor and its fitted SQNR, and the gain of per-channel scales, for weights scaled
    wrong (a factor up to 2e4, as a loader that applies a global scale twice) and quantization-like noise. The fits
    are summed again in float64 where they come close or their float32 sums cancel; an exact scaled copy fits at
    inf."""
    generator = torch.Generator().manual_seed(seed)
    reference = torch.randn(rows, columns, generator=generator).to(dtype)
    weight = (reference.float() * scale * (1 + noise * torch.randn(rows, columns, generator=generator))).to(dtype)
    # rounding may give the reference back (an equal weight is the next test's)
    assume(not torch.equal(reference.float(), weight.float()))
    fit = weight_fit(reference, weight)
    plain, factor, fitted, gain = _direct(reference, weight)
    assert fit.sqnr_db == pytest.approx(plain, abs=1e-4)
    assert fit.factor == pytest.approx(factor, rel=1e-5)
    _agree(fit.fitted_db, fitted)
    _agree(fit.channel_gain_db, gain, plain)
    assert not fit.zeros and fit.finite


def _agree(ours: float, direct: float, plain: float = 0.0) -> None:
    """To 1e-4 dB where the fit's SQNR (`direct`, plus `plain` for a gain) is under 100 dB: float64 sums resolve its
    residual that finely there; beyond, a scaled copy within a few float64 roundings of exact: both past it."""
    if direct + plain < 100.0:
        assert ours == pytest.approx(direct, abs=1e-4)
    else:
        assert ours + plain >= 99.0


def test_zeros_infinite_values_and_an_equal_weight_are_told():
    reference = torch.randn(8, 16)
    assert weight_fit(reference, torch.zeros_like(reference)).zeros
    assert not weight_fit(reference, reference * 1e-30).zeros
    broken = reference.clone()
    broken[3, 4] = math.inf
    assert not weight_fit(reference, broken).finite
    broken[3, 4] = math.nan
    assert not weight_fit(reference, broken).finite
    same = weight_fit(reference, reference.clone())
    assert same.sqnr_db == math.inf and same.factor == 1.0 and same.fitted_db == math.inf
