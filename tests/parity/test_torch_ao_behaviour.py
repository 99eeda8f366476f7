"""Where qcore used to differ from torch.ao/torchao: each case cross-checked on the same input (issue: fidelity)."""
import pytest
import torch
from torch import fx, nn

import qcore
from qcore.numeric import compute_sqnr
from qcore.quantization.convert import QPARAMS_KEY

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


# ---- 3-5. the numeric suite: result names, input logging in shadow mode, the scope of add_loggers ----

class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.pool = nn.Linear(8, 8), nn.Linear(8, 8), nn.MaxPool1d(2)

    def forward(self, x):
        y = torch.relu(self.fc1(x))
        z = torch.sigmoid(self.fc2(y))
        return self.pool(((y + z) * z).unsqueeze(1)).squeeze(1)


def _entries(results):
    for layer, per_type in results.items():
        for results_type, per_model in per_type.items():
            for model, entries in per_model.items():
                for entry in entries:
                    yield layer, results_type, model, entry


def _validate_like_torch_ao(results):
    """The invariants of torch.ao's result structure, which torch.ao's own results satisfy."""
    for layer, results_type, model, entry in _entries(results):
        assert entry["type"] == results_type
        if results_type == "node_output":
            assert entry["ref_node_name"] == entry["prev_node_name"], (layer, model, entry)
        else:
            assert entry["ref_node_name"] != entry["prev_node_name"], (layer, model, entry)
    for per_type in results.values():
        for per_model in per_type.get("node_input", {}).values():
            assert [e["index_of_arg"] for e in per_model] == sorted(e["index_of_arg"] for e in per_model)


def _kind(target_type):
    for kind in ("linear", "relu", "sigmoid", "add", "mul", "pool"):
        if kind in target_type.lower():
            return kind
    return target_type


def _torch_ao_logger_results(model, batch, should_log_inputs):
    import copy

    import torch.ao.ns._numeric_suite_fx as ao_ns
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("fbgemm"), (batch,))
    prepared(batch)
    quantized = convert_fx(copy.deepcopy(prepared))
    a, b = ao_ns.add_loggers("fp32", prepared, "int8", quantized, ao_ns.OutputLogger,
                             should_log_inputs=should_log_inputs)
    a(batch)
    b(batch)
    return ao_ns.extract_logger_info(a, b, ao_ns.OutputLogger, "int8")


@pytest.mark.parametrize("method", ["export", "fx"])
def test_add_loggers_names_and_scope_follow_torch_ao(method):
    from qcore import numeric as qns

    torch.manual_seed(0)
    model, batch = Mixed().eval(), torch.randn(4, 8)
    reference = _torch_ao_logger_results(model, batch, should_log_inputs=True)
    _validate_like_torch_ao(reference)
    float_gm, quant_gm = qcore.quantize(qcore.capture(model, batch, method=method), batch, [batch])
    a, b = qns.add_loggers("fp32", float_gm, "int8", quant_gm, qns.OutputLogger, should_log_inputs=True)
    a(batch)
    b(batch)
    ours = qns.extract_logger_info(a, b, qns.OutputLogger, "int8")
    _validate_like_torch_ao(ours)
    # every op torch.ao logs, except the relu that qcore fuses into fc1's output
    logged = {_kind(e["ref_node_target_type"]) for *_, e in _entries(ours)}
    assert {_kind(e["ref_node_target_type"]) for *_, e in _entries(reference)} - {"relu"} <= logged
    assert list(ours) == ["fc1", "fc2", "sigmoid", "add", "mul", "pool"]
    # an input entry names the node that produced the input; add logs both of its arguments
    add_inputs = ours["add"]["node_input"]["fp32"]
    assert [(e["prev_node_name"], e["index_of_arg"]) for e in add_inputs] == [("relu", 0), ("sigmoid", 1)]
    assert (ours["fc2"]["node_input"]["int8"][0]["prev_node_target_type"]
            == "qcore.observe.qparams.fake_quantize_per_tensor")
    assert ours["pool"]["node_output"]["fp32"][0]["fqn"] == "pool"
    # the streaming compare's scope: quantized layers only
    a, b = qns.add_loggers("fp32", float_gm, "int8", quant_gm, qns.OutputLogger, only_quantized_layers=True)
    a(batch)
    b(batch)
    assert list(qns.extract_logger_info(a, b, qns.OutputLogger, "int8")) == ["fc1", "fc2"]


