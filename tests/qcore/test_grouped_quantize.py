"""A grouped capture quantized as the per-expert capture is: prepare gives each grouped projection observers of every
expert at once, convert fake-quantizes each expert's rows and weight with its own qparams, and the quantized graph
computes what the quantized per-expert graph computes, bit for bit."""
import math
import re
import warnings

import pytest
import torch

import qcore
from qcore.graph.capture import clone_graph_module, experts_grouped
from qcore.graph.experts import expert_layers
from qcore.graph.grouped import find_grouped_ops
from qcore.observe.observers import MovingAverageMinMaxObserver
from qcore.observe.segmented import ExpertsObserver, PerExpertObservers
from qcore.quantization.calibrate import calibrate
from qcore.quantization.convert import QPARAMS_KEY, convert
from qcore.quantization.prepare import prepare
from tests.models import logits_of, tiny_moe

pytest.importorskip("transformers")


def _quantized(gm, quantizer, batches):
    """(the observers of every expert at once that prepare made, the converted graph)."""
    prepared = prepare(clone_graph_module(gm), quantizer)
    segmented = [module for module in prepared.modules() if isinstance(module, ExpertsObserver)]
    calibrate(prepared, batches)
    return segmented, convert(prepared)


def _both(architecture, quantizer, batches=3, **shape):
    model, data = tiny_moe(architecture, layers=2, batch=4, n=batches + 1, **shape)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    per_expert = qcore.capture(model, data[0])
    return _quantized(grouped, quantizer, data[:batches]), _quantized(per_expert, quantizer, data[:batches]), data


def _where_read(enabled, monkeypatch):
    """Weights quantized where they are read (a large model's analysis), into reused buffers whatever their size."""
    from qcore.quantization.convert import quantize_weights_where_read
    from qcore.runtime import scratch

    if enabled:
        monkeypatch.setattr(scratch, "MIN_REUSED_BYTES", 0)
    return quantize_weights_where_read(enabled)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"])
@pytest.mark.parametrize("quantizer", [
    qcore.Int8StaticQuantizer(),
    qcore.Int8StaticQuantizer(per_channel=False, activation_observer=MovingAverageMinMaxObserver),
    qcore.Int8StaticQuantizer(activation_observer="histogram"),
], ids=["default", "per-tensor-moving-average", "histogram"])
def test_a_grouped_capture_quantizes_to_the_per_expert_captures_values(architecture, quantizer):
    (segmented, grouped), (_, per_expert), data = _both(architecture, quantizer, experts=4)
    # a gated block's 8, whatever its expert count: the routed tokens the gate and up projections read, each
    # projection's output, the down projection's input, and each weight
    assert len(segmented) == 2 * 8
    # a histogram has no form over every expert at once: one per expert, each called on its expert's rows
    histograms = [observer for observer in segmented if isinstance(observer, PerExpertObservers)]
    assert len(histograms) == (2 * 5 if quantizer.activation_observer.__name__ == "HistogramObserver" else 0)
    for batch in data[-1:]:  # a batch calibration did not see, routed otherwise
        assert torch.equal(logits_of(grouped(**batch)), logits_of(per_expert(**batch)))


@pytest.mark.parametrize("quantizer", [
    qcore.Int8StaticQuantizer(),
    qcore.Int8StaticQuantizer(per_channel=False, activation_observer="histogram"),
    qcore.Int8StaticQuantizer(layer_overrides={"model.layers.0.mlp.experts.1.up_proj": {"skip": True},
                                               "model.layers.1.mlp.experts.*.down_proj": {"skip": True}}),
], ids=["default", "per-tensor-histogram", "experts-in-float"])
@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss"])
def test_expert_weights_quantized_where_read_are_the_quantized_copys_values(architecture, quantizer, monkeypatch):
    """A large model's grouped expert weights quantized where they are read (no quantized copy held; a fused
    parameter's half each expert's rows alone), into reused buffers: the logits of the graph holding quantized
    copies, bit for bit, and the experts kept in float read the float weight."""
    from qcore.observe.segmented import fake_quantize_experts_where_read

    model, data = tiny_moe(architecture, layers=2, batch=4, n=4, experts=4)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    _, held = _quantized(grouped, quantizer, data[:3])
    with _where_read(True, monkeypatch):
        _, where_read = _quantized(grouped, quantizer, data[:3])
        reads = [node for node in where_read.graph.nodes if node.target is fake_quantize_experts_where_read]
        # every projection of the two blocks, but for the one whose every expert stays in float
        assert len(reads) == 2 * 3 - bool(quantizer.layer_overrides)
        for batch in data[-1:]:
            assert torch.equal(logits_of(where_read(**batch)), logits_of(held(**batch)))


