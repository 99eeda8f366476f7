"""Observers of every expert of an MoE projection at once, over the routed rows sorted by expert.

Where a projection's experts are one op (`qcore.graph.grouped`), one observer keeps every expert's statistics: its
forward takes the routed rows and the count of each expert's run, and reduces each run as the observer of that
expert's own Linear would reduce the tokens routed to it, in a few ops whatever the expert count (segment reductions,
no loop over experts, no host read), or, for an observer without such a form (a histogram), one observer per expert
called on its run (PerExpertObservers). An expert that a batch routed no token to is left as it was, as an observer
left uncalled is. Ranges are [E] (per tensor) or [E, C] (per channel); `calculate_qparams` gives them per expert,
and one expert's range that no batch reached gets scale 1 and zero point 0, as convert gives a tensor calibration
never reached. `fake_quantize_per_expert` fake-quantizes each expert's run with its expert's qparams.
"""
from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from qcore.graph.grouped import linear_by_expert, rows_of_experts
from qcore.observe.observers import ObserverBase, calculate_qparams_together
from qcore.observe.qparams import (
    KeptRowArguments,
    calculate_qparams,
    fake_quantize_by_run,
    fake_quantize_divided_rows,
    fake_quantize_per_channel,
    fake_quantize_rows,
)
from qcore.runtime import deferred

__all__ = ["ExpertsObserver", "ExpertsQuantizedWhereRead", "PerExpertObservers", "SegmentedMinMaxObserver",
           "SegmentedMovingAverageMinMaxObserver", "SegmentedPerChannelMinMaxObserver", "SegmentedRangeObserver",
           "fake_quantize_divided_experts", "fake_quantize_experts_where_read", "fake_quantize_per_expert",
           "observe_runs", "segmented_observer", "with_float_experts"]


