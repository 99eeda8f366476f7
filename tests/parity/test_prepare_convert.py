"""Prepare/convert: observers per group, sharing, fake-quant numerics, and parity with torch.ao's FX flow."""
import copy

import pytest
import torch
from torch.ao.quantization import QConfig, QConfigMapping
from torch.ao.quantization import observer as ao
from torch.ao.quantization.quantize_fx import convert_to_reference_fx, prepare_fx

import qcore
from qcore.numeric import compute_sqnr
from qcore.numeric.compare import compare
from qcore.quantization.prepare import get_edge_or_node_to_qspec
from tests.models import CatModel, SmallCNN, SmallMLP, batches


def _observer_nodes(gm):
    return [n for n in gm.graph.nodes if n.meta.get("qcore_inserted") == "observer"]


def test_one_observer_instance_per_group_and_cat_shares():
    gm = qcore.capture(CatModel().eval(), torch.randn(2, 8))
    group_ids = qcore.get_edge_or_node_to_group_id(get_edge_or_node_to_qspec(qcore.Int8StaticQuantizer().annotate(
        copy.deepcopy(gm))))
    prepared = qcore.prepare(gm, qcore.Int8StaticQuantizer())
    cat = next(n for n in prepared.graph.nodes if n.target == torch.ops.aten.cat.default)
    a_out, b_out = cat.args[0]
    # both cat inputs and its output are one group, so a single observer module watches all three
    assert a_out.target == b_out.target
    observers = {n.target for n in _observer_nodes(prepared)}
    assert len(observers) == len(set(group_ids.values()))


def test_weights_match_torch_per_channel_fake_quant():
    model = SmallMLP().eval()
    data = batches((8, 32))
    _, quant_gm = qcore.quantize(model, data[0], data)
    weight = model.fc1.weight.detach()
    scale = weight.abs().amax(1) / 127
    reference = torch.fake_quantize_per_channel_affine(weight, scale, torch.zeros(64, dtype=torch.int32), 0, -127, 127)
    torch.testing.assert_close(quant_gm.qcore_fq_fc1_weight, reference)


def test_per_tensor_quantizer_and_layer_overrides():
    model = SmallMLP().eval()
    data = batches((8, 32))
    quantizer = qcore.Int8StaticQuantizer(per_channel=False, layer_overrides={"fc3": {"skip": True}})
    float_gm, quant_gm = qcore.quantize(model, data[0], data, quantizer)
    layers = [r["layer"] for r in compare(float_gm, quant_gm, data) if r["op"] != "output"]
    w = quant_gm.qcore_fq_fc1_weight
    assert torch.unique(w / (model.fc1.weight.abs().max() / 127)).round().numel() <= 255
    assert not hasattr(quant_gm, "qcore_fq_fc3_weight")
    assert "fc3" in layers  # still compared, just not quantized


def test_dynamic_override_quantizes_per_batch():
    model = SmallMLP().eval()
    data = batches((8, 32))
    quantizer = qcore.Int8StaticQuantizer(layer_overrides={"fc1": {"is_dynamic": True}})
    _, quant_gm = qcore.quantize(model, data[0], data, quantizer)
    assert any(getattr(n.target, "__name__", "") == "fake_quantize_dynamic" for n in quant_gm.graph.nodes)


def test_a_layers_activation_observer_observes_what_it_reads_and_nothing_else():
    """fc2's override gives the tensor fc2 reads (fc1's output after its relu) a histogram observer, and leaves
    fc2's own output (what fc3 reads) and the model's input with the quantizer's min/max observer."""
    from qcore.observe.observers import HistogramObserver, MinMaxObserver

    gm = qcore.capture(SmallMLP().eval(), torch.randn(8, 32))
    quantizer = qcore.Int8StaticQuantizer(layer_overrides={"fc2": {"activation_observer": "histogram"}})
    prepared = qcore.prepare(gm, quantizer)
    linears = [n for n in prepared.graph.nodes if n.target == torch.ops.aten.linear.default]
    reads = [type(prepared.get_submodule(linear.args[0].target)) for linear in linears]
    assert reads == [MinMaxObserver, HistogramObserver, MinMaxObserver]
    output = next(iter(next(n for n in prepared.graph.nodes if n.op == "output").all_input_nodes))
    assert type(prepared.get_submodule(output.target)) is MinMaxObserver


def test_quantized_model_is_close_to_float():
    model = SmallCNN().eval()
    data = batches((4, 3, 16, 16))
    float_gm, quant_gm = qcore.quantize(model, data[0], data)
    with torch.no_grad():
        assert float(compute_sqnr(float_gm(data[0]), quant_gm(data[0]))) > 25


