"""Streaming observers: statistics that stay on the tensor's device, with no per-batch host copies."""
from __future__ import annotations

import abc
import contextlib
import copy
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from qcore.observe.qparams import FLOAT32_EPS, calculate_qparams, is_per_channel, is_symmetric, resolve_quant_range
from qcore.runtime import deferred, native

__all__ = ["DerivedObserver", "FixedQParamsObserver", "HistogramObserver", "MinMaxObserver",
    "MovingAverageMinMaxObserver", "ObserverBase", "PerChannelMinMaxObserver", "PlaceholderObserver",
    "best_clipping_ranges", "calculate_qparams_together", "copied", "fresh_copy", "has_qparams", "pooled_ranges",
    "share_qparams"]


_NO_CHANNELS = torch.empty(0)  # a per-channel range before a first batch: never written to, only replaced
_RANGE_POOL = threading.local()  # the rows pooled_ranges() hands out: (+inf rows, -inf rows, rows per allocation)


@contextlib.contextmanager
def pooled_ranges(rows: int = 256) -> Iterator[None]:
    """Within the block, per-tensor range observers start from rows of shared allocations (+inf and -inf, `rows`
    at a time in four ops) instead of two new tensors each. Rows of one allocation share a version counter: a write
    to one makes the others' memoized qparams be computed again, never stale; so a pool serves observers calibrated
    together (one prepare's)."""
    previous = getattr(_RANGE_POOL, "rows", None)
    _RANGE_POOL.rows = ([], [], rows)
    try:
        yield
    finally:
        _RANGE_POOL.rows = previous


class ObserverBase(nn.Module, abc.ABC):
    """Common fields of every observer: dtype, range, qscheme and channel axis. `clips_outliers` says whether the
    observer's range may leave out the extremes it saw (to lower the expected error), rather than cover them."""

    clips_outliers: ClassVar[bool] = False

    def __init__(
        self,
        dtype: torch.dtype = torch.int8,
        quant_min: int | None = None,
        quant_max: int | None = None,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        ch_axis: int | None = None,
        is_dynamic: bool = False,
        eps: float = FLOAT32_EPS,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.quant_min, self.quant_max = resolve_quant_range(dtype, quant_min, quant_max)
        self.qscheme = qscheme
        self.ch_axis = ch_axis
        self.is_dynamic = is_dynamic
        self.eps = eps
        self.frozen = False  # set once a constant input (a weight) has been observed: later calls are no-ops

    def observe_constant(self, value: torch.Tensor) -> None:
        """Observe a tensor that never changes (a weight) once, then ignore further calls."""
        with torch.no_grad():
            self(value)
        self.frozen = True

    @property
    def symmetric(self) -> bool:
        """Whether the qscheme is symmetric."""
        return is_symmetric(self.qscheme)

    @property
    def per_channel(self) -> bool:
        """Whether the qscheme is per-channel."""
        return is_per_channel(self.qscheme)

    @abc.abstractmethod
    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (scale, zero_point) from what was observed."""

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, quant_range=[{self.quant_min}, {self.quant_max}], qscheme={self.qscheme}"


class _RangeObserver(ObserverBase):
    """Observers that keep a running min/max and derive qparams from it."""
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        low, high = self._initial_range()
        self.register_buffer("min_val", low)
        self.register_buffer("max_val", high)

    def _initial_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(min_val, max_val) before any value: +inf and -inf (rows of a pool within pooled_ranges())."""
        pool = getattr(_RANGE_POOL, "rows", None)
        if pool is None:
            return torch.tensor(math.inf), torch.tensor(-math.inf)
        lows, highs, size = pool
        if not lows:
            lows.extend(torch.full((size,), math.inf).unbind(0))
            highs.extend(torch.full((size,), -math.inf).unbind(0))
        return lows.pop(), highs.pop()

    @property
    def has_observed(self) -> bool:
        """True once at least one batch was seen (a host sync: call after calibration only)."""
        deferred.run_pending(self)
        return bool(torch.isfinite(self.min_val).all()) and self.min_val.numel() > 0

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (scale, zero_point) from what was observed: computed once per state, and once for an observer and
        the copies of its state that share_qparams links to it."""
        scale, zero_point = self.memoized_qparams()
        return scale.clone(), zero_point.clone()

    def memoized_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """calculate_qparams's tensors themselves, not copies: to be read, never written."""
        deferred.run_pending(self)
        source = _live_twin(self)
        if source is not None:
            return source.memoized_qparams()
        key = _state_key(self)
        memo = self.__dict__.get("_qparams_memo")
        if memo is not None and key is not None and _same_state(memo[0], key):
            return memo[1]
        scale, zero_point = self._qparams()
        if key is not None:
            self.__dict__["_qparams_memo"] = (key, (scale, zero_point))
        return scale, zero_point

    def _qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) covering the observed range."""
        if not self.has_observed:
            raise RuntimeError(f"{type(self).__name__} has observed no data: run calibration batches before convert")
        return calculate_qparams(self.min_val, self.max_val, self.quant_min, self.quant_max, self.symmetric, self.eps,
                                 float_qparams=self.qscheme == torch.per_channel_affine_float_qparams)


class MinMaxObserver(_RangeObserver):
    """Running minimum and maximum of every value seen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the same values again in this model call (shared along a view) leave the range as it is
        if self.frozen or x.numel() == 0 or deferred.seen_whole(self, x):
            return x
        low, high = torch.aminmax(x.detach() if x.requires_grad else x)  # detach is an op even under no_grad
        if self.min_val.device == low.device and self.min_val.dtype == self.max_val.dtype == torch.float32:
            if self.min_val.dim() == 0 and deferred.defer(self, _update_ranges, 0, lambda: (self, low, high)):
                return x  # with the other ranges of this model call, in one chain
            torch.minimum(self.min_val, low.float(), out=self.min_val)  # in place: no Module.__setattr__ per batch
            torch.maximum(self.max_val, high.float(), out=self.max_val)
            return x
        self.min_val = torch.minimum(self.min_val.to(low.device), low.float())
        self.max_val = torch.maximum(self.max_val.to(high.device), high.float())
        return x