def test_each_experts_qparams_are_its_own_linears():
    (_, grouped), (_, per_expert), _ = _both("qwen3_moe", qcore.Int8StaticQuantizer(), experts=4)
    ops = {op.item: op for op in find_grouped_ops(grouped)}
    qparams = {str(node.meta.get("qcore_float_weight", "")): node.meta[QPARAMS_KEY] for node in per_expert.graph.nodes
               if QPARAMS_KEY in node.meta and node.op == "get_attr"}
    grouped_qparams = {str(node.meta.get("qcore_float_weight", "")): node.meta[QPARAMS_KEY]
                       for node in grouped.graph.nodes if QPARAMS_KEY in node.meta and node.op == "get_attr"}
    block = "model.layers.0.mlp.experts"
    down = grouped_qparams[f"{block}.grouped_down_proj"]
    scales = list(down["scale"])
    width = len(scales) // 4
    for expert in range(4):  # each expert's rows of the grouped weight's per-channel scales are its Linear's
        own = list(qparams[f"{block}.{expert}.down_proj.weight"]["scale"])
        assert scales[expert * width:(expert + 1) * width] == own
    assert f"{block}.down_proj" in ops


def test_an_expert_no_calibration_token_reaches_is_named_and_quantized_as_torch_ao_converts_it():
    """A block with more experts than its few tokens reach: convert warns naming the unreached experts, and their
    rows get scale 1 and zero point 0, as the per-expert graph's convert gives them."""
    model, data = tiny_moe("qwen3_moe", layers=1, experts=32, batch=1, tokens=4, n=2)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    per_expert = qcore.capture(model, data[0])
    found, messages = {}, {}
    for name, gm in (("grouped", grouped), ("per_expert", per_expert)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, found[name] = _quantized(gm, qcore.Int8StaticQuantizer(), data[:1])
        messages[name] = [str(w.message) for w in caught if "no calibration batch reached" in str(w.message)]
    assert len(messages["grouped"]) == len(messages["per_expert"]) == 1
    # the same ops, named alike: each unreached expert's layers, and the modules of the ops between them
    assert messages["grouped"][0].split(" (")[0] == messages["per_expert"][0].split(" (")[0]
    assert re.search(r"model\.layers\.0\.mlp\.experts\.\d+\.gate_proj", messages["grouped"][0])
    assert torch.equal(logits_of(found["grouped"](**data[1])), logits_of(found["per_expert"](**data[1])))


def test_a_per_expert_override_is_refused_by_a_grouped_capture():
    model, data = tiny_moe("qwen3_moe", layers=1, experts=4, batch=2, n=1)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    quantizer = qcore.Int8StaticQuantizer(layer_overrides={"model.layers.0.mlp.experts.2.down_proj":
                                                           {"per_channel": False}})
    with pytest.raises(ValueError, match="different settings"):
        prepare(clone_graph_module(grouped), quantizer)


def test_a_grouped_capture_is_taken_unless_an_override_gives_its_experts_different_settings():
    from qcore.analysis import takes_grouped_capture

    model, data = tiny_moe("qwen3_moe", layers=1, experts=4, batch=2, n=1)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    split = {"model.layers.0.mlp.experts.2.down_proj": {"per_channel": False}}
    skipped = {"model.layers.0.mlp.experts.2.down_proj": {"skip": True}}
    assert takes_grouped_capture(grouped) and takes_grouped_capture(grouped, qcore.Int8StaticQuantizer())
    assert takes_grouped_capture(grouped, qcore.Int8StaticQuantizer(layer_overrides=skipped))
    assert not takes_grouped_capture(grouped, qcore.Int8StaticQuantizer(layer_overrides=split))


@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_measure_sqnr_of_a_grouped_capture_gives_every_experts_records_of_the_per_expert_capture(architecture):
    """Each expert's shadow and weight SQNR from the grouped projection's per-expert sums, the output SQNR, every
    other layer's: the per-expert graph's, to the bit."""
    from qcore.analysis import measure_sqnr

    model, data = tiny_moe(architecture, layers=2, experts=4, batch=4, n=4)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    per_expert = qcore.capture(model, data[0])
    a = measure_sqnr(grouped, data, qcore.Int8StaticQuantizer())
    b = measure_sqnr(per_expert, data, qcore.Int8StaticQuantizer())
    assert set(a.layers) == set(b.layers)
    assert "model.layers.1.mlp.experts.3.down_proj" in a.layers
    for layer, expected in b.layers.items():
        found = a.layers[layer]
        for field in ("sqnr_db", "shadow_sqnr_db", "weight_sqnr_db"):
            value, wanted = getattr(found, field), getattr(expected, field)
            assert value == wanted or (math.isnan(value) and math.isnan(wanted)), (layer, field)
        assert found.batches == expected.batches
    assert a.outputs["output"].sqnr_db == b.outputs["output"].sqnr_db


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_experts_comparator_sums_each_experts_rows_as_a_comparator_of_that_expert_alone(dtype):
    """float32 on the CPU: the native kernel's sums of each run, bit for bit; other dtypes: torch ops in float64."""
    from qcore.numeric.loggers import ExpertsComparator, StreamingComparator

    generator = torch.Generator().manual_seed(0)
    comparator = ExpertsComparator(4)
    alone = [StreamingComparator() for _ in range(4)]
    for _ in range(3):
        counts = torch.tensor([300, 0, 5, 2000])
        reference = torch.randn(int(counts.sum()), 24, generator=generator).to(dtype)
        actual = (reference.float() + 0.01 * torch.randn(reference.shape, generator=generator)).to(dtype)
        comparator(actual, reference.reshape(-1), counts)
        for expert, (ref, act) in enumerate(zip(reference.split(counts.tolist()), actual.split(counts.tolist()))):
            alone[expert].add(ref, act)
    for expert, found in enumerate(comparator.results()):
        expected = alone[expert].result()
        if expert == 1:  # no row in any batch: no measurement
            assert found["batches"] == expected["batches"] == 0 and math.isnan(found["sqnr_db"])
            continue
        assert found["batches"] == expected["batches"] == 3
        if dtype == torch.float32:
            assert found == expected
        else:
            assert found["sqnr_db"] == pytest.approx(expected["sqnr_db"], abs=1e-9)


def test_expert_coverage_of_a_grouped_capture_counts_each_experts_tokens_from_the_blocks_counts():
    """The coverage detector adds up each block's counts, one counter a block: the tokens the per-expert graph's
    counters count, expert by expert; the routing agreement and every layer's SQNR as the per-expert graph's."""
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.report import ExpertCoverageDetector
    from qcore.report.coverage import ExpertTokenCounts

    model, data = tiny_moe("qwen3_moe", layers=2, experts=16, batch=1, tokens=4, n=3)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    per_expert = qcore.capture(model, data[0])
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors"}),
                        detectors={"expert_coverage": ExpertCoverageDetector()})
    a = ModelAnalysis(grouped, qcore.Int8StaticQuantizer(), data, plan=plan)
    b = ModelAnalysis(per_expert, qcore.Int8StaticQuantizer(), data, plan=plan)
    assert a.measurement.detector_reports["expert_coverage"] == b.measurement.detector_reports["expert_coverage"]
    tokens = a.measurement.detector_reports["expert_coverage"]["model.layers.1.mlp.experts"]["tokens"]
    assert sum(tokens) == 2 * 1 * 4 * len(data) and 0 in tokens  # top-2 of every token; an expert none reached
    assert a.routing_agreement == b.routing_agreement
    assert {layer: entry.shadow_sqnr_db for layer, entry in a.sqnr.layers.items()} == \
        {layer: entry.shadow_sqnr_db for layer, entry in b.sqnr.layers.items()}
    points = ExpertCoverageDetector().determine_observer_insert_points(grouped)
    assert len(points) == 2 and all(isinstance(point["observer_to_insert"], ExpertTokenCounts)
                                    for point in points.values())


