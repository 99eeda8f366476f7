"""The report observer: range, per-channel and percentile statistics, streaming and on-device.

Per batch it keeps (like torch.ao's ModelReportObserver): the epoch min/max, the mean of each batch's
range, per-channel min/max, per-channel q100/qp ratios averaged over the batches where a channel is not
all zero, and a per-channel count of constant batches. Unlike it, it never copies to the host, never sorts
the whole activation, and has no size limit per channel.

Percentiles: q100 and q0 are exact (per-channel max/min). qp comes from a fixed random sample of at most
`sample_size` values per channel per batch (all values when a channel has fewer, so it is then exact,
with torch.quantile's "lower" interpolation). With m sampled values the estimate's rank lies within
p +/- eps of the exact one with probability at least 1 - 2*exp(-2*m*eps^2): for m = 4096 and eps = 0.03,
at least 1 - 1e-3 per batch, and the per-batch ratios are then averaged.

Two paths compute the same numbers. Float32 CPU activations of up to NATIVE_MAX_NUMEL values go through
one call of the native kernel (`qcore/native.py`, `qcore/_stats.c`), planned once per shape, which selects from the
same sample when percentiles are sampled; everything else (CUDA, other dtypes, sampled channels-last
percentiles, no C compiler) goes through torch ops that stay on the device.
"""
from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import nn

from qcore.observe.segmented import observe_runs
from qcore.runtime import deferred, native
from qcore.runtime.native import launch_bound

__all__ = ["DEFAULT_SAMPLE_SIZE", "NATIVE_MAX_NUMEL", "NATIVE_MAX_TOP", "ExpertsReportObservers", "ReportObserver",
           "average_ratio_values", "batch_to_epoch_ratios", "fresh_ranges"]

DEFAULT_SAMPLE_SIZE = 4096
_NO_CHANNELS = torch.empty(0)  # the per-channel state before a first batch: never written to, only replaced
NATIVE_MAX_NUMEL = 1 << 20  # above this, per-op overhead is small next to the work: torch ops do as well
NATIVE_MAX_TOP = 128  # the kernel keeps each channel's k largest values in a sorted list (MAX_TOP in _stats.c)
# channel-major channels (runs) insert value by value into that list: for a longer top k, selecting among all of a
# channel's values is cheaper; channels-last rows insert whole blocks branchlessly and keep the list up to 128
RUNS_MAX_TOP = 64
MAX_KEPT_PLANS = 256  # shapes an observer keeps a native plan for (an MoE expert's run: one per token count)
_NO_SAMPLE = torch.empty(0, dtype=torch.int64)  # the exact selection's sample: none (never written)
_STATE = frozenset({"extremes", "extreme_sums", "min_val", "max_val", "ratio_sums", "ratio_counts",
                    "constant_channels"})