def _update_ranges(entries: list[tuple[MinMaxObserver, torch.Tensor, torch.Tensor]]) -> None:
    """The queued batch minima and maxima of several MinMaxObservers, every round of the call's in one chain of ops:
    each running range exactly what its own updates give (a minimum and a maximum do not depend on the order)."""
    groups: dict[tuple[torch.device, torch.dtype], dict[MinMaxObserver, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    for observer, low, high in entries:  # an observer called more than once in the call: its batches side by side
        groups.setdefault((low.device, low.dtype), {}).setdefault(observer, []).append((low, high))
    for (device, _), members in groups.items():
        observers = list(members)
        lows = torch.stack([low for batches in members.values() for low, _ in batches])
        highs = torch.stack([high for batches in members.values() for _, high in batches])
        if lows.dtype != torch.float32:
            lows, highs = lows.float(), highs.float()
        if len(lows) > len(observers):  # each observer's least and greatest over its batches (a NaN stays)
            lengths = deferred.segment_lengths(device, tuple(len(batches) for batches in members.values()))
            # unsafe: the lengths are the queue's own, and checking them reads them back (a host sync on a GPU)
            lows = torch.segment_reduce(lows, "min", lengths=lengths, unsafe=True)
            highs = torch.segment_reduce(highs, "max", lengths=lengths, unsafe=True)
        new_min = torch.minimum(torch.stack([observer.min_val for observer in observers]), lows)
        new_max = torch.maximum(torch.stack([observer.max_val for observer in observers]), highs)
        torch._foreach_copy_([*(o.min_val for o in observers), *(o.max_val for o in observers)],
                             [*new_min.unbind(0), *new_max.unbind(0)])


_update_ranges.takes_rounds_together = True  # type: ignore[attr-defined]


class MovingAverageMinMaxObserver(_RangeObserver):
    """Exponential moving average of each batch's min and max."""

    def __init__(self, averaging_constant: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        self.averaging_constant = averaging_constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen or x.numel() == 0:
            return x
        low, high = torch.aminmax(x.detach() if x.requires_grad else x)
        old_min, old_max = self.min_val.to(low.device), self.max_val.to(high.device)
        c = self.averaging_constant
        first = torch.isinf(old_min)
        self.min_val = torch.where(first, low.float(), old_min + c * (low.float() - old_min))
        self.max_val = torch.where(first, high.float(), old_max + c * (high.float() - old_max))
        return x


class PerChannelMinMaxObserver(_RangeObserver):
    """Running min/max per slice along ch_axis (weights use ch_axis=0)."""

    def __init__(self, ch_axis: int = 0, qscheme: torch.qscheme = torch.per_channel_symmetric, **kwargs) -> None:
        super().__init__(ch_axis=ch_axis, qscheme=qscheme, **kwargs)

    def _initial_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No channels before a first batch, which replaces them (every prepare makes one per weight)."""
        return _NO_CHANNELS, _NO_CHANNELS

    def observe_constant(self, value: torch.Tensor) -> None:
        """Observe a weight once; a weight that an observer of the same settings observed as it is now (the same
        tensor, unchanged: each prepare of a graph observes its weights) is not reduced again: that observer's range
        tensors are shared (frozen, both), and its qparams computed once for both."""
        source = _observer_of_constant(self, value) if self.min_val is _NO_CHANNELS else None
        if source is None:
            super().observe_constant(value)
            _remember_constant(self, value)
            return
        # both are frozen: nothing writes either range again, so they are shared rather than copied
        self.min_val, self.max_val = source.min_val, source.max_val
        share_qparams(self, source)
        self.frozen = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen or x.numel() == 0:
            return x
        flat = (x.detach() if x.requires_grad else x).movedim(self.ch_axis, 0).reshape(x.shape[self.ch_axis], -1)
        if flat.is_cpu:  # torch's CPU aminmax along a dim is 8-20x slower than amin and amax (one launch elsewhere)
            low, high = flat.amin(dim=1), flat.amax(dim=1)
        else:
            low, high = torch.aminmax(flat, dim=1)
        if self.min_val.numel() == 0:
            self.min_val, self.max_val = low.float(), high.float()
        else:
            self.min_val = torch.minimum(self.min_val.to(low.device), low.float())
            self.max_val = torch.maximum(self.max_val.to(high.device), high.float())
        return x


class HistogramObserver(_RangeObserver):
    """Streaming histogram; the clipping range minimizes the expected L2 quantization error."""

    clips_outliers: ClassVar[bool] = True
    histogram: torch.Tensor
    # set by prepare where no op of the graph writes to an observed value after this observer reads it: a float32
    # value is then queued as it is, not copied (it stays as it is until the queue runs, as the model call returns)
    input_held: bool = False

    def __init__(self, bins: int = 2048, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bins = bins
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen or x.numel() == 0 or self._update_native(x) or self._queue(x):
            return x
        values = x.detach().float().reshape(-1)
        low, high = torch.aminmax(values)
        old_min, old_max = self.min_val.to(values.device), self.max_val.to(values.device)
        new_min, new_max = torch.minimum(old_min, low), torch.maximum(old_max, high)
        width = torch.clamp(new_max - new_min, min=FLOAT32_EPS)
        histogram = _rebin(self.histogram.to(values.device), old_min, old_max, new_min, width, self.bins)
        index = torch.sub(values, new_min).div_(width).mul_(self.bins).long().clamp_(0, self.bins - 1)
        if index.device.type == "cpu":  # whole counts, exact in float64; on a GPU bincount reads its size back
            histogram += torch.bincount(index, minlength=self.bins)
        else:
            histogram.index_add_(0, index, torch.ones_like(values, dtype=torch.float64))
        self.histogram, self.min_val, self.max_val = histogram, new_min, new_max
        return x

    def _queue(self, x: torch.Tensor) -> bool:
        """Queue a copy of the batch for one update with the other histograms of this model call (on the torch path:
        a GPU launches one chain for all of them); False leaves it to this observer's own chain."""
        state = (self.histogram, self.min_val, self.max_val)
        if not (x.is_floating_point() and all(t.device == x.device for t in state)
                and self.histogram.dtype == torch.float64 and self.histogram.shape == (self.bins,)
                and self.min_val.dtype == self.max_val.dtype == torch.float32
                and self.min_val.dim() == self.max_val.dim() == 0):
            return False
        held = self.input_held and x.dtype == torch.float32

        def entry() -> tuple[HistogramObserver, torch.Tensor, bool]:
            return (self, deferred.flat(x), False) if held else (self, deferred.flat_copy(x, torch.float32), True)

        # its run works in about half the memory per value of a comparator's: it holds twice as many
        return deferred.defer(self, _update_histograms, x.numel(), entry, scale=2, device=x.device)

    def _update_native(self, x: torch.Tensor) -> bool:
        """The same update in one call of the native kernel (a float32 CPU batch, float32 CPU state); False leaves
        it to the torch path (which also takes a batch holding NaN or inf)."""
        state = (self.histogram, self.min_val, self.max_val)
        if not (x.__class__ in (torch.Tensor, nn.Parameter) and x.dtype == torch.float32 and x.is_cpu
                and all(t.is_cpu and t.is_contiguous() for t in state)
                and self.histogram.dtype == torch.float64 and self.min_val.dtype == self.max_val.dtype == torch.float32
                and self.min_val.numel() == self.max_val.numel() == 1 and self.histogram.numel() == self.bins):
            return False
        library = native.kernel()
        if library is None:
            return False
        values = x.detach().contiguous()
        if library.qcore_histogram_update(values.data_ptr(), values.numel(), native.threads(values.numel()),
                                          self.histogram.data_ptr(), self.bins, self.min_val.data_ptr(),
                                          self.max_val.data_ptr()) != 0:
            return False
        for tensor in state:  # written through their pointers: their versions say so, for the qparams memo
            torch.autograd.graph.increment_version(tensor)
        return True

    def _qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) for the clipping range with the lowest expected error."""
        if not self.has_observed:
            raise RuntimeError("HistogramObserver has observed no data: run calibration batches before convert")
        low, high = _best_clipping_range(
            self.histogram, self.min_val, self.max_val, self.quant_max - self.quant_min, self.symmetric
        )
        return calculate_qparams(low, high, self.quant_min, self.quant_max, self.symmetric, self.eps)


def calculate_qparams_together(observers: Iterable[nn.Module]) -> None:
    """Compute the qparams of many observers at once, in a few chains of ops and one host read instead of a chain
    and a read each: the per-tensor histogram searches as one batched search, the min/max observers' formulas over
    their ranges laid end to end. Each observer then answers calculate_qparams from its memo, exactly what it would
    have computed alone; observers of other kinds, and those that saw nothing, compute (or raise) when asked."""
    chosen: dict[nn.Module, None] = {}
    for observer in observers:  # a copy that shares its source's qparams brings the source instead
        source = _live_twin(observer)
        chosen[observer if source is None else source] = None
    pending: list[tuple[_RangeObserver, Any]] = []
    for observer in chosen:
        if not isinstance(observer, _RangeObserver) or not (
                type(observer)._qparams is _RangeObserver._qparams
                or (isinstance(observer, HistogramObserver) and observer.min_val.dim() == 0)):
            continue
        deferred.run_pending(observer)
        key = _state_key(observer)
        memo = observer.__dict__.get("_qparams_memo")
        if key is not None and observer.min_val.numel() and not (memo is not None and _same_state(memo[0], key)):
            pending.append((observer, key))
    groups: dict[tuple[Any, ...], list[tuple[_RangeObserver, Any]]] = {}
    for observer, key in _observed(pending):
        histogram = observer.histogram.shape if isinstance(observer, HistogramObserver) else None
        group = (histogram, observer.min_val.device, observer.min_val.dtype, observer.quant_min, observer.quant_max,
                 observer.symmetric, observer.eps, observer.qscheme == torch.per_channel_affine_float_qparams)
        groups.setdefault(group, []).append((observer, key))
    for (histogram, _, _, quant_min, quant_max, symmetric, eps, float_qparams), members in groups.items():
        lows = laid_end_to_end([observer.min_val for observer, _ in members])
        highs = laid_end_to_end([observer.max_val for observer, _ in members])
        if histogram is not None:
            histograms = torch.stack([observer.histogram for observer, _ in members])
            lows, highs = best_clipping_ranges(histograms, lows, highs, quant_max - quant_min, symmetric)
        scales, zero_points = calculate_qparams(lows, highs, quant_min, quant_max, symmetric, eps,
                                                float_qparams=float_qparams)
        for (observer, key), scale, zero_point in zip(members, pieces(scales, [o.min_val for o, _ in members]),
                                                      pieces(zero_points, [o.min_val for o, _ in members])):
            observer.__dict__["_qparams_memo"] = (key, (scale, zero_point))


def laid_end_to_end(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every element of `tensors` in one 1-d tensor, in order: one op (stack) where they are all scalars."""
    if all(t.dim() == 0 for t in tensors):
        return torch.stack(list(tensors))
    return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])


