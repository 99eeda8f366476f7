"""Quantization parameters and fake quantization (quantize then dequantize), vectorized."""
from __future__ import annotations

import functools
import struct
import weakref
from collections.abc import Callable
from typing import Any

import torch

from qcore.runtime import native, scratch

__all__ = ["FLOAT32_EPS", "PER_CHANNEL_SCHEMES", "PER_TENSOR_SCHEMES", "SYMMETRIC_SCHEMES", "calculate_qparams",
    "default_quant_range", "fake_quantize_dynamic", "fake_quantize_finite_per_channel", "fake_quantize_per_channel",
    "fake_quantize_per_channel_steps", "fake_quantize_per_tensor", "fused_kernels_preferred", "is_per_channel",
    "is_symmetric", "per_channel_steps", "resolve_quant_range", "row_slices", "scaled_row_extremes",
    "fake_quantize_scaled_rows", "fake_quantize_divided_rows", "fake_quantize_by_run", "KeptRowArguments",
    "fake_quantize_rows"]

FLOAT32_EPS = torch.finfo(torch.float32).eps

_RANGES: dict[torch.dtype, tuple[int, int]] = {
    torch.int8: (-128, 127),
    torch.uint8: (0, 255),
    torch.int32: (-(2**31), 2**31 - 1),
}
if hasattr(torch, "int4"):
    _RANGES[torch.int4] = (-8, 7)

PER_TENSOR_SCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL_SCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams)
SYMMETRIC_SCHEMES = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def default_quant_range(dtype: torch.dtype) -> tuple[int, int]:
    """Return the (quant_min, quant_max) of an integer dtype (int8, uint8, int4)."""
    try:
        return _RANGES[dtype]
    except KeyError:
        raise ValueError(f"unsupported quantized dtype {dtype}; use torch.int8, torch.uint8 or torch.int4") from None


def resolve_quant_range(dtype: torch.dtype, quant_min: int | None, quant_max: int | None) -> tuple[int, int]:
    """Fill a missing quant_min/quant_max from the dtype and check the range is valid."""
    low, high = default_quant_range(dtype)
    quant_min = low if quant_min is None else int(quant_min)
    quant_max = high if quant_max is None else int(quant_max)
    if not (low <= quant_min < quant_max <= high):
        raise ValueError(f"quant range [{quant_min}, {quant_max}] does not fit {dtype} [{low}, {high}]")
    return quant_min, quant_max


def is_symmetric(qscheme: torch.qscheme) -> bool:
    """True for the symmetric qschemes."""
    return qscheme in SYMMETRIC_SCHEMES


def is_per_channel(qscheme: torch.qscheme) -> bool:
    """True for the per-channel qschemes."""
    return qscheme in PER_CHANNEL_SCHEMES


def calculate_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    quant_min: int,
    quant_max: int,
    symmetric: bool,
    eps: float = FLOAT32_EPS,
    float_qparams: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point that cover [min_val, max_val] (extended to include 0), elementwise.

    Same formulas as torch.ao's observers: symmetric ranges are centred on zero with
    scale = max|x| / ((quant_max - quant_min) / 2); affine ranges map min..max onto quant_min..quant_max.
    float_qparams (per_channel_affine_float_qparams): the range is min..max itself, not extended to 0, a scale
    at or below eps becomes 1, and the zero point is the float -min / scale.
    """
    if float_qparams:
        scale = (max_val.float() - min_val.float()) / float(quant_max - quant_min)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        return scale, -min_val.float() / scale
    min_neg = torch.clamp(min_val.float(), max=0.0)
    max_pos = torch.clamp(max_val.float(), min=0.0)
    if symmetric:
        max_abs = torch.maximum(-min_neg, max_pos)
        scale = torch.clamp(max_abs / ((quant_max - quant_min) / 2), min=eps)
        mid = 0 if quant_min < 0 else (quant_min + quant_max + 1) // 2
        zero_point = torch.full_like(scale, mid, dtype=torch.int64)
    else:
        scale = torch.clamp((max_pos - min_neg) / float(quant_max - quant_min), min=eps)
        zero_point = quant_min - torch.round(min_neg / scale).to(torch.int64)
        zero_point = torch.clamp(zero_point, quant_min, quant_max)
    return scale, zero_point


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _working(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 values are quantized in float32 (their own precision cannot hold x/scale exactly)."""
    return x.float() if x.dtype in _HALF_DTYPES else x


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a weight read where it is used is a Parameter
_NATIVE_RANGE = 1 << 16  # integer bounds and zero points the native per-row kernel takes (float32-exact sums)
_ROWS_ELEMENTS = 1 << 22  # fake-quantized at a time on the torch path (bf16, fp16): 16 MB of float32 working values
# on the CPU, where each chunk's few ops are no launches to save, a quarter of that: an LM head's chunk is then a few
# MB beside its quantized copy at the analysis's peak, not 24 MB
_HOST_ROWS_ELEMENTS = 1 << 20


