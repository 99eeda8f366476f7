"""Where qcore used to differ from torch.ao/torchao: each case cross-checked on the same input (issue: fidelity)."""
import pytest
import torch
from torch import fx, nn

import qcore
from qcore.convert import QPARAMS_KEY

torchao_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
tq = pytest.importorskip("torchao.quantization.pt2e.quantizer")
to = pytest.importorskip("torchao.quantization.pt2e.observer")
torchao_prepare = pytest.importorskip("torchao.quantization.pt2e.prepare")


def _batches(shape, count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(count)]


def _torchao(model, batches, quantizer):
    prepared = torchao_pt2e.prepare_pt2e(torch.export.export(model, (batches[0],)).module(), quantizer)
    for batch in batches:
        prepared(batch)
    return torchao_pt2e.convert_pt2e(prepared)


# ---- 1. an op that takes the same node twice ----

class CatTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.cat([y, y], 1)


def test_cat_of_one_tensor_twice_shares_one_observer_like_torchao():
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    torch.manual_seed(0)
    model, batches = CatTwice().eval(), _batches((4, 8))
    reference = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = torchao_pt2e.prepare_pt2e(torch.export.export(model, (batches[0],)).module(), reference)
    cat = next(n for n in prepared.graph.nodes if n.target == torch.ops.aten.cat.default)
    assert prepared.get_submodule(cat.args[0][0].target) is prepared.get_submodule(next(iter(cat.users)).target)

    _, quant_gm = qcore.quantize(model, batches[0], batches)   # raised "links form a cycle" before
    cat = next(n for n in quant_gm.graph.nodes if n.target == torch.ops.aten.cat.default)
    produced, output = cat.args[0][0].meta[QPARAMS_KEY], next(iter(cat.users)).meta[QPARAMS_KEY]
    assert produced["scale"] == output["scale"] and produced["zero_point"] == output["zero_point"]


def test_a_shared_spec_pointing_at_itself_is_a_no_op():
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    cat = graph.call_function(torch.cat, ([relu, relu], 1))
    graph.output(cat)
    for node in (relu, cat):
        node.meta["quantization_annotation"] = qcore.QuantizationAnnotation()
    spec = qcore.QuantizationSpec(torch.int8, qcore.MinMaxObserver)
    mapping = {relu: spec, (relu, cat): qcore.SharedQuantizationSpec((relu, cat)),
               cat: qcore.SharedQuantizationSpec((relu, cat))}
    # torchao 0.18 recurses until RecursionError on this mapping; the self-link adds nothing, so implicit
    # sharing puts the edge in relu's group, and cat shares it
    assert set(qcore.get_edge_or_node_to_group_id(mapping).values()) == {0}


# ---- 2. a float spec keeps a bias in float ----

def _float_bias_quantizer(module, base, observers):
    class FloatBias(base):
        def annotate(self, gm):
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                    x, weight, bias = node.args
                    act = module.QuantizationSpec(torch.int8, observers.MinMaxObserver, -128, 127,
                                                  torch.per_tensor_affine)
                    specs = {x: act, weight: module.QuantizationSpec(
                        torch.int8, observers.PerChannelMinMaxObserver, -127, 127, torch.per_channel_symmetric,
                        ch_axis=0), bias: module.QuantizationSpec(torch.float32, observers.PlaceholderObserver)}
                    node.meta["quantization_annotation"] = module.QuantizationAnnotation(
                        input_qspec_map=specs, output_qspec=act)
            return gm

        def validate(self, gm):
            pass

    return FloatBias()


def test_a_float32_placeholder_spec_keeps_the_bias_in_float_as_torchao_does():
    torch.manual_seed(0)
    model, batches = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval(), _batches((16, 8))
    reference = _torchao(model, batches, _float_bias_quantizer(tq, tq.Quantizer, to))
    _, ours = qcore.quantize(model, batches[0], batches, _float_bias_quantizer(qcore, qcore.Quantizer, qcore))
    biases = [n for n in ours.graph.nodes if n.op == "get_attr" and n.target.endswith("bias")]
    assert biases and all(all(u.target == torch.ops.aten.linear.default for u in n.users) for n in biases)
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(ours(batch), reference(batch), rtol=0, atol=1e-6)


def test_a_float16_placeholder_spec_rounds_through_float16():
    observer = qcore.PlaceholderObserver(dtype=torch.float16)
    assert observer.is_float and observer.dtype == torch.float16
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    graph.output(relu)
    gm = fx.GraphModule(nn.Module(), graph)

    class Half(qcore.Quantizer):
        def annotate(self, gm):
            node = next(n for n in gm.graph.nodes if n.target is torch.relu)
            node.meta["quantization_annotation"] = qcore.QuantizationAnnotation(
                output_qspec=qcore.QuantizationSpec(torch.float16, qcore.PlaceholderObserver))
            return gm

    quant = qcore.convert(qcore.prepare(gm, Half()))
    value = torch.randn(64) * 1000
    torch.testing.assert_close(quant(value), torch.relu(value).half().float(), rtol=0, atol=0)