def _run_extremes(x: torch.Tensor, counts: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's least and greatest value over its run of rows ([E], or [E, C] per column with `per_channel`);
    +inf and -inf for an expert whose run is empty (a NaN stays)."""
    rows = x.detach().reshape(x.shape[0], -1)
    if not per_channel:  # each row's extremes first: the reduction by expert then runs over a vector
        rows_low, rows_high = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    else:
        rows_low = rows_high = rows
    # a scatter by each row's expert: a tenth of segment_reduce's time along the rows of a matrix on the CPU, and no
    # host read (the rows' count is known); NaN propagates as amin/amax propagate it
    experts = torch.arange(counts.shape[0], device=rows.device)
    expert_of_row = rows_of_experts(experts, counts.to(rows.device), rows.shape[0])[:, None].expand(
        -1, rows_low.shape[1])
    shape = (counts.shape[0], rows_low.shape[1])
    low = torch.full(shape, math.inf, device=rows.device).scatter_reduce_(0, expert_of_row, rows_low.float(), "amin")
    high = torch.full(shape, -math.inf, device=rows.device).scatter_reduce_(0, expert_of_row, rows_high.float(),
                                                                           "amax")
    return (low, high) if per_channel else (low.squeeze(1), high.squeeze(1))


class ExpertsObserver(ObserverBase):
    """An observer of every expert of a grouped projection at once: its forward takes the rows by expert and the
    experts' counts, observe_constant an [E, ...] weight; its qparams are per expert. `float_experts`: the experts
    convert leaves in float (their statistics are kept all the same)."""

    experts: int
    float_experts: tuple[int, ...] = ()
    dynamic_experts: tuple[int, ...] = ()  # quantized from each batch's own range, not from these statistics

    @property
    @abc.abstractmethod
    def observed(self) -> torch.Tensor:
        """[E] bool: the experts some batch routed a token to."""

    @abc.abstractmethod
    def fake_quantize_weight(self, value: torch.Tensor) -> torch.Tensor:
        """`value` ([E, ...], the weight observed) with each expert's slice fake-quantized with its qparams."""

    def observe_constant_in_parts(self, parts: Iterable[torch.Tensor]) -> None:
        """observe_constant of the [E, ...] weight whose consecutive runs of experts `parts` gives, in order: what
        observing the whole gives, with only one part made at a time where the observer reduces part by part."""
        self.observe_constant(torch.cat(list(parts)))

    def _check_counts(self, x: torch.Tensor, counts: torch.Tensor) -> None:
        if counts.dim() != 1 or counts.shape[0] != self.experts:
            raise ValueError(f"{type(self).__name__} keeps {self.experts} experts; given counts of shape "
                             f"{tuple(counts.shape)} for rows {tuple(x.shape)}")


class SegmentedRangeObserver(ExpertsObserver):
    """A running range per expert; qparams per expert from it. Its forward takes the rows and the experts' counts;
    observe_constant an [E, ...] weight, each expert's slice once."""

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, experts: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if experts < 1:
            raise ValueError(f"a segmented observer needs at least one expert, not {experts}")
        self.experts = experts
        self.register_buffer("min_val", torch.full((experts,), math.inf))
        self.register_buffer("max_val", torch.full((experts,), -math.inf))

    @property
    def observed(self) -> torch.Tensor:
        """[E] bool: the experts some batch routed a token to (a device tensor: read it once, after calibration)."""
        seen = torch.isfinite(self.min_val) | torch.isnan(self.min_val)
        if seen.dim() == 1:
            return seen
        return seen.all(dim=1) if seen.shape[1] else seen.new_zeros(self.experts)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) per expert ([E] or [E, C]), each from its expert's range as the observer of that
        expert's own Linear computes them; scale 1 and zero point 0 for an expert no batch reached."""
        scale, zero_point = calculate_qparams(self.min_val, self.max_val, self.quant_min, self.quant_max,
                                              self.symmetric, self.eps)
        reached = self.observed.reshape((-1,) + (1,) * (scale.dim() - 1))
        return (torch.where(reached, scale, torch.ones_like(scale)),
                torch.where(reached, zero_point, torch.zeros_like(zero_point)))

    def observe_constant(self, value: torch.Tensor) -> None:
        """Observe every expert's slice of `value` ([E, ...], a weight) once: its least and greatest value."""
        if value.dim() < 2 or value.shape[0] != self.experts:
            raise ValueError(f"{type(self).__name__} keeps {self.experts} experts; given a weight of shape "
                             f"{tuple(value.shape)}, not [experts, ...]")
        self.observe_constant_in_parts([value])

    def _set_constant_range(self, low: torch.Tensor, high: torch.Tensor) -> None:
        """A weight's extremes per expert (one row each), taken once: ValueError unless every expert's came."""
        if low.shape[0] != self.experts:
            raise ValueError(f"{type(self).__name__} keeps {self.experts} experts; the parts of a weight gave "
                             f"{low.shape[0]}")
        self.min_val, self.max_val = low, high
        self.frozen = True

    def observe_constant_in_parts(self, parts: Iterable[torch.Tensor]) -> None:
        """observe_constant of the weight `parts` gives run by run of experts, each part's extremes taken alone."""
        if self.frozen:
            return
        lows, highs = [], []
        for part in parts:
            flat = part.detach().reshape(part.shape[0], -1)
            lows.append(flat.amin(dim=1).float())
            highs.append(flat.amax(dim=1).float())
        self._set_constant_range(torch.cat(lows), torch.cat(highs))

    def fake_quantize_weight(self, value: torch.Tensor) -> torch.Tensor:
        """`value` ([E, ...], the weight observed) with each expert's slice fake-quantized with its qparams."""
        scale, zero_point = self.calculate_qparams()
        return fake_quantize_per_channel(value, scale, zero_point, 0, self.quant_min, self.quant_max)

    def extra_repr(self) -> str:
        return f"experts={self.experts}, {super().extra_repr()}"


class SegmentedMinMaxObserver(SegmentedRangeObserver):
    """Each expert's running minimum and maximum of every value routed to it (MinMaxObserver per expert)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Observe `x`'s rows, each expert's run of `counts` rows for that expert; returns x."""
        self._check_counts(x, counts)
        if self.frozen or x.numel() == 0:
            return x
        low, high = _run_extremes(x, counts, per_channel=False)
        torch.minimum(self.min_val, low, out=self.min_val)
        torch.maximum(self.max_val, high, out=self.max_val)
        return x