def pieces(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """laid_end_to_end undone: views of `flat` with the shapes of `like`."""
    if all(t.dim() == 0 for t in like):
        return list(flat.unbind(0))
    return [piece if t.dim() == 1 else piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in like]),
                                                                              like)]


def _observed(observers: list[tuple[_RangeObserver, Any]]) -> list[tuple[_RangeObserver, Any]]:
    """Those that have seen a batch (has_observed), found with one host read per device."""
    by_device: dict[torch.device, list[tuple[_RangeObserver, Any]]] = {}
    for member in observers:
        by_device.setdefault(member[0].min_val.device, []).append(member)
    seen: list[tuple[_RangeObserver, Any]] = []
    for device, members in by_device.items():
        finite = torch.isfinite(laid_end_to_end([observer.min_val for observer, _ in members]))
        sizes = tuple(observer.min_val.numel() for observer, _ in members)
        if any(size != 1 for size in sizes):
            finite = torch.segment_reduce(finite.float(), "min", lengths=deferred.segment_lengths(device, sizes),
                                          unsafe=True) > 0
        seen.extend(member for member, observed in zip(members, finite.tolist()) if observed)
    return seen


def copied(observer: nn.Module) -> nn.Module:
    """A deep copy of an observer, its buffers cloned in one op each (a tensor's own deep copy takes a few)."""
    memo: dict[int, Any] = {id(buffer): buffer.clone() for buffer in observer._buffers.values() if buffer is not None}
    return copy.deepcopy(observer, memo)