def test_add_shadow_loggers_logs_inputs_when_asked():
    from qcore import numeric as qns

    torch.manual_seed(0)
    model, batch = Mixed().eval(), torch.randn(16, 8)
    float_gm, quant_gm = qcore.quantize(model, batch, [batch])
    for should_log_inputs, loggers in ((False, 2), (True, 4)):
        shadow = qns.add_shadow_loggers("fp32", float_gm, "int8", quant_gm, qns.OutputLogger,
                                        should_log_inputs=should_log_inputs)
        assert sum(isinstance(m, qns.OutputLogger) for m in shadow.modules()) == loggers * 2   # fc1 and fc2
        shadow(batch)
        results = qns.extract_shadow_logger_info(shadow, qns.OutputLogger, "int8")
        _validate_like_torch_ao(results)
    fed = results["fc2"]["node_input"]
    float_input, quantized_input = fed["fp32"][0]["values"][0], fed["int8"][0]["values"][0]
    assert not torch.equal(float_input, quantized_input)      # the copy quantizes the float input it is fed
    assert float(qns.compute_sqnr(float_input, quantized_input)) > 25


# ---- 0. conv/linear followed by BatchNorm is folded before annotation ----

class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


class InvertedResidual(nn.Module):
    """torchvision MobileNetV2/EfficientNet-style: expand conv-bn-relu6, depthwise conv-bn-relu6, squeeze-
    excitation with in-place activations, projection conv-bn, residual add."""

    def __init__(self, channels=16, expand=4):
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                    nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True))
        self.se_reduce, self.se_expand = nn.Conv2d(hidden, 8, 1), nn.Conv2d(8, hidden, 1)
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        scale = torch.sigmoid(self.se_expand(nn.functional.silu(self.se_reduce(y.mean((2, 3), keepdim=True)))))
        return x + self.project(y * scale)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(), InvertedResidual())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _settled(model, batches):
    """BatchNorm running statistics from a few batches, with non-trivial affine parameters, then eval."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 2.0)
                module.bias.uniform_(-0.5, 0.5)
        model.train()
        for batch in batches:
            model(batch)
    return model.eval()


@pytest.mark.parametrize("method", ["export", "fx"])
def test_conv_bn_is_folded_into_the_conv_as_torch_ao_fuses_it(method):
    from torch.ao.quantization.quantize_fx import fuse_fx

    batches = _batches((4, 3, 16, 16), count=4)
    model = _settled(ConvBnRelu(), batches)
    fused = fuse_fx(model)   # torch.ao: ConvReLU2d with the BatchNorm folded into the conv
    float_gm = qcore.capture(model, batches[0], method=method)
    assert [(f.layer, f.batch_norm) for f in float_gm.meta["qcore_folded_bn"]] == [("conv1", "bn1"), ("conv2", "bn2")]
    assert not any("batch_norm" in str(n.target) or n.op == "call_module" for n in float_gm.graph.nodes)
    layers = {op.layer: op for op in qcore.find_quantizable_ops(float_gm)}
    assert list(layers) == ["conv1", "conv2", "fc"]   # reported under the conv's name
    for name in ("conv1", "conv2"):
        reference = dict(fused.named_modules())[name]
        reference = reference[0] if isinstance(reference, nn.Sequential) else reference   # ConvReLU2d holds it
        ours = layers[name]
        torch.testing.assert_close(getattr(float_gm, ours.weight.target), reference.weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(getattr(float_gm, ours.bias.target), reference.bias, rtol=1e-5, atol=1e-6)
        assert layers[name].output.target in (torch.ops.aten.relu.default, torch.relu)   # conv-bn-relu: one layer
    with torch.no_grad():
        torch.testing.assert_close(float_gm(batches[0]), model(batches[0]), rtol=1e-4, atol=1e-5)


def _torch_ao_output_sqnr(model, batches):
    import copy

    from torch.ao.quantization import QConfig, QConfigMapping
    from torch.ao.quantization import observer as ao
    from torch.ao.quantization.quantize_fx import convert_to_reference_fx, prepare_fx

    qconfig = QConfig(
        activation=ao.MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine),
        weight=ao.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                                     quant_min=-127, quant_max=127))
    prepared = prepare_fx(copy.deepcopy(model), QConfigMapping().set_global(qconfig), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
        quantized = convert_to_reference_fx(prepared)  # simulated in float: the same on every CPU
        reference, output = torch.cat([model(b) for b in batches]), torch.cat([quantized(b) for b in batches])
    return float(compute_sqnr(reference, output))


@pytest.mark.parametrize("model_class", [ConvBnRelu, Blocks])
def test_folded_output_sqnr_agrees_with_torch_ao(model_class):
    batches = _batches((8, 3, 16, 16), count=4)
    model = _settled(model_class(), batches)
    reference = _torch_ao_output_sqnr(model, batches)
    measured = {}
    for fold in (True, False):
        float_gm = qcore.capture(model, batches[0], fold_bn=fold)
        _, quant_gm = qcore.quantize(float_gm, batches[0], batches)
        with torch.no_grad():
            expected, output = torch.cat([model(b) for b in batches]), torch.cat([quant_gm(b) for b in batches])
        measured[fold] = float(compute_sqnr(expected, output))
    # folded: what an int8 deployment runs, as torch.ao's reference mode simulates it; unfolded, the BatchNorm
    # runs in float between two quantizers, which no int8 backend does
    assert abs(measured[True] - reference) <= 0.5, (measured, reference)
    assert abs(measured[False] - reference) > abs(measured[True] - reference)


# ---- 6-11: ModelReport, lazy modules, float qparams, report text ----

def test_lazy_modules_are_materialized_before_capture():
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)).eval()
    batch = torch.randn(2, 3, 8, 8)
    float_gm = qcore.capture(model, batch)
    assert [op.layer for op in qcore.find_quantizable_ops(float_gm)] == ["0", "3"]
    with torch.no_grad():
        torch.testing.assert_close(float_gm(batch), model(batch))


def test_a_second_prepare_detailed_calibration_is_a_value_error_as_in_torch_ao():
    from qcore.report import ModelReport, OutlierDetector

    report = ModelReport(nn.Sequential(nn.Linear(4, 4)).eval(), [OutlierDetector()], example_inputs=torch.randn(2, 4))
    report.prepare_detailed_calibration()
    with pytest.raises(ValueError, match="already called"):
        report.prepare_detailed_calibration()


def test_per_channel_affine_float_qparams_match_torch_ao():
    from torch.ao.quantization import observer as ao

    weight = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])
    reference = ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8,
                                            qscheme=torch.per_channel_affine_float_qparams)
    ours = qcore.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.uint8, qscheme=torch.per_channel_affine_float_qparams)
    reference(weight)
    ours(weight)
    (scale, zero_point), (ref_scale, ref_zero_point) = ours.calculate_qparams(), reference.calculate_qparams()
    torch.testing.assert_close(scale, ref_scale)
    torch.testing.assert_close(zero_point, ref_zero_point)     # float zero points: [-127.5, 85.0]
    from qcore.observe.qparams import fake_quantize_per_channel

    expected = torch.quantize_per_channel(weight, ref_scale, ref_zero_point, 0, torch.quint8).dequantize()
    torch.testing.assert_close(fake_quantize_per_channel(weight, scale, zero_point, 0, 0, 255), expected)


def test_per_channel_detector_text_is_torch_aos():
    import torch.ao.quantization.fx._model_report.detector as ao_detector
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_fx

    from qcore.report import PerChannelDetector

    model, batch = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval(), torch.randn(2, 4)
    prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), (batch,))
    reference = ao_detector.PerChannelDetector("x86").generate_detector_report(prepared)[0]
    ours = PerChannelDetector("x86").generate_detector_report(qcore.capture(model, batch))[0]
    assert ours == reference
    assert ours == "Further Optimizations for backend x86: \nNo further per_channel optimizations possible."
    per_tensor = PerChannelDetector("x86", quantizer=qcore.Int8StaticQuantizer(per_channel=False))
    text = per_tensor.generate_detector_report(qcore.capture(model, batch))[0]
    assert "Module 0 can be configured to use per_channel quantization.\n" in text


def test_report_observer_epoch_api_follows_torch_ao():
    from torch.ao.quantization.fx._model_report.model_report_observer import ModelReportObserver

    from qcore.report.detectors import DetectorBase
    from qcore.report.observer import ReportObserver

    ours, reference = ReportObserver(), ModelReportObserver()
    with pytest.raises(ValueError):  # a documented difference: torch.ao returns -0.0 before any data
        ours.get_batch_to_epoch_ratio()
    assert float(reference.get_batch_to_epoch_ratio()) == 0.0
    for batch in _batches((8, 4), count=4):
        ours(batch)
        reference(batch)
    torch.testing.assert_close(ours.average_batch_activation_range, reference.average_batch_activation_range)
    torch.testing.assert_close(ours.get_batch_to_epoch_ratio(), reference.get_batch_to_epoch_ratio())
    ours.reset_batch_and_epoch_values()
    reference.reset_batch_and_epoch_values()
    assert ours.num_batches_tracked == reference.num_batches_tracked == 0
    assert float(ours.average_batch_activation_range) == float(reference.average_batch_activation_range) == 0
    ours(torch.ones(3, 4))   # a constant activation: nan here, torch.ao raises (documented difference)
    assert torch.isnan(ours.get_batch_to_epoch_ratio())
    assert DetectorBase.DEFAULT_PRE_OBSERVER_NAME == ao_detector_constant("DEFAULT_PRE_OBSERVER_NAME")
    assert DetectorBase.DEFAULT_POST_OBSERVER_NAME == ao_detector_constant("DEFAULT_POST_OBSERVER_NAME")


@pytest.mark.parametrize("case", ["epochs", "after_relu", "ones", "zeros"])
def test_report_observer_attributes_are_tensors_with_torch_aos_values(case):
    from torch.ao.quantization.fx._model_report.model_report_observer import ModelReportObserver

    from qcore.report.observer import ReportObserver

    ours, reference = ReportObserver(), ModelReportObserver()
    for name in ("average_batch_activation_range", "epoch_activation_min", "epoch_activation_max"):
        assert isinstance(getattr(ours, name), torch.Tensor)  # attributes, as torch.ao's buffers
        torch.testing.assert_close(getattr(ours, name), getattr(reference, name))  # before any data too
    runs = {"epochs": [_batches((8, 4), count=3, seed=s) for s in range(2)],
            "after_relu": [[torch.relu(b) for b in _batches((8, 4), count=3)]],
            "ones": [[torch.ones(3, 4)]], "zeros": [[torch.zeros(3, 4)]]}[case]
    for batches in runs:
        for batch in batches:
            ours(batch)
            reference(batch)
        for name in ("average_batch_activation_range", "epoch_activation_min", "epoch_activation_max"):
            torch.testing.assert_close(getattr(ours, name), getattr(reference, name))


def ao_detector_constant(name):
    import torch.ao.quantization.fx._model_report.detector as ao_detector

    return getattr(ao_detector.DynamicStaticDetector, name)


def test_visualizer_class_constants_are_torch_aos():
    from torch.ao.quantization.fx._model_report.model_report_visualizer import ModelReportVisualizer as Reference

    from qcore.report.visualizer import ModelReportVisualizer

    for name in ("TABLE_TENSOR_KEY", "TABLE_CHANNEL_KEY", "NUM_NON_FEATURE_TENSOR_HEADERS",
                 "NUM_NON_FEATURE_CHANNEL_HEADERS", "CHANNEL_NUM_INDEX"):
        assert getattr(ModelReportVisualizer, name) == getattr(Reference, name), name


# ---- missing API: the quantizer's observer callback, selective equalization ----

def _fixed_output_quantizer(module, base, observers, seen):
    """Annotates linear as int8; its callback pins the model output's observer to fixed qparams."""
    class PinnedOutput(base):
        def annotate(self, gm):
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                    act = module.QuantizationSpec(torch.int8, observers.MinMaxObserver, -128, 127,
                                                  torch.per_tensor_affine)
                    node.meta["quantization_annotation"] = module.QuantizationAnnotation(
                        input_qspec_map={node.args[0]: act}, output_qspec=act)
            return gm

        def validate(self, gm):
            pass

        def prepare_obs_or_fq_callback(self, model, edge_or_node_to_obs_or_fq):
            output = next(n for n in model.graph.nodes if n.op == "output").args[0][0]
            seen.append(len(edge_or_node_to_obs_or_fq))
            edge_or_node_to_obs_or_fq[output] = observers.FixedQParamsObserver(
                scale=0.5, zero_point=0, dtype=torch.int8, quant_min=-128, quant_max=127)

    return PinnedOutput()