def _plain(value):
    """A report entry with its tensors as lists, to compare."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _grouped_and_per_expert(**shape):
    """A tiny Qwen3-MoE's batches and its two captures: {"grouped": one op a projection, "per_expert": one Linear per
    expert}."""
    model, data = tiny_moe("qwen3_moe", **shape)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    return data, {"grouped": grouped, "per_expert": qcore.capture(model, data[0])}


def test_the_detectors_report_each_expert_of_a_grouped_capture_as_on_the_per_expert_graph():
    """torch.ao's four detectors and expert coverage, on the shared calibration pass: each expert's entry, from its
    own observers fed its rows by one call a projection, is the per-expert graph's; and so is every other layer's
    (the experts' activation, which the per-expert graph observes on the first expert's rows only, aside)."""
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.report import (
        DynamicStaticDetector,
        ExpertCoverageDetector,
        InputWeightEqualizationDetector,
        OutlierDetector,
        PerChannelDetector,
    )

    data, captures = _grouped_and_per_expert(layers=2, experts=8, batch=2, tokens=8, n=3)
    reports = {}
    for name, gm in captures.items():
        detectors = {"per_channel": PerChannelDetector(quantizer=qcore.Int8StaticQuantizer(per_channel=False)),
                     "dynamic_static": DynamicStaticDetector(), "equalization": InputWeightEqualizationDetector(0.5),
                     "outlier": OutlierDetector(), "expert_coverage": ExpertCoverageDetector()}
        plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors"}), detectors=detectors)
        analysis = ModelAnalysis(gm, qcore.Int8StaticQuantizer(per_channel=False), data, plan=plan)
        reports[name] = {key: _plain(report) for key, report in analysis.measurement.detector_reports.items()}
    expert = "model.layers.1.mlp.experts.5.down_proj"
    for key in ("per_channel", "dynamic_static", "equalization", "outlier"):
        found, expected = reports["grouped"][key], reports["per_expert"][key]
        assert expert in found, key
        activation = [layer for layer in expected if layer.endswith("experts.act_fn")]
        assert set(found) == set(expected), key
        for layer in expected:
            if layer not in activation:
                assert found[layer] == expected[layer], (key, layer)
    assert reports["grouped"]["expert_coverage"] == reports["per_expert"]["expert_coverage"]


@pytest.mark.parametrize("preset", ["W4A16", "W8A8", "FP8_DYNAMIC", "MXFP4", "FP8_BLOCK", "NVFP4A16", "FP8", "NVFP4"])
def test_a_format_quantizes_a_grouped_capture_as_the_per_expert_graph(preset):
    """Each expert's routed rows and weight quantized as its Linear's: scales that follow the rows over every
    expert's rows at once; a weight's scales that span it (FP8's blocks, NVFP4's global one) expert by expert; an
    activation's static scale over a whole tensor (FP8's, NVFP4's global one) observed and applied expert by expert.
    The per-expert graph's values and records bit for bit."""
    from qcore.analysis import measure_sqnr
    from qcore.quantization.format_quantizer import FormatQuantizer

    model, data = tiny_moe("qwen3_moe", layers=2, experts=4, batch=4, n=4)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    per_expert = qcore.capture(model, data[0])
    a = measure_sqnr(grouped, data, FormatQuantizer(preset))
    b = measure_sqnr(per_expert, data, FormatQuantizer(preset))
    assert set(a.layers) == set(b.layers)
    for layer, expected in b.layers.items():
        for field in ("shadow_sqnr_db", "weight_sqnr_db"):
            value, wanted = getattr(a.layers[layer], field), getattr(expected, field)
            assert value == wanted or (math.isnan(value) and math.isnan(wanted)), (layer, field)
    assert a.outputs["output"].sqnr_db == b.outputs["output"].sqnr_db
    assert math.isfinite(a.layers["model.layers.1.mlp.experts.2.down_proj"].weight_sqnr_db)  # quantized


