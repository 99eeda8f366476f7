"""A fix trial takes the calibrated state of the activation observers it shares with earlier measurements of the same
float graph (issue: scale, analysis cost): the same numbers as a trial calibrated from scratch, with no
calibration pass when every observer is known, and only the new observers watching the batches otherwise."""
import contextlib
import math

import pytest
import torch

import qcore
import qcore.measure.passes
from qcore.analysis import ModelAnalysis
from qcore.observe.observers import (
    HistogramObserver,
    MinMaxObserver,
    PerChannelMinMaxObserver,
    copied,
    fresh_copy,
    share_qparams,
)
from qcore.quantization.calibrated import CalibratedObservers
from qcore.quantization.quantizer import Int8StaticQuantizer, with_layer_overrides
from tests.helpers import count_op_calls
from tests.models import SmallMLP, batches


@pytest.fixture
def model_and_batches():
    torch.manual_seed(0)
    data = batches((16, 32), n=4)
    return qcore.capture(SmallMLP().eval(), data[0]), data


@pytest.fixture
def calibration_passes(monkeypatch):
    passes = []
    original = qcore.measure.passes.calibrate

    def counted(model, batches, *args, **kwargs):
        passes.append([name for name, module in model.named_modules() if getattr(module, "frozen", None) is False])
        return original(model, batches, *args, **kwargs)

    monkeypatch.setattr(qcore.measure.passes, "calibrate", counted)
    return passes


def _numbers(analysis):
    sqnr = analysis.sqnr
    return ({name: (e.sqnr_db, e.shadow_sqnr_db, e.weight_sqnr_db) for name, e in sqnr.layers.items()},
            {name: o.sqnr_db for name, o in sqnr.outputs.items()})


def _fresh(float_gm, data, quantizer):
    return _numbers(ModelAnalysis(float_gm, quantizer, data))


def test_a_weight_only_trial_is_not_calibrated_and_measures_what_a_calibrated_one_does(model_and_batches,
                                                                                       calibration_passes):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, Int8StaticQuantizer(per_channel=True), data)
    assert base.sqnr is not None
    assert len(calibration_passes) == 1
    per_tensor = with_layer_overrides(base.quantizer, {"fc2": {"per_channel": False}})
    trial = base.variant(per_tensor)
    assert _numbers(trial) == _fresh(float_gm, data, per_tensor)
    assert len(calibration_passes) == 2  # the base, and the fresh analysis: none for the trial
    assert _numbers(trial) != _numbers(base)  # the trial is measured, not copied


def test_the_standalone_quantized_model_takes_the_models_calibration_and_computes_what_a_calibrated_one_does(
        model_and_batches, monkeypatch):
    import qcore.quantization.calibrated as calibrated

    float_gm, data = model_and_batches
    analysis = ModelAnalysis(float_gm, Int8StaticQuantizer(), data)
    assert analysis.sqnr is not None
    passes = []
    monkeypatch.setattr(calibrated, "calibrate", lambda model, batches: passes.append(model))
    quantized = analysis.quantized_gm
    monkeypatch.undo()
    calibrated_alone = ModelAnalysis(float_gm, Int8StaticQuantizer(), data).quantized_gm  # no pass before it
    assert passes == []
    with torch.no_grad():
        assert all(torch.equal(quantized(batch), calibrated_alone(batch)) for batch in data)


def test_an_observer_trial_calibrates_only_its_new_observers_and_its_smaller_retry_none(model_and_batches,
                                                                                      calibration_passes):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, None, data)
    assert base.sqnr is not None
    both = with_layer_overrides(base.quantizer, {"fc2": {"activation_observer": "histogram"},
                                                 "fc3": {"activation_observer": "histogram"}})
    first = base.variant(both)
    assert first.sqnr is not None
    assert len(calibration_passes) == 2
    watching = calibration_passes[1]
    assert watching and len(watching) < len(calibration_passes[0])  # the histograms only
    one = with_layer_overrides(base.quantizer, {"fc3": {"activation_observer": "histogram"}})
    retry = base.variant(one)
    assert retry.sqnr is not None
    assert len(calibration_passes) == 2  # fc3's histograms were calibrated by the first trial
    assert _numbers(first) == _fresh(float_gm, data, both)
    assert _numbers(retry) == _fresh(float_gm, data, one)


