"""One calibration pass and one comparison pass feed every measurement (issue: analysis cost).

The shared pass must give exactly what separate passes give; the equalization variants must agree with the
layer's shadow SQNR in the model that is really equalized or smoothed; graph copies must not hold a second set
of weights, and what a pass no longer needs is released.
"""
import gc
import math
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcore
from qcore.analysis import AnalysisPlan, ModelAnalysis, measure_sqnr
from qcore.graph.capture import clone_graph_module
from qcore.measure.passes import FirstOutputs, measure_model
from qcore.measure.variants import variant_batches
from qcore.numeric.compare import compare, compare_propagated_and_shadow
from qcore.numeric.loggers import StreamingComparator
from qcore.quantization.convert import convert
from qcore.report import InputWeightEqualizationDetector, OutlierDetector
from qcore.report.detectors import DynamicStaticDetector
from qcore.rewrites.equalize import equalize
from qcore.rewrites.smoothing import smooth
from qcore.runtime.collector import full_collections_deferred
from tests.models import SmallCNN, SmallMLP


class SkewedMLP(nn.Module):
    """An MLP whose input channels span four orders of magnitude, with an add whose output feeds a linear (a
    quantized producer that keeps its output: input-weight equalization scales it with a mul)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.side, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(16, 32), \
            nn.Linear(32, 8)

    def forward(self, x):
        hidden = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(hidden + self.side(x))


class NormLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 8)
        with torch.no_grad():
            self.norm.weight[:3] *= 40.0

    def forward(self, x):
        return self.fc(self.norm(x))


def _skewed(count, shape=(32, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 2, shape[-1])
    return [torch.randn(shape, generator=g) * spread for _ in range(count)]


def _detectors():
    return {"dynamic_static": DynamicStaticDetector(), "iwe": InputWeightEqualizationDetector(0.5),
            "outlier": OutlierDetector()}


@pytest.mark.parametrize("make, batches", [(SmallMLP, lambda: [torch.randn(16, 32) for _ in range(4)]),
                                           (SmallCNN, lambda: [torch.randn(4, 3, 16, 16) for _ in range(4)])])
def test_the_shared_pass_gives_exactly_what_separate_passes_give(make, batches):
    torch.manual_seed(0)
    model, data = make().eval(), batches()
    float_gm = qcore.capture(model, data[0])
    shared = ModelAnalysis(float_gm, None, data,
                           plan=AnalysisPlan(frozenset({"sqnr", "detectors", "equalization"}), _detectors()))
    _, quant_gm = qcore.quantize(model, data[0], data)
    propagated = {r["layer"]: r["sqnr_db"] for r in compare(float_gm, quant_gm, data, propagate=True)}
    shadow = {r["layer"]: r["sqnr_db"] for r in compare(float_gm, quant_gm, data, propagate=False)}
    for layer, entry in shared.sqnr.layers.items():
        assert entry.sqnr_db == propagated[layer] and entry.shadow_sqnr_db == shadow[layer]
    assert shared.sqnr.worst_output().sqnr_db == propagated["output"]
    separate = ModelAnalysis(float_gm, None, data).detector_reports(_detectors())
    reports = shared.detector_reports(shared.plan.detectors)
    assert reports.keys() == separate.keys()
    for key, by_layer in separate.items():
        assert reports[key].keys() == by_layer.keys()
        for layer, features in by_layer.items():
            for feature, value in features.items():
                mine = reports[key][layer][feature]
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(mine, value, rtol=0, atol=0, equal_nan=True)
                else:
                    assert mine == value or (isinstance(value, float) and math.isnan(value) and math.isnan(mine))


def test_input_weight_variants_agree_with_the_equalized_models_shadow_sqnr():
    torch.manual_seed(0)
    model, data = SkewedMLP().eval(), _skewed(2)  # two batches: the variants see every batch
    float_gm = qcore.capture(model, data[0])
    analysis = ModelAnalysis(float_gm, None, data, plan=AnalysisPlan(frozenset({"sqnr", "equalization"})))
    variants = analysis.equalization_variants
    assert set(variants) == set(analysis.equalizable_layers) == {"fc1", "fc2", "side", "head"}
    equalized = measure_sqnr(equalize(float_gm, analysis.equalizable_layers, data), data).layers
    for layer, methods in variants.items():
        variant = methods["input_weight"]
        assert variant.baseline_db == pytest.approx(analysis.sqnr.layers[layer].shadow_sqnr_db, abs=1e-9)
        # fc1's rows also absorb fc2's scale in the equalized model, which changes fc1's own output quantization:
        # the variant measures equalizing fc1's input only
        tolerance = 1.0 if layer == "fc1" else 1e-3
        assert variant.sqnr_db == pytest.approx(equalized[layer].shadow_sqnr_db, abs=tolerance), layer
    assert variants["fc1"]["input_weight"].gain_db > 3  # the skewed model input: equalization helps a lot


def test_smoothing_variants_agree_with_the_smoothed_models_shadow_sqnr():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model, data = NormLinear().eval(), [torch.randn(4, 6, 16, generator=g) for _ in range(2)]
    float_gm = qcore.capture(model, data[0])
    analysis = ModelAnalysis(float_gm, None, data, plan=AnalysisPlan(frozenset({"sqnr", "equalization"})))
    variant = analysis.equalization_variants["fc"]["smoothing"]
    assert variant.alpha == analysis.smoothing["fc"]["alpha"] and variant.producer_name == "norm"
    smoothed = smooth(float_gm, data, variant.alpha)
    assert smoothed.meta["qcore_smoothing"][0]["alpha"] == variant.alpha
    assert variant.sqnr_db == pytest.approx(measure_sqnr(smoothed, data).layers["fc"].shadow_sqnr_db, abs=0.1)
    assert variant.gain_db > 3
    # the model's own search picks the alpha the check announces
    assert smooth(float_gm, data, "search").meta["qcore_smoothing"][0]["alpha"] == variant.alpha


def test_variants_run_on_a_quarter_of_the_batches_and_compare_with_the_shadow_over_the_same_batches():
    assert [variant_batches(n) for n in (1, 2, 3, 8, 9, 200)] == [1, 2, 2, 2, 2, 50]
    torch.manual_seed(0)
    data = _skewed(8)
    float_gm = qcore.capture(SkewedMLP().eval(), data[0])
    measured = measure_model(float_gm, data, equalization_layers=["fc1"])
    two = measure_model(float_gm, data, equalization_layers=["fc1"])  # deterministic
    assert measured.variants["fc1"]["input_weight"] == two.variants["fc1"]["input_weight"]
    assert measured.sqnr.layers["fc1"].batches == 8
    # the baseline is the shadow comparison over the first two batches, not over all eight
    assert measured.variants["fc1"]["input_weight"].baseline_db != pytest.approx(
        measured.sqnr.layers["fc1"].shadow_sqnr_db, abs=1e-9)


def test_instrumented_branches_run_on_their_batches_then_go_with_their_buffers():
    torch.manual_seed(0)
    model, data = SmallMLP().eval(), [torch.randn(8, 32) for _ in range(5)]
    float_gm, quant_gm = qcore.quantize(model, data[0], data)
    seen, finished = StreamingComparator(), []

    def instrument(graph):
        graph.gm.register_buffer("qcore_extra", torch.zeros(1 << 20))
        layer = graph.pairs[0].layer
        with graph.gm.graph.inserting_after(graph.references[layer]):
            extra = graph.gm.graph.get_attr("qcore_extra")
        graph.gm.add_submodule("qcore_extra_compare", seen)
        with graph.gm.graph.inserting_after(extra):
            graph.gm.graph.call_module("qcore_extra_compare", (graph.references[layer], graph.references[layer]))
        return lambda: finished.append((graph.shadows[layer].batches, hasattr(graph.gm, "qcore_extra")))

    _, shadows = compare_propagated_and_shadow(float_gm, quant_gm, data, instrument=instrument, instrument_batches=2)
    assert seen.batches == 2 and finished == [(2, True)]
    assert all(record["batches"] == 5 for record in shadows)


def test_copies_share_the_weights_and_the_converted_graph_can_drop_its_float_ones():
    torch.manual_seed(0)
    model, data = SmallMLP().eval(), [torch.randn(8, 32) for _ in range(2)]
    float_gm = qcore.capture(model, data[0])
    shared = clone_graph_module(float_gm, share_parameters=True)
    assert all(a is b for a, b in zip(float_gm.parameters(), shared.parameters()))
    assert not any(a is b for a, b in zip(float_gm.parameters(), clone_graph_module(float_gm).parameters()))
    prepared = qcore.prepare(clone_graph_module(float_gm, share_parameters=True), qcore.Int8StaticQuantizer())
    qcore.calibrate(prepared, data)
    kept = convert(clone_graph_module(prepared), keep_float_weights=True)
    dropped = convert(prepared, keep_float_weights=False)
    assert [n for n, _ in kept.named_parameters() if n.endswith("weight")]
    assert not [n for n, _ in dropped.named_parameters() if n.endswith("weight")]
    with torch.no_grad():
        torch.testing.assert_close(dropped(data[0]), kept(data[0]), rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(float_gm.parameters(), model.parameters()))


def test_the_analysis_collects_its_own_garbage_graphs_without_traversing_older_objects():
    from pytest_qreport.core.runtime import young_garbage_collection

    assert gc.isenabled()
    graph = qcore.capture(SmallMLP().eval(), torch.randn(2, 32))
    with young_garbage_collection():
        assert gc.isenabled() and gc.get_freeze_count() > 0  # the session's objects are out of every collection
        copy = clone_graph_module(graph)  # a GraphModule is a reference cycle: refcounts alone never free it
        gone = weakref.ref(copy)
        del copy
        gc.collect()  # as an automatic collection would, during the analysis
        assert gone() is None
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_measurement_runs_no_full_collection_and_its_cyclic_garbage_goes_at_the_next_one():
    """Its graphs live until it returns: a full collection during it would scan them and free nothing."""
    graph = qcore.capture(SkewedMLP().eval(), torch.randn(2, 16))
    full_collections = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full_collections.append(info)

    def measured_under_eager_collections(measure):
        threshold = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.collect()  # no long-lived objects left: a full collection comes due as soon as the measurement makes some
        gc.set_threshold(20, 1, 1)
        gc.callbacks.append(count)
        try:
            full_collections.clear()
            measure(graph, _skewed(4), detectors=_detectors(), equalization_layers=["fc2"], smoothing="search")
            return len(full_collections), gc.get_threshold()
        finally:
            gc.callbacks.remove(count)
            gc.set_threshold(*threshold)
            gc.unfreeze()

    assert measured_under_eager_collections(measure_model.__wrapped__)[0] > 0  # the measurement undeferred
    assert measured_under_eager_collections(measure_model) == (0, (20, 1, 1))

    threshold = gc.get_threshold()
    with pytest.raises(RuntimeError), full_collections_deferred():
        assert gc.get_threshold()[:2] == threshold[:2] and gc.get_threshold()[2] > threshold[2]
        raise RuntimeError("a measurement that fails")
    assert gc.get_threshold() == threshold


def test_large_allocations_are_mapped_for_big_models_only_and_the_threshold_is_set_back(monkeypatch):
    from pytest_qreport.core import runtime

    thresholds: list[int] = []
    monkeypatch.setattr(runtime, "_set_mmap_threshold", thresholds.append)
    with runtime.young_garbage_collection(map_large_allocations=False):
        pass
    assert thresholds == []  # a small model's analysis is not slowed by page faults
    with runtime.young_garbage_collection(map_large_allocations=True):
        assert thresholds == [1 << 20]
    assert thresholds == [1 << 20, 32 << 20]  # what follows allocates from the heap again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_activation_freed_and_allocated_again_is_not_faulted_in_each_time():
    script = textwrap.dedent('''
        import resource, torch
        from pytest_qreport.core import runtime

        runtime._set_mmap_threshold(32 << 20)
        torch.ones(4 << 20, dtype=torch.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            activation = torch.ones(4 << 20, dtype=torch.uint8)
            del activation
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # 4 MiB are 1,024 pages: with free() trimming the heap above 128 KiB, each of the 50 rounds faulted them in
    # again (about 50,000 faults); kept in the heap, they are faulted in once
    assert int(done.stdout) < 5 * 1024


def test_variants_from_the_detectors_channel_ranges_equal_those_from_their_own():
    torch.manual_seed(0)
    data = _skewed(4)
    float_gm = qcore.capture(SkewedMLP().eval(), data[0])
    alone = measure_model(float_gm, data, equalization_layers=["fc1", "head"])
    shared = measure_model(float_gm, data, equalization_layers=["fc1", "head"],
                           detectors={"iwe": InputWeightEqualizationDetector(0.5)})
    assert alone.variants == shared.variants and set(shared.variants) == {"fc1", "head"}


def test_a_deterministic_model_needs_no_runs_beyond_the_two_passes(monkeypatch):
    import qcore.analysis as analysis_module

    calls = []
    real = analysis_module.first_nondeterministic
    monkeypatch.setattr(analysis_module, "first_nondeterministic", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    data = [torch.randn(8, 32) for _ in range(3)]
    analysis = ModelAnalysis(qcore.capture(SmallMLP().eval(), data[0]), None, data)
    analysis.sqnr  # noqa: B018
    assert analysis.nondeterminism is None and calls == []


def test_the_batch_0_outputs_are_compared_in_the_comparison_pass_and_not_held_after_it(monkeypatch):
    # the modules (qcore.measure.passes and qcore.numeric.compare are also functions)
    measure_module, compare_module = sys.modules["qcore.measure.passes"], sys.modules["qcore.numeric.compare"]
    torch.manual_seed(0)
    data = [torch.randn(8, 32) for _ in range(3)]
    float_gm = qcore.capture(SmallMLP().eval(), data[0])
    held_in_batch_1, real = [], compare_module.call_model
    first_outputs = []

    def spy(gm, batch):
        if batch is data[1] and first_outputs:  # the comparison's second batch: the check is done by now
            held_in_batch_1.append((first_outputs[0].agree, first_outputs[0]._first))
        return real(gm, batch)

    def recorded(float_gm):
        first_outputs.append(FirstOutputs(float_gm))
        return first_outputs[-1]

    monkeypatch.setattr(compare_module, "call_model", spy)
    monkeypatch.setattr(measure_module, "FirstOutputs", recorded)
    measured = measure_model(float_gm, data)
    assert measured.first_outputs_agree is True
    assert held_in_batch_1 and all(state == (True, None) for state in held_in_batch_1)
    outputs = FirstOutputs(float_gm)
    outputs.append(torch.ones(3))
    assert outputs.agree is None
    outputs.append(torch.tensor([1.0, 1.0, 2.0]))  # a second run that differs
    assert outputs.agree is False and outputs._first is None


def test_a_non_deterministic_model_is_measured_once_however_many_checks_ask(monkeypatch):
    import qcore.analysis as analysis_module

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(torch.nn.functional.dropout(x, 0.5, training=True))

    measured = []
    real = analysis_module.measure_model
    monkeypatch.setattr(analysis_module, "measure_model", lambda *a, **k: measured.append(1) or real(*a, **k))
    data = [torch.randn(4, 8) for _ in range(2)]
    analysis = ModelAnalysis(qcore.capture(Noisy().eval(), data[0]), None, data,
                             plan=AnalysisPlan(frozenset({"sqnr", "detectors"}), {"outlier": OutlierDetector()}))
    for _ in range(3):
        with pytest.raises(qcore.NonDeterministicModelError):
            analysis.sqnr  # noqa: B018
    assert measured == [1]
    assert analysis.detector_reports(analysis.plan.detectors)["outlier"]  # their own pass, still valid


def test_a_measured_variant_drops_its_equalized_copy_of_the_weights_and_rebuilds_it_on_demand():
    torch.manual_seed(0)
    data = _skewed(3)
    analysis = ModelAnalysis(qcore.capture(SkewedMLP().eval(), data[0]), None, data)
    variant = analysis.variant(equalize=True)
    measured = variant.sqnr
    assert "quantized_input_gm" not in variant.__dict__  # what a fix trial leaves behind: numbers, not weights
    assert analysis.variant(equalize=True) is variant and variant.sqnr is measured
    rebuilt = variant.quantized_input_gm
    assert rebuilt is not analysis.float_gm
    assert not torch.equal(rebuilt.get_parameter("fc1.weight"), analysis.float_gm.get_parameter("fc1.weight"))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       weights=st.integers(1, 3), skew=st.floats(0.0, 3.0))
def test_the_smoothing_alpha_search_ranks_each_alpha_as_measured_alone(seed, dtype, weights, skew):
    """The grid's qparams are made together and each alpha's scale from terms made once per range: the search
    picks the alpha that measuring each alpha on its own picks."""
    from qcore.observe.qparams import calculate_qparams, fake_quantize_per_channel, fake_quantize_per_tensor
    from qcore.rewrites.smoothing import ALPHA_GRID, _ChannelStats

    generator = torch.Generator().manual_seed(seed)
    observer = _ChannelStats(keep_first=True)
    observer.weights = [torch.randn(12, 8, generator=generator).to(dtype) for _ in range(weights)]
    spread = torch.logspace(0, skew, 8)
    for _ in range(3):
        observer(torch.randn(5, 8, generator=generator) * spread)

    def alone(alpha):
        low, high = observer.low, observer.high
        activation = torch.maximum(low.abs(), high.abs()).clamp(min=1e-5)
        magnitude = torch.stack([w.abs().amax(0).float() for w in observer.weights]).amax(0).clamp(min=1e-5)
        scale = activation.pow(alpha) / magnitude.pow(1 - alpha)
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale)).clamp(1e-4, 1e4)
        s, z = calculate_qparams((low / scale).amin(), (high / scale).amax(), -128, 127, False)
        x = fake_quantize_per_tensor(observer.first / scale, float(s), int(z), -128, 127)
        noise = signal = 0.0
        for weight in observer.weights:
            reference = observer.first @ weight.float().t()
            w = weight.float() * scale
            ws, wz = calculate_qparams(w.amin(1), w.amax(1), -127, 127, True)
            noise += float((reference - x @ fake_quantize_per_channel(w, ws, wz, 0, -127, 127).t()).double()
                           .square().sum())
            signal += float(reference.double().square().sum())
        return torch.equal(observer.scale(alpha), scale), 10 * math.log10(signal / max(noise, 1e-30))

    measured = [alone(alpha) for alpha in ALPHA_GRID]
    assert all(same for same, _ in measured)
    assert observer.best_alpha() == ALPHA_GRID[max(range(len(ALPHA_GRID)), key=lambda i: (measured[i][1], -i))]
    observer(torch.full((1, 8), 1e3))  # a new range: the terms are made again
    assert alone(0.5)[0]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       weights=st.integers(1, 3), rows=st.integers(1, 19), width=st.integers(1, 37), native=st.booleans(),
       chunk=st.sampled_from([1, 3, 7]))
def test_the_alphas_quantized_together_have_the_errors_each_has_alone(seed, dtype, weights, rows, width, native, chunk):
    """Every alpha's scaled input and weights are quantized in one chain (a first dimension of alphas, in chunks
    of a bounded size), and each alpha's squared error equals, to the bit, the error of that alpha measured alone
    (the same steps on its own tensors, the weights' errors added in order), on both paths."""
    from unittest import mock

    from qcore.observe.qparams import calculate_qparams, fake_quantize_per_channel, fake_quantize_per_tensor
    from qcore.rewrites import smoothing
    from qcore.runtime import native as native_module

    generator = torch.Generator().manual_seed(seed)
    observer = smoothing._ChannelStats(keep_first=True)
    observer.weights = [torch.randn(int(torch.randint(1, 23, (), generator=generator)), width,
                                    generator=generator).to(dtype) for _ in range(weights)]
    for _ in range(2):
        observer(torch.randn(rows, width, generator=generator) * torch.logspace(0, 2, width))

    def alone(alpha):
        scale = observer.scale(alpha)
        s, z = calculate_qparams((observer.low / scale).amin(), (observer.high / scale).amax(), -128, 127, False)
        x = fake_quantize_per_tensor(observer.first / scale, float(s), int(z), -128, 127)
        noise = torch.zeros((), dtype=torch.float64)
        for weight in observer.weights:
            reference = observer.first @ weight.float().t()
            w = weight.float() * scale
            low, high = torch.aminmax(w, dim=1)
            ws, wz = calculate_qparams(low, high, -127, 127, True)
            noise = noise + (reference - x @ fake_quantize_per_channel(w, ws, wz, 0, -127, 127).t()).double() \
                .square().sum()
        return noise

    largest = max([observer.first.numel(), *(w.numel() for w in observer.weights)])
    with mock.patch.object(smoothing, "_ALPHAS_ELEMENTS", largest * chunk), \
            mock.patch.object(native_module, "kernel", native_module.kernel if native else lambda: None):
        _, noises = observer.alpha_errors()
        expected = torch.stack([alone(alpha) for alpha in smoothing.ALPHA_GRID])
    assert torch.equal(noises, expected)
    # the search's scales serve scale() (the same bits as one alpha's alone), until a weight or a range changes
    assert all(torch.equal(observer.scale(alpha), observer._scale(alpha, *observer._scale_terms()))
               for alpha in smoothing.ALPHA_GRID)
    assert observer.scale(0.5) is observer.__dict__["_known_scales"][1][0.5]
    with torch.no_grad():
        observer.weights[0].mul_(2.0)
    assert observer.scale(0.5) is not observer.__dict__["_known_scales"][1][0.5]
    assert torch.equal(observer.scale(0.5), observer._scale(0.5, *observer._scale_terms()))


def test_weight_sqnrs_are_read_to_the_host_together_and_an_exact_copy_is_inf():
    """One host read for every weight compared whole, with the values each gives alone: an all-zero weight (0/0) is
    inf, as an exact activation is, and a weight with a NaN stays nan."""
    from qcore.measure.passes import weight_sqnrs
    from qcore.numeric.metrics import compute_sqnr
    from tests.helpers import count_op_calls

    torch.manual_seed(0)
    model = SmallMLP().eval()
    with torch.no_grad():
        model.fc2.weight.zero_()
    float_gm = qcore.capture(model, (torch.randn(4, 32),))
    quant_gm = convert(qcore.prepare(clone_graph_module(float_gm), qcore.Int8StaticQuantizer()))
    reads, found = count_op_calls(lambda: weight_sqnrs(float_gm, quant_gm), torch.ops.aten._local_scalar_dense)
    assert found["fc2"] == math.inf and reads == 0  # tolist reads them all at once, without a scalar read each
    for layer, value in found.items():
        if layer != "fc2":
            original = getattr(model, layer).weight.detach()
            quantized = getattr(quant_gm, f"qcore_fq_{layer}_weight")
            assert value == float(compute_sqnr(original, quantized))
    with torch.no_grad():
        model.fc1.weight[0, 0] = math.nan
    assert math.isnan(weight_sqnrs(float_gm, quant_gm)["fc1"])


class NormHeads(nn.Module):
    """A LayerNorm read by three linears of one width (a smoothing group) and two convolutions of one shape: the
    variants' weights of a row shape are made together."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 12), nn.Linear(16, 16)
        self.stem, self.conv_a, self.conv_b = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 3)
        with torch.no_grad():
            self.norm.weight[:3] *= 40.0

    def forward(self, x, image):
        h = self.norm(x)
        stem = torch.relu(self.stem(image))
        return self.q(h) * self.v(h), self.k(h), self.conv_a(stem) + self.conv_b(stem)


def _variants_each_alone(monkeypatch):
    """Plan and make each variant's input qparams and weight on its own, a chain of ops and host reads each."""
    import qcore.measure.passes as passes_module
    import qcore.measure.variants as variants_module
    from qcore.observe.qparams import calculate_qparams

    def alone(prepared, chosen):
        for op, variant in chosen:
            observer = variants_module._observer_of(prepared, op.node.args[0])
            factor = variant.factor.float()
            scale, zero_point = calculate_qparams((variant.low * factor).amin(), (variant.high * factor).amax(),
                                                  observer.quant_min, observer.quant_max, observer.symmetric,
                                                  observer.eps)
            variant.extras = variants_module._weight_plan(prepared, op, variant)
            variant.extras.update(scale=float(scale.reshape(-1)[0]), zero_point=int(zero_point.reshape(-1)[0]))

    monkeypatch.setattr(variants_module, "_prepare_variants", alone)
    monkeypatch.setattr(passes_module, "make_variant_weights", lambda variants: None)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-path"])
def test_variants_planned_and_made_together_measure_what_each_would_alone(native, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from qcore.runtime import native as native_module

    if not native:
        monkeypatch.setattr(native_module, "kernel", lambda: None)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, 16, generator=g) * torch.logspace(-1, 1, 16), torch.randn(2, 4, 9, 9, generator=g))
            for _ in range(2)]
    float_gm = qcore.capture(NormHeads().eval(), data[0])
    layers = ["q", "k", "v", "stem", "conv_a", "conv_b"]

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostReads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    def measured():
        HostReads.count = 0
        with HostReads():
            found = measure_model(float_gm, data, equalization_layers=layers, smoothing="search")
        return found.variants, HostReads.count

    together, reads_together = measured()
    with monkeypatch.context() as patched:
        _variants_each_alone(patched)
        alone, reads_alone = measured()
    assert together == alone
    assert sum(len(methods) for methods in together.values()) == 9  # 6 input-weight, 3 smoothing
    # per variant two reads of its input qparams and one of whether its weight observer saw a batch, now per group
    assert reads_alone - reads_together >= 2 * 9