def test_a_format_given_experts_of_one_projection_differently_refuses_a_grouped_capture():
    """Experts of one projection in different presets: not taken yet, and left in float they would pass for
    quantized."""
    from qcore.quantization.format_quantizer import FormatQuantizer

    model, data = tiny_moe("qwen3_moe", layers=1, experts=4, batch=2, n=1)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    quantizer = FormatQuantizer("W4A16", layer_overrides={"model.layers.0.mlp.experts.1.down_proj": {"format": "W8A8"}})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.down_proj: its experts are given different"):
        prepare(clone_graph_module(grouped), quantizer)


@pytest.mark.parametrize("skipped", [
    {"model.layers.0.mlp.experts.2.down_proj": {"skip": True}},
    {"model.layers.1.mlp.experts.*.gate_proj": {"skip": True}, "model.layers.0.mlp.experts.1.up_proj": {"skip": True}},
], ids=["one-expert", "a-projection-and-an-expert"])
def test_experts_a_layer_override_skips_stay_in_float_as_on_the_per_expert_graph(skipped):
    """A fix that keeps experts in float (`skip`, float_layers): their rows, weights and outputs stay float, the
    others quantized: the per-expert graph's values and records, bit for bit."""
    from qcore.analysis import measure_sqnr

    quantizer = qcore.Int8StaticQuantizer(layer_overrides=skipped)
    (_, grouped), (_, per_expert), data = _both("qwen3_moe", quantizer, experts=4)
    assert torch.equal(logits_of(grouped(**data[-1])), logits_of(per_expert(**data[-1])))
    model, data = tiny_moe("qwen3_moe", layers=2, experts=4, batch=4, n=4)
    with experts_grouped():
        grouped_float = qcore.capture(model, data[0])
    a = measure_sqnr(grouped_float, data, quantizer)
    b = measure_sqnr(qcore.capture(model, data[0]), data, quantizer)
    for layer, expected in b.layers.items():
        for field in ("shadow_sqnr_db", "weight_sqnr_db"):
            value, wanted = getattr(a.layers[layer], field), getattr(expected, field)
            assert value == wanted or (math.isnan(value) and math.isnan(wanted)), (layer, field)
    assert math.isinf(a.layers["model.layers.0.mlp.experts.1.up_proj" if len(skipped) > 1 else
                               "model.layers.0.mlp.experts.2.down_proj"].shadow_sqnr_db)
    assert a.outputs["output"].sqnr_db == b.outputs["output"].sqnr_db


