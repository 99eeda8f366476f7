"""torch.ao's own ModelReport and numeric-suite cases that qcore used to fail, run on both (issue: fidelity)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore import numeric as qns
from qcore.graph.capture import clone_graph_module
from qcore.quantization.convert import convert
from qcore.quantization.prepare import prepare

ao_ns = pytest.importorskip("torch.ao.ns._numeric_suite_fx")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
ao_utils = pytest.importorskip("torch.ao.ns.fx.utils")


@pytest.fixture(autouse=True)
def _fbgemm():
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation warnings
        yield
    torch.backends.quantized.engine = engine


# ---- OutlierDetector over many calibration runs (torch.ao: test_multiple_run_consistent_spike_outlier_report_gen)

class LargeBatchModel(nn.Module):
    def __init__(self, size=8):
        super().__init__()
        self.linear, self.relu_1 = nn.Linear(size, size), nn.ReLU()
        self.conv, self.relu_2 = nn.Conv2d(size, size, 1), nn.ReLU()

    def forward(self, x):
        return self.relu_2(self.conv(self.relu_1(self.linear(x))))


def _spiky_runs(size=8, runs=30):
    g = torch.Generator().manual_seed(0)
    inputs = []
    for run in range(runs):
        x = torch.randn((1, size, size, size), generator=g)
        x[:, 0:size:2, 0, 3] = 3.28e8  # a consistent spike in every other channel
        if run % 14 == 0:
            x[0][1] = 0.0  # and channel 1 all zero in 3 of the runs
        inputs.append(x)
    return inputs


def _reports(model, inputs, generate_after=()):
    """torch.ao's and qcore's outlier reports after one forward per input (and reports generated in between)."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report.detector import OutlierDetector as AoOutlierDetector
    from torch.ao.quantization.fx._model_report.model_report import ModelReport as AoModelReport

    from qcore.report import ModelReport, OutlierDetector

    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), (inputs[0],))
    theirs = AoModelReport(prepared, {AoOutlierDetector(reference_percentile=0.95)})
    ours = ModelReport(model, [OutlierDetector(reference_percentile=0.95)], example_inputs=inputs[0])
    run_theirs, run_ours = theirs.prepare_detailed_calibration(), ours.prepare_detailed_calibration()
    for index, x in enumerate(inputs):
        run_theirs(x)
        run_ours(x)
        if index in generate_after:
            theirs.generate_model_report(False)
            ours.generate_model_report(False)
    return (theirs.generate_model_report(True)["outlier_detector"][1],
            ours.generate_model_report(True)["outlier_detector"][1])


def test_outlier_counts_every_batch_of_every_run_as_torch_ao():
    from qcore.report import OutlierDetector

    torch.manual_seed(0)
    theirs, ours = _reports(LargeBatchModel().eval(), _spiky_runs())
    # the conv's input channels are axis 1 for both (a linear's are its last axis in qcore: see the README)
    a, b = theirs["conv.0"], ours["conv"]
    for key in (OutlierDetector.NUM_BATCHES_KEY, OutlierDetector.CONSTANT_COUNTS_KEY):
        assert b[key].dtype == a[key].dtype == torch.int32 and torch.equal(a[key], b[key]), key
    for key in (OutlierDetector.IS_SUFFICIENT_BATCHES_KEY, OutlierDetector.OUTLIER_KEY):
        assert list(a[key]) == list(b[key]), key
    assert int(b[OutlierDetector.NUM_BATCHES_KEY][0]) == 30
    assert sum(b[OutlierDetector.OUTLIER_KEY]) == 4  # half of the 8 channels, as torch.ao's test asserts
    # reports generated in between (observers kept) do not reset the counts: 2 runs of 2 batches count 4
    theirs, ours = _reports(LargeBatchModel().eval(), _spiky_runs(runs=4), generate_after=(1,))
    assert theirs["conv.0"][OutlierDetector.NUM_BATCHES_KEY].tolist() == [4] * 8
    assert ours["conv"][OutlierDetector.NUM_BATCHES_KEY].tolist() == [4] * 8


# ---- extract_weights of functional convs, without a runnable example (torch.ao: test_extract_weights_conv_fun_ptq)