def test_a_trial_compares_the_weights_of_its_own_layers_only(monkeypatch):
    """A fix trial measures the layers it concerns (its measurement holds no others): their weight SQNRs are the
    whole variant's, and the other layers' weights are not compared."""
    import qcore.measure.passes as passes_module
    from qcore.analysis import with_layer_overrides

    compared = []
    real = passes_module.compute_sqnr
    monkeypatch.setattr(passes_module, "compute_sqnr", lambda a, b: compared.append(1) or real(a, b))
    data = _skewed(2)
    analysis = ModelAnalysis(qcore.capture(SkewedMLP().eval(), data[0]), None, data)
    quantizer = with_layer_overrides(analysis.quantizer, {"fc2": {"activation_observer": "histogram"}})
    whole = analysis.variant(quantizer).sqnr.layers
    assert len(compared) == 4
    trial = analysis.variant(quantizer, layers=["fc2"]).sqnr.layers
    assert len(compared) == 5
    assert trial["fc2"].weight_sqnr_db == whole["fc2"].weight_sqnr_db and not math.isnan(whole["fc2"].weight_sqnr_db)
    assert set(trial) == {"fc2"}


def test_the_alpha_search_holds_one_chunk_of_quantized_weights_at_a_time():
    """A chunk of alphas' quantized weights is the most alive at once: no scaled copy of the chunk beside it, and
    each chunk dropped once its errors are summed (the search's peak memory on an LLM is about one chunk of its
    largest weight)."""
    import weakref
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    from qcore.rewrites import smoothing

    generator = torch.Generator().manual_seed(0)
    observer = smoothing._ChannelStats(keep_first=True)
    observer.weights = [torch.randn(64, 32, generator=generator) for _ in range(3)]
    observer(torch.randn(4, 32, generator=generator) * torch.logspace(0, 2, 32))
    chunk_bytes = len(smoothing.ALPHA_GRID) * 64 * 32 * 4  # every alpha of one weight, scaled, in float32

    class LiveBytes(TorchDispatchMode):
        """The peak of the bytes that the tensors made under it hold while alive (a storage counted once)."""

        def __init__(self) -> None:
            super().__init__()
            self.holders: dict[int, list[int]] = {}  # storage: [bytes, tensors alive on it]
            self.live = self.peak = 0

        def _gone(self, key: int) -> None:
            entry = self.holders[key]
            entry[1] -= 1
            if not entry[1]:
                self.live -= entry[0]
                del self.holders[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    key = tensor.untyped_storage().data_ptr()
                    if key not in self.holders:
                        self.holders[key] = [tensor.untyped_storage().nbytes(), 0]
                        self.live += self.holders[key][0]
                        self.peak = max(self.peak, self.live)
                    self.holders[key][1] += 1
                    weakref.finalize(tensor, self._gone, key)
            return out

    from qcore.runtime import native

    largest = max(observer.first.numel(), *(weight.numel() for weight in observer.weights))
    peaks = {}
    for path, kernel in (("native", native.kernel), ("torch", lambda: None)):
        with mock.patch.object(smoothing, "_ALPHAS_ELEMENTS", largest * len(smoothing.ALPHA_GRID)), \
                mock.patch.object(native, "kernel", kernel), torch.no_grad(), LiveBytes() as counted:
            observer.alpha_errors()
        peaks[path] = counted.peak
    # float32 weights are not copied; the first batch's alphas and the errors are small beside a chunk: each alpha's
    # quantized weight is made from the weight (by the native kernel without a scaled copy; by torch from one
    # alpha's scaled copy at a time, the chunk's ranges taken before)
    for path, peak in peaks.items():
        assert chunk_bytes <= peak < chunk_bytes * 1.5, path


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e30, 1e30), st.floats(-1e30, 1e30)), min_size=1, max_size=40),
       st.sampled_from(["torch.per_tensor_affine", "torch.per_channel_symmetric", "torch.per_tensor_symmetric"]))
def test_an_observed_range_is_the_widest_channel_range_with_zero_in_it(ranges, qscheme):
    """The range resolution_limits compares with the quantizer's resolution: each channel's [min, max] widened to
    hold 0 (and made symmetric about it for a symmetric scheme), the widest over the channels."""
    from qcore.measure.diagnose import _observed_range

    low, high = [min(a, b) for a, b in ranges], [max(a, b) for a, b in ranges]
    if "symmetric" in qscheme:
        expected = max(2 * max(-min(lo, 0.0), max(hi, 0.0)) for lo, hi in zip(low, high))
    else:
        expected = max(max(hi, 0.0) - min(lo, 0.0) for lo, hi in zip(low, high))
    assert _observed_range({"min_val": low, "max_val": high, "qscheme": qscheme}) == expected
    assert _observed_range({"min_val": [], "max_val": [], "qscheme": qscheme}) is None