def _torch_ao_layer_sqnr(model, data, hook_names):
    """Per-layer SQNR of torch.ao's prepare_fx/convert_to_reference_fx int8 model."""
    qconfig = QConfig(
        activation=ao.MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine),
        weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                                     quant_min=-127, quant_max=127))
    prepared = prepare_fx(copy.deepcopy(model), QConfigMapping().set_global(qconfig), (data[0],))
    for batch in data:
        prepared(batch)
    # reference mode: torch.ao's int8 arithmetic simulated in float, the same on every CPU (its x86 kernels
    # accumulate in 16 bits on AVX2 and overflow with reduce_range=False)
    quantized = convert_to_reference_fx(prepared)
    captured = {"float": {}, "quant": {}}

    def hook(store, key):
        def save(module, inputs, output):
            store.setdefault(key, []).append(output.detach())
        return save

    for layer, float_name in hook_names.items():
        dict(model.named_modules())[float_name].register_forward_hook(hook(captured["float"], layer))
    # a layer's quantized output: the dequantize after the quantize that follows its module
    outputs = {}
    for node in quantized.graph.nodes:
        if node.op == "call_module" and node.target in hook_names:
            (quantize,) = node.users
            (dequantize,) = quantize.users
            outputs[dequantize] = node.target

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node in outputs:
                captured["quant"].setdefault(outputs[node], []).append(value.detach())
            return value

    with torch.no_grad():
        for batch in data:
            model(batch)
            Recorder(quantized).run(batch)
    return {layer: float(compute_sqnr(torch.cat(captured["float"][layer]), torch.cat(captured["quant"][layer])))
            for layer in hook_names}


@pytest.mark.parametrize("model_cls,shape,hooks", [
    (SmallMLP, (16, 32), {"fc1": "relu1", "fc2": "relu2", "fc3": "fc3"}),
    (SmallCNN, (4, 3, 16, 16), {"conv1": "relu1", "conv2": "relu2", "fc": "fc"}),
])
def test_layer_sqnr_equals_torch_ao_reference_mode(model_cls, shape, hooks):
    model = model_cls().eval()
    data = batches(shape, n=6)
    reference = _torch_ao_layer_sqnr(model, data, hooks)
    float_gm, quant_gm = qcore.quantize(model, data[0], data)
    ours = {r["layer"]: r["sqnr_db"] for r in compare(float_gm, quant_gm, data)}
    for layer, value in reference.items():  # measured: equal to 0.001 dB
        assert abs(ours[layer] - value) <= 0.05, (layer, ours[layer], value)


class _BiasAndSigmoidQuantizer(qcore.Quantizer):
    """Linear with an int32 bias whose scale derives from input x weight scales; sigmoid with fixed qparams."""

    def annotate(self, gm):
        from qcore.quantization.quantizer import int8_activation_spec, int8_weight_spec

        for node in gm.graph.nodes:
            if node.target == torch.ops.aten.linear.default:
                x, weight, bias = node.args
                act, wspec = int8_activation_spec(), int8_weight_spec(per_channel=False)

                def derive(observers):
                    (s_in, _), (s_w, _) = (o.calculate_qparams() for o in observers)
                    scale = (s_in * s_w).reshape(-1)
                    return scale, torch.zeros_like(scale, dtype=torch.int64)

                bias_spec = qcore.DerivedQuantizationSpec(derived_from=[(x, node), (weight, node)],
                                                          derive_qparams_fn=derive, dtype=torch.int32,
                                                          qscheme=torch.per_tensor_symmetric)
                node.meta["quantization_annotation"] = qcore.QuantizationAnnotation(
                    input_qspec_map={x: act, weight: wspec, bias: bias_spec}, output_qspec=int8_activation_spec())
            if node.target == torch.ops.aten.sigmoid.default:
                node.meta["quantization_annotation"] = qcore.QuantizationAnnotation(
                    output_qspec=qcore.FixedQParamsQuantizationSpec(torch.uint8, 1.0 / 256, 0))
        return gm


class _LinearSigmoid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(self.fc(x))


def test_derived_bias_and_fixed_qparams_specs():
    model = _LinearSigmoid().eval()
    data = batches((4, 8))
    _, quant_gm = qcore.quantize(model, data[0], data, _BiasAndSigmoidQuantizer())
    fq = {n.name: n.meta.get("qcore_qparams") for n in quant_gm.graph.nodes if n.meta.get("qcore_qparams")}
    bias = next(v for v in fq.values() if v["dtype"] == "torch.int32")
    inputs = next(v for v in fq.values() if v["dtype"] == "torch.int8" and v["qscheme"] == "torch.per_tensor_affine")
    weight = next(v for v in fq.values() if v["qscheme"] == "torch.per_tensor_symmetric" and v["dtype"] == "torch.int8")
    assert bias["scale"][0] == pytest.approx(inputs["scale"][0] * weight["scale"][0], rel=1e-6)
    assert any(v["dtype"] == "torch.uint8" and v["scale"] == [1.0 / 256] for v in fq.values())


def test_derived_spec_on_unannotated_key_is_a_clear_error():
    from qcore.quantization.prepare import QuantizationConfigError

    class Broken(_BiasAndSigmoidQuantizer):
        def annotate(self, gm):
            super().annotate(gm)
            linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
            annotation = linear.meta["quantization_annotation"]
            bias = linear.args[2]
            annotation.input_qspec_map[bias].derived_from = [linear.args[0]]  # a node with no spec
            return gm

    gm = qcore.capture(_LinearSigmoid().eval(), torch.randn(2, 8))
    with pytest.raises(QuantizationConfigError, match="has no spec"):
        qcore.prepare(gm, Broken())