class SegmentedMovingAverageMinMaxObserver(SegmentedRangeObserver):
    """Each expert's exponential moving average of the minimum and maximum of its run in each batch that routed a
    token to it (MovingAverageMinMaxObserver per expert: its first batch sets the range)."""

    def __init__(self, experts: int, averaging_constant: float = 0.01, **kwargs) -> None:
        super().__init__(experts, **kwargs)
        self.averaging_constant = averaging_constant

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Observe `x`'s rows, each expert's run of `counts` rows for that expert; returns x."""
        self._check_counts(x, counts)
        if self.frozen or x.numel() == 0:
            return x
        low, high = _run_extremes(x, counts, per_channel=False)
        reached = counts.to(self.min_val.device) > 0
        first = (self.min_val == math.inf) & (self.max_val == -math.inf)  # no batch yet: torch.ao's test
        c = self.averaging_constant
        averaged_low = self.min_val + c * (low - self.min_val)
        averaged_high = self.max_val + c * (high - self.max_val)
        self.min_val = torch.where(reached, torch.where(first, low, averaged_low), self.min_val)
        self.max_val = torch.where(reached, torch.where(first, high, averaged_high), self.max_val)
        return x


class SegmentedPerChannelMinMaxObserver(SegmentedRangeObserver):
    """Each expert's running minimum and maximum per channel ([E, C]): of the routed rows' columns (`ch_axis` 1,
    an activation's channels), or, observed once with observe_constant, of an [E, out, in] weight's rows per
    expert (`ch_axis` 0, the output channels of each expert's [out, in] weight) or columns (`ch_axis` 1)."""

    def __init__(self, experts: int, ch_axis: int = 1, qscheme: torch.qscheme = torch.per_channel_symmetric,
                 **kwargs) -> None:
        if ch_axis not in (0, 1):
            raise ValueError(f"ch_axis {ch_axis}: an expert's rows or weight have channels along 0 or 1")
        super().__init__(experts, ch_axis=ch_axis, qscheme=qscheme, **kwargs)
        # no channels before the first batch or weight, which sets them
        self.min_val = torch.full((experts, 0), math.inf)
        self.max_val = torch.full((experts, 0), -math.inf)

    def _grow(self, channels: int) -> None:
        if self.min_val.shape[1] == 0:
            self.min_val = torch.full((self.experts, channels), math.inf, device=self.min_val.device)
            self.max_val = torch.full((self.experts, channels), -math.inf, device=self.max_val.device)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Observe the columns of `x`'s rows, each expert's run of `counts` rows for that expert; returns x."""
        self._check_counts(x, counts)
        if self.frozen or x.numel() == 0:  # a weight observed once: its calls leave it
            return x
        if self.ch_axis != 1:
            raise ValueError("routed rows have their channels along axis 1: observe a weight with observe_constant")
        low, high = _run_extremes(x, counts, per_channel=True)
        self._grow(low.shape[1])
        torch.minimum(self.min_val, low, out=self.min_val)
        torch.maximum(self.max_val, high, out=self.max_val)
        return x

    def observe_constant(self, value: torch.Tensor) -> None:
        """Observe every expert's weight of `value` ([E, out, in]) once, per channel along ch_axis of each."""
        if value.dim() != 3 or value.shape[0] != self.experts:
            raise ValueError(f"{type(self).__name__} keeps {self.experts} experts; given a weight of shape "
                             f"{tuple(value.shape)}, not [experts, out, in]")
        self.observe_constant_in_parts([value])

    def observe_constant_in_parts(self, parts: Iterable[torch.Tensor]) -> None:
        """observe_constant of the [E, out, in] weight `parts` gives run by run of experts, each part alone."""
        if self.frozen:
            return
        reduced = 2 if self.ch_axis == 0 else 1
        lows, highs = [], []
        for part in parts:
            weight = part.detach().float()
            lows.append(weight.amin(dim=reduced))
            highs.append(weight.amax(dim=reduced))
        self._set_constant_range(torch.cat(lows), torch.cat(highs))

    def fake_quantize_weight(self, value: torch.Tensor) -> torch.Tensor:
        """`value` ([E, out, in], the weight observed) with each expert's output channels fake-quantized with their
        qparams: one per-row pass over the [E x out, in] rows, each row as its expert's weight alone gives it."""
        if self.ch_axis != 0:
            raise ValueError("a weight's channels per expert are quantized along its output channels (ch_axis 0)")
        scale, zero_point = self.calculate_qparams()
        rows = value.reshape(-1, value.shape[-1])
        return fake_quantize_per_channel(rows, scale.reshape(-1), zero_point.reshape(-1), 0, self.quant_min,
                                         self.quant_max).reshape(value.shape)


def observe_runs(observers: Mapping[int, Callable[[torch.Tensor], Any]], x: torch.Tensor,
                 counts: torch.Tensor) -> None:
    """Call each expert's observer ({expert: observer}) on its run of `x`'s rows (`counts` rows each, read to the
    host once), none on an empty run: an expert a batch routed no token to is left as an uncalled observer is."""
    runs = x.split(counts.tolist())
    for expert, observer in observers.items():
        if runs[expert].numel():
            observer(runs[expert])


def fake_quantize_per_expert(x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                             quant_min: int, quant_max: int, kept_float: torch.Tensor | None = None,
                             dynamic: torch.Tensor | None = None, symmetric: bool = False) -> torch.Tensor:
    """Each expert's run of `x`'s rows fake-quantized with that expert's per-tensor qparams (`scale` and
    `zero_point` [E]): the values one per-tensor fake quantization per expert gives, in one per-row pass. The rows
    of the experts `kept_float` ([E] bool) marks are x's own; those of the experts `dynamic` marks are quantized with
    qparams from their own run's range in this batch (`symmetric` or affine), as fake_quantize_dynamic quantizes a
    tensor alone."""
    if dynamic is not None:
        low, high = _run_extremes(x, counts, per_channel=False)
        own_scale, own_zero_point = calculate_qparams(low, high, quant_min, quant_max, symmetric)
        dynamic = dynamic.to(x.device)
        scale = torch.where(dynamic, own_scale, scale.to(x.device, own_scale.dtype))
        zero_point = torch.where(dynamic, own_zero_point, zero_point.to(x.device, own_zero_point.dtype))
    rows = x.shape[0]
    quantized = fake_quantize_by_run(x, counts, scale, zero_point, quant_min, quant_max)
    if quantized is None:  # one per-row pass with each expert's qparams repeated over its rows: the same values
        row_scale = rows_of_experts(scale.to(x.device), counts, rows)
        row_zero_point = rows_of_experts(zero_point.to(x.device), counts, rows)
        quantized = fake_quantize_per_channel(x, row_scale, row_zero_point, 0, quant_min, quant_max)
    if kept_float is None:
        return quantized
    row_float = rows_of_experts(kept_float.to(x.device), counts, rows).reshape((-1,) + (1,) * (x.dim() - 1))
    return torch.where(row_float, x, quantized)


def with_float_experts(quantized: torch.Tensor, weight: torch.Tensor, float_experts: Sequence[int]) -> torch.Tensor:
    """`quantized` ([E, ...], a weight's quantized copy) with the slices of `float_experts` the float `weight`'s."""
    if float_experts:
        kept = torch.tensor(list(float_experts), device=weight.device)
        quantized = quantized.index_copy(0, kept, weight.index_select(0, kept).to(quantized.dtype))
    return quantized


def fake_quantize_experts_where_read(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                                     quant_min: int, quant_max: int, kept_float: Sequence[int] = ()) -> torch.Tensor:
    """A grouped projection's [E, out, in] weight fake-quantized where it is read, with each expert's qparams
    (`scale` and `zero_point` [E] per tensor, or [E, out] per output channel of each expert's weight): the values its
    observer's fake_quantize_weight gives. The slices of the experts `kept_float` lists are the float weight's. A
    grouped_linear that reads it quantizes each expert's weight just before that expert's matmul
    (ExpertsQuantizedWhereRead); any other read quantizes the whole weight once."""
    return ExpertsQuantizedWhereRead(weight, None, scale, zero_point, quant_min, quant_max, kept_float)


def fake_quantize_divided_experts(weight: torch.Tensor, factor: torch.Tensor, scale: torch.Tensor,
                                  zero_point: torch.Tensor, quant_min: int, quant_max: int) -> torch.Tensor:
    """A grouped projection's float [E, out, in] weight with each expert's columns divided by its factor ([E, in]),
    fake-quantized with each expert's qparams: an equalization variant's weight where it is read (no copy held)."""
    return ExpertsQuantizedWhereRead(weight, factor.to(weight.dtype), scale, zero_point, quant_min, quant_max, ())


# the native kernel's arguments of every expert's rows, made once per qparams: a grouped projection's weight quantized
# where read is read every batch of every pass, one expert at a time
_KEPT_EXPERT_ARGUMENTS = KeptRowArguments()


class ExpertsQuantizedWhereRead(torch.Tensor):
    """A grouped projection's weight quantized where it is read, not yet computed: the float [E, out, in] weight
    (divided by each expert's column factor, for an equalization variant), each expert's qparams and the experts
    kept in float. grouped_linear computes each expert's quantized weight right before its matmul, and none for an
    expert no row reached: one expert's weight at a time, in cache, where the whole projection's would pass through
    memory twice. Any other op reads the whole weight quantized, computed once."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, factor: torch.Tensor | None, scale: torch.Tensor, zero_point: torch.Tensor,
                quant_min: int, quant_max: int, kept_float: Sequence[int]) -> ExpertsQuantizedWhereRead:
        return torch.Tensor._make_wrapper_subclass(cls, weight.shape, dtype=weight.dtype,
                                                   device=weight.device)

    def __init__(self, weight: torch.Tensor, factor: torch.Tensor | None, scale: torch.Tensor,
                 zero_point: torch.Tensor, quant_min: int, quant_max: int, kept_float: Sequence[int]) -> None:
        super().__init__()
        self.weight, self.factor, self.scale, self.zero_point = weight.detach(), factor, scale, zero_point
        self.quant_min, self.quant_max = quant_min, quant_max
        self.kept = frozenset(kept_float)
        self._whole: torch.Tensor | None = None

    def expert(self, index: int) -> torch.Tensor:
        """One expert's [out, in] weight, quantized (the float weight's slice for an expert kept in float)."""
        weight = self.weight[index]
        if index in self.kept:
            return weight
        if self.factor is None:
            arguments = _KEPT_EXPERT_ARGUMENTS.expert_arguments(weight, self.scale, self.zero_point, index,
                                                                self.quant_min, self.quant_max)
            if arguments is not None:
                return fake_quantize_rows(weight, arguments, reuse_output=True)
        scale, zero_point = self.scale[index], self.zero_point[index]
        if scale.dim() == 0:  # per tensor: each of its rows with the expert's qparams
            rows = weight.shape[0]
            scale, zero_point = scale.expand(rows).contiguous(), zero_point.expand(rows).contiguous()
        if self.factor is not None:  # divided and quantized in one pass
            return fake_quantize_divided_rows(weight, self.factor[index], scale, zero_point, self.quant_min,
                                              self.quant_max, reuse_output=True)
        return fake_quantize_per_channel(weight, scale, zero_point, 0, self.quant_min, self.quant_max,
                                         reuse_output=True)

    def whole(self) -> torch.Tensor:
        """The whole [E, out, in] weight quantized (computed at the first read, then kept while this lives)."""
        if self._whole is None:
            whole = torch.empty(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)
            with torch.no_grad():
                for index in range(self.weight.shape[0]):
                    whole[index] = self.expert(index)
            self._whole = whole
        return self._whole

    def __repr__(self) -> str:
        return f"ExpertsQuantizedWhereRead(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.qcore.grouped_linear.default and isinstance(args[2], cls) and \
                not any(isinstance(a, cls) for a in (args[0], args[1], *args[3:])):
            # each expert's weight quantized right before its matmul: grouped_linear's values, bit for bit (an
            # expert's rows meet the weight the whole quantized weight holds for it, laid out alike)
            weight = args[2]
            return linear_by_expert(args[0], args[1], weight.expert, weight.shape[1], *args[3:], **kwargs)
        unwrapped = [a.whole() if isinstance(a, cls) else a for a in args]
        return func(*unwrapped, **{k: v.whole() if isinstance(v, cls) else v for k, v in kwargs.items()})


class PerExpertObservers(ExpertsObserver):
    """One observer per expert, each called with its expert's run of the rows alone: for observers whose statistics
    do not reduce over experts in one op (a histogram's rebinning to each expert's range). It reads the counts to
    the host once a batch, as the grouped projection it observes does."""

    def __init__(self, observers: Sequence[ObserverBase]) -> None:
        first = observers[0]
        super().__init__(dtype=first.dtype, quant_min=first.quant_min, quant_max=first.quant_max,
                         qscheme=first.qscheme, ch_axis=first.ch_axis, is_dynamic=first.is_dynamic, eps=first.eps)
        self.experts = len(observers)
        self.per_expert = nn.ModuleList(observers)

    @property
    def min_val(self) -> torch.Tensor:
        """Each expert's observed minimum ([E]: per-tensor observers; +inf before any row)."""
        return torch.stack([observer.min_val for observer in self.per_expert])

    @property
    def max_val(self) -> torch.Tensor:
        """Each expert's observed maximum ([E]: per-tensor observers; -inf before any row)."""
        return torch.stack([observer.max_val for observer in self.per_expert])

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Observe each expert's run of `x`'s rows (`counts` rows each) with that expert's observer; returns x."""
        self._check_counts(x, counts)
        if self.frozen or x.numel() == 0:
            return x
        observe_runs(dict(enumerate(self.per_expert)), x, counts)
        return x

    @property
    def observed(self) -> torch.Tensor:
        """[E] bool: the experts some batch routed a token to."""
        seen = []
        for observer in self.per_expert:
            deferred.run_pending(observer)
            low = observer.min_val
            seen.append((torch.isfinite(low) | torch.isnan(low)).all() if low.numel() else torch.tensor(False))
        return torch.stack(seen)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero_point) per expert, each its own observer's; scale 1 and zero point 0 for an expert no batch
        reached. The experts' histogram searches run as one batched search."""
        reached = self.observed.tolist()
        calculate_qparams_together([o for o, seen in zip(self.per_expert, reached, strict=True) if seen])
        found = [observer.calculate_qparams() if seen else None
                 for observer, seen in zip(self.per_expert, reached, strict=True)]
        like = next((pair for pair in found if pair is not None), None)
        if like is None:
            return torch.ones(self.experts), torch.zeros(self.experts, dtype=torch.long)
        scales = torch.stack([pair[0] if pair is not None else torch.ones_like(like[0]) for pair in found])
        zero_points = torch.stack([pair[1] if pair is not None else torch.zeros_like(like[1]) for pair in found])
        return scales.reshape(self.experts, -1).squeeze(1), zero_points.reshape(self.experts, -1).squeeze(1)

    def observe_constant(self, value: torch.Tensor) -> None:
        """Observe each expert's slice of `value` ([E, ...], a weight) once, with its own observer."""
        if value.shape[0] != self.experts:
            raise ValueError(f"{type(self).__name__} keeps {self.experts} experts; given a weight of shape "
                             f"{tuple(value.shape)}")
        self.observe_constant_in_parts([value])

    def observe_constant_in_parts(self, parts: Iterable[torch.Tensor]) -> None:
        """observe_constant of the weight `parts` gives run by run of experts, each expert's slice by its observer."""
        if self.frozen:
            return
        experts = (expert for part in parts for expert in part.detach())
        for observer, expert in zip(self.per_expert, experts, strict=True):
            observer.observe_constant(expert)
        self.frozen = True

    def fake_quantize_weight(self, value: torch.Tensor) -> torch.Tensor:
        """`value` ([E, ...]) with each expert's slice fake-quantized with its own observer's qparams."""
        scale, zero_point = self.calculate_qparams()
        if scale.dim() == 2:  # per output channel of each expert's weight: one pass over the [E x out, in] rows
            rows = value.reshape(-1, value.shape[-1])
            return fake_quantize_per_channel(rows, scale.reshape(-1), zero_point.reshape(-1), 0, self.quant_min,
                                             self.quant_max).reshape(value.shape)
        return fake_quantize_per_channel(value, scale, zero_point, 0, self.quant_min, self.quant_max)



_SEGMENTED = {"MinMaxObserver": SegmentedMinMaxObserver,
              "MovingAverageMinMaxObserver": SegmentedMovingAverageMinMaxObserver,
              "PerChannelMinMaxObserver": SegmentedPerChannelMinMaxObserver}


def segmented_observer(observer: Any, experts: int, **kwargs: Any) -> ExpertsObserver:
    """The observer of every expert at once that stands for `observer` (a class, or one made with_args) observing
    each expert alone: its segmented form where it has one (reductions over every expert in a few ops), else one
    of it per expert (PerExpertObservers); for a class per expert (an object with `classes`), one of each."""
    classes = getattr(observer, "classes", None)  # a class per expert (PerExpertObserverClasses)
    if classes is not None:
        if len(classes) != experts:
            raise ValueError(f"{len(classes)} observer classes for {experts} experts")
        return PerExpertObservers([cls(**kwargs) for cls in classes])
    keywords = dict(getattr(observer, "keywords", {}) or {})
    base = getattr(observer, "func", observer)
    segmented = _SEGMENTED.get(getattr(base, "__name__", ""))
    if segmented is None:
        return PerExpertObservers([observer(**kwargs) for _ in range(experts)])
    return segmented(experts, **{**keywords, **kwargs})