@pytest.mark.parametrize("overrides", [
    {"model.layers.0.mlp.experts.2.gate_proj": {"activation_observer": "histogram"}},
    {"model.layers.1.mlp.experts.*.down_proj": {"activation_observer": "histogram"},
     "model.layers.0.mlp.experts.1.up_proj": {"activation_observer": "histogram"},
     "model.layers.0.mlp.experts.3.gate_proj": {"skip": True}},
], ids=["one-experts-gate", "a-projection-an-experts-up-and-a-skip"])
def test_experts_an_override_gives_another_observer_observe_with_it_as_on_the_per_expert_graph(overrides):
    """The outlier screen's change (a clipping observer for named experts): each expert's rows observed with its
    own class; an override of the gate or the up projection changes the observer of the rows both read, as
    prepare's callback does on the per-expert graph. The values bit for bit."""
    quantizer = qcore.Int8StaticQuantizer(layer_overrides=overrides)
    (segmented, grouped), (_, per_expert), data = _both("qwen3_moe", quantizer, experts=4)
    assert any(isinstance(observer, PerExpertObservers) for observer in segmented)
    assert torch.equal(logits_of(grouped(**data[-1])), logits_of(per_expert(**data[-1])))


@pytest.mark.parametrize("overrides", [
    {"model.layers.0.mlp.experts.2.gate_proj": {"is_dynamic": True}},
    {"model.layers.1.mlp.experts.*.down_proj": {"is_dynamic": True},
     "model.layers.0.mlp.experts.1.up_proj": {"is_dynamic": True, "activation_observer": "histogram"},
     "model.layers.0.mlp.experts.3.down_proj": {"skip": True}},
], ids=["one-experts-gate", "a-projection-an-experts-up-and-a-skip"])
def test_experts_an_override_makes_dynamic_are_quantized_from_their_own_rows_as_on_the_per_expert_graph(overrides):
    """The dynamic-vs-static screen's change: a dynamic expert's rows quantized with qparams from their own range
    in each batch, its output left in float, the other experts static: the per-expert graph's values and records, bit
    for bit."""
    from qcore.analysis import measure_sqnr

    quantizer = qcore.Int8StaticQuantizer(layer_overrides=overrides)
    (_, grouped), (_, per_expert), data = _both("qwen3_moe", quantizer, experts=4)
    for batch in data:
        assert torch.equal(logits_of(grouped(**batch)), logits_of(per_expert(**batch)))
    model, data = tiny_moe("qwen3_moe", layers=2, experts=4, batch=4, n=4)
    with experts_grouped():
        a = measure_sqnr(qcore.capture(model, data[0]), data, quantizer)
    b = measure_sqnr(qcore.capture(model, data[0]), data, quantizer)
    for layer, expected in b.layers.items():
        value, wanted = a.layers[layer].shadow_sqnr_db, expected.shadow_sqnr_db
        assert value == wanted or (math.isnan(value) and math.isnan(wanted)), layer