def test_an_equalized_trial_quantizes_another_float_graph_and_is_calibrated(model_and_batches, calibration_passes):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, None, data)
    assert base.sqnr is not None
    equalized = base.variant(equalize=True)
    assert equalized.sqnr is not None
    assert len(calibration_passes) == 2  # the base and the equalized graph: its activations are not the base's
    assert calibration_passes[1] == calibration_passes[0]  # every observer watched them


class CountingObserver(MinMaxObserver):
    """A user's own observer class: its state is its own business, so it is always calibrated."""


def test_a_users_own_observer_class_is_always_calibrated(model_and_batches, calibration_passes):
    float_gm, data = model_and_batches
    quantizer = Int8StaticQuantizer(activation_observer=CountingObserver)
    base = ModelAnalysis(float_gm, quantizer, data)
    assert base.sqnr is not None
    trial = base.variant(with_layer_overrides(quantizer, {"fc2": {"per_channel": False}}))
    assert _numbers(trial) == _fresh(float_gm, data, trial.quantizer)
    assert len(calibration_passes) == 3


def test_signatures_tell_apart_what_observers_watch_and_how(model_and_batches):
    float_gm, data = model_and_batches
    from qcore.graph.capture import clone_graph_module
    from qcore.quantization.prepare import prepare

    kept = CalibratedObservers()
    minmax = prepare(clone_graph_module(float_gm, share_parameters=True), Int8StaticQuantizer())
    histogram = prepare(clone_graph_module(float_gm, share_parameters=True),
                        Int8StaticQuantizer(activation_observer="histogram"))
    a, b = kept.signatures(minmax), kept.signatures(histogram)
    assert len(set(a.values())) == len(a) > 0  # one per value watched
    assert not set(a.values()) & set(b.values())  # another observer class is another state
    assert kept.signatures(prepare(clone_graph_module(float_gm, share_parameters=True),
                                   Int8StaticQuantizer())) == a


def test_a_trial_of_some_layers_measures_them_and_the_outputs_as_a_whole_trial_does(model_and_batches):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, None, data)
    fix = with_layer_overrides(base.quantizer, {"fc2": {"activation_observer": "histogram"}})
    focused, whole = base.variant(fix, layers=["fc2"]), base.variant(fix)
    assert focused is not whole and focused is base.variant(fix, layers=("fc2",))  # kept per configuration
    assert list(focused.sqnr.layers) == ["fc2"] and len(whole.sqnr.layers) == 3
    assert focused.sqnr.layers["fc2"] == whole.sqnr.layers["fc2"]
    assert focused.sqnr.outputs == whole.sqnr.outputs


def _linear_calls(function):
    """(the linear layers `function()` runs, what it returned): addmm calls, one per layer and batch."""
    return count_op_calls(function, torch.ops.aten.addmm)


def test_a_trial_compares_with_the_kept_float_outputs_and_runs_the_float_graph_only_as_far_as_it_reads(
        model_and_batches):
    float_gm, data = model_and_batches
    fix = with_layer_overrides(Int8StaticQuantizer(), {"fc1": {"per_channel": True}})  # no observer to calibrate
    fresh = ModelAnalysis(float_gm, None, data).variant(fix, layers=["fc1"])
    linears, expected = _linear_calls(lambda: fresh.sqnr)
    # calibration, quantized graph, and fc1's shadow: the float outputs and fc1's float input and value are the
    # calibration pass's
    assert linears == len(data) * (3 + 3 + 1)
    assert fresh.context.float_outputs is not None  # a trial's pass keeps them for the next one when none are kept
    base = ModelAnalysis(float_gm, None, data)
    assert base.sqnr.outputs == expected.outputs
    assert base.context.float_outputs is not None
    kept = base.context.float_outputs.outputs
    assert kept is not None and len(kept) == len(data)
    assert all(torch.equal(a, float_gm(b)) for a, b in zip(kept, data))

    # fc1's values: the float graph as far as fc1 (its value, and its shadow), the quantized graph whole
    linears, trial = _linear_calls(lambda: base.variant(fix, layers=["fc1"]).sqnr)
    assert linears == len(data) * (1 + 1 + 3)
    assert trial == expected  # the same numbers as a trial that runs the float graph
    # the output alone: the quantized graph only
    linears, alone = _linear_calls(lambda: base.variant(fix, layers=["fc2"], layer_kinds=()).sqnr)
    assert linears == len(data) * 3
    assert alone.outputs == expected.outputs