def fresh_copy(observer: ObserverBase) -> ObserverBase:
    """A copy of an observer with the same settings and nothing observed: its range and histogram made anew rather
    than cloned, its memoized qparams left behind."""
    memo: dict[int, Any] = {id(value): None for key in ("_qparams_memo", "_qparams_twin")
                            if (value := observer.__dict__.get(key)) is not None}
    per_expert = isinstance(observer.__dict__.get("experts"), int)  # an observer of a grouped projection's experts
    for name, buffer in observer._buffers.items():
        if buffer is None:
            continue
        if name in ("min_val", "max_val") and per_expert:  # each expert's range as before any row
            memo[id(buffer)] = torch.full_like(buffer, math.inf if name == "min_val" else -math.inf)
        elif name in ("min_val", "max_val"):
            memo[id(buffer)] = (_NO_CHANNELS if observer.per_channel else
                                torch.tensor(math.inf if name == "min_val" else -math.inf))
        elif name == "histogram":
            memo[id(buffer)] = torch.zeros_like(buffer)
        else:
            memo[id(buffer)] = buffer.clone()
    fresh = copy.deepcopy(observer, memo)
    children = observer._modules.get("per_expert")
    if isinstance(children, nn.ModuleList):  # one observer per expert of a grouped projection: each made anew
        fresh.per_expert = nn.ModuleList([fresh_copy(child) for child in children])
    fresh.frozen = False
    return fresh