class ReportObserver(nn.Module):
    """Streaming statistics of one activation; `percentiles` may be empty (range statistics only)."""

    def __init__(self, ch_axis: int = 1, percentiles: tuple[float, ...] = (), per_channel: bool = True,
                 sample_size: int = DEFAULT_SAMPLE_SIZE, seed: int = 0,
                 ranges: tuple[torch.Tensor, torch.Tensor] | None = None, min_ratio_values: int = 0) -> None:
        """`ranges`: the starting (extremes, extreme_sums), from fresh_ranges (made anew when None).
        `min_ratio_values`: a batch with fewer values per channel adds no percentile ratio (its ranges count as
        any batch's), as a batch where the channel is all zero adds none: too few values estimate no percentile."""
        super().__init__()
        if min_ratio_values < 0:
            raise ValueError(f"min_ratio_values must be at least 0, got {min_ratio_values}")
        self.ch_axis = ch_axis
        self.min_ratio_values = int(min_ratio_values)
        self.per_channel = per_channel or bool(percentiles)
        self.percentiles: tuple[float, ...] = tuple(sorted(set(percentiles)))
        self.sample_size = sample_size
        self.seed = seed
        self.num_batches_tracked = 0
        # [-min, max] of the whole tensor: running maximum, and sum over batches (for the mean batch range)
        extremes, extreme_sums = ranges if ranges is not None else (
            torch.full((2,), float("-inf")), torch.zeros(2, dtype=torch.float64))
        self.register_buffer("extremes", extremes)
        self.register_buffer("extreme_sums", extreme_sums)
        for name in ("min_val", "max_val", "ratio_sums", "ratio_counts", "constant_channels"):
            # one empty tensor for every observer: the first batch replaces each with its own (_init_channels)
            self.register_buffer(name, _NO_CHANNELS)
        self._sample_key: tuple | None = None
        self._sample_index: torch.Tensor | None = None
        self._native_plan: tuple | None = None  # (shape, kernel function, its arguments after the data pointer)
        # the plans of the shapes seen since the state last moved, by shape: an MoE expert's token count changes
        # from batch to batch and comes back, and a plan costs several times the kernel on a small run
        self._native_plans: dict[torch.Size, tuple] = {}
        self._native_scratch: tuple = ()

    def add_percentiles(self, percentiles) -> None:
        """Also track these percentiles (for observers shared between detectors, before calibration)."""
        if self.num_batches_tracked:
            raise RuntimeError("percentiles can only be added before calibration")
        self.percentiles = tuple(sorted(set(self.percentiles) | set(percentiles)))
        self._drop_native_plan()
        self.per_channel = self.per_channel or bool(self.percentiles)

    @property
    def epoch_activation_min(self) -> torch.Tensor:
        """Smallest value seen."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        return -self.extremes[0]

    @property
    def epoch_activation_max(self) -> torch.Tensor:
        """Largest value seen."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        return self.extremes[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        if self.min_ratio_values and self.percentiles and x.dim() and \
                x.numel() < self.min_ratio_values * x.shape[self.ch_axis % x.dim()]:
            return self._observe(x, native=False, ratios=False)  # the native kernel computes ratios: torch ops
        plan = self._native_plan  # the hot path: the same shape again, one native call
        if plan is not None and x.shape != plan[0]:  # an MoE expert's token count of an earlier batch
            plan = self.__dict__.get("_native_plans", {}).get(x.shape)
            if plan is not None:
                self.__dict__["_native_plan"] = plan
        if plan is not None and x.__class__ is torch.Tensor and x.dtype == torch.float32 and x.is_cpu:
            # a strided view (attention's transposed keys) is copied: cheaper than the torch path's dozen ops
            values = x if x.is_contiguous() else x.detach().contiguous()
            if not plan[1](values.data_ptr(), *plan[2]):
                self.__dict__["num_batches_tracked"] += 1
                return x
            return self._observe(x, native=False)  # a NaN: torch ops propagate it
        return self._observe(x)

    def _observe(self, x: torch.Tensor, native: bool = True, ratios: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return x
        values = x.detach() if x.requires_grad else x  # detach is an op even under no_grad
        if self.extremes.device != values.device:
            self.to(values.device)
        if self.per_channel:  # what reports name as the axis used (ch_axis -1: the last)
            self.__dict__["observed_axis"] = self.ch_axis % values.dim()
        if native and self._observe_native(values):
            return x
        if not self.per_channel:
            low, high = torch.aminmax(values)
            if not (self._queueable(low.numel()) and deferred.defer(self, _update_reports, 0, lambda: (self, low, high,
                                                                                                      None))):
                self._update_range(torch.stack([-low, high]))
            return x
        axis = self.ch_axis % values.dim()
        rows = values.reshape(-1, values.shape[-1]) if axis == values.dim() - 1 and values.is_contiguous() else None
        others = 0 if rows is not None else [d for d in range(values.dim()) if d != axis]
        source = rows if rows is not None else values
        if rows is not None and launch_bound(rows.device):  # one launch for both
            low_c, high_c = torch.aminmax(rows, dim=0)
        else:  # faster than aminmax(dim=0) on the CPU, and aminmax takes one dim
            low_c, high_c = source.amin(dim=others), source.amax(dim=others)
        if self.min_val.numel() == 0:
            self._init_channels(low_c.numel(), low_c.device)
        if low_c.dim() == 1 and (ratios or not self.percentiles) and self._queueable(low_c.numel()):
            quantiles = self._batch_quantiles(values, rows, axis) if self.percentiles else None
            if deferred.defer(self, _update_reports, 0, lambda: (self, low_c, high_c, quantiles)):
                return x
        if low_c.dtype != torch.float32:
            low_c, high_c = low_c.float(), high_c.float()
        self._update_range(torch.cat([-low_c, high_c]).view(2, -1).amax(dim=1))
        torch.minimum(self.min_val, low_c, out=self.min_val)
        torch.maximum(self.max_val, high_c, out=self.max_val)
        self.constant_channels.add_(high_c == low_c)
        if self.percentiles and ratios:
            self._add_ratios(self._batch_quantiles(values, rows, axis), high_c)
        return x

    def _queueable(self, channels: int) -> bool:
        """Whether this batch's statistics can wait for one update with the other report observers of the model call
        (`_update_reports`): the state has the dtypes and shapes that update writes (`channels` per channel)."""
        device = self.extremes.device
        if not (self.extremes.dtype == torch.float32 and self.extremes.shape == (2,)
                and self.extreme_sums.dtype == torch.float64 and self.extreme_sums.shape == (2,)
                and self.extreme_sums.device == device):
            return False
        if not self.per_channel:
            return True
        rows = len(self.percentiles)
        return (self.min_val.shape == self.max_val.shape == self.constant_channels.shape == (channels,)
                and self.ratio_sums.shape == self.ratio_counts.shape == (rows, channels)
                and self.min_val.dtype == self.max_val.dtype == self.constant_channels.dtype == torch.float32
                and self.ratio_sums.dtype == torch.float64 and self.ratio_counts.dtype == torch.float32
                and all(t.device == device for t in (self.min_val, self.max_val, self.constant_channels,
                                                     self.ratio_sums, self.ratio_counts)))

    def _observe_native(self, values: torch.Tensor) -> bool:
        """Plan the native kernel for this shape and run it; False leaves the batch to the torch path."""
        if (values.dtype != torch.float32 or not values.is_cpu or values.numel() > NATIVE_MAX_NUMEL
                or self.extremes.dtype != torch.float32):
            return False
        library = native.kernel()
        if library is None:
            return False
        values = values.contiguous()
        if not self.per_channel:
            function = library.qcore_observe_range
            arguments = (values.numel(), native.threads(values.numel()), self.extremes.data_ptr(),
                         self.extreme_sums.data_ptr())
        else:
            sizes = self._native_sizes(values.shape)
            if sizes is None:
                return False
            outer, channels, inner, top, picks, sample = sizes
            if self.min_val.numel() != channels:
                if self.min_val.numel():
                    return False  # a different channel count: let the torch path raise its error
                self._init_channels(channels, values.device)
            workers = native.threads(values.numel())
            needed = library.qcore_scratch_floats(outer, channels, inner, top, sample.numel(), workers)
            # a new shape (an MoE expert's token count changes every batch) plans again: the last plan's picks and
            # scratch serve where they fit, so that a plan costs a few microseconds, not a few allocations
            kept = self.__dict__.get("_native_scratch") or ()
            key = tuple(picks)
            picks = kept[1] if kept and kept[0] == key else torch.tensor(picks, dtype=torch.int64)
            scratch = kept[3] if kept and kept[3].numel() >= needed else torch.empty(needed)
            if kept and scratch is not kept[3]:
                self.__dict__["_native_plans"] = {}  # the plans kept point into the smaller scratch: let it go
            function = library.qcore_observe
            arguments = (outer, channels, inner, top, picks.data_ptr(), picks.numel(), sample.data_ptr(),
                         sample.numel(), scratch.data_ptr(), scratch.numel(), workers,
                         *(buffer.data_ptr() for buffer in (self.extremes, self.extreme_sums, self.min_val,
                                                            self.max_val, self.constant_channels)),
                         self.min_val.numel(), self.ratio_sums.data_ptr(), self.ratio_counts.data_ptr(),
                         min(self.ratio_sums.numel(), self.ratio_counts.numel()))
            # keeps the memory the pointers point to (set in __dict__: nn.Module's __setattr__ costs more than a plan)
            self.__dict__["_native_scratch"] = (key, picks, sample, scratch)
        plan = (values.shape, function, arguments, self.__dict__.get("_native_scratch"))  # what it points into
        plans = self.__dict__.setdefault("_native_plans", {})
        if len(plans) >= MAX_KEPT_PLANS:
            plans.clear()
        plans[values.shape] = self.__dict__["_native_plan"] = plan
        outcome = function(values.data_ptr(), *arguments)
        if outcome == native.REFUSED:
            self._native_plan = None
            raise RuntimeError(f"the native report kernel refused its buffer sizes for shape {tuple(values.shape)}; "
                               "this is a qcore bug: please report it, and set QCORE_NATIVE=0 meanwhile")
        if outcome:
            return False  # a NaN: torch ops propagate it
        self.__dict__["num_batches_tracked"] += 1
        return True

    def _native_sizes(self, shape: torch.Size) -> tuple | None:
        """(outer, channels, inner, k, picks, sample) of the kernel for one activation shape, or None when it
        can't give the statistics the torch path would. Exact: picks are positions in each channel's
        ascending top k, and sample is empty. Sampled (channel-major only): the kernel selects the ascending
        ranks in picks (0-based, k of them) among the torch path's own sample, whose offsets it gets."""
        axis = self.ch_axis % len(shape)
        outer, channels, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
        count = outer * inner
        no_sample = _NO_SAMPLE
        if not self.percentiles:
            return outer, channels, inner, 0, [], no_sample
        ranks = [int(p * (count - 1)) + 1 for p in self.percentiles]  # 1-based, ascending
        top = max(count - rank + 1 for rank in ranks)
        if count > self.sample_size or (top > RUNS_MAX_TOP and inner > 1):
            if inner == 1:
                return None  # channels last and sampled: the torch path samples rows
            # channel 0's offsets of the torch path's sample (every position when count <= sample_size: a
            # selection among all of a channel's values is exact, and cheaper than a long top-k)
            offsets = channel_sample_offsets(tuple(shape), axis, self.sample_size, self.seed)
            ranks = [int(p * (offsets.numel() - 1)) for p in self.percentiles]
            return outer, channels, inner, len(ranks), ranks, offsets
        if top > NATIVE_MAX_TOP:
            return None
        picks = [top - 1 - (count - rank) for rank in ranks]  # positions in each channel's ascending top-k
        return outer, channels, inner, top, picks, no_sample

    def __getstate__(self):
        state = dict(super().__getstate__())  # copies and pickles re-plan: the plan holds raw pointers
        state.update(_native_plan=None, _native_plans={}, _native_scratch=())
        return state

    def _drop_native_plan(self) -> None:
        self.__dict__["_native_plan"] = None
        self.__dict__["_native_plans"] = {}

    def __setattr__(self, name, value):
        if name in _STATE:  # the plan holds pointers into the state buffers
            self._drop_native_plan()
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        self._drop_native_plan()  # .to(), .double(), ...: the buffers move
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._drop_native_plan()
        return super()._load_from_state_dict(*args, **kwargs)

    def _init_channels(self, channels: int, device) -> None:
        self._drop_native_plan()
        self.min_val = torch.full((channels,), float("inf"), device=device)
        self.max_val = torch.full((channels,), float("-inf"), device=device)
        self.ratio_sums = torch.zeros(len(self.percentiles), channels, dtype=torch.float64, device=device)
        self.ratio_counts = torch.zeros(len(self.percentiles), channels, device=device)
        self.constant_channels = torch.zeros(channels, device=device)

    def _update_range(self, extremes: torch.Tensor) -> None:
        if extremes.dtype != torch.float32:
            extremes = extremes.float()
        torch.maximum(self.extremes, extremes, out=self.extremes)
        self.extreme_sums.add_(extremes)
        self.__dict__["num_batches_tracked"] += 1  # a plain counter: skip nn.Module.__setattr__ on the hot path

    def _sample_positions(self, shape: torch.Size, axis: int, device) -> torch.Tensor:
        """[channels, m] flat (row-major) indices: the same m positions in every channel."""
        key = ("take", tuple(shape), axis, str(device))
        if key != self._sample_key:
            self._sample_index = _channel_sample_index(tuple(shape), axis % len(shape), self.sample_size, self.seed,
                                                       torch.device(device))
            self._sample_key = key
        return self._sample_index

    def _batch_quantiles(self, values: torch.Tensor, rows: torch.Tensor | None, axis: int) -> torch.Tensor:
        """[len(percentiles), channels] ([channels] for one percentile): this batch's per-channel percentiles, of its
        sample (in values' dtype)."""
        if rows is not None:  # [positions, channels], a view
            if rows.shape[0] > self.sample_size:
                rows = rows.index_select(0, self._row_sample(rows.shape[0], rows.device))
            return _column_quantiles(rows, self.percentiles, dim=0)
        sample = values.take(self._sample_positions(values.shape, axis, values.device))
        return _column_quantiles(sample, self.percentiles, dim=1)

    def _add_ratios(self, quantiles: torch.Tensor, high_c: torch.Tensor) -> None:
        ratio_sums, ratio_counts = _batch_ratios(quantiles, high_c)
        self.ratio_sums.add_(ratio_sums)
        self.ratio_counts.add_(ratio_counts)

    def _row_sample(self, count: int, device) -> torch.Tensor:
        key = ("rows", count, str(device))
        if key != self._sample_key:
            self._sample_index = sorted_sample(count, self.sample_size, self.seed).to(device)
            self._sample_key = key
        return self._sample_index

    # ---- read-only views for detectors (host copies happen here, after calibration) ----

    def batch_to_epoch_ratio(self) -> float:
        """Mean batch range / epoch range; nan when the activation was constant or never observed."""
        return batch_to_epoch_ratios([self])[0]

    @property
    def average_batch_activation_range(self) -> torch.Tensor:
        """Mean over batches of (batch max - batch min), a float32 tensor as torch.ao's attribute of that name
        (0 before data)."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        if self.num_batches_tracked == 0:
            return torch.zeros((), device=self.extremes.device)
        return (self.extreme_sums.sum() / self.num_batches_tracked).float()

    def get_batch_to_epoch_ratio(self) -> torch.Tensor:
        """torch.ao's name for the mean batch range / epoch range. Before any data this raises ValueError, where
        torch.ao returns -0.0 (its range starts at -inf and its no-data check looks for +inf only): a ratio of no
        data is no number. A constant activation (epoch range 0) gives nan instead of torch.ao's ValueError."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        if self.num_batches_tracked == 0 or not bool(torch.isfinite(self.extremes).all()):
            raise ValueError("No data has been run through observer or infinity value present")
        return torch.tensor(self.batch_to_epoch_ratio())

    def reset_batch_and_epoch_values(self) -> None:
        """Forget every statistic (for a new epoch), keeping the device, as torch.ao's observer does."""
        deferred.run_pending(self)  # a batch queued before the reset belongs to the epoch it ends
        device = self.extremes.device
        self.__dict__["num_batches_tracked"] = 0
        for name, value in (("extremes", torch.full((2,), float("-inf"), device=device)),
                            ("extreme_sums", torch.zeros(2, dtype=torch.float64, device=device))):
            setattr(self, name, value)
        for name in ("min_val", "max_val", "ratio_sums", "ratio_counts", "constant_channels"):
            setattr(self, name, torch.empty(0, device=device))
        self._sample_key, self._sample_index = None, None
        self._drop_native_plan()

    def is_constant(self) -> bool:
        """True when every value seen was the same."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        return self.num_batches_tracked > 0 and float(self.extremes.sum()) == 0

    def average_ratios(self, percentile: float) -> torch.Tensor:
        """Per-channel mean of q100/q_percentile over the batches where the channel was not all zero
        (nan for channels that were always zero)."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        row = self.percentiles.index(percentile)
        return average_ratio_values(self.ratio_sums[row], self.ratio_counts[row])

    def batches_used(self, percentile: float) -> torch.Tensor:
        """Per-channel number of batches that contributed a ratio."""
        deferred.run_pending(self)  # a batch queued in this model call counts
        return self.ratio_counts[self.percentiles.index(percentile)]

    def extra_repr(self) -> str:
        fewest = f", min_ratio_values={self.min_ratio_values}" if self.min_ratio_values else ""
        return f"ch_axis={self.ch_axis}, percentiles={self.percentiles}, per_channel={self.per_channel}{fewest}"


def fresh_ranges(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The starting range state (extremes, extreme_sums) of `count` report observers, made in four ops for all of
    them instead of two each: each a row of one allocation, its own to update in place."""
    if count <= 0:
        return []
    extremes = torch.full((count, 2), float("-inf")).unbind(0)
    extreme_sums = torch.zeros(count, 2, dtype=torch.float64).unbind(0)
    return list(zip(extremes, extreme_sums))


def batch_to_epoch_ratios(observers: list[ReportObserver]) -> list[float]:
    """Each observer's batch_to_epoch_ratio, read to the host in two copies per device for all of them instead of
    two each (each read of a GPU tensor waits for the device)."""
    for observer in observers:
        deferred.run_pending(observer)  # a batch queued in this model call counts
    ratios = [float("nan")] * len(observers)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for index, observer in enumerate(observers):
        if observer.num_batches_tracked:
            key = (observer.extremes.device, observer.extremes.dtype, observer.extreme_sums.dtype)
            groups.setdefault(key, []).append(index)
    for members in groups.values():
        epoch_ranges = torch.stack([observers[i].extremes for i in members]).sum(1).tolist()
        range_sums = torch.stack([observers[i].extreme_sums for i in members]).sum(1).tolist()
        for index, epoch_range, range_sum in zip(members, epoch_ranges, range_sums):
            if epoch_range != 0 and epoch_range == epoch_range:
                ratios[index] = range_sum / observers[index].num_batches_tracked / epoch_range
    return ratios


def average_ratio_values(ratio_sums: torch.Tensor, ratio_counts: torch.Tensor) -> torch.Tensor:
    """Per channel, the sum of a percentile's ratios over the batches that gave one, divided by their count, in
    float64 (nan where none did): ReportObserver.average_ratios of one observer's row, or of several laid end to
    end."""
    counts = ratio_counts.double()
    nan = torch.full_like(counts, float("nan"))
    return torch.where(counts > 0, ratio_sums / counts.clamp(min=1), nan)


def _batch_ratios(quantiles: torch.Tensor, high_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q100 / q_p, whether it counts) of a batch's per-channel percentiles and maximum (float32 high_c)."""
    if quantiles.dtype != torch.float32:
        quantiles = quantiles.float()
    quantiles = quantiles + 0.0  # -0.0 -> +0.0: which of two equal zeros a selection returns is arbitrary
    return torch.nan_to_num(high_c / quantiles), torch.logical_or(quantiles, high_c)  # 0/0 -> 0: zero channels add 0


def _update_reports(entries: list[tuple[ReportObserver, torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
    """The queued batches of several report observers in one chain of ops per kind: each observer's state gets
    exactly what its own update gives (the same elementwise steps over their statistics laid end to end)."""
    groups: dict[tuple[torch.device, tuple[float, ...] | None], list] = {}
    for observer, low, high, quantiles in entries:
        key = (low.device, observer.percentiles if observer.per_channel else None)
        groups.setdefault(key, []).append((observer, low, high, quantiles))
    entries.clear()
    for (device, percentiles), group in groups.items():
        observers = [observer for observer, _, _, _ in group]
        lows = torch.stack([low for _, low, _, _ in group]) if percentiles is None else torch.cat(
            [low for _, low, _, _ in group])
        highs = torch.stack([high for _, _, high, _ in group]) if percentiles is None else torch.cat(
            [high for _, _, high, _ in group])
        if lows.dtype != torch.float32:
            lows, highs = lows.float(), highs.float()
        if percentiles is None:
            _update_extremes(observers, torch.stack([-lows, highs], dim=1))
            continue
        sizes = tuple(observer.min_val.numel() for observer in observers)
        lengths = deferred.segment_lengths(device, sizes)
        # unsafe: the lengths are the observers' own, and checking them reads them back (a host sync on a GPU)
        _update_extremes(observers, torch.stack([-torch.segment_reduce(lows, "min", lengths=lengths, unsafe=True),
                                                 torch.segment_reduce(highs, "max", lengths=lengths, unsafe=True)],
                                                dim=1))
        targets = [[observer.min_val for observer in observers], [observer.max_val for observer in observers],
                   [observer.constant_channels for observer in observers]]
        results = [torch.minimum(torch.cat(targets[0]), lows), torch.maximum(torch.cat(targets[1]), highs),
                   torch.cat(targets[2]).add_(highs == lows)]
        if percentiles:
            ratios, counts = _batch_ratios(torch.cat([quantiles for _, _, _, quantiles in group], dim=-1), highs)
            targets += [[observer.ratio_sums for observer in observers],
                        [observer.ratio_counts for observer in observers]]
            results += [torch.cat(targets[3], dim=1).add_(ratios), torch.cat(targets[4], dim=1).add_(counts)]
        torch._foreach_copy_([target for kind in targets for target in kind],
                             [piece for result in results for piece in result.split(sizes, dim=-1)])


def _update_extremes(observers: list[ReportObserver], extremes: torch.Tensor) -> None:
    """Each observer's range update by its row of extremes ([observers, 2]: -min and max, float32)."""
    current = torch.maximum(torch.stack([observer.extremes for observer in observers]), extremes)
    sums = torch.stack([observer.extreme_sums for observer in observers]).add_(extremes)
    torch._foreach_copy_([*(observer.extremes for observer in observers),
                          *(observer.extreme_sums for observer in observers)], [*current.unbind(0), *sums.unbind(0)])
    for observer in observers:
        observer.__dict__["num_batches_tracked"] += 1  # a plain counter: skip nn.Module.__setattr__


@functools.lru_cache(maxsize=256)
def sorted_sample(count: int, size: int, seed: int) -> torch.Tensor:
    """The ascending positions of a seeded random sample of `size` out of range(count) (all when count <= size),
    shared by every observer that asks for the same: never modify it."""
    if count <= size:
        return torch.arange(count)
    chosen = torch.zeros(count, dtype=torch.bool)
    chosen[torch.randperm(count, generator=torch.Generator().manual_seed(seed + count))[:size]] = True
    return chosen.nonzero().reshape(-1)  # the sorted sample, without a sort


# the index of a shape, shared by the observers that sample it while any of them holds it: an LLM's every
# layer input has one shape, and an index per observer is as large as the sample
_SHARED_INDICES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _channel_sample_index(shape: tuple[int, ...], axis: int, size: int, seed: int, device: torch.device
                          ) -> torch.Tensor:
    """[channels, m] flat (row-major) indices of the positions sampled in every channel of an activation of `shape`
    on `device`, shared by every observer that asks for the same: never modify it."""
    key = (shape, axis, size, seed, device)
    index = _SHARED_INDICES.get(key)
    if index is None:
        channel = torch.arange(shape[axis]) * math.prod(shape[axis + 1:])
        index = (channel[:, None] + channel_sample_offsets(shape, axis, size, seed)[None, :]).to(device)
        _SHARED_INDICES[key] = index
    return index


@functools.lru_cache(maxsize=256)
def channel_sample_offsets(shape: tuple[int, ...], axis: int, size: int, seed: int) -> torch.Tensor:
    """Channel 0's flat offsets of the positions sampled in every channel of an activation of `shape` (channel
    c's are these plus c times the channel stride), shared like sorted_sample."""
    others = [d for d in range(len(shape)) if d != axis]
    positions = sorted_sample(math.prod(shape[d] for d in others), size, seed)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    offsets = torch.zeros_like(positions)
    for d in reversed(others):  # decode the flat position over the non-channel dims
        offsets += (positions % shape[d]) * strides[d]
        positions = positions // shape[d]
    return offsets


def _column_quantiles(sample: torch.Tensor, percentiles: tuple[float, ...], dim: int) -> torch.Tensor:
    """[len(percentiles), channels] (one percentile: [channels]): torch.quantile(..., interpolation="lower") of each
    channel's sample.

    High percentiles are read from a top-k (cheaper than a selection over every value); others use kthvalue.
    """
    count = sample.shape[dim]
    ranks = [int(p * (count - 1)) + 1 for p in percentiles]  # 1-based, ascending
    largest = max(count - r + 1 for r in ranks)
    if largest * 4 <= count:
        top = torch.topk(sample, largest, dim=dim, sorted=True).values  # descending
        picks = [top.select(dim, count - r) for r in ranks]  # views into the descending top-k
    else:
        picks = [torch.kthvalue(sample, r, dim=dim).values for r in ranks]
    return picks[0] if len(picks) == 1 else torch.stack(picks)  # one percentile: its row alone, one view fewer


class ExpertsReportObservers(nn.Module):
    """The report observers of the experts of a grouped projection (one per expert, each a detector's observer of
    that expert's Linear), called with the rows by expert and their counts: each observes its expert's run alone,
    as on the per-expert graph. It reads the counts to the host once a batch, as the grouped projection does."""

    def __init__(self, observers: dict[int, nn.Module], experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.by_expert = nn.ModuleDict({str(expert): observer for expert, observer in observers.items()})

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Give each expert's observer its run of `x`'s rows (`counts` rows each); returns x."""
        observe_runs({int(expert): observer for expert, observer in self.by_expert.items()}, x, counts)
        return x