def test_a_trial_that_calibrates_takes_the_float_outputs_and_its_layers_inputs_from_its_calibration_pass(
        model_and_batches):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, None, data)
    fix = with_layer_overrides(base.quantizer, {"fc2": {"activation_observer": "histogram"}})  # a new observer
    whole = base.variant(fix).sqnr  # every layer: the float graph runs whole
    fresh = ModelAnalysis(float_gm, None, data)  # no float outputs kept
    fresh.context.saw_float_runs_agree()  # as after a first measurement (no runs of batch 0 to tell)
    linears, focused = _linear_calls(lambda: fresh.variant(fix, layers=["fc2"]).sqnr)
    # calibration, quantized graph, and on fc2's kept float input its shadow (its float value is kept too)
    assert linears == len(data) * (3 + 3 + 1)
    assert focused.layers["fc2"] == whole.layers["fc2"] and focused.outputs == whole.outputs  # to the bit


def test_a_trial_measures_the_layer_sqnrs_it_is_asked_for_and_a_later_ask_for_more_measures_them_all(
        model_and_batches):
    float_gm, data = model_and_batches
    base = ModelAnalysis(float_gm, None, data)
    fix = with_layer_overrides(base.quantizer, {"fc2": {"activation_observer": "histogram"}})
    whole = base.variant(fix).sqnr.layers["fc2"]
    own = base.variant(fix, layers=["fc2"], layer_kinds={"own"})
    assert own.sqnr.layers["fc2"].shadow_sqnr_db == whole.shadow_sqnr_db
    assert math.isnan(own.sqnr.layers["fc2"].sqnr_db) and math.isnan(own.sqnr.layers["fc2"].cosine)
    assert base.variant(fix, layers=["fc2"], layer_kinds=["own"]) is own  # kept per configuration and kinds
    both = base.variant(fix, layers=["fc2"], layer_kinds={"propagated"})
    assert both is not own and both.layer_kinds == {"own", "propagated"}
    assert both.sqnr.layers["fc2"] == whole
    assert base.variant(fix, layers=["fc2"], layer_kinds={"own"}) is both
    with pytest.raises(ValueError, match="unknown layer SQNR kind"):
        base.variant(fix, layers=["fc1"], layer_kinds={"weight"})


def test_float_outputs_are_kept_only_within_their_byte_limit():
    from qcore.numeric.compare import KeptFloatOutputs

    kept = KeptFloatOutputs(limit=3 * 4 * 8)
    kept.add(torch.zeros(4, 4))
    kept.add({"logits": torch.zeros(2, 4), "rest": None})
    assert kept.outputs is not None and len(kept.outputs) == 2
    kept.add(torch.zeros(1))  # past the limit: none are kept
    assert kept.outputs is None
    kept.add(torch.zeros(1))
    assert kept.outputs is None


def test_layer_inputs_are_kept_within_their_byte_limit_and_a_value_past_it_on_no_batch():
    from qcore.numeric.compare import KeptLayerInputs

    kept = KeptLayerInputs(limit=128)
    whole = torch.arange(32.0).reshape(2, 16)
    for position in range(2):
        kept.position = position
        kept.add("wide", torch.zeros(4, 4))  # 64 bytes a batch: past the limit on the second
        kept.add("row", whole[position])  # a view: kept as a copy of its 64 bytes, not with its base
    assert list(kept.values) == ["row"] and len(kept.values["row"]) == 2
    assert all(value._base is None for value in kept.values["row"])
    assert torch.equal(torch.stack(kept.values["row"]), whole)
    kept.position = 2
    kept.add("wide", torch.zeros(1))  # refused once: not kept from a later batch on either
    assert "wide" not in kept.values