_CONSTANTS_KEPT = 4096
# (id of a weight, the observer's type and settings) -> (the weight, its version, the observer, the observer's state),
# weakly: which observer observed that weight, while both live and neither changed
_OBSERVED_CONSTANTS: dict[tuple, tuple[weakref.ref, int, weakref.ref, Any]] = {}


def _constant_key(observer: ObserverBase, value: torch.Tensor) -> tuple:
    return (id(value), type(observer), observer.dtype, observer.quant_min, observer.quant_max, observer.qscheme,
            observer.ch_axis, observer.eps, observer.is_dynamic)


def _remember_constant(observer: _RangeObserver, value: torch.Tensor) -> None:
    state = _state_key(observer)
    if state is None or value.is_inference():  # no versions in inference mode
        return
    if len(_OBSERVED_CONSTANTS) >= _CONSTANTS_KEPT:
        del _OBSERVED_CONSTANTS[next(iter(_OBSERVED_CONSTANTS))]
    _OBSERVED_CONSTANTS[_constant_key(observer, value)] = (weakref.ref(value), value._version, weakref.ref(observer),
                                                           state)


def _observer_of_constant(observer: _RangeObserver, value: torch.Tensor) -> _RangeObserver | None:
    """The live observer of the same type and settings that observed `value` as it is now, its range unchanged since;
    else None."""
    if value.is_inference():
        return None
    found = _OBSERVED_CONSTANTS.get(_constant_key(observer, value))
    if found is None:
        return None
    value_ref, version, observer_ref, state = found
    source = observer_ref()
    if (version != value._version or value_ref() is not value or source is None or not source.frozen
            or not _same_state(state, _state_key(source))):
        return None
    return source


def share_qparams(observer: nn.Module, source: nn.Module) -> None:
    """Let `observer`, which holds a copy of `source`'s state as it is now, take its qparams from `source`: computed
    once for both, for as long as neither state changes (each then computes its own)."""
    if isinstance(observer, _RangeObserver) and type(source) is type(observer):
        key, source_key = _state_key(observer), _state_key(source)
        if key is not None and source_key is not None:
            observer.__dict__["_qparams_twin"] = (key, weakref.ref(source), source_key)


def _live_twin(observer: nn.Module) -> nn.Module | None:
    """The observer whose qparams `observer` takes (share_qparams), while neither state has changed since; else None."""
    twin = observer.__dict__.get("_qparams_twin")
    source = twin[1]() if twin is not None else None
    if source is not None and _same_state(twin[0], _state_key(observer)) and _same_state(twin[2], _state_key(source)):
        return source
    return None


def has_qparams(observer: nn.Module) -> bool:
    """Whether the observer's qparams are known without computing them: memoized for its state as it is now, or
    taken from a live twin (share_qparams) whose own are known. Either means it has observed something (no host
    read to tell); a twin's state may be one that saw nothing (an expert no token reached), which its copy shares."""
    source = _live_twin(observer)
    if source is not None:
        return has_qparams(source)
    memo = observer.__dict__.get("_qparams_memo")
    return memo is not None and _same_state(memo[0], _state_key(observer))


def _state_key(observer: nn.Module) -> tuple[tuple[str, Any, int], ...] | None:
    """The observer's state as (buffer name, tensor, its version): any write to a buffer, in place or by assignment,
    changes it. None where tensors have no version (inference mode)."""
    try:
        return tuple((name, tensor, tensor._version) for name, tensor in observer._buffers.items()
                     if tensor is not None)
    except RuntimeError:
        return None


def _same_state(a: tuple[tuple[str, Any, int], ...] | None, b: tuple[tuple[str, Any, int], ...] | None) -> bool:
    return (a is not None and b is not None and len(a) == len(b)
            and all(x[0] == y[0] and x[1] is y[1] and x[2] == y[2] for x, y in zip(a, b)))


def _rebin(histogram: torch.Tensor, old_min, old_max, new_min, new_width, bins: int) -> torch.Tensor:
    """Spread old histograms (..., bins) over their new ranges (one per leading index) by interpolating their
    cumulative counts."""
    finite = (old_min - old_min) == 0  # isfinite in two ops instead of four: inf - inf and NaN - NaN are NaN
    old_width = torch.where(finite, torch.clamp(old_max - old_min, min=FLOAT32_EPS), torch.ones_like(old_min))
    old_min = torch.where(finite, old_min, new_min)
    cumulative = torch.cat([histogram.new_zeros(*histogram.shape[:-1], 1), histogram.cumsum(-1)], dim=-1)
    edges = _arange(histogram.device, bins + 1, 1, torch.int64)
    new_edges = (_column(new_min) + _column(new_width) * edges / bins)
    position = ((new_edges - _column(old_min)) / _column(old_width) * bins).clamp(0, bins).double()
    left = position.floor().long().clamp(max=bins - 1)
    fraction = position - left
    below = cumulative.gather(-1, left)
    at_edges = below + fraction * (cumulative.gather(-1, left + 1) - below)
    return at_edges.diff(dim=-1)


