"""A convert given the model's converted graph (`weights_from`) shares each weight that graph quantized the same way
(the same float parameter, qparams or format) instead of quantizing it again, and quantizes every other weight
itself: the converted copy computes exactly what a convert of its own gives. A screen's copy whose change is the
activations' observers only is such a copy."""
import pytest
import torch

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
    findings, analysis = analyze_with_checks(lambda: model, batches, checks=checks)
    screened = analysis.screened("outlier")
    assert screened is not None and len(screened.own_sqnr_db) >= 16  # the experts' projections among them
    assert any(".experts." in name for name in asked) and all(shared), asked  # histogram observers: weights as before
    monkeypatch.setattr(convert_module._QuantizedWeights, "find", lambda self, source, weight, how: None)
    findings_alone, analysis_alone = analyze_with_checks(lambda: model, batches, checks=checks)
    assert analysis_alone.screened("outlier").own_sqnr_db == screened.own_sqnr_db
    assert {key: finding.verdict for key, finding in findings.items()} == \
        {key: finding.verdict for key, finding in findings_alone.items()}