def test_layers_own_values_take_at_most_half_of_the_limit_and_leave_the_rest_to_inputs():
    from qcore.numeric.compare import KeptLayerInputs

    kept = KeptLayerInputs(limit=128)
    for position in range(2):
        kept.position = position
        kept.add("fc1_output", torch.zeros(2, 4), own=True)  # 32 bytes a batch: both fit the own values' half
        kept.add("fc2_input", torch.ones(2, 4))  # as do the inputs' 32 bytes a batch, in the rest
        kept.add("fc2_output", torch.zeros(16), own=True)  # past the own values' half on the first batch
    assert sorted(kept.values) == ["fc1_output", "fc2_input"]
    assert kept.held == 128
    assert all(len(values) == 2 for values in kept.values.values())
    result = torch.zeros(6, 4).view(2, 3, 4)  # a whole view (a linear's 3-d result): kept as it is, no copy
    fresh = KeptLayerInputs()
    fresh.add("fc3_output", result, own=True)
    assert fresh.values["fc3_output"][0] is result


def test_keepers_sharing_a_budget_hold_at_most_it_together_and_a_dropped_keeper_frees_its_room():
    import gc

    from qcore.numeric.compare import KeptBudget, KeptFloatOutputs, KeptLayerInputs

    budget = KeptBudget(limit=96)
    outputs = KeptFloatOutputs(budget=budget)
    outputs.add(torch.zeros(2, 4))  # 32 bytes
    trial = KeptLayerInputs(limit=96, budget=budget)
    trial.add("fc2_input", torch.zeros(4, 4))  # 64 bytes: the budget is full
    trial.add("fc3_input", torch.zeros(1))  # past the budget, though within the keeper's own limit
    assert list(trial.values) == ["fc2_input"] and outputs.held + trial.held == 96
    outputs.add(torch.zeros(1))  # the outputs may not grow past it either: none of them are kept
    assert outputs.outputs is None and outputs.held == 0
    del trial
    gc.collect()
    later = KeptLayerInputs(limit=96, budget=budget)
    later.add("fc2_input", torch.zeros(24))  # 96 bytes: the room the others left
    assert later.held == 96


def test_layer_inputs_leave_half_of_their_budget_to_the_float_outputs_kept_after_them():
    from qcore.numeric.compare import KeptBudget, KeptFloatOutputs, KeptLayerInputs

    budget = KeptBudget(limit=128)
    outputs, inputs = KeptFloatOutputs(budget=budget), KeptLayerInputs(budget=budget)
    for position in range(2):  # a batch's inputs are kept as the float graph runs, its output once it returns
        inputs.position = position
        inputs.add("fc2_input", torch.zeros(4))  # 16 bytes a batch: both fit half of the budget
        inputs.add("fc3_input", torch.zeros(2, 4))  # 32 bytes a batch: past that half on the second, kept on none
        outputs.add(torch.zeros(2, 4))  # 32 bytes a batch: the whole budget would have had no room on the second
    assert list(inputs.values) == ["fc2_input"] and inputs.held == 32
    assert outputs.outputs is not None and len(outputs.outputs) == 2 and outputs.held == 64


def _counting_qparams(monkeypatch):
    """Count the histogram searches, alone or batched: a list with an entry per histogram searched."""
    import qcore.observe.observers as observers

    computed = []
    original = observers.best_clipping_ranges

    def counted(histograms, *args):
        computed.extend(histograms.unbind(0))
        return original(histograms, *args)

    monkeypatch.setattr(observers, "best_clipping_ranges", counted)
    return computed


def test_qparams_are_computed_once_per_state_and_again_after_any_write(monkeypatch):
    computed = _counting_qparams(monkeypatch)
    observer = HistogramObserver(bins=64)
    observer(torch.randn(500, generator=torch.Generator().manual_seed(0)))
    first = observer.calculate_qparams()
    again = observer.calculate_qparams()
    assert len(computed) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    again[0].mul_(2)  # what a caller does with its qparams does not reach the next caller's
    assert torch.equal(observer.calculate_qparams()[0], first[0])
    observer(torch.randn(500, generator=torch.Generator().manual_seed(1)) * 3)
    grown = observer.calculate_qparams()
    observer.max_val.fill_(100.0)  # a write in place is a new state too
    written = observer.calculate_qparams()
    assert len(computed) == 3 and grown[0] > first[0] and written[0] > grown[0]
    fresh = HistogramObserver(bins=64)
    fresh.load_state_dict(observer.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], written[0]) and len(computed) == 4


