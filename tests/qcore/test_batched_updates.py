"""Observers and comparators updated together at the end of a model call (qcore.runtime.deferred) hold exactly what
their own update, batch by batch, gives: on the torch path (native kernels off, as on a GPU), for any order of
calls, owners called several times per call, a queue that fills up, and values changed in place after they were
observed."""
import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qcore.graph.inputs import call_model
from qcore.numeric.loggers import StreamingComparator
from qcore.observe.observers import HistogramObserver, MinMaxObserver
from qcore.report.observer import ReportObserver
from qcore.runtime import deferred, native
from tests.helpers import count_aten_ops

CALLS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.floats(0.1, 50.0), st.booleans()),
                 min_size=1, max_size=12)


def _torch_path(pending: int = deferred.PENDING_ELEMENTS):
    """qcore's native kernels off (the path a GPU takes), and a queue of `pending` elements there."""
    patches = (mock.patch.dict(native._state, {"library": None}),
               mock.patch.object(deferred, "PENDING_ELEMENTS", pending // deferred.LAUNCH_BOUND_SCALE))
    stack = contextlib.ExitStack()
    for patch in patches:
        stack.enter_context(patch)
    return stack


def _values(size: int, spread: float, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)) * spread


def _histograms(calls, batched: bool) -> list[HistogramObserver]:
    observers = [HistogramObserver(bins=64) for _ in range(4)]
    for seed, (owner, size, spread, changed_after) in enumerate(calls):
        x = _values(size, spread, seed)
        if batched:
            with deferred.batched_updates():
                observers[owner](x)
                if changed_after:
                    x.mul_(3.0)  # an in-place op after the observer: the queued copy keeps what was observed
        else:
            observers[owner](x)
    return observers


@settings(max_examples=30, deadline=None)
@given(CALLS, st.sampled_from([1 << 21, 400]))
def test_histograms_updated_together_equal_their_own_updates(calls, pending):
    with _torch_path(pending):  # 400: the queue runs early, mid-call
        _check_histograms(calls)


def _check_histograms(calls) -> None:
    alone = _histograms(calls, batched=False)
    # every call in one scope: owners called several times run in rounds, in order
    together = [HistogramObserver(bins=64) for _ in range(4)]
    with deferred.batched_updates():
        for seed, (owner, size, spread, _) in enumerate(calls):
            together[owner](_values(size, spread, seed))
    for mine, theirs in zip(together, alone):
        assert torch.equal(mine.histogram, theirs.histogram)
        assert torch.equal(mine.min_val, theirs.min_val) and torch.equal(mine.max_val, theirs.max_val)
    for mine, theirs in zip(_histograms(calls, batched=True), alone):
        assert torch.equal(mine.histogram, theirs.histogram)


@settings(max_examples=30, deadline=None)
@given(CALLS)
def test_comparators_updated_together_equal_their_own_updates(calls):
    with _torch_path():
        _check_comparators(calls)


def _check_comparators(calls) -> None:
    alone, together = [StreamingComparator() for _ in range(4)], [StreamingComparator() for _ in range(4)]
    with deferred.batched_updates():
        for seed, (owner, size, spread, changed_after) in enumerate(calls):
            reference = _values(size, spread, seed)
            actual = reference + _values(size, spread / 10, seed + 1000)
            alone[owner](actual.clone(), reference.clone())
            together[owner](actual, reference)
            if changed_after:
                actual.zero_()
    for mine, theirs in zip(together, alone):
        assert mine.batches == theirs.batches
        torch.testing.assert_close(mine.sums, theirs.sums, rtol=1e-12, atol=0)


@settings(max_examples=20, deadline=None)
@given(CALLS)
def test_comparators_that_hold_their_values_equal_those_that_copy_them(calls):
    """A value that stays as it is until the call returns is queued as it is: the same sums as a copy's."""
    copying = [StreamingComparator() for _ in range(4)]
    holding = [StreamingComparator(actual_held=True, reference_held=True) for _ in range(4)]
    with _torch_path(), deferred.batched_updates():
        for seed, (owner, size, spread, _) in enumerate(calls):
            reference = _values(size, spread, seed).reshape(-1, 1) if size % 2 else _values(size, spread, seed)
            actual = reference + 0.1
            copying[owner](actual, reference)
            holding[owner](actual, reference)
    for mine, theirs in zip(holding, copying):
        assert mine.batches == theirs.batches
        assert torch.equal(mine.sums, theirs.sums)


@settings(max_examples=30, deadline=None)
@given(CALLS, st.lists(st.sampled_from([torch.float32, torch.bfloat16, "nan"]), min_size=12, max_size=12))
def test_minmax_ranges_updated_together_equal_their_own_updates(calls, kinds):
    def batch(seed, size, spread, kind):
        x = _values(size, spread, seed)
        return x.index_fill(0, torch.tensor([0]), float("nan")) if kind == "nan" else x.to(kind)

    alone, together = [MinMaxObserver() for _ in range(4)], [MinMaxObserver() for _ in range(4)]
    with _torch_path():
        for seed, ((owner, size, spread, _), kind) in enumerate(zip(calls, kinds)):
            alone[owner](batch(seed, size, spread, kind))
        with deferred.batched_updates():  # owners called several times run in rounds, in order
            for seed, ((owner, size, spread, changed_after), kind) in enumerate(zip(calls, kinds)):
                x = batch(seed, size, spread, kind)
                together[owner](x)
                if changed_after:
                    x.mul_(3.0)
            assert any(deferred._open_here.queues[-1].rounds.values())  # they were queued
    for mine, theirs in zip(together, alone):
        assert torch.equal(mine.min_val, theirs.min_val) or (mine.min_val.isnan() and theirs.min_val.isnan())
        assert torch.equal(mine.max_val, theirs.max_val) or (mine.max_val.isnan() and theirs.max_val.isnan())


def _report_observers() -> list[ReportObserver]:
    """Per tensor; channel-major with a percentile; channels last with two, sampled; per channel, no percentile."""
    return [ReportObserver(per_channel=False), ReportObserver(ch_axis=1, percentiles=(0.99,)),
            ReportObserver(ch_axis=-1, percentiles=(0.5, 0.99), sample_size=64), ReportObserver(ch_axis=1)]


def _report_batch(owner: int, size: int, spread: float, seed: int, kind) -> torch.Tensor:
    rows = 1 + size // 40
    shape = [(rows, 7), (rows, 8, 5), (2, rows, 6), (rows, 5)][owner]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * spread
    if kind == "zeros":  # channels that are all zero, and zeros of both signs
        x[:, :2] = 0.0
        x[0, 2:] = -0.0
    if kind == "nan":
        x.view(-1)[0] = float("nan")
    return x.to(kind) if isinstance(kind, torch.dtype) else x


@settings(max_examples=30, deadline=None)
@given(CALLS, st.lists(st.sampled_from([torch.float32, torch.bfloat16, "nan", "zeros"]), min_size=12,
                       max_size=12))
def test_report_observers_updated_together_equal_their_own_updates(calls, kinds):
    alone, together = _report_observers(), _report_observers()
    with _torch_path():
        for seed, ((owner, size, spread, _), kind) in enumerate(zip(calls, kinds)):
            alone[owner](_report_batch(owner, size, spread, seed, kind))
        with deferred.batched_updates():  # owners called several times run in rounds, in order
            for seed, ((owner, size, spread, changed_after), kind) in enumerate(zip(calls, kinds)):
                x = _report_batch(owner, size, spread, seed, kind)
                together[owner](x)
                if changed_after:
                    x.mul_(3.0)
            assert any(deferred._open_here.queues[-1].rounds.values())  # they were queued
    for mine, theirs in zip(together, alone):
        assert mine.num_batches_tracked == theirs.num_batches_tracked
        for (name, value), (_, expected) in zip(mine.named_buffers(), theirs.named_buffers()):
            assert value.dtype == expected.dtype and value.shape == expected.shape, name
            torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=name)