def test_prepare_calls_the_quantizers_observer_callback_as_torchao_does():
    torch.manual_seed(0)
    model, batches = nn.Sequential(nn.Linear(8, 8)).eval(), _batches((16, 8))
    seen_ao, seen_ours = [], []
    reference = _torchao(model, batches, _fixed_output_quantizer(tq, tq.Quantizer, to, seen_ao))
    _, ours = qcore.quantize(model, batches[0], batches, _fixed_output_quantizer(qcore, qcore.Quantizer, qcore,
                                                                                 seen_ours))
    assert seen_ours == seen_ao == [2]
    with torch.no_grad():
        output = ours(batches[0])
        torch.testing.assert_close(output, reference(batches[0]), rtol=0, atol=1e-6)
    assert torch.all(torch.remainder(output, 0.5) == 0)   # on the pinned grid


def test_selective_equalization_helpers_follow_torch_ao():
    from qcore.rewrites.equalize import equalize, get_equalization_qconfig_dict, get_layer_sqnr_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[0].weight[:, 3] *= 40   # one outlier input channel makes layer 0 the worst
    batches = _batches((32, 8))
    float_gm, quant_gm = qcore.quantize(model, batches[0], batches)
    sqnr = get_layer_sqnr_dict(float_gm, quant_gm, batches[0])
    assert list(sqnr) == ["0", "2", "4"] and all(isinstance(v, float) for v in sqnr.values())
    mapping = get_equalization_qconfig_dict(sqnr, num_layers_to_equalize=2)
    worst = sorted(sqnr, key=sqnr.get)[:2]
    assert [name for name, _ in mapping["module_name"]] == worst
    equalized = equalize(float_gm, mapping, batches)   # equalize takes torch.ao's dict form
    layers = {op.layer: op for op in qcore.find_quantizable_ops(equalized)}
    originals = {op.layer: op for op in qcore.find_quantizable_ops(float_gm)}
    for name in worst:   # the chosen layers' weight columns are rescaled
        assert not torch.equal(equalized.get_parameter(layers[name].weight.target),
                               float_gm.get_parameter(originals[name].weight.target))
    with torch.no_grad():
        torch.testing.assert_close(equalized(batches[0]), float_gm(batches[0]), rtol=1e-4, atol=1e-5)