def test_kept_observers_and_the_trials_that_take_them_compute_their_qparams_once(model_and_batches, monkeypatch):
    computed = _counting_qparams(monkeypatch)
    model, data = model_and_batches
    quantizer = Int8StaticQuantizer(per_channel=True, activation_observer=HistogramObserver)
    analysis = ModelAnalysis(model, quantizer, data)
    before = _numbers(analysis)
    histograms = len(computed)
    assert histograms > 0
    per_tensor = with_layer_overrides(quantizer, {"fc2": {"per_channel": False}})
    trial = analysis.variant(per_tensor)
    assert _numbers(trial) != before
    assert len(computed) == histograms  # every activation observer's state was known: its qparams too
    scratch = ModelAnalysis(model, per_tensor, data)
    assert _numbers(scratch) == _numbers(trial) and len(computed) == 2 * histograms


def test_a_taken_state_shares_the_tensors_of_what_nothing_calls_and_copies_a_live_observers(model_and_batches):
    """A trial's observers take a kept state: keep()'s own copy, or an observer adopted once its graph let it go,
    shares its tensors (no copy made: neither side writes them again); one adopted while live is copied."""
    from qcore.graph.capture import clone_graph_module
    from qcore.quantization.calibrate import calibrate
    from qcore.quantization.prepare import prepare

    float_gm, data = model_and_batches
    quantizer = Int8StaticQuantizer()

    def prepared():
        return prepare(clone_graph_module(float_gm, share_parameters=True), quantizer)

    calibrated = prepared()
    kept = CalibratedObservers()
    signatures = kept.signatures(calibrated)
    calibrate(calibrated, data)
    kept.keep(calibrated, signatures)
    trial = prepared()
    clones, missing = count_op_calls(lambda: kept.take(trial, kept.signatures(trial)), torch.ops.aten.clone)
    assert missing == [] and clones == 0
    for name, signature in signatures.items():
        mine, source = trial.get_submodule(name), kept._states[signature]
        assert mine.frozen and mine.min_val is source.min_val and mine.max_val is source.max_val
        assert mine.min_val is not calibrated.get_submodule(name).min_val  # keep() copied the calibrated one

    for done in (True, False):
        adopted = CalibratedObservers()
        for name, signature in signatures.items():
            adopted.adopt(signature, calibrated.get_submodule(name), done=done)
        trial = prepared()
        clones, missing = count_op_calls(lambda kept=adopted, graph=trial: kept.take(graph, kept.signatures(graph)),
                                         torch.ops.aten.clone)
        assert missing == [] and (clones == 0) == done
        for name in signatures:
            assert (trial.get_submodule(name).min_val is calibrated.get_submodule(name).min_val) == done
            assert torch.equal(trial.get_submodule(name).min_val, calibrated.get_submodule(name).min_val)


def test_a_shared_state_that_changes_is_computed_anew():
    observer, copy_ = HistogramObserver(bins=64), HistogramObserver(bins=64)
    observer(torch.linspace(-1, 1, 100))
    copy_.load_state_dict(observer.state_dict())
    share_qparams(copy_, observer)
    assert torch.equal(copy_.calculate_qparams()[0], observer.calculate_qparams()[0])
    observer(torch.linspace(-5, 5, 100))  # the source moves on: the copy keeps its own state's qparams
    assert torch.equal(copy_.calculate_qparams()[0], HistogramObserver.calculate_qparams(copy_)[0])
    assert copy_.calculate_qparams()[0] < observer.calculate_qparams()[0]


def test_a_copy_of_a_state_that_saw_nothing_is_not_taken_for_calibrated():
    from qcore.observe.observers import has_qparams

    observer, copy_ = MinMaxObserver(), MinMaxObserver()  # an input no calibration token reached (an expert's)
    copy_.load_state_dict(observer.state_dict())
    share_qparams(copy_, observer)
    assert not has_qparams(copy_)  # so convert reads its state and quantizes it as one that saw nothing
    observer(torch.linspace(-1, 1, 10))
    copied = MinMaxObserver()
    copied.load_state_dict(observer.state_dict())
    share_qparams(copied, observer)
    assert not has_qparams(copied)  # the source's qparams are not computed yet: nothing is known without a read
    observer.calculate_qparams()
    assert has_qparams(copied)


