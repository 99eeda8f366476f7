"""Resumed runs (qcore.search.resume): a switch setting run from a recorded cut gives exactly the outputs of a full
run; the searches' estimates on one batch."""
import itertools

import pytest
import torch
from torch import fx, nn

import qcore
from qcore.search.resume import ResumableGraph, last_writes
from qcore.search.sensitivity import SwitchableModel, find_float_layers, layer_sensitivity
from tests.models import SmallCNN, batches, tiny_llama


class _Residual(nn.Module):
    """Two residual blocks written the torchvision way: in-place ReLUs and `out += identity`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(4))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.stem(x))
        for first, second in (self.convs[:2], self.convs[2:]):
            identity = out
            out = second(self.relu(first(out)))
            out += identity
            out = self.relu(out)
        return out


def _cases():
    llama, llama_batches = tiny_llama(layers=2, batch=2)
    cnn_batches = batches((2, 3, 16, 16), n=2)
    return {"llama": (llama, llama_batches[:2]), "cnn": (SmallCNN().eval(), cnn_batches),
            "residual": (_Residual().eval(), cnn_batches)}


@pytest.fixture(scope="module", params=["llama", "cnn", "residual"])
def switchable(request):
    model, model_batches = _cases()[request.param]
    return SwitchableModel(qcore.capture(model, model_batches[0]), model_batches), model_batches


def _full(switchable_model, model_batches):
    """The same setting run whole, without any recording or sums kept from earlier runs."""
    kept, sums = switchable_model._resumable._recordings, switchable_model._sums
    switchable_model._resumable._recordings, switchable_model._sums = {}, {}
    try:
        return switchable_model.run(model_batches)
    finally:
        switchable_model._resumable._recordings, switchable_model._sums = kept, sums


def test_every_one_layer_change_resumes_to_the_full_runs_numbers(switchable):
    model, model_batches = switchable
    assert model._resumable.enabled and len(model._resumable._cuts) > 1
    model.quantize_only([])
    model.record(model_batches)
    model.quantize_only(model.layers)
    model.record(model_batches)
    for layer in model.layers:
        model.quantize_only([name for name in model.layers if name != layer])
        assert model.run(model_batches) == _full(model, model_batches), layer
        model.quantize_only([layer])
        assert model.run(model_batches) == _full(model, model_batches), layer
    for pair in itertools.islice(itertools.combinations(model.layers, 2), 6):
        model.quantize_only([name for name in model.layers if name not in pair])
        assert model.run(model_batches) == _full(model, model_batches), pair
    model.forget()
    model.quantize_only(model.layers)


def test_the_ranking_and_the_search_equal_their_whole_run_versions(switchable):
    model, model_batches = switchable
    whole = SwitchableModel(model.float_gm, model_batches, resume=False)
    found = {}
    for switchable_model in (model, whole):
        ranking = layer_sensitivity(model.float_gm, model_batches, model=switchable_model)
        found[switchable_model] = ranking, find_float_layers(model.float_gm, model_batches, None, target_db=80.0,
                                                            max_float_layers=3, model=switchable_model,
                                                            sensitivity=ranking)
    assert found[model] == found[whole] and model._resumable._suffixes and not whole._resumable.enabled


def test_a_resumed_run_computes_only_the_rest_of_the_graph():
    model, model_batches = _cases()["llama"]
    switchable_model = SwitchableModel(qcore.capture(model, model_batches[0]), model_batches)
    resumable = switchable_model._resumable
    switchable_model.quantize_only(switchable_model.layers)
    switchable_model.record(model_batches)
    last = switchable_model.layers[-1]
    switchable_model.quantize_only([name for name in switchable_model.layers if name != last])
    switchable_model.run(model_batches)
    suffix, live = next(iter(resumable._suffixes.values()))
    assert len(resumable._suffixes) == 1 and list(resumable._suffixes) == [resumable._cuts[-1]]
    ops = [n for n in suffix.graph.nodes if n.op == "call_function"]
    full_ops = [n for n in switchable_model.gm.graph.nodes if n.op == "call_function"]
    assert 0 < len(ops) < len(full_ops) / 4 and live
    switchable_model.forget()
    assert not resumable._recordings


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def test_a_traced_graph_always_runs_whole_and_no_cut_holds_a_value_written_to_later():
    traced = fx.symbolic_trace(_InPlace())
    assert last_writes(traced) is None      # a module not known to be free of in-place writes
    resumable = ResumableGraph(traced, [], lambda: [])
    assert not resumable.enabled
    x = torch.randn(2, 8)
    assert torch.equal(resumable.record("b", x), traced(x)) and torch.equal(resumable.run("b", x), traced(x))
    exported = qcore.capture(_InPlace().eval(), torch.randn(2, 8))
    writes = last_writes(exported)
    relu = next(n for n in exported.graph.nodes if "relu_" in str(n.target))
    position = list(exported.graph.nodes).index(relu)
    assert writes == {relu.args[0]: position, relu: position}
    nodes = list(exported.graph.nodes)
    first_linear = nodes[nodes.index(relu) - 1]
    state = [0]
    resumable = ResumableGraph(exported, [first_linear], lambda: state)   # emitted again from the cut at the ReLU
    assert resumable.enabled and resumable._cuts == [nodes.index(relu)]
    assert resumable._live[nodes.index(relu)][0] == [nodes[nodes.index(first_linear) - 1]]   # x, not the linear
    resumable.record("b", x)
    state[0] = 1
    for _ in range(3):   # the in-place ReLU writes to the linear's new output, never to a recorded value
        assert torch.equal(resumable.run("b", x), exported(x))
    assert not ResumableGraph(exported, [relu], lambda: state).enabled   # a switch that writes in place


def test_the_format_search_resumed_equals_it_run_whole():
    from qcore.quantization.format_quantizer import FormatQuantizer
    from qcore.search.format_search import FormatSwitchModel, search_formats

    model, model_batches = _cases()["llama"]
    float_gm = qcore.capture(model, model_batches[0])
    quantizer = FormatQuantizer("NVFP4")
    models = {resume: FormatSwitchModel(float_gm, model_batches, quantizer, resume=resume) for resume in (False, True)}
    found = {resume: search_formats(float_gm, model_batches, quantizer, 60.0, max_moves=4, model=models[resume])
             for resume in (False, True)}
    assert found[True] == found[False] and len(found[True].layer_formats) == 4
    assert models[True]._resumable._suffixes and not models[False]._resumable.enabled


def test_a_setting_measured_before_on_the_same_batches_is_not_run_again():
    model, model_batches = _cases()["cnn"]
    switchable_model = SwitchableModel(qcore.capture(model, model_batches[0]), model_batches)
    executed = []
    original = switchable_model._resumable.run
    switchable_model._resumable.run = lambda key, inputs: executed.append(key) or original(key, inputs)
    gains = layer_sensitivity(switchable_model.float_gm, model_batches, model=switchable_model, only_quantized=False)
    assert len(executed) == len(gains.layers) * len(model_batches)
    executed.clear()
    both = layer_sensitivity(switchable_model.float_gm, model_batches, model=switchable_model)
    assert len(executed) == len(gains.layers) * len(model_batches)   # only the only-quantized runs are new
    assert [(e.layer, e.only_float_db) for e in both.layers] == [(e.layer, e.only_float_db) for e in gains.layers]


def _counting_batch_runs(switchable_model):
    """A list that gets one entry per batch the switchable model computes."""
    runs = []
    measure = switchable_model.reference.batch_sums

    def counted(*args, **kwargs):
        runs.append(args[1])
        return measure(*args, **kwargs)

    switchable_model.reference.batch_sums = counted
    return runs


def test_a_setting_estimated_on_one_batch_then_measured_on_two_runs_the_second_batch_only():
    model, model_batches = _cases()["llama"]
    float_gm = qcore.capture(model, model_batches[0])
    switchable_model, fresh = SwitchableModel(float_gm, model_batches), SwitchableModel(float_gm, model_batches)
    runs = _counting_batch_runs(switchable_model)
    switchable_model.quantize_only(switchable_model.layers[1:])
    fresh.quantize_only(fresh.layers[1:])
    switchable_model.run(model_batches[:1])
    assert switchable_model.run(model_batches) == fresh.run(model_batches)
    assert [id(batch) for batch in runs] == [id(model_batches[0]), id(model_batches[1])]


@pytest.mark.parametrize("case", ["llama", "cnn"])
def test_the_search_estimating_on_the_first_batch_picks_what_measuring_every_candidate_on_every_batch_picks(case):
    model, model_batches = _cases()[case]
    float_gm = qcore.capture(model, model_batches[0])
    found, runs = {}, {}
    for estimate in (True, False):
        switchable_model = SwitchableModel(float_gm, model_batches)
        runs[estimate] = _counting_batch_runs(switchable_model)
        found[estimate] = find_float_layers(float_gm, model_batches, None, target_db=80.0, max_float_layers=3,
                                            candidates=4, model=switchable_model, estimate=estimate)
    # three steps, or for the CNN's 3 layers two: a set that keeps every layer in float quantizes nothing
    most = min(3, len(SwitchableModel(float_gm, model_batches).layers) - 1)
    assert found[True] == found[False] and len(found[True].float_layers) == most
    # the Llama's 17 layers are more than the 8 the ranking re-measures, and its first step's 4 candidates more than 3
    assert len(runs[True]) < len(runs[False]) if case == "llama" else len(runs[True]) == len(runs[False])


def test_a_recording_started_from_another_keeps_what_a_whole_recording_keeps(switchable):
    model, model_batches = switchable
    resumable, batch = model._resumable, model_batches[0]
    model.forget()
    model.quantize_only(model.layers)
    model.record(model_batches)
    last = model.layers[-1]
    model.quantize_only([name for name in model.layers if name != last])
    state = tuple(model._switch_state())
    resumable._recording_suffixes.clear()
    started_outputs = resumable.record(id(batch), batch)  # from the all-quantized recording's last usable cut
    started = resumable._recordings[state][id(batch)]
    assert resumable._recording_suffixes
    resumable.forget()
    whole_outputs = resumable.record(id(batch), batch)
    whole = resumable._recordings[state][id(batch)]
    assert started.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(value, started[name]), name
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(started_outputs),
                                                 torch.utils._pytree.tree_leaves(whole_outputs)))
    model.forget()
    model.quantize_only(model.layers)


def test_the_format_search_estimating_on_the_first_batch_moves_as_measuring_every_move_on_every_batch_does():
    from qcore.quantization.format_quantizer import FormatQuantizer
    from qcore.search.format_search import FormatSwitchModel, search_formats

    model, model_batches = _cases()["llama"]
    float_gm = qcore.capture(model, model_batches[0])
    quantizer = FormatQuantizer("NVFP4")
    found, runs = {}, {}
    for estimate in (True, False):
        switchable_model = FormatSwitchModel(float_gm, model_batches, quantizer)
        runs[estimate] = _counting_batch_runs(switchable_model)
        found[estimate] = search_formats(float_gm, model_batches, quantizer, 60.0, max_moves=4,
                                         model=switchable_model, estimate=estimate)
    assert found[True] == found[False] and len(found[True].layer_formats) == 4
    assert len(runs[True]) < len(runs[False])


def test_the_format_search_measures_its_moves_exactly_with_the_model_calibration_taken(monkeypatch):
    # a moved layer's observer watches with its new format's settings, so only those are calibrated again; the
    # measured SQNR is a whole pass's with the moves made
    from qcore.analysis import ModelAnalysis, measure_sqnr
    from qcore.quantization.calibrated import CalibratedObservers
    from qcore.quantization.format_quantizer import FormatQuantizer

    model, model_batches = _cases()["llama"]
    float_gm = qcore.capture(model, model_batches[0])
    analysis = ModelAnalysis(float_gm, FormatQuantizer("NVFP4"), batches=model_batches)
    assert analysis.sqnr.worst_output() is not None  # the model's pass calibrates its observers
    taken = []
    take = CalibratedObservers.take
    monkeypatch.setattr(CalibratedObservers, "take", lambda self, prepared, signatures: taken.append(
        (len(signatures), take(self, prepared, signatures))) or taken[-1][1])
    fix = analysis.format_fix(60.0, max_moves=4)
    monkeypatch.undo()
    moved = len(fix.layer_formats)
    assert moved == 4 and taken and all(len(missing) <= moved < watched for watched, missing in taken)
    overrides = {layer: {"skip": True} if name == "float" else {"format": name}
                 for layer, name in fix.layer_formats.items()}
    worst = measure_sqnr(float_gm, model_batches, FormatQuantizer("NVFP4", overrides), shadow=False).worst_output()
    assert fix.measured_db == worst.sqnr_db