class AllConvFunctional(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight1d, self.bias1d = nn.Parameter(torch.randn(1, 1, 1, generator=g)), nn.Parameter(torch.randn(1))
        self.weight2d, self.bias2d = nn.Parameter(torch.randn(1, 1, 1, 1, generator=g)), nn.Parameter(torch.randn(1))
        self.weight3d = nn.Parameter(torch.randn(1, 1, 1, 1, 1, generator=g))
        self.bias3d = nn.Parameter(torch.randn(1))

    def forward(self, x):
        x = F.conv1d(x, self.weight1d, self.bias1d, 1, 0, 1, 1)
        x = F.conv1d(x, self.weight1d, self.bias1d, 1, 0, 1, 1)
        x = F.relu(x)
        x = F.conv2d(x, self.weight2d, self.bias2d, (1, 1), (0, 0), (1, 1), 1)
        x = F.conv2d(x, self.weight2d, self.bias2d, (1, 1), (0, 0), (1, 1), 1)
        x = F.relu(x)
        x = F.conv3d(x, self.weight3d, self.bias3d, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
        x = F.conv3d(x, self.weight3d, self.bias3d, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
        return F.relu(x)


def _values(results, model):
    out = []
    for entry in results.values():
        value = entry["weight"][model][0]["values"][0]
        out.append(float((value.dequantize() if value.is_quantized else value).reshape(-1)[0]))
    return out


def test_extract_weights_of_functional_convs_needs_no_runnable_example():
    from torch.ao.quantization import get_default_qconfig_mapping

    model = AllConvFunctional().eval()
    example = (torch.randn(1, 1),)  # fits no conv: the model cannot run on it, and is never run
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), example)
    theirs = ao_ns.extract_weights("fp32", prepared, "int8", quantize_fx.convert_fx(copy.deepcopy(prepared)))
    float_gm = qcore.capture(model, example)  # torch.export runs the model and fails; FX traces it
    quantized = convert(prepare(clone_graph_module(float_gm), qcore.Int8StaticQuantizer()))  # no calibration
    ours = qns.extract_weights("fp32", float_gm, "int8", quantized)
    assert len(ours) == len(theirs) == 6
    assert _values(ours, "fp32") == _values(theirs, "fp32")
    # one int8 step apart at most: torch.ao's fbgemm weights span [-128, 127], qcore's symmetric [-127, 127]
    for value, reference in zip(_values(ours, "int8"), _values(theirs, "int8")):
        assert abs(value - reference) <= abs(reference) / 127 + 1e-7


# ---- a sparse NN: EmbeddingBag + dense + interaction (torch.ao: test_sparsenn_compare_activations)

class DenseTopMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_mlp = nn.Sequential(nn.Linear(4, 2))
        self.top_mlp = nn.Sequential(nn.Linear(2 + 5, 2), nn.Linear(2, 2))

    def forward(self, sparse_feature, dense):
        return self.top_mlp(torch.cat([self.dense_mlp(dense), sparse_feature], dim=1))


class EmbBagWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_bag = nn.EmbeddingBag(10, 5, mode="sum")

    def forward(self, indices, offsets):
        return self.emb_bag(indices, offsets)


class SparseNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.model_sparse, self.dense_top = EmbBagWrapper(), DenseTopMLP()

    def forward(self, sparse_indices, sparse_offsets, dense):
        return self.dense_top(self.model_sparse(sparse_indices, sparse_offsets), dense)


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("should_log_inputs", [False, True])
def test_sparse_nn_activations_are_compared_like_torch_ao(method, should_log_inputs):
    from torch.ao.quantization import get_default_qconfig_mapping

    torch.manual_seed(0)
    model = SparseNN().eval()
    data = (torch.LongTensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.LongTensor([0, 4]), torch.randn(2, 4))
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), data)
    prepared(*data)
    a, b = ao_ns.add_loggers("fp32", prepared, "int8", quantize_fx.convert_fx(copy.deepcopy(prepared)),
                             ao_ns.OutputLogger, should_log_inputs=should_log_inputs)
    a(*data)
    b(*data)
    theirs = ao_ns.extract_logger_info(a, b, ao_ns.OutputLogger, "int8")
    float_gm, quant_gm = qcore.quantize(qcore.capture(model, data, method=method), data, [data])
    a, b = qns.add_loggers("fp32", float_gm, "int8", quant_gm, qns.OutputLogger, should_log_inputs=should_log_inputs)
    a(*data)
    b(*data)
    ours = qns.extract_logger_info(a, b, qns.OutputLogger, "int8")
    # the same five values in the same order: the bags, the dense linear, the cat and the two top linears
    assert list(ours) == ["model_sparse.emb_bag", "dense_top.dense_mlp.0", "dense_top", "dense_top.top_mlp.0",
                          "dense_top.top_mlp.1"]
    assert len(theirs) == 5
    for ours_entry, theirs_entry in zip(ours.values(), theirs.values()):
        torch.testing.assert_close(ours_entry["node_output"]["fp32"][0]["values"][0],
                                   theirs_entry["node_output"]["fp32"][0]["values"][0])
        if should_log_inputs:
            assert len(ours_entry["node_input"]["fp32"]) == len(theirs_entry["node_input"]["fp32"])
    # qcore keeps the bags in float (torch.ao quantizes their weights per row): see the README's differences
    bags = ours["model_sparse.emb_bag"]["node_output"]
    torch.testing.assert_close(bags["int8"][0]["values"][0], bags["fp32"][0]["values"][0])
    # the comparison: None where torch.ao's is None (the bags' int64 indices and offsets), numbers elsewhere
    ao_ns.extend_logger_results_with_comparison(theirs, "fp32", "int8", ao_utils.compute_sqnr, "sqnr")
    qns.extend_logger_results_with_comparison(ours, "fp32", "int8", qns.compute_sqnr, "sqnr")
    for ours_entry, theirs_entry in zip(ours.values(), theirs.values()):
        for kind in theirs_entry:
            for mine, reference in zip(ours_entry[kind]["int8"], theirs_entry[kind]["int8"]):
                assert [value is None for value in mine["sqnr"]] == [value is None for value in reference["sqnr"]]
                if kind == "node_output":
                    assert all(value is not None for value in mine["sqnr"])
    if should_log_inputs:
        assert ours["model_sparse.emb_bag"]["node_input"]["int8"][0]["sqnr"] == [None]


def test_sparse_nn_shadows_the_quantized_linears():
    torch.manual_seed(0)
    model = SparseNN().eval()
    data = (torch.LongTensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.LongTensor([0, 4]), torch.randn(2, 4))
    float_gm, quant_gm = qcore.quantize(qcore.capture(model, data), data, [data])
    shadowed = qns.add_shadow_loggers("fp32", float_gm, "int8", quant_gm, qns.OutputLogger)
    shadowed(*data)
    # torch.ao shadows four (the bags too, weight-only quantized); qcore keeps the bags in float
    assert list(qns.extract_shadow_logger_info(shadowed, qns.OutputLogger, "int8")) == [
        "dense_top.dense_mlp.0", "dense_top.top_mlp.0", "dense_top.top_mlp.1"]