@pytest.mark.parametrize("overrides", [
    {"model.layers.0.mlp.experts.1.down_proj": {"is_dynamic": True}},
    {"model.layers.0.mlp.experts.2.gate_proj": {"skip": True}},
], ids=["an-expert-dynamic", "an-expert-skipped"])
def test_a_trial_takes_the_grouped_observers_state_its_experts_saw_without_a_calibration_pass(overrides):
    """A fix trial on a grouped capture (some experts made dynamic or kept in float) takes the state the model's
    observers of every expert calibrated to, keeping the experts it was told of: no calibration pass, and the
    quantized graph that calibrating it anew gives, bit for bit."""
    from qcore.quantization.calibrated import CalibratedObservers, calibrate_kept

    model, data = tiny_moe("qwen3_moe", layers=1, experts=4, batch=4, n=3)
    with experts_grouped():
        gm = qcore.capture(model, data[0])
    kept = CalibratedObservers()
    calibrate_kept(prepare(clone_graph_module(gm), qcore.Int8StaticQuantizer(), recompile=False), data, kept)
    assert any("Segmented" in signature for signature in kept._states), "the grouped observers were kept"
    trial = qcore.Int8StaticQuantizer(layer_overrides=overrides)
    taken = prepare(clone_graph_module(gm), trial, recompile=False)
    missing = kept.take(taken, kept.signatures(taken))
    assert missing == []
    told = [module for module in taken.modules() if isinstance(module, ExpertsObserver) and
            (module.dynamic_experts or module.float_experts)]
    assert told, "the trial's own experts stay dynamic or in float"
    calibrate_kept(taken, data, kept)
    fresh = prepare(clone_graph_module(gm), trial)
    calibrate(fresh, data)
    quantized, expected = convert(taken), convert(fresh)
    for batch in data:
        assert torch.equal(logits_of(quantized(**batch)), logits_of(expected(**batch)))


def _captures(architecture="qwen3_moe", **shape):
    """(model, batches, the per-expert capture, the grouped capture) of a tiny MoE."""
    model, data = tiny_moe(architecture, layers=2, experts=4, batch=4, n=4, **shape)
    with experts_grouped():
        grouped = qcore.capture(model, data[0])
    return model, data, qcore.capture(model, data[0]), grouped


@pytest.mark.parametrize(("architecture", "where_read"), [("qwen3_moe", False), ("gpt_oss", False),
                                                          ("qwen3_moe", True), ("gpt_oss", True)])
def test_the_equalization_variants_of_a_grouped_captures_experts_are_the_per_expert_captures(architecture,
                                                                                            where_read, monkeypatch):
    """Each expert's input-weight equalization variant, measured on its projection's shadow with each expert's
    factor, input qparams and divided weight, and its baseline: the per-expert graph's values, to the bit; with
    weights quantized where they are read too."""
    from qcore.analysis import AnalysisPlan, ModelAnalysis

    _, data, per_expert, grouped = _captures(architecture)
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "equalization"}))
    with _where_read(where_read, monkeypatch):
        expected = ModelAnalysis(per_expert, qcore.Int8StaticQuantizer(), data, plan=plan)
        expected.equalization_variants  # noqa: B018 - measured within the block
        found = ModelAnalysis(grouped, qcore.Int8StaticQuantizer(), data, plan=plan)
        found.equalization_variants  # noqa: B018
    wanted = {layer: methods for layer, methods in expected.equalization_variants.items() if ".experts." in layer}
    assert wanted
    for layer, methods in wanted.items():
        assert found.equalization_variants[layer] == methods, layer
    assert found.context.rewrite_scales.keys() >= {key for key in expected.context.rewrite_scales if
                                                    ".experts." in key[1]}