def _column(value: torch.Tensor) -> torch.Tensor:
    """One range per row of a histogram stack (a single histogram's 0-d range as it is)."""
    return value.unsqueeze(-1) if value.dim() else value


def _update_histograms(entries: list[tuple[HistogramObserver, torch.Tensor, bool]]) -> None:
    """The queued batches of several histogram observers in one chain of ops: each histogram gets exactly the
    counts and range its own update gives (the same elementwise float32 steps, whole counts in float64). An entry
    is (observer, values, whether the values are the queue's own copy or the graph's value itself)."""
    groups: dict[tuple[torch.device, int], list[tuple[HistogramObserver, torch.Tensor, bool]]] = {}
    for entry in entries:
        groups.setdefault((entry[1].device, entry[0].bins), []).append(entry)
    entries.clear()  # the queued copies are freed once laid end to end
    for (device, bins), group in groups.items():
        observers = [observer for observer, _, _ in group]
        flats = [flat for _, flat, _ in group]
        own = group[0][2]
        group.clear()
        # the steps below run in place on `values`: a graph's value itself is copied first
        values = torch.cat(flats) if len(flats) > 1 else flats[0] if own else flats[0].clone()
        lengths = deferred.segment_lengths(device, tuple(flat.numel() for flat in flats))
        del flats
        old_min = torch.stack([observer.min_val for observer in observers])
        old_max = torch.stack([observer.max_val for observer in observers])
        # unsafe: the lengths are the queue's own, and checking them reads them back (a host sync on a GPU)
        new_min = torch.minimum(old_min, torch.segment_reduce(values, "min", lengths=lengths, unsafe=True))
        new_max = torch.maximum(old_max, torch.segment_reduce(values, "max", lengths=lengths, unsafe=True))
        width = torch.clamp(new_max - new_min, min=FLOAT32_EPS)
        histograms = _rebin(torch.stack([observer.histogram for observer in observers]), old_min, old_max, new_min,
                            width, bins)
        total = values.numel()
        # in place, each value with its own observer's range laid beside it: the values are this run's own,
        # and the working memory (12 bytes a value at most) is what bounds the queue
        values.sub_(torch.repeat_interleave(new_min, lengths, output_size=total))
        values.div_(torch.repeat_interleave(width, lengths, output_size=total))
        # int32: a bin is at most `bins`, and a NaN clamps to bin 0 as it does through int64
        index = values.mul_(bins).to(torch.int32).clamp_(0, bins - 1)
        del values
        index.add_(torch.repeat_interleave(_first_bins(device, len(observers), bins), lengths, output_size=total))
        counts = histograms.view(-1)
        if device.type == "cpu":  # whole counts, exact in float64; on a GPU bincount reads its size back
            counts += torch.bincount(index, minlength=counts.numel())
        else:
            counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        torch._foreach_copy_([*(o.histogram for o in observers), *(o.min_val for o in observers),
                              *(o.max_val for o in observers)],
                             [*histograms.unbind(0), *new_min.unbind(0), *new_max.unbind(0)])


_ARANGES: dict[tuple[torch.device, int, int, torch.dtype], torch.Tensor] = {}


