"""Comparison metrics, with the formulas of the FX numeric suite."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qcore.observe.qparams import row_slices
from qcore.runtime import native

__all__ = ["compared_by_rows", "compute_cosine_similarity", "compute_normalized_l2_error", "compute_sqnr",
           "large_tensor_sqnr", "read_to_host", "rowwise_sqnr", "signal_and_noise", "sqnr_from_sums"]

_ROWS_ELEMENTS = 1 << 20  # compared at a time by large_tensor_sqnr (in float64: four 8 MB transients)


def _elementwise(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Apply a metric to tensors, or pairwise to tuples/lists of tensors (dequantizing quantized tensors). A pair
    that is not floating point (an EmbeddingBag's int64 indices, logged as its input) gives None, as torch.ao's
    numeric suite does; torch.ao also gives None for float16 and bfloat16, which these metrics compare."""

    def wrapper(x, y):
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            return [wrapper(a, b) for a, b in zip(x, y)]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            return None
        if x.is_quantized:
            x = x.dequantize()
        if y.is_quantized:
            y = y.dequantize()
        if not (x.is_floating_point() and y.is_floating_point()):
            return None
        return fn(x, y)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_elementwise
def compute_sqnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio in dB: 20*log10(||x|| / ||x - y||); identical tensors give inf."""
    return 20 * torch.log10(torch.linalg.vector_norm(x) / torch.linalg.vector_norm(x - y))


@_elementwise
def compute_normalized_l2_error(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sqrt(sum((x - y)^2) / sum(x^2))."""
    return torch.sqrt(((x - y) ** 2).sum() / (x**2).sum())


@_elementwise
def compute_cosine_similarity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the flattened tensors."""
    return F.cosine_similarity(x.reshape(1, -1), y.reshape(1, -1))


def sqnr_from_sums(signal_sq: float, noise_sq: float) -> float:
    """SQNR in dB from accumulated sum(x^2) and sum((x - y)^2)."""
    import math

    if noise_sq == 0:
        return math.inf
    if signal_sq == 0:
        return -math.inf
    return 10 * math.log10(signal_sq / noise_sq)


def compared_by_rows(x: torch.Tensor) -> bool:
    """Whether large_tensor_sqnr compares x (and rowwise_sqnr may) a bounded number of rows at a time."""
    return x.dim() > 0 and x.numel() > _ROWS_ELEMENTS


def large_tensor_sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """compute_sqnr of two tensors of one shape (a weight and its quantized copy), a bounded number of rows at a
    time when they are large: no copy of an LM head's difference."""
    if not compared_by_rows(x):
        return float(compute_sqnr(x, y))
    return rowwise_sqnr(x, y.__getitem__)


def rowwise_sqnr(x: torch.Tensor, rows_of_y: Callable[[slice], torch.Tensor]) -> float:
    """large_tensor_sqnr(x, y) of an x compared_by_rows, with y made a few rows at a time by `rows_of_y(rows)` and
    never whole (an LM head's quantized copy): the same sums, and inf where y equals x."""
    sums = torch.zeros(2, dtype=torch.float64, device=x.device)
    for part in row_slices(x, _ROWS_ELEMENTS):
        sums += signal_and_noise(x[part], rows_of_y(part))
    signal, noise = sums.tolist()
    return sqnr_from_sums(signal, noise)


def signal_and_noise(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[sum(x^2), sum((x - y)^2)] in float64 of two tensors of one shape (no host sync): one pass of the native
    kernel for float32 CPU tensors (no float64 copies, which for an LM head's logits are fresh pages each time),
    else torch ops on float64 copies."""
    if (x.__class__ is y.__class__ is torch.Tensor and x.dtype == y.dtype == torch.float32 and x.is_cpu and y.is_cpu
            and x.shape == y.shape and native.kernel() is not None):
        x, y = x.detach().contiguous(), y.detach().contiguous()
        sums = torch.zeros(4, dtype=torch.float64)
        native.kernel().qcore_compare_sums(x.data_ptr(), y.data_ptr(), x.numel(), native.threads(x.numel()),
                                           sums.data_ptr())
        return sums[[0, 3]]
    a = x.double()
    return torch.stack([a.square().sum(), (a - y.double()).square_().sum()])


def read_to_host(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Each 0-d tensor as a Python number and each 1-d one as a list, in order; those of one device, dtype and rank
    read in one copy (on a GPU, one wait for them all instead of one each)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype, tensor.dim()), []).append(index)
    found: list[Any] = [None] * len(tensors)
    for (_, _, rank), members in groups.items():
        values = [tensors[index] for index in members]
        flat = (torch.stack(values) if rank == 0 else torch.cat(values)).tolist()
        start = 0
        for index, value in zip(members, values):
            size = 1 if rank == 0 else value.numel()
            found[index] = flat[start] if rank == 0 else flat[start:start + size]
            start += size
    return found