def test_report_observers_of_a_model_call_update_in_a_few_chains(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    observers = [ReportObserver(ch_axis=1, percentiles=(0.99,)) for _ in range(12)]
    x = _values(64, 1.0, 0).reshape(4, 16)

    def call() -> None:
        with deferred.batched_updates():
            for observer in observers:
                observer(x)

    with torch.no_grad():
        call()  # the first batch sizes the per-channel state
        together, _ = count_aten_ops(call)
        monkeypatch.setattr(deferred, "PENDING_ELEMENTS", -1)
        alone, _ = count_aten_ops(call)
    assert together < alone / 2, (together, alone)


def test_state_read_inside_a_scope_includes_the_queued_batches(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    observer, comparator = HistogramObserver(bins=32), StreamingComparator()
    x = _values(100, 2.0, 0)
    with deferred.batched_updates():
        observer(x)
        comparator(x + 0.01, x)
        scale, _ = observer.calculate_qparams()
        assert comparator.result()["batches"] == 1 and comparator.result()["sqnr_db"] > 0
    assert scale > 0 and float(observer.max_val) == float(x.max())


def test_a_report_observers_statistics_read_inside_a_scope_include_the_queued_batches(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    observer, x = ReportObserver(ch_axis=1, percentiles=(0.9,)), _values(64, 2.0, 0).reshape(8, 8)
    with deferred.batched_updates():
        observer(x)
        assert float(observer.epoch_activation_max) == float(x.max())
        assert int(observer.batches_used(0.9).min()) == 1 and observer.num_batches_tracked == 1


def test_a_failed_model_call_drops_what_it_queued(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    observer = HistogramObserver(bins=32)

    class Fails(nn.Module):
        def forward(self, x):
            observer(x)
            raise ValueError("the batch failed")

    try:
        call_model(Fails(), _values(10, 1.0, 0))
    except ValueError:
        pass
    assert not observer.has_observed and observer.histogram.sum() == 0


class _Observed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(12))
        self.observers = nn.ModuleList(HistogramObserver(bins=64) for _ in range(12))

    def forward(self, x):
        for layer, observer in zip(self.layers, self.observers):
            x = observer(layer(x))
        return x


def test_a_model_call_runs_its_observers_in_one_chain_of_ops(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    model, x = _Observed(), _values(64, 1.0, 0).reshape(4, 16)
    with torch.no_grad():
        together, _ = count_aten_ops(lambda: call_model(model, x))
        monkeypatch.setattr(deferred, "PENDING_ELEMENTS", 0)
        alone, _ = count_aten_ops(lambda: call_model(model, x))
    # 12 observers: a copy each and one shared chain, against a chain each
    assert together < alone / 3, (together, alone)


def test_ranges_of_observers_called_several_times_in_a_call_update_in_one_chain(monkeypatch):
    """A min/max observer shared along views (called three times a model call here) takes all of its batches in the
    call's one range update, not a round each: the same ranges."""
    from tests.helpers import count_op_calls

    monkeypatch.setitem(native._state, "library", None)
    xs = [_values(24, 1.0 + seed, seed) for seed in range(9)]
    alone, together = [MinMaxObserver() for _ in range(3)], [MinMaxObserver() for _ in range(3)]
    for index, x in enumerate(xs):
        alone[index % 3](x)

    def call() -> None:
        with deferred.batched_updates():
            for index, x in enumerate(xs):
                together[index % 3](x.view(4, 6) if index >= 3 else x)

    chains, _ = count_op_calls(call, torch.ops.aten.minimum)
    assert chains == 1
    for mine, theirs in zip(together, alone):
        assert torch.equal(mine.min_val, theirs.min_val) and torch.equal(mine.max_val, theirs.max_val)


def test_a_minmax_observer_given_a_whole_view_of_what_it_saw_in_the_call_does_not_observe_it_again(monkeypatch):
    """The same values again (a view of all of the tensor it saw, written to by no op since) leave a range as it is:
    no reduction for them. A part of it, a written tensor, equal values in another tensor, or another call are
    observed; the ranges are those of an observer given every value."""
    from tests.helpers import count_op_calls

    monkeypatch.setitem(native._state, "library", None)
    x, other = _values(24, 1.0, 0).reshape(4, 6), _values(24, 2.0, 1).reshape(4, 6)
    original = x.clone()
    together, alone = MinMaxObserver(), MinMaxObserver()

    def call() -> None:
        with deferred.batched_updates():
            together(x)
            together(x.view(6, 4))
            together(x.t())  # the same values: not observed again
            together(x[:2])  # a part: observed
            together(x.clone())  # equal values in a tensor of their own: observed
            x.mul_(-3.0)
            together(x.view(-1))  # written to since: observed
            together(other)

    reductions, _ = count_op_calls(call, torch.ops.aten.aminmax)
    assert reductions == 5
    for value in (original, original[:2], original, original * -3.0, other):
        alone(value)
    assert torch.equal(together.min_val, alone.min_val) and torch.equal(together.max_val, alone.max_val)
    seen_before, _ = count_op_calls(lambda: together(other.view(-1)), torch.ops.aten.aminmax)
    assert seen_before == 1  # a new call (here none: no scope) observes it


def test_the_next_batch_makes_no_tensor_from_host_values(monkeypatch):
    """On a GPU a tensor made from host values (the queue's segment lengths) is a copy that waits for the device:
    a composition seen once is kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostTensors.made += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    monkeypatch.setitem(native._state, "library", None)
    model, x = _Observed(), _values(64, 1.0, 0).reshape(4, 16)
    with torch.no_grad():
        call_model(model, x)
        with HostTensors():
            call_model(model, x + 1)
    assert HostTensors.made == 0


def test_another_thread_does_not_queue_into_this_threads_model_call(monkeypatch):
    import threading

    monkeypatch.setitem(native._state, "library", None)
    observer = HistogramObserver(bins=32)
    with deferred.batched_updates():  # open here, not in the thread: its update runs at once
        thread = threading.Thread(target=observer, args=(_values(50, 1.0, 0),))
        thread.start()
        thread.join()
        assert float(observer.histogram.sum()) == 50


def test_a_full_kind_runs_early_alone_and_the_small_updates_wait_for_the_end_of_the_call(monkeypatch):
    from qcore.observe.observers import _update_histograms, _update_ranges

    monkeypatch.setitem(native._state, "library", None)
    # histograms hold 2 x PENDING_ELEMENTS values, LAUNCH_BOUND_SCALE times that on the torch path: 200 at most
    monkeypatch.setattr(deferred, "PENDING_ELEMENTS", 100 // deferred.LAUNCH_BOUND_SCALE)
    ranges, histograms = [MinMaxObserver() for _ in range(3)], [HistogramObserver(bins=16) for _ in range(3)]
    with deferred.batched_updates():
        for minmax, histogram in zip(ranges, histograms):
            minmax(_values(10, 1.0, 0))
            histogram(_values(90, 1.0, 1))
        queue = deferred._open_here.queues[-1]
        assert len(queue.rounds[_update_ranges][0]) == 3  # none ran with the histograms
        assert len(queue.rounds[_update_histograms][0]) == 1  # the third ran the first two early
        assert float(histograms[0].histogram.sum()) == 90 and not ranges[0].min_val.isfinite()
    assert all(float(h.histogram.sum()) == 90 for h in histograms) and all(m.min_val.isfinite() for m in ranges)


def test_the_queue_holds_more_where_each_run_is_a_chain_of_launches(monkeypatch):
    """On the torch path (a GPU, or native kernels off) a kind holds LAUNCH_BOUND_SCALE times as many values; a CPU
    bfloat16 model beside the native kernels keeps the host's smaller queue."""
    from qcore.observe.observers import _update_histograms

    if native.kernel() is None:
        pytest.skip(f"needs qcore's native kernels: {native.status()}")
    monkeypatch.setattr(deferred, "PENDING_ELEMENTS", 100)  # histograms hold 200 values, or 200 x LAUNCH_BOUND_SCALE

    def queued(library) -> int:
        monkeypatch.setitem(native._state, "library", library)
        histograms = [HistogramObserver(bins=16) for _ in range(3)]
        with deferred.batched_updates():
            for histogram in histograms:
                histogram(_values(90, 1.0, 1).bfloat16())  # bfloat16: the torch path either way
            queue = deferred._open_here.queues[-1]
            held = len(queue.rounds[_update_histograms][0])
        assert all(float(h.histogram.sum()) == 90 for h in histograms)
        return held

    assert queued(native.kernel()) == 1  # the third ran the first two early
    assert queued(None) == 3


@settings(max_examples=20, deadline=None)
@given(CALLS, st.sampled_from([1 << 21, 400]))
def test_histograms_that_hold_their_values_equal_those_that_copy_them(calls, pending):
    """A float32 value that stays as it is until the call returns is queued as it is, not copied: the same
    histograms, and the value is left as it was (a run of one entry works on a copy of it)."""
    copying = [HistogramObserver(bins=64) for _ in range(4)]
    holding = [HistogramObserver(bins=64) for _ in range(4)]
    for observer in holding:
        observer.input_held = True
    with _torch_path(pending):
        for seed, (owner, size, spread, _) in enumerate(calls):
            x = _values(size, spread, seed).reshape(-1, 1) if size % 2 else _values(size, spread, seed)
            with deferred.batched_updates():
                copying[owner](x)
            with deferred.batched_updates():
                holding[owner](x)
            assert torch.equal(x, _values(size, spread, seed).reshape(x.shape))
    for mine, theirs in zip(holding, copying):
        assert torch.equal(mine.histogram, theirs.histogram)
        assert torch.equal(mine.min_val, theirs.min_val) and torch.equal(mine.max_val, theirs.max_val)


def test_histograms_holding_their_values_make_no_copies(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)
    xs = [_values(256, 1.0, seed) for seed in range(6)]

    def ops(held: bool) -> int:
        observers = [HistogramObserver(bins=64) for _ in xs]
        for observer in observers:
            observer.input_held = held

        def call() -> None:
            with deferred.batched_updates():
                for observer, x in zip(observers, xs):
                    observer(x)

        return count_aten_ops(call)[0]

    ops(held=False)  # the first run makes what the next ones reuse (segment lengths, aranges)
    assert ops(held=True) == ops(held=False) - len(xs)  # one copy per value fewer, the chain the same


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x))


def test_prepare_lets_an_observer_hold_only_values_no_later_op_writes_to():
    """An exported graph's functional values are held; a value that an op writes to in place (aten.relu_, as an FX
    graph may keep) is copied."""
    import qcore
    from qcore.graph.ops import INSERTED_KEY, op_kind
    from qcore.quantization.prepare import prepare

    x = _values(32, 1.0, 0).reshape(4, 8)
    held = {}
    for written in (False, True):
        torch.manual_seed(0)
        gm = qcore.capture(_TwoLinears().eval(), x)
        if written:  # relu_ on the second linear's output (the model's output, observed), as its last op
            second = [node for node in gm.graph.nodes if op_kind(node) == "linear"][-1]
            with gm.graph.inserting_before(next(iter(gm.graph.find_nodes(op="output")))):
                gm.graph.call_function(torch.ops.aten.relu_.default, (second,))
        prepared = prepare(gm, qcore.Int8StaticQuantizer(activation_observer="histogram"))
        observers = [prepared.get_submodule(str(node.target)) for node in prepared.graph.nodes
                     if node.meta.get(INSERTED_KEY) == "observer"]
        held[written] = [o.input_held for o in observers if isinstance(o, HistogramObserver)]
    # the model's input, the first linear's output, the second's (and the relu_ that writes it, which shares its
    # value): only what is written in place is copied
    assert held == {False: [True, True, True], True: [True, True, False, False]}