def _by_rows(x: torch.Tensor, rows: Callable[[torch.Tensor, slice], torch.Tensor], in_place: bool = False
             ) -> torch.Tensor:
    """rows(x[part], part) over slices `part` of dim 0, a bounded number of elements at a time, into one tensor
    (x itself with `in_place`; the computation is elementwise: the same values as rows(x, slice(None)))."""
    if x.dim() == 0 or x.numel() <= _HOST_ROWS_ELEMENTS or (x.requires_grad and torch.is_grad_enabled()):
        return rows(x, slice(None))  # a small tensor (an activation): whole, without asking where ops are launches
    elements = _ROWS_ELEMENTS if native.launch_bound(x.device) else _HOST_ROWS_ELEMENTS
    if x.numel() <= elements:
        return rows(x, slice(None))
    out = x if in_place else torch.empty_like(x)
    for part in row_slices(x, elements):
        out[part] = rows(x[part], part)
    return out


def row_slices(x: torch.Tensor, elements: int) -> list[slice]:
    """Slices of x's first dimension (x has one) of about `elements` elements each, at least one row."""
    step = max(1, elements * x.shape[0] // max(1, x.numel()))
    return [slice(start, start + step) for start in range(0, x.shape[0], step)]


def fake_quantize_per_tensor(
    x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int
) -> torch.Tensor:
    """Quantize then dequantize with one scale and zero point (float32 arithmetic, round half to even); the
    result has x's dtype."""
    inv_scale = _float32(1.0 / _float32(scale))
    if (x.__class__ is torch.Tensor and x.dtype == torch.float32 and x.is_cpu
            and not (x.requires_grad and torch.is_grad_enabled())):
        library = native.kernel()
        if library is not None:  # the same roundings in one pass (native.py)
            x = x.contiguous()
            out = torch.empty_like(x)
            library.qcore_fake_quantize_per_tensor(x.data_ptr(), out.data_ptr(), x.numel(), inv_scale, scale,
                                                   quant_min - zero_point, quant_max - zero_point,
                                                   native.threads(x.numel()))
            return out
    # torch's fused kernel has the same roundings (1 / scale in float32, half to even, 0.0 for -0.0) in one op
    # instead of five where it adds the zero point exactly (in float32); it makes a NaN a number, so a NaN is put back
    # by one more op (_nan_where_nan)
    fused = (quant_min <= zero_point <= quant_max and max(abs(quant_min), abs(quant_max)) <= _NATIVE_RANGE
             and not (x.requires_grad and torch.is_grad_enabled()))
    # for fp16/bf16 the kernel computes in float32 and rounds the result to x's dtype, as a cast after it would
    if fused and (x.dtype == torch.float32 or (x.dtype in _HALF_DTYPES and fused_kernels_preferred(x))):
        return _nan_where_nan(torch.fake_quantize_per_tensor_affine(x, _float32(scale), zero_point, quant_min,
                                                                    quant_max), x)

    def rows(values: torch.Tensor, _: slice) -> torch.Tensor:
        if fused:  # fp16/bf16 on the CPU, a bounded number of elements at a time in float32
            work = _working(values)
            out = torch.fake_quantize_per_tensor_affine(work, _float32(scale), zero_point, quant_min, quant_max)
            return _nan_where_nan(out, work).to(x.dtype)
        q = _working(values) * inv_scale  # a new tensor: the steps below run in place on it, same roundings
        # clamp(round(v) + zp, min, max) - zp == clamp(round(v), min - zp, max - zp): float32 holds these
        # integers exactly, and a rounded value too large for that is clamped either way. Adding 0.0 turns
        # round()'s -0.0 into the 0.0 that integer arithmetic gives (torch's kernel): a later x / 0 keeps its sign.
        q = q.round_().clamp_(quant_min - zero_point, quant_max - zero_point)
        return q.mul_(scale).add_(0.0).to(x.dtype)

    return _by_rows(x, rows)


def _nan_where_nan(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`out` (written over) with a NaN wherever x holds one, in one op where isnan and where take two: clamp(out,
    min=x, max=out) is out to the bit, sign of zero included (max(out, x) then min with out: a tie of 0.0 and -0.0
    gives out's 0.0 in the CPU's vector lanes and in its scalar tail), and NaN where x is NaN (a NaN bound gives
    NaN). Of the NaN only its being one is kept, not x's sign and payload: neither is a value."""
    return torch.clamp(out, min=x, max=out, out=out)


def fused_kernels_preferred(x: torch.Tensor) -> bool:
    """Whether fp16/bf16 values are fake-quantized by torch's fused kernels in their own dtype (one launch: a GPU,
    and the torch path QCORE_NATIVE=0 stands for), rather than through float32 copies on a chain of ops (the CPU,
    where torch's fused kernels are scalar loops: 2-3x slower on an LM head)."""
    return native.launch_bound(x.device)


def fake_quantize_per_channel(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    in_place: bool = False,
    reuse_output: bool = False,
) -> torch.Tensor:
    """Quantize then dequantize with one scale and zero point per slice along `axis`; the result has x's dtype.
    in_place=True may write the result over x (a large contiguous x, made for this call alone), instead of
    allocating a second copy; reuse_output=True may write it into a buffer of qcore.runtime.scratch's pool (a
    result that lives briefly: a weight quantized where it is read)."""
    float_zero_point = zero_point.is_floating_point()
    native_rows = _rows_native(x, axis) and _native_rows_take(zero_point, quant_min, quant_max)
    scale, inv_scale, zero_point = per_channel_steps(scale, zero_point, axis, x)
    if native_rows:  # the same roundings, one pass
        arguments = _row_arguments(scale, inv_scale, zero_point, quant_min, quant_max, x.shape[0])
        return fake_quantize_rows(x, arguments, reuse_output, in_place)
    return _per_channel_by_rows(x, scale, inv_scale, zero_point, axis, quant_min, quant_max, in_place,
                                float_zero_point)


def fake_quantize_by_run(x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                         quant_min: int, quant_max: int) -> torch.Tensor | None:
    """fake_quantize_per_channel of `x`'s rows (axis 0) with each run's `scale` and integer `zero_point` ([E]) over
    its `counts` rows, in one pass of the native kernel without the per-row copies of the qparams; None where the
    kernel does not take it (the caller's per-row path computes the same values)."""
    if not (x.__class__ in _PLAIN_TENSORS and x.dtype == torch.float32 and x.is_cpu and x.dim() >= 1
            and not zero_point.is_floating_point() and max(abs(quant_min), abs(quant_max)) <= _NATIVE_RANGE
            and counts.is_cpu and scale.numel() == zero_point.numel() == counts.numel()
            and not (x.requires_grad and torch.is_grad_enabled())):
        return None
    library = native.kernel()
    if library is None or not bool(zero_point.abs().le(_NATIVE_RANGE).all()):
        return None
    steps, inverse, zero_point = per_channel_steps(scale, zero_point, 0, x.reshape(-1))
    low, high = quant_min - zero_point, quant_max - zero_point  # per_row's bounds, an expert's rows alike
    x = x.contiguous()
    out = torch.empty_like(x)
    counts = counts.to(torch.int64).contiguous()
    if library.qcore_fake_quantize_by_run(x.data_ptr(), out.data_ptr(), x.shape[0], x.numel() // max(1, x.shape[0]),
                                          counts.numel(), counts.data_ptr(), inverse.data_ptr(), steps.data_ptr(),
                                          low.data_ptr(), high.data_ptr(), native.threads(x.numel())) != 0:
        raise ValueError(f"counts {counts.tolist()} are not runs of the {x.shape[0]} rows they quantize")
    return out


def _scaled_rows_native(x: torch.Tensor, column_scales: torch.Tensor) -> Any:
    """The native kernel library when `x` (a float32 CPU matrix) scaled by the rows of `column_scales` can take
    the fused scaled-row kernels; else None."""
    if not (x.__class__ in _PLAIN_TENSORS and x.dtype == torch.float32 and x.is_cpu and x.dim() == 2
            and column_scales.dtype == torch.float32 and column_scales.is_cpu
            and column_scales.shape[-1] == x.shape[1] and not (x.requires_grad and torch.is_grad_enabled())):
        return None
    return native.kernel()


def _native_rows_take(zero_point: torch.Tensor, quant_min: int, quant_max: int) -> bool:
    """Whether the native per-row kernels take these integer bounds and zero points (float32-exact sums)."""
    return (not zero_point.is_floating_point() and max(abs(quant_min), abs(quant_max)) <= _NATIVE_RANGE
            and bool(zero_point.abs().le(_NATIVE_RANGE).all()))


def scaled_row_extremes(x: torch.Tensor, column_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each row of x * s for each row s of `column_scales` ([k, columns]): two [k, rows] tensors, what
    torch.aminmax((x[None] * column_scales[:, None, :]), dim=2) gives, without the k scaled copies on the CPU."""
    library = _scaled_rows_native(x, column_scales)
    if library is None:
        low, high = torch.aminmax(x[None] * column_scales[:, None, :], dim=2)
        return low, high
    x, column_scales = x.contiguous(), column_scales.contiguous()
    count, rows = column_scales.shape[0], x.shape[0]
    low, high = x.new_empty(count, rows), x.new_empty(count, rows)
    library.qcore_scaled_row_extremes(x.data_ptr(), column_scales.data_ptr(), count, rows, x.shape[1],
                                      low.data_ptr(), high.data_ptr(), native.threads(x.numel()))
    return low, high


def fake_quantize_scaled_rows(x: torch.Tensor, column_scales: torch.Tensor, scale: torch.Tensor,
                              zero_point: torch.Tensor, quant_min: int, quant_max: int) -> list[torch.Tensor]:
    """For each row s of `column_scales` ([k, columns]): fake_quantize_per_channel(x * s, ...) per row of the scaled
    matrix, with the k-th `x.shape[0]` entries of `scale` and `zero_point` (laid out as scaled_row_extremes's
    ranges), each in a fresh tensor, to the bit; on the CPU without the scaled copies."""
    rows = x.shape[0]
    library = _scaled_rows_native(x, column_scales)
    if library is None or not _native_rows_take(zero_point, quant_min, quant_max):
        return [fake_quantize_per_channel(x * column_scale, scale[k * rows:(k + 1) * rows],
                                          zero_point[k * rows:(k + 1) * rows], 0, quant_min, quant_max, in_place=True)
                for k, column_scale in enumerate(column_scales)]
    x, column_scales = x.contiguous(), column_scales.contiguous()
    scale, inv_scale, zero_point = per_channel_steps(scale, zero_point, 0, x)
    arguments = _row_arguments(scale, inv_scale, zero_point, quant_min, quant_max, scale.numel())
    quantized = []
    for k, column_scale in enumerate(column_scales):
        out = torch.empty_like(x)
        inverse, steps, low, high = (value[k * rows:(k + 1) * rows].data_ptr() for value in arguments)
        library.qcore_fake_quantize_scaled_rows(x.data_ptr(), column_scale.data_ptr(), out.data_ptr(), rows,
                                                x.shape[1], inverse, steps, low, high, native.threads(x.numel()),
                                                native.streams(out.nbytes))
        quantized.append(out)
    return quantized


def fake_quantize_divided_rows(x: torch.Tensor, column_divisor: torch.Tensor, scale: torch.Tensor,
                               zero_point: torch.Tensor, quant_min: int, quant_max: int,
                               reuse_output: bool = False) -> torch.Tensor:
    """fake_quantize_per_channel(x / column_divisor, scale, zero_point, 0, ...) of a matrix x and one divisor per
    column, to the bit; on the CPU in one pass, without the divided copy. reuse_output=True may write it into a
    buffer of qcore.runtime.scratch's pool (a weight quantized where it is read)."""
    divisor = column_divisor.reshape(1, -1) if column_divisor.numel() == (x.shape[-1] if x.dim() else -1) else None
    library = _scaled_rows_native(x, divisor) if divisor is not None and x.dim() == 2 else None
    if library is None or not _native_rows_take(zero_point, quant_min, quant_max):
        divided = scratch.elementwise(torch.div, x, column_divisor) if reuse_output else x / column_divisor
        return fake_quantize_per_channel(divided, scale, zero_point, 0, quant_min, quant_max, in_place=True)
    assert divisor is not None
    x, divisor = x.contiguous(), divisor.contiguous()
    rows = x.shape[0]
    scale, inv_scale, zero_point = per_channel_steps(scale, zero_point, 0, x)
    inverse, steps, low, high = _row_arguments(scale, inv_scale, zero_point, quant_min, quant_max, rows)
    reused = scratch.reused_like(x) if reuse_output else None
    out = torch.empty_like(x) if reused is None else reused
    library.qcore_fake_quantize_divided_rows(x.data_ptr(), divisor.data_ptr(), out.data_ptr(), rows, x.shape[1],
                                             inverse.data_ptr(), steps.data_ptr(), low.data_ptr(), high.data_ptr(),
                                             native.threads(x.numel()), native.streams(out.nbytes))
    return out


def _rows_native(x: torch.Tensor, axis: int) -> bool:
    """Whether the native per-row kernel takes `x` quantized along `axis`: a float32 CPU tensor outside autograd,
    its rows along axis 0 (the qparams: _native_rows_take)."""
    return (x.__class__ in _PLAIN_TENSORS and x.dtype == torch.float32 and x.is_cpu and x.dim() > 0
            and axis % x.dim() == 0 and not (x.requires_grad and torch.is_grad_enabled())
            and native.kernel() is not None)


class KeptRowArguments:
    """The native per-row kernel's arguments of the weights quantized with the same qparams at every read (a weight
    quantized where it is read, each batch of each pass), made once per (scale, zero point) pair instead of at each
    read: a few small ops and a host read each time, which for an MoE's hundreds of expert weights cost as much as
    the kernel. An entry is used only while its scale and zero point are the same tensors, unchanged (their
    versions), for the same bounds and row count; it goes with its scale, and at most `limit` are kept."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._kept: dict[tuple[int, int], tuple] = {}

    def arguments(self, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, quant_min: int,
                  quant_max: int) -> tuple[torch.Tensor, ...] | None:
        """(1 / scale, scale, low, high) per row of `x` for fake_quantize_rows, or None where the native kernel
        does not take this quantization (fake_quantize_per_channel then computes it)."""
        if not _rows_native(x, axis):
            return None
        return self._kept_arguments(scale, zero_point, x.shape[0], quant_min, quant_max, lambda: (scale, zero_point),
                                    x)

    def expert_arguments(self, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, expert: int,
                         quant_min: int, quant_max: int) -> tuple[torch.Tensor, ...] | None:
        """arguments() of one expert's [out, in] slice `weight` of a grouped projection's weight, with every expert's
        qparams (`scale` and `zero_point` [E] per tensor or [E, out] per output channel): made once for all the
        experts, the expert's rows a slice of them; None where the native kernel does not take them."""
        if not _rows_native(weight, 0) or scale.dim() not in (1, 2) or scale.shape != zero_point.shape:
            return None
        experts, rows = scale.shape[0], weight.shape[0]
        if scale.dim() == 2 and scale.shape[1] != rows:
            return None
        arguments = self._kept_arguments(scale, zero_point, experts * rows, quant_min, quant_max, lambda: (
            (scale.reshape(-1), zero_point.reshape(-1)) if scale.dim() == 2 else
            (scale.repeat_interleave(rows), zero_point.repeat_interleave(rows))), weight)
        if arguments is None:
            return None
        return tuple(value[expert * rows:(expert + 1) * rows] for value in arguments)

    def _kept_arguments(self, scale: torch.Tensor, zero_point: torch.Tensor, rows: int, quant_min: int,
                        quant_max: int, laid_out: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                        like: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The kept arguments of `rows` rows quantized with `scale` and `zero_point` (`laid_out()` gives them one per
        row, along axis 0 of `like`), made and kept where no valid entry has them."""
        key = (id(scale), id(zero_point))
        entry = self._kept.get(key)
        state = (scale._version, zero_point._version, rows, quant_min, quant_max)
        if entry is not None and entry[0]() is scale and entry[1]() is zero_point and entry[2] == state:
            return entry[3]
        if not (scale.is_cpu and zero_point.is_cpu and _native_rows_take(zero_point, quant_min, quant_max)):
            return None
        row_scale, row_zero_point = laid_out()
        steps, inverse, point = per_channel_steps(row_scale, row_zero_point, 0, like)
        # their own copies: a view of the scale would keep it alive, and its entry with it
        arguments = tuple(value.clone() for value in _row_arguments(steps, inverse, point, quant_min, quant_max,
                                                                    rows))
        if len(self._kept) >= self.limit:
            self._kept.clear()
        forget = functools.partial(self._forget, key)  # the entry goes with its scale: ids are used again
        self._kept[key] = (weakref.ref(scale, forget), weakref.ref(zero_point), state, arguments)
        return arguments

    def _forget(self, key: tuple[int, int], gone: weakref.ref) -> None:
        entry = self._kept.get(key)
        if entry is not None and entry[0] is gone:  # not a later entry of a tensor at the same address
            del self._kept[key]


def fake_quantize_rows(x: torch.Tensor, arguments: tuple[torch.Tensor, ...], reuse_output: bool = False,
                       in_place: bool = False) -> torch.Tensor:
    """fake_quantize_per_channel of `x` along axis 0 in one pass of the native kernel, with its row arguments made
    already (_row_arguments; KeptRowArguments.arguments keeps them); reuse_output=True may write it into a buffer of
    qcore.runtime.scratch's pool, in_place=True over a contiguous x."""
    inverse, steps, low, high = arguments
    in_place = in_place and x.is_contiguous()
    x = x.contiguous()
    reused = scratch.reused_like(x) if reuse_output and not in_place else None
    out = x if in_place else torch.empty_like(x) if reused is None else reused
    library = native.kernel()
    assert library is not None, "the native rows kernel is asked for only where it is built"
    library.qcore_fake_quantize_per_row(x.data_ptr(), out.data_ptr(), x.shape[0], x.numel() // max(1, x.shape[0]),
                                        inverse.data_ptr(), steps.data_ptr(), low.data_ptr(), high.data_ptr(),
                                        native.threads(x.numel()), native.streams(out.nbytes))
    return out


def _row_arguments(scale: torch.Tensor, inv_scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                   quant_max: int, rows: int) -> tuple[torch.Tensor, ...]:
    """(1 / scale, scale, quant_min - zero point, quant_max - zero point), one contiguous float entry per row: the
    per-row kernels' arguments (an integer zero point folded into the bounds)."""
    return tuple(value.reshape(-1).expand(rows).contiguous() for value in (
        inv_scale, scale, quant_min - zero_point, quant_max - zero_point))


def per_channel_steps(scale: torch.Tensor, zero_point: torch.Tensor, axis: int, x: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale, zero point) laid out along `axis` of x, in the dtypes the torch path computes with (float32;
    the zero point in x's dtype, float32 for fp16/bf16): what fake_quantize_per_channel makes at each call."""
    shape = [1] * x.dim()
    shape[axis] = -1
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(shape)
    zero_point = zero_point.to(device=x.device).reshape(shape).to(torch.float32 if x.dtype in _HALF_DTYPES else x.dtype)
    return scale, torch.reciprocal(scale), zero_point  # 1.0 / scale, in one op instead of two


def fake_quantize_per_channel_steps(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor,
                                    zero_point: torch.Tensor | None, axis: int, quant_min: int, quant_max: int,
                                    in_place: bool = False) -> torch.Tensor:
    """fake_quantize_per_channel on torch ops with its steps made already (`per_channel_steps` of integer zero points;
    zero_point None: every one is 0): a weight quantized where it is read, every batch."""
    return _per_channel_by_rows(x, scale, inv_scale, zero_point, axis, quant_min, quant_max, in_place, False)


def fake_quantize_finite_per_channel(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
                                     quant_min: int, quant_max: int) -> torch.Tensor:
    """fake_quantize_per_channel in one op of torch's fused kernel, for what it computes alike: a tensor known to be
    finite, with |x / scale| well inside int64, zero points all 0 (int32) and float32 scales. Its roundings are the
    torch path's there (1 / scale in float32, half to even, the product rounded once to x's dtype); fp16/bf16 go in
    as they are (the kernel computes in float32). The CUDA kernel adds the zero point before rounding, in float, and
    so keeps round()'s -0.0: adding 0.0 makes it the 0.0 of the torch path (and of the CPU kernel)."""
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max).add_(0.0)


def _per_channel_by_rows(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor,
                         zero_point: torch.Tensor | None, axis: int, quant_min: int, quant_max: int, in_place: bool,
                         float_zero_point: bool) -> torch.Tensor:
    def rows(values: torch.Tensor, part: slice) -> torch.Tensor:
        step_zero_point = zero_point
        if part == slice(None) or axis % x.dim():  # every channel's qparams (no slicing op)
            step_scale, step_inverse = scale, inv_scale
        else:  # the qparams of these rows' channels
            step_scale, step_inverse = scale[part], inv_scale[part]
            step_zero_point = None if zero_point is None else zero_point[part]
        q = _working(values)  # a new tensor for bf16/fp16 values: the steps below run in place on it
        q = q.mul_(step_inverse) if q is not values else q * step_inverse
        if step_zero_point is None:  # zero points all 0: adding 0.0 last turns round()'s -0.0 into 0.0, as above
            return q.round_().clamp_(quant_min, quant_max).mul_(step_scale).add_(0.0).to(x.dtype)
        if float_zero_point:  # float qparams: the zero point is added before rounding, as torch does
            q.add_(step_zero_point).round_()
        else:
            q.round_().add_(step_zero_point)
        return q.clamp_(quant_min, quant_max).sub_(step_zero_point).mul_(step_scale).to(x.dtype)

    return _by_rows(x, rows, in_place)


def fake_quantize_dynamic(x: torch.Tensor, quant_min: int, quant_max: int, symmetric: bool) -> torch.Tensor:
    """Fake-quantize with qparams chosen from this tensor's own range (dynamic quantization)."""
    if x.numel() == 0:  # an expert no token was routed to in this batch
        return x
    work = _working(x)
    min_val, max_val = torch.aminmax(work.detach())
    scale, zero_point = calculate_qparams(min_val, max_val, quant_min, quant_max, symmetric)
    inv_scale = 1.0 / scale
    q = torch.clamp(torch.round(work * inv_scale) + zero_point, quant_min, quant_max)
    return ((q - zero_point) * scale).to(x.dtype)