def _arange(device: torch.device, count: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """arange(0, count * step, step) on `device`, made once (the flushes of every batch ask for the same few)."""
    key = (device, count, step, dtype)
    found = _ARANGES.get(key)
    if found is None:
        if len(_ARANGES) >= 256:
            del _ARANGES[next(iter(_ARANGES))]
        found = _ARANGES[key] = torch.arange(0, count * step, step, dtype=dtype, device=device)
    return found


def _first_bins(device: torch.device, histograms: int, bins: int) -> torch.Tensor:
    """The position of each histogram's first bin in a stack of them laid end to end (int32)."""
    return _arange(device, histograms, bins, torch.int32)


def _best_clipping_range(histogram, min_val, max_val, levels: int, symmetric: bool):
    """Search clipping ranges on the histogram's bin edges for the least expected squared error."""
    low, high = best_clipping_ranges(histogram[None], min_val.reshape(1), max_val.reshape(1), levels, symmetric)
    return low[0], high[0]


_SYMMETRIC_LIMITS = 512  # clipping magnitudes tried by the symmetric search
_SEARCH_ELEMENTS = 1 << 23  # float64 elements a symmetric search holds at a time (64 MB per temporary)
_AFFINE_ROWS = 8  # histograms an affine search takes at a time on the CPU


def best_clipping_ranges(histograms: torch.Tensor, min_vals: torch.Tensor, max_vals: torch.Tensor, levels: int,
                         symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipping range with the least expected squared error of each histogram of a stack (rows, bins) over its
    own [min_val, max_val]: one chain of ops for every row, each row's result exactly its search alone."""
    rows, bins = histograms.shape
    counts = histograms.double()
    width = ((max_vals - min_vals).double() / bins)[:, None]
    start = min_vals.double()[:, None]
    steps = torch.arange(bins + 1, device=counts.device, dtype=torch.float64)
    centers = start + width * (steps[:-1] + 0.5)
    if symmetric:
        magnitude = torch.maximum(-min_vals, max_vals).double()[:, None]
        limits = magnitude * torch.linspace(1.0 / _SYMMETRIC_LIMITS, 1.0, _SYMMETRIC_LIMITS, device=counts.device,
                                            dtype=torch.float64)
        step = (2 * limits / levels)[:, :, None]
        best = []
        chunk = max(1, _SEARCH_ELEMENTS // (_SYMMETRIC_LIMITS * bins))
        for first in range(0, rows, chunk):
            part = slice(first, first + chunk)
            over = torch.clamp(centers[part].abs()[:, None, :] - limits[part][:, :, None], min=0.0)
            inside = (over == 0).double()
            error = (counts[part][:, None, :] * (inside * step[part] ** 2 / 12 + over**2)).sum(-1)
            best.append(limits[part].gather(1, torch.argmin(error, dim=1, keepdim=True))[:, 0])
        magnitudes = torch.cat(best)
        return (-magnitudes).float(), magnitudes.float()
    edges = start + width * steps
    # Affine: error(lo, hi) = rounding noise of the values inside + clipping error of the values outside,
    # from prefix sums, for pairs of bin edges.
    n, s1, s2 = (torch.cat([counts.new_zeros(rows, 1), t.cumsum(-1)], dim=-1)
                 for t in (counts, counts * centers, counts * centers**2))
    total_n, total_s1, total_s2 = n[:, -1:], s1[:, -1:], s2[:, -1:]
    below = s2 - 2 * edges * s1 + edges**2 * n  # clipping error of the values under each edge
    above = (total_s2 - s2) - 2 * edges * (total_s1 - s1) + edges**2 * (total_n - n)
    # each row's search is its own: where ops are launches every row goes in one chain; on the CPU a few rows at a
    # time, since a row the coarse grid cannot prune tries every pair of edges (millions) and the candidates of all
    # rows at once would grow with the model's depth
    chunk = rows if native.launch_bound(counts.device) else _AFFINE_ROWS
    parts = [slice(None)] if rows <= chunk else [slice(first, first + chunk) for first in range(0, rows, chunk)]
    found = [_best_affine_pairs(_AffineSearch(edges[part], n[part], below[part], above[part], levels))
             for part in parts]
    if len(found) == 1:
        return found[0]
    return torch.cat([low for low, _ in found]), torch.cat([high for _, high in found])


def _best_affine_pairs(search: _AffineSearch) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of the least expected error of each row of an affine search, float32."""
    edges, size = search.edges, search.size
    rows = edges.shape[0]
    row, i, j = search.candidates()
    error = search.errors(row, i, j)
    best = torch.full((rows,), float("inf"), dtype=error.dtype, device=error.device).scatter_reduce(
        0, row, error, "amin")
    # the first minimum in (lo, hi) order, as an argmin over every pair would pick
    flat = torch.where(error == best[row], i * size + j, torch.full_like(i, size * size))
    flat = torch.full((rows,), size * size, dtype=flat.dtype, device=flat.device).scatter_reduce(0, row, flat, "amin")
    return (edges.gather(1, (flat // size)[:, None])[:, 0].float(),
            edges.gather(1, (flat % size)[:, None])[:, 0].float())


class _AffineSearch:
    """The expected error of (lo, hi) edge pairs of each row of a histogram stack, and the pairs to try."""

    def __init__(self, edges, n, below, above, levels: int) -> None:
        self.edges, self.n, self.below, self.above, self.levels = edges, n, below, above, levels
        self.size = edges.shape[1]

    def _at(self, values: torch.Tensor, row: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return values.reshape(-1)[row * self.size + index]

    def errors(self, row: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Expected squared error of clipping row `row` to [edge i, edge j] (inf where lo >= hi)."""
        lo, hi = self._at(self.edges, row, i), self._at(self.edges, row, j)
        span = torch.clamp(hi, min=0.0) - torch.clamp(lo, max=0.0)
        total_n = self.n[:, -1][row]
        inside = total_n - self._at(self.n, row, i) - (total_n - self._at(self.n, row, j))
        error = (self._at(self.below, row, i) + self._at(self.above, row, j)
                 + torch.clamp(inside, min=0.0) * (span / self.levels) ** 2 / 12)
        return torch.where(lo < hi, error, torch.full_like(error, float("inf")))

    def candidates(self, stride: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, lo, hi) edge index triples that hold each row's least error over every pair: the cells of a coarse
        grid whose lower bound does not exceed the row's best coarse point, refined to every pair (every pair of a
        row where few of its cells can be ruled out). below[i] grows with i, above[j] shrinks with j, and the
        rounding noise grows with the span and the count inside, so a cell's least error is at least below[its
        first lo] + above[its last hi] + the noise of its narrowest pair."""
        edges, n, size = self.edges, self.n, self.size
        rows, device = edges.shape[0], edges.device
        points = torch.arange(0, size, stride, device=device)
        if (size - 1) % stride:
            points = torch.cat([points, points.new_tensor([size - 1])])
        every_row = torch.arange(rows, device=device)
        upper = self.errors(every_row[:, None, None], points[None, :, None], points[None, None, :]).amin(dim=(1, 2))
        first, last = points[:-1], points[1:]
        narrow_lo, narrow_hi = edges[:, last][:, :, None], edges[:, first][:, None, :]
        span = torch.clamp(narrow_hi, min=0.0) - torch.clamp(narrow_lo, max=0.0)
        inside = torch.clamp(n[:, first][:, None, :] - n[:, last][:, :, None], min=0.0)
        bound = (self.below[:, first][:, :, None] + self.above[:, last][:, None, :]
                 + inside * (span / self.levels) ** 2 / 12)
        bound = torch.where(first[:, None] < last[None, :], bound, torch.full_like(bound, float("inf")))
        cells = torch.nonzero(bound <= (upper + upper.abs() * 1e-9)[:, None, None])
        per_row = torch.bincount(cells[:, 0], minlength=rows).tolist()
        every_pair = [r for r, count in enumerate(per_row) if count * (stride + 1) ** 2 >= size * size // 2]
        parts_row, parts_i, parts_j = [], [], []
        if every_pair:
            refined = torch.ones(rows, dtype=torch.bool, device=device)
            refined[every_pair] = False
            cells = cells[refined[cells[:, 0]]]
            pairs = torch.arange(size, device=device)
            for r in every_pair:
                parts_row.append(torch.full((size * size,), r, dtype=torch.long, device=device))
                parts_i.append(pairs[:, None].expand(size, size).reshape(-1))
                parts_j.append(pairs[None, :].expand(size, size).reshape(-1))
        offsets = torch.arange(stride + 1, device=device)
        lo = (first[cells[:, 1]][:, None] + offsets[None, :]).clamp(max=size - 1)  # [cells, stride + 1]
        hi = (first[cells[:, 2]][:, None] + offsets[None, :]).clamp(max=size - 1)
        parts_row.append(cells[:, 0][:, None].expand(-1, (stride + 1) ** 2).reshape(-1))
        parts_i.append(lo[:, :, None].expand(-1, -1, stride + 1).reshape(-1))
        parts_j.append(hi[:, None, :].expand(-1, stride + 1, -1).reshape(-1))
        if len(parts_row) == 1:
            return parts_row[0], parts_i[0], parts_j[0]
        return torch.cat(parts_row), torch.cat(parts_i), torch.cat(parts_j)


class PlaceholderObserver(ObserverBase):
    """Records nothing: for dynamic specs, whose qparams are chosen per tensor at run time, and for float specs
    (dtype float32/float16/bfloat16, torchao's way of keeping a bias in float): convert inserts no fake-quant
    for float32, and a round trip through float16/bfloat16 for those."""

    def __init__(self, dtype: torch.dtype = torch.int8, quant_min: int | None = None, quant_max: int | None = None,
                 **kwargs) -> None:
        float_dtype = dtype if dtype.is_floating_point else None
        super().__init__(torch.int8 if float_dtype else dtype, None if float_dtype else quant_min,
                         None if float_dtype else quant_max, **kwargs)
        if float_dtype is not None:
            self.dtype = float_dtype

    @property
    def is_float(self) -> bool:
        """True for a float spec: the tensor is not integer-quantized."""
        return self.dtype.is_floating_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic observers have no static qparams."""
        raise RuntimeError("a dynamic (placeholder) observer has no static qparams")


class FixedQParamsObserver(ObserverBase):
    """Returns the scale and zero point it was given (sigmoid/tanh-style outputs)."""

    def __init__(self, scale: float, zero_point: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("scale", torch.tensor([float(scale)]))
        self.register_buffer("zero_point", torch.tensor([int(zero_point)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed (scale, zero_point)."""
        return self.scale, self.zero_point


class DerivedObserver(ObserverBase):
    """Qparams computed from other observers (for example bias scale = input scale x weight scale)."""

    def __init__(
        self,
        observers: Sequence[nn.Module],
        derive_qparams_fn: Callable[[list], tuple[torch.Tensor, torch.Tensor]],
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self._sources = list(observers)  # plain list: the sources are owned by their own graph nodes
        self.derive_qparams_fn = derive_qparams_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ask derive_qparams_fn for the qparams, given the source observers."""
        return self.derive_qparams_fn(self._sources)