def _observer_zoo():
    """Observers of every kind calculate_qparams_together takes or leaves, fed a few batches."""
    from qcore.observe.observers import MovingAverageMinMaxObserver, PerChannelMinMaxObserver

    g = torch.Generator().manual_seed(3)
    observers = [HistogramObserver(bins=64), HistogramObserver(bins=64), HistogramObserver(bins=128),
                 HistogramObserver(bins=64, qscheme=torch.per_tensor_symmetric), MinMaxObserver(),
                 MinMaxObserver(dtype=torch.uint8), MovingAverageMinMaxObserver(), PerChannelMinMaxObserver(),
                 PerChannelMinMaxObserver(qscheme=torch.per_channel_affine_float_qparams)]
    for scale in (1.0, 3.0):
        for observer in observers:
            observer(torch.randn(6, 40, generator=g) * scale + 0.5)
    unobserved, poisoned = HistogramObserver(bins=64), MinMaxObserver()
    poisoned(torch.full((4,), float("nan")))
    return observers, [unobserved, poisoned]


def test_qparams_computed_together_are_each_observers_own():
    from qcore.observe.observers import calculate_qparams_together

    observers, failing = _observer_zoo()
    alone = [type(o)._qparams(o) for o in observers]
    copy_ = HistogramObserver(bins=64)
    copy_.load_state_dict(observers[0].state_dict())
    share_qparams(copy_, observers[0])
    calculate_qparams_together([*observers, *failing, copy_])
    assert all("_qparams_memo" in o.__dict__ for o in observers)  # computed together, not when asked
    for observer, (scale, zero_point) in zip(observers, alone):
        found = observer.calculate_qparams()
        assert torch.equal(found[0], scale) and torch.equal(found[1], zero_point)
        assert found[0].shape == scale.shape and found[1].dtype == zero_point.dtype
    assert torch.equal(copy_.calculate_qparams()[0], alone[0][0])
    for observer in failing:  # they raise when asked, as alone
        with pytest.raises(RuntimeError, match="observed no data"):
            observer.calculate_qparams()


def test_convert_reads_the_host_a_few_times_whatever_the_number_of_layers(monkeypatch):
    """On the torch path (native kernels off, as on a GPU, where each read waits for the device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qcore.graph.capture import capture
    from qcore.quantization.calibrate import calibrate
    from qcore.quantization.convert import convert
    from qcore.quantization.prepare import prepare
    from qcore.runtime import native

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    def host_reads(layers):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).eval()
        data = batches((2, 8))
        prepared = prepare(capture(model, data[0]), Int8StaticQuantizer(activation_observer=HistogramObserver))
        calibrate(prepared, data)
        Reads.count = 0
        with Reads():
            convert(prepared)
        return Reads.count

    monkeypatch.setitem(native._state, "library", None)
    assert host_reads(12) == host_reads(2) <= 3


@pytest.mark.parametrize("make", [MinMaxObserver, HistogramObserver,
                                  lambda: PerChannelMinMaxObserver(ch_axis=1)])
def test_a_copied_observer_holds_its_own_buffers_with_the_same_state(make):
    observer = make()
    observer(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
    copy = copied(observer)
    assert type(copy) is type(observer) and vars(copy).keys() == vars(observer).keys()
    for (name, mine), (_, theirs) in zip(copy.named_buffers(), observer.named_buffers()):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name
    copy(torch.full((4, 6), 100.0))  # the copy observes on its own
    assert float(observer.max_val.max()) < 100 <= float(copy.max_val.max())


@pytest.mark.parametrize("make", [MinMaxObserver, HistogramObserver,
                                  lambda: PerChannelMinMaxObserver(ch_axis=1, qscheme=torch.per_channel_symmetric)])
def test_a_fresh_copy_has_the_settings_and_none_of_the_state(make):
    """fresh_copy (a variant's weight observer) observes as a new observer of the same settings does, and leaves the
    source's state and memoized qparams alone."""
    generator = torch.Generator().manual_seed(0)
    seen, later = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator) * 3
    observer = make()
    observer(seen)
    before = [tensor.clone() for tensor in observer.calculate_qparams()]
    fresh = fresh_copy(observer)
    assert vars(fresh).get("_qparams_memo") is None and not fresh.frozen
    new = make()
    fresh(later)
    new(later)
    for mine, theirs in zip(fresh.calculate_qparams(), new.calculate_qparams()):
        assert torch.equal(mine, theirs)
    for (name, mine), (_, theirs) in zip(fresh.named_buffers(), new.named_buffers()):
        assert torch.equal(mine, theirs), name
    assert all(torch.equal(a, b) for a, b in zip(observer.calculate_qparams(), before))