def test_equalizing_experts_of_a_grouped_capture_rewrites_them_as_the_per_expert_capture():
    """equalize() of expert layers (a glob, and one expert alone) on a grouped capture: each chosen expert's rows
    scaled and its weight's columns divided, the float model's outputs those of the per-expert capture equalized
    alike, and quantized, the same logits."""
    from qcore.rewrites.equalize import equalize

    _, data, per_expert, grouped = _captures()
    layers = ["model.layers.0.mlp.experts.*.down_proj", "model.layers.1.mlp.experts.2.up_proj"]
    a, b = equalize(per_expert, layers, data), equalize(grouped, layers, data)
    for batch in data:
        assert torch.equal(logits_of(a(**batch)), logits_of(b(**batch)))
    (_, quantized_a), (_, quantized_b) = (_quantized(gm, qcore.Int8StaticQuantizer(), data) for gm in (a, b))
    for batch in data:
        assert torch.equal(logits_of(quantized_a(**batch)), logits_of(quantized_b(**batch)))


@pytest.mark.parametrize("where_read", [False, True])
def test_a_switchable_grouped_capture_switches_each_expert_as_the_per_expert_capture_does(where_read, monkeypatch):
    """The float_layers search's switchable model of a grouped capture: each expert's quantizers switched on and off
    alone, the output SQNR the per-expert capture's for every set of layers in float, runs resumed part-way
    included; with weights quantized where they are read too."""
    _, data, per_expert, grouped = _captures()
    with _where_read(where_read, monkeypatch):
        _switch_experts(data, per_expert, grouped, where_read)


def _switch_experts(data, per_expert, grouped, where_read):
    from qcore.search.sensitivity import SwitchableModel, _ExpertsWhereReadWeightSwitch

    a, b = SwitchableModel(per_expert, data), SwitchableModel(grouped, data)
    assert a.layers == b.layers
    assert any(isinstance(switch, _ExpertsWhereReadWeightSwitch) for switch, _ in b._switches) == where_read
    assert b._resumable.enabled
    for model in (a, b):
        model.quantize_only(model.layers)
        model.record(data[:2])
    for kept in (["model.layers.1.mlp.experts.2.down_proj"], ["model.layers.0.mlp.experts.1.gate_proj",
                                                              "model.layers.0.mlp.experts.3.up_proj"],
                 [layer for layer in a.layers if ".experts." in layer]):
        values = []
        for model in (a, b):
            model.quantize_only([layer for layer in model.layers if layer not in kept])
            values.append(model.run(data[:2]))
        assert values[0] == values[1], kept


def test_an_experts_outlier_ratios_leave_out_its_batches_of_few_tokens_alike_in_either_capture():
    """expert_min_batch_tokens: an expert's batch of fewer tokens gives no ratio, in the grouped capture as one
    Linear per expert; the other layers' entries are torch.ao's rule's (every batch)."""
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.report import OutlierDetector

    data, captures = _grouped_and_per_expert(layers=1, experts=8, batch=2, tokens=8, n=4)
    reports = {}
    for name, gm in captures.items():
        for fewest in (0, 4):
            plan = AnalysisPlan(measurements=frozenset({"detectors"}),
                                detectors={"outlier": OutlierDetector(expert_min_batch_tokens=fewest)})
            analysis = ModelAnalysis(gm, qcore.Int8StaticQuantizer(per_channel=False), data, plan=plan)
            reports[name, fewest] = _plain(analysis.measurement.detector_reports["outlier"])
    experts = set(expert_layers(captures["per_expert"]))
    for layer, entry in reports["per_expert", 4].items():  # the experts' activation aside (the test above)
        assert layer.endswith("experts.act_fn") or reports["grouped", 4][layer] == entry, layer
    every, fewer = reports["per_expert", 0], reports["per_expert", 4]
    assert set(every) == set(fewer) and experts < set(every)
    used = "outlier_detection_batches_used"
    for layer in set(every) - experts:
        assert fewer[layer] == every[layer], layer
    assert all(b <= a for layer in experts for a, b in zip(every[layer][used], fewer[layer][used]))
    left_out = [layer for layer in experts if fewer[layer][used] != every[layer][used]]
    kept = [layer for layer in experts if any(fewer[layer][used])]
    assert left_out and kept, "some experts saw fewer than 4 tokens in a batch, and some 4 or more"
