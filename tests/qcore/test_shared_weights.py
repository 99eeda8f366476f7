"""A convert given the model's converted graph (`weights_from`) shares each weight that graph quantized the same way
(the same float parameter, qparams or format) instead of quantizing it again, and quantizes every other weight
itself: the converted copy computes exactly what a convert of its own gives. A screen's copy whose change is the
activations' observers only is such a copy."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore.graph.capture import capture, clone_graph_module
from qcore.quantization.calibrate import calibrate
from qcore.quantization.convert import convert
from qcore.quantization.format_quantizer import FormatQuantizer
from qcore.quantization.prepare import prepare
from tests.models import SmallMLP, tiny_moe


def _converted(float_gm, quantizer, batches, weights_from=None):
    prepared = prepare(clone_graph_module(float_gm, share_parameters=True), quantizer)
    calibrate(prepared, batches)
    return convert(prepared, keep_float_weights=False, weights_from=weights_from)


def _quantized_weights(gm):
    """{float parameter: the quantized weight buffer the converted graph reads for it}."""
    return {node.meta["qcore_float_weight"]: gm.get_buffer(str(node.target)) for node in gm.graph.nodes
            if node.op == "get_attr" and "qcore_float_weight" in node.meta}


@pytest.mark.parametrize("model_quantizer, same, other", [
    (qcore.Int8StaticQuantizer(), qcore.Int8StaticQuantizer(activation_observer="histogram"),
     qcore.Int8StaticQuantizer(per_channel=False)),
    (FormatQuantizer("W4A16"), FormatQuantizer("W4A16", layer_overrides={"fc2": {"skip": True}}),
     FormatQuantizer("W8A16")),
], ids=["int8", "format"])
def test_a_copy_quantized_the_same_way_shares_the_models_weights_and_computes_what_its_own_convert_does(
        model_quantizer, same, other):
    torch.manual_seed(0)
    batches = [torch.randn(4, 128) for _ in range(3)]
    float_gm = capture(SmallMLP(features=128, hidden=256, classes=16).eval(), batches[0])  # W4A16's groups of 128
    model = _converted(float_gm, model_quantizer, batches)
    model_weights = _quantized_weights(model)
    for quantizer, shares in ((same, True), (other, False)):
        copy = _converted(float_gm, quantizer, batches, weights_from=model)
        alone = _converted(float_gm, quantizer, batches)
        weights, own = _quantized_weights(copy), _quantized_weights(alone)
        assert set(weights) == set(own) and weights
        for name, weight in weights.items():
            assert torch.equal(weight, own[name])
            assert (weight is model_weights.get(name)) == shares, name
        for batch in batches:
            assert torch.equal(copy(batch), alone(batch))


def test_an_moe_models_outlier_screen_shares_every_expert_weight_and_measures_what_it_measured_alone(monkeypatch):
    import qcore.quantization.convert as convert_module
    from pytest_qreport.checks import BUILTIN_CHECKS
    from tests.helpers import analyze_with_checks

    model, batches = tiny_moe("qwen3_moe", layers=2, experts=8)
    checks = [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    asked, shared = [], []
    find = convert_module._QuantizedWeights.find

    def counted(self, source, weight, how):
        found = find(self, source, weight, how)
        if self.earlier is not None:
            asked.append(str(source.target))
            shared.append(found is not None)
        return found

    monkeypatch.setattr(convert_module._QuantizedWeights, "find", counted)
    # the heuristic on every batch, as torch.ao's: it names experts that saw a few tokens in a batch
    every_batch = {"outlier": {"expert_min_batch_tokens": 0}}
    findings, analysis = analyze_with_checks(lambda: model, batches, checks=checks, check_options=every_batch)
    screened = analysis.screened("outlier")
    assert screened is not None and len(screened.own_sqnr_db) >= 16  # the experts' projections among them
    assert any(".experts." in name for name in asked) and all(shared), asked  # histogram observers: weights as before
    monkeypatch.setattr(convert_module._QuantizedWeights, "find", lambda self, source, weight, how: None)
    findings_alone, analysis_alone = analyze_with_checks(lambda: model, batches, checks=checks,
                                                         check_options=every_batch)
    assert analysis_alone.screened("outlier").own_sqnr_db == screened.own_sqnr_db
    assert {key: finding.verdict for key, finding in findings.items()} == \
        {key: finding.verdict for key, finding in findings_alone.items()}


def _matmuls(function):
    """(the aten mm and addmm calls `function()` dispatches, what it returned)."""
    from tests.helpers import count_op_calls

    calls = {}

    def counted():
        addmm, returned = count_op_calls(function, torch.ops.aten.addmm)
        calls["addmm"] = addmm
        return returned

    mm, returned = count_op_calls(counted, torch.ops.aten.mm)
    return mm + calls["addmm"], returned


@settings(max_examples=40, deadline=None)
@given(rows=st.tuples(st.integers(0, 160), st.integers(0, 160)), shape=st.sampled_from([(512, 1024), (1024, 512),
                                                                                      (64, 96)]),
       lead=st.sampled_from([(), (2,)]), bias=st.booleans())
def test_two_matmuls_of_one_weight_run_as_one_where_rows_are_few_and_the_weight_large(rows, shape, lead, bias):
    from qcore.numeric.instrument import linear_on_rows_together

    generator = torch.Generator().manual_seed(sum(rows))
    weight = torch.randn(shape, generator=generator)
    offset = torch.randn(shape[0], generator=generator) if bias else None
    first, second = (torch.randn(*lead, count, shape[1], generator=generator) for count in rows)
    alone = [torch.nn.functional.linear(x, weight, offset) for x in (first, second)]
    matmuls, together = _matmuls(lambda: linear_on_rows_together(first, second, weight, offset))
    one = max(rows) * math.prod(lead) <= 128 and weight.numel() >= 1 << 19
    assert matmuls == (1 if one else 2)
    for got, expected in zip(together, alone):
        assert got.shape == expected.shape
        if one:  # one matmul's blocking may round a row's sums otherwise in the last bit
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # sums of 1024 float32 terms
        else:
            assert torch.equal(got, expected)


def test_a_screens_shadow_and_the_layers_own_multiply_by_one_weight_at_once_and_measure_what_they_measure_apart(
        monkeypatch):
    import importlib

    from pytest_qreport.checks import BUILTIN_CHECKS
    from qcore.graph.capture import experts_grouped
    from qcore.numeric.instrument import pair_shadow_matmuls
    from tests.helpers import analyze_with_checks

    compare = importlib.import_module("qcore.numeric.compare")
    model, batches = tiny_moe("qwen3_moe", layers=1, experts=4, hidden=1024, width=512)  # experts of 2^19 elements
    checks = [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    made = []

    def paired(graph):
        made.append(pair_shadow_matmuls(graph))
        return made[-1]

    def analyzed():
        with experts_grouped(False):  # one Linear per expert, as the plugin captures a large MoE
            # the heuristic on every batch, as torch.ao's: it names experts that saw a few tokens in a batch
            return analyze_with_checks(lambda: model, batches, checks=checks,
                                       check_options={"outlier": {"expert_min_batch_tokens": 0}})

    monkeypatch.setattr(compare, "pair_shadow_matmuls", paired)
    matmuls, (findings, analysis) = _matmuls(analyzed)
    monkeypatch.setattr(compare, "pair_shadow_matmuls", lambda graph: 0)
    matmuls_apart, (findings_apart, analysis_apart) = _matmuls(analyzed)
    screened, apart = analysis.screened("outlier"), analysis_apart.screened("outlier")
    experts = [layer for layer in screened.own_sqnr_db if ".experts." in layer]
    assert len(experts) >= 8 and sum(made) >= len(experts), (made, experts)
    # each expert's pair (its weight large, its rows few): one matmul a batch instead of two; the other layers'
    # weights are below linear_on_rows_together's size, and their pairs run one matmul each
    assert matmuls_apart - matmuls == len(experts) * len(batches)
    assert screened.own_sqnr_db.keys() == apart.own_sqnr_db.keys()
    for layer, value in screened.own_sqnr_db.items():
        assert value == pytest.approx(apart.own_sqnr_db[layer], abs=1e-3), layer
    for layer, record in analysis.sqnr.layers.items():
        assert record.shadow_sqnr_db == pytest.approx(analysis_apart.sqnr.layers[layer].shadow_sqnr_db, abs=1e-3,
                                                      nan_ok=True), layer
    assert {key: finding.verdict for key, finding in findings.items()} == \
        {key: finding.verdict for key, finding in findings_apart.items()}