def test_per_channel_observers_start_from_one_shared_empty_range_and_observe_apart():
    """A per-channel observer made for a weight holds no channels until it observes (one shared empty range, not
    a range made and dropped at each prepare); observing replaces it, so observers never share a range."""
    from tests.helpers import count_aten_ops

    made, (first, second) = count_aten_ops(lambda: [PerChannelMinMaxObserver(ch_axis=0) for _ in range(2)])
    assert made == 0 and first.min_val.numel() == 0 and not first.has_observed
    generator = torch.Generator().manual_seed(0)
    first(torch.randn(3, 4, generator=generator))
    second(torch.randn(5, 4, generator=generator) * 10)
    assert first.min_val.shape == (3,) and second.min_val.shape == (5,)
    assert float(first.max_val.max()) < float(second.max_val.max())
    assert PerChannelMinMaxObserver().min_val.numel() == 0


def test_a_weight_observed_at_an_earlier_prepare_is_not_reduced_again(model_and_batches):
    """Each prepare of a graph observes its weights: a weight an observer of the same settings observed as it is
    now takes that observer's range tensors (shared, no copy: both are frozen) and qparams (no reduction), the same as
    observing it; a weight written to since, or other settings, is observed."""
    from qcore.quantization.prepare import prepare
    from tests.helpers import count_op_calls

    float_gm, _ = model_and_batches

    def weight_observers(quantizer) -> list:
        prepared = prepare(qcore.graph.capture.clone_graph_module(float_gm, share_parameters=True), quantizer)
        return [m for m in prepared.modules() if isinstance(m, PerChannelMinMaxObserver)]

    first = weight_observers(Int8StaticQuantizer())
    reductions, again = count_op_calls(lambda: weight_observers(Int8StaticQuantizer()), torch.ops.aten.amax)
    assert reductions == 0 and len(again) == len(first) > 0
    for mine, theirs in zip(again, first):
        assert torch.equal(mine.min_val, theirs.min_val) and torch.equal(mine.max_val, theirs.max_val)
        assert all(torch.equal(a, b) for a, b in zip(mine.calculate_qparams(), theirs.calculate_qparams()))
        assert mine.min_val is theirs.min_val and mine.max_val is theirs.max_val and mine.frozen and theirs.frozen
    weight = next(p for p in float_gm.parameters() if p.dim() == 2)
    with torch.no_grad():
        weight.mul_(2.0)
    kept = [(o.min_val.clone(), o.max_val.clone()) for o in first]
    reductions, changed = count_op_calls(lambda: weight_observers(Int8StaticQuantizer()), torch.ops.aten.amax)
    assert reductions == 1 and max(float(o.max_val.max()) for o in changed) > 0
    # the new observation made its own range: the shared ones are as they were
    assert all(torch.equal(o.min_val, low) and torch.equal(o.max_val, high) for o, (low, high) in zip(first, kept))