# ---- 12-13: layer names of functional linears; attention through scaled_dot_product_attention ----

class FunctionalAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        batch, tokens, channels = x.shape
        q, k, v = nn.functional.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, -1)   # torchvision Swin/ViT

        def heads(t):
            return t.view(batch, tokens, 2, 8).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, channels))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FunctionalAttention()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(self.attn(x), x, x, need_weights=False)[0]


def test_a_functional_linear_is_named_after_the_module_that_owns_its_weight():
    batch = torch.randn(2, 5, 16)
    layers = [op.layer for op in qcore.find_quantizable_ops(qcore.capture(Encoder().eval(), batch))]
    assert layers[:2] == ["attn.qkv", "attn"] and "attn.proj" in layers       # not attn.linear
    assert "mha.out_proj" in layers and any(name.startswith("mha.in_proj") for name in layers)
    assert not any(name.startswith("attn.linear") or name == "linear" for name in layers)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps the values of the nodes asked for."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted, self.values = set(wanted), {}

    def run_node(self, node):
        value = super().run_node(node)
        if node in self.wanted:
            self.values[node] = value
        return value


@pytest.mark.parametrize("method", ["export", "fx"])
def test_sdpa_gets_quantized_query_key_value_and_an_item_under_its_module(method):
    torch.manual_seed(0)
    model, batches = nn.Sequential(FunctionalAttention()).eval(), _batches((2, 5, 16))
    float_gm, quant_gm = qcore.quantize(qcore.capture(model, batches[0], method=method), batches[0], batches)
    sdpa = next(op for op in qcore.find_quantizable_ops(quant_gm) if op.kind == "sdpa")
    assert sdpa.layer == "0"     # named after its module
    inputs = sdpa.node.args[:3]
    assert all(a.meta.get("qcore_inserted") == "qdq" for a in inputs)                 # query, key, value
    assert not any(u.meta.get("qcore_inserted") == "qdq" for u in sdpa.node.users)    # its output stays float
    # the same attention computed with torch's own fake quantization at qcore's qparams
    recorder = _Recorder(quant_gm, [a.args[0] for a in inputs] + [sdpa.node])
    with torch.no_grad():
        recorder.run(batches[0])
    fake = [torch.fake_quantize_per_tensor_affine(recorder.values[a.args[0]], a.meta[QPARAMS_KEY]["scale"][0],
                                                  a.meta[QPARAMS_KEY]["zero_point"][0], -128, 127) for a in inputs]
    torch.testing.assert_close(recorder.values[sdpa.node], nn.functional.scaled_dot_product_attention(*fake),
                               rtol=1e-5, atol=1e-6)
    # and the analysis measures it as a layer of its own
    from qcore.analysis import analyze_model

    measured = analyze_model(model, batches).sqnr.layers
    assert measured["0"].op == "sdpa" and 20 < measured["0"].sqnr_db < 80
