"""A quantized weight against its reference weight: SQNR, per-channel and whole-tensor scale fits, zeros and
values that are not finite, from one pass of float32 products summed in float64."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["WeightFit", "input_channel_scales", "sqnr_db", "weight_fit"]

_ROWS_ELEMENTS = 1 << 22  # weight elements taken at a time: the copies stay small


def _column_sums(reference: torch.Tensor, weight: torch.Tensor, exact: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per input channel (dim 1) of two weights of one shape, with d = weight - reference: sum(r*r), sum(d*d),
    sum(r*d) in float64, from float32 products (float64 ones when `exact`) a bounded number of output rows at a
    time. The error's own sum is taken, not told apart from the two energies, so that its digits are kept."""
    ref = reference.detach().reshape(reference.shape[0], reference.shape[1] if reference.dim() > 1 else 1, -1)
    ours = weight.detach().reshape(ref.shape)
    step = max(1, _ROWS_ELEMENTS // max(1, ref[0].numel()))
    sums = torch.zeros(3, ref.shape[1], dtype=torch.float64, device=ref.device)
    for start in range(0, ref.shape[0], step):
        dtype = torch.float64 if exact else torch.float32
        r = ref[start:start + step].to(dtype)
        d = ours[start:start + step].to(device=ref.device, dtype=dtype) - r
        sums += torch.stack([(r * r).sum(dim=(0, 2)), (d * d).sum(dim=(0, 2)), (r * d).sum(dim=(0, 2))]).double()
    return sums[0], sums[1], sums[2]


def input_channel_scales(reference: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per input channel (dim 1), the least-squares scale c with weight[:, j] ~ c * reference[:, j]."""
    energy, _, error_cross = _column_sums(reference, weight)
    return torch.where(energy > 0, (energy + error_cross) / energy.clamp_min(1e-300), 1.0)


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise): inf without noise, -inf without signal or with infinite noise, NaN with NaN."""
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise <= 0:
        return math.inf
    if math.isinf(noise):
        return -math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass(frozen=True)
class WeightFit:
    """A weight against the reference's: its SQNR, the gain when each input channel's scale is fitted first, and,
    as a whole, the least-squares factor s of weight ~ s * reference with the SQNR once divided out; whether it is
    all zeros, and whether it holds values that are not finite."""

    sqnr_db: float
    channel_gain_db: float
    factor: float
    fitted_db: float
    zeros: bool
    finite: bool


# a difference of float64 sums this small against them is their rounding, not a residual: a weight that is an exact
# scaled copy of the reference (bfloat16 rounds a small error away) then fits it exactly (inf), not at 150-170 dB
_FLOAT64_RESIDUE = 2.0 ** -46


def _resolved(residual: float, noise: float) -> float:
    """`residual` (noise minus what a scale fit explains), or 0.0 where float64 cannot tell it from its rounding."""
    return residual if residual > noise * _FLOAT64_RESIDUE else 0.0


def _fit_db(signal: float, noise: float, error_cross: float) -> tuple[float, float]:
    """(s, SQNR of the reference against weight / s) from sum(r*r), sum(d*d), sum(r*d) with d = weight - r: the
    residual of weight ~ s r is noise - error_cross^2 / signal, divided by s^2."""
    if signal <= 0:
        return math.nan, math.nan
    factor = (signal + error_cross) / signal
    if noise <= 0:
        return factor, math.inf
    residual = _resolved(noise - error_cross * error_cross / signal, noise)
    if factor == 0:
        return factor, -math.inf
    return factor, sqnr_db(signal, residual / (factor * factor))


def weight_fit(reference: torch.Tensor, weight: torch.Tensor) -> WeightFit:
    """A weight's numbers against the reference's (WeightFit), from one pass of per-channel sums; a weight that a
    scale maps close to the reference (whose fits subtract nearly equal sums) is summed again in float64."""
    sums = _column_sums(reference, weight)
    fit = _fit(reference, weight, *sums)
    if max(fit.channel_gain_db, fit.fitted_db - fit.sqnr_db) > CLOSE_FIT_DB or _loses_digits(*sums):
        fit = _fit(reference, weight, *_column_sums(reference, weight, exact=True))
    return fit


CLOSE_FIT_DB = 1.0  # a scale fit this much better than the weight itself: its float32 sums would lose digits
# a fit's residual under this share of the sums it is the difference of has lost more of float32's digits than the
# figures' 1e-4 dB may: a weight a scale maps close to the reference, or one near zeros (d = w - r is then about -r)
_CANCELLING = 2.0 ** -8


def _loses_digits(energy: torch.Tensor, noise: torch.Tensor, error_cross: torch.Tensor) -> bool:
    """Whether a scale fit's residual, of one channel or of the whole weight, is a small difference of the float32
    products' sums."""
    return any(bool(((e > 0) & (_residual(e, n, c) < n * _CANCELLING)).any())
               for e, n, c in ((energy, noise, error_cross), (energy.sum(), noise.sum(), error_cross.sum())))


def _residual(energy: torch.Tensor, noise: torch.Tensor, error_cross: torch.Tensor) -> torch.Tensor:
    """What of the error sum(d*d) a scale fit of the weight to the reference leaves, per channel (or of sums):
    noise - error_cross^2 / energy, from sum(r*r), sum(d*d) and sum(r*d)."""
    return noise - error_cross**2 / energy.clamp_min(1e-300)


def _fit(reference: torch.Tensor, weight: torch.Tensor, energy: torch.Tensor, noise: torch.Tensor,
         error_cross: torch.Tensor) -> WeightFit:
    signal, total = float(energy.sum()), float(noise.sum())
    plain = sqnr_db(signal, total)
    factor, fitted = _fit_db(signal, total, float(error_cross.sum()))
    cross_total = float(error_cross.sum())
    gain = 0.0
    if reference.dim() >= 2 and math.isfinite(plain):
        scales = (energy + error_cross) / energy.clamp_min(1e-300)
        fitting = (energy > 0) & (scales.abs() > 1e-300)
        # per channel, sum over rows of (w / c - r)^2 = (sum(d*d) - sum(r*d)^2 / sum(r*r)) / c^2
        residual = _residual(energy, noise, error_cross)
        residual = torch.where(residual > noise * _FLOAT64_RESIDUE, residual, 0.0)
        fitted_noise = torch.where(fitting, residual / torch.where(fitting, scales, 1.0) ** 2, noise)
        gain = sqnr_db(signal, float(fitted_noise.sum())) - plain
    # all zeros gives d = -r: sum(d*d) = sum(r*r) and sum(r*d) = -sum(r*r), bit for bit; a weight too small to
    # move d off -r does too, so that case alone is read again
    zeros = total == signal and cross_total == -signal and not bool(weight.detach().any())
    return WeightFit(plain, gain, factor, fitted, zeros, math.isfinite(total) and math.isfinite(cross_total))