def test_weights_whose_qparams_an_earlier_prepare_made_convert_without_reducing_or_copying_them(model_and_batches):
    """A convert's weight observers whose qparams are known (those of the observer of an earlier prepare, while it
    lives, as a model's do while its trials prepare) are not reduced again to tell whether they saw anything, and
    their qparams are read, not copied: the same quantized weights as the first convert's."""
    from qcore.quantization.convert import convert
    from qcore.quantization.prepare import prepare
    from tests.helpers import count_op_calls

    float_gm, data = model_and_batches

    def calibrated():
        prepared = prepare(qcore.graph.capture.clone_graph_module(float_gm, share_parameters=True),
                           Int8StaticQuantizer())
        for batch in data:
            prepared(batch)
        return prepared

    first = calibrated()
    observers = [m for m in first.modules() if isinstance(m, PerChannelMinMaxObserver)]
    weights = {name: buffer for name, buffer in convert(first).named_buffers() if name.startswith("qcore_fq_")}
    second, third = calibrated(), calibrated()
    reductions, again = count_op_calls(lambda: convert(second), torch.ops.aten.amin)
    copies, _ = count_op_calls(lambda: convert(third), torch.ops.aten.clone)
    assert observers and weights and reductions == 0 and copies == 0
    assert all(torch.equal(again.get_buffer(name), buffer) for name, buffer in weights.items())


def test_range_observers_of_one_prepare_start_from_rows_of_a_pool_and_observe_as_made_alone(model_and_batches):
    """prepare makes its range observers' starting ranges a few hundred at a time (pooled_ranges): each observer
    holds a row of its own and ends, through a model call's queue or not, in the state of one made alone; a memo
    taken before more batches is never stale (a write to any row of a pool makes its rows' memos be computed
    again)."""
    from qcore.observe.observers import MinMaxObserver, pooled_ranges
    from qcore.quantization.prepare import prepare
    from qcore.runtime import deferred

    g = torch.Generator().manual_seed(0)
    data = [torch.randn(16, 8, generator=g) * scale for scale in (1.0, 3.0, 0.5)]
    with pooled_ranges(rows=4):  # two allocations for six observers
        pooled = [MinMaxObserver() for _ in range(6)]
    alone = [MinMaxObserver() for _ in range(6)]
    assert pooled[0].min_val._base is not None and pooled[0].min_val.data_ptr() != pooled[1].min_val.data_ptr()
    for observers in (pooled, alone):
        for step, batch in enumerate(data):
            with deferred.batched_updates() if step != 1 else contextlib.nullcontext():
                for index, observer in enumerate(observers):
                    observer(batch * (index + 1))
            if step == 0:
                [observer.calculate_qparams() for observer in observers]  # memoized, then written again
    for ours, theirs in zip(pooled, alone):
        assert torch.equal(ours.min_val, theirs.min_val) and torch.equal(ours.max_val, theirs.max_val)
        assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams()))
    float_gm, _ = model_and_batches
    made, prepared = count_op_calls(lambda: prepare(
        qcore.graph.capture.clone_graph_module(float_gm, share_parameters=True), Int8StaticQuantizer()),
        torch.ops.aten.lift_fresh)
    assert made == 0 and any(type(module) is MinMaxObserver for module in prepared.modules())


def test_a_prepared_copys_code_is_generated_only_when_a_calibration_pass_runs_it(model_and_batches, monkeypatch):
    from qcore.graph.capture import clone_graph_module
    from qcore.quantization.calibrate import calibrate
    from qcore.quantization.calibrated import calibrate_kept
    from qcore.quantization.convert import convert
    from qcore.quantization.prepare import prepare

    float_gm, data = model_and_batches
    generated = []
    generate = torch.fx.Graph.python_code
    monkeypatch.setattr(torch.fx.Graph, "python_code",
                        lambda graph, *args, **kwargs: generated.append(graph) or generate(graph, *args, **kwargs))
    kept = CalibratedObservers()
    quantizer = Int8StaticQuantizer()

    def prepared():
        return prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False), quantizer,
                       recompile=False)

    first = prepared()
    generated.clear()
    calibrate_kept(first, data, kept)  # a pass runs it: its code first
    assert generated == [first.graph]
    second = prepared()
    generated.clear()
    calibrate_kept(second, data, kept)  # every observer's state is known: nothing runs it
    assert generated == []
    reference = prepared()
    reference.recompile()
    calibrate(reference, data)
    expected = convert(reference)(data[1])
    for quantized in (convert(first), convert(second)):
        assert torch.equal(quantized(data[1]), expected)
