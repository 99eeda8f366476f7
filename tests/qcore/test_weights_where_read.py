"""Large models' weights quantized and rewritten where they are read
(qcore.quantization.convert.quantize_weights_where_read, qcore.graph.deferred.read_rewritten_where_used): the same
numbers, no copy of the weights."""
import copy
import importlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcore
from qcore.analysis import AnalysisPlan, ModelAnalysis
from qcore.graph.deferred import deferred_parameters
from qcore.graph.ops import QUANTIZED_WHERE_READ_KEY, REWRITTEN_KEY, weight_value
from qcore.measure import variants
from qcore.measure.passes import measure_model
from qcore.measure.variants import ScaledWeightQuantizer
from qcore.observe.observers import MinMaxObserver, PerChannelMinMaxObserver
from qcore.observe.qparams import fake_quantize_finite_per_channel, fake_quantize_per_channel_steps
from qcore.quantization.convert import fake_quantize_over_input, fake_quantize_with, quantize_weights_where_read
from qcore.report.detectors import OutlierDetector, PerChannelDetector
from qcore.runtime import native, scratch
from qcore.search.sensitivity import SwitchableModel
from tests.models import tiny_llama

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class Net(nn.Module):
    """Conv, linear and a matmul with a parameter, so that each weight form is converted."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 32)
        self.head = nn.Linear(32, 10)
        self.table = nn.Parameter(torch.randn(10, 6))

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return torch.relu(self.head(torch.relu(self.fc(x)))) @ self.table


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 3, 4, 4, generator=g) for _ in range(4)]
    return qcore.capture(Net().eval(), (batches[0],)), batches


def test_a_measurement_quantized_where_read_equals_the_one_with_quantized_copies(net):
    float_gm, batches = net
    detectors = {"per_channel": PerChannelDetector(), "outlier": OutlierDetector()}
    options = {"detectors": detectors, "equalization_layers": ["fc", "head"], "smoothing": 0.5, "logits": True}
    plain = measure_model(float_gm, batches, **options)
    with quantize_weights_where_read():
        where_read = measure_model(float_gm, batches, **options)
    assert where_read.sqnr == plain.sqnr  # propagated, shadow and weight SQNR of every layer, and the outputs
    assert all(layer.weight_sqnr_db is not None for layer in where_read.sqnr.layers.values())
    assert where_read.variants == plain.variants and where_read.variants  # the equalization variants were measured
    assert where_read.logits == plain.logits and where_read.unmeasured == plain.unmeasured


def test_variants_of_a_model_quantized_where_read_quantize_their_weights_where_the_shadow_reads_them(net, monkeypatch):
    float_gm, batches = net
    reads = []
    forward = ScaledWeightQuantizer.forward
    monkeypatch.setattr(ScaledWeightQuantizer, "forward", lambda self, weight: reads.append(1) or forward(self, weight))
    plain = measure_model(float_gm, batches, equalization_layers=["fc", "head"], smoothing=0.5)
    assert not reads
    with quantize_weights_where_read():
        where_read = measure_model(float_gm, batches, equalization_layers=["fc", "head"], smoothing=0.5)
    assert reads and where_read.variants == plain.variants


@pytest.mark.skipif(native.kernel() is None, reason="the reused buffers are the native kernels' (CPU float32)")
def test_a_variants_weight_quantized_where_read_is_divided_into_a_reused_buffer_with_the_same_values():
    """Each batch divides a variant's weight by its column factor again: into a buffer of the pool, not fresh pages
    (an MoE block's experts are hundreds of such weights a batch), with the values of the weight quantized ahead."""
    from qcore.runtime.scratch import reused_outputs

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 1024, generator=generator)  # 2 MiB: large enough for the pool
    factor = torch.rand(1024, generator=generator) + 0.5
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, qscheme=torch.per_channel_symmetric)
    observer(weight / factor)
    expected = fake_quantize_with(observer, weight / factor)
    quantizer = ScaledWeightQuantizer(observer, factor)
    with reused_outputs() as pool:
        for _ in range(2):
            result = quantizer(weight)
            assert torch.equal(result, expected)
            pooled = {buffer.untyped_storage().data_ptr() for entries in pool._buffers.values()
                      for buffer, _, _ in entries}
            assert result.untyped_storage().data_ptr() in pooled
            del result


def test_a_graph_quantized_where_read_holds_no_quantized_copy_and_quantizes_each_weight_where_it_is_read(net):
    _, batches = net
    torch.manual_seed(1)
    model = Net().eval()
    with quantize_weights_where_read():
        float_copy, quantized = qcore.quantize(model, (batches[0],), batches)
    held = {name: b for name, b in quantized.named_buffers() if name.startswith("qcore_fq")}
    assert held and all(b.dim() == 1 for b in held.values())  # per-channel scales and zero points only
    floats = dict(float_copy.named_parameters())
    nodes = list(quantized.graph.nodes)
    where_read = [n for n in nodes if n.meta.get(QUANTIZED_WHERE_READ_KEY)]
    assert len(where_read) == 4
    for node in where_read:  # right before the layer that reads it: one quantized weight alive at a time
        assert nodes.index(next(iter(node.users))) == nodes.index(node) + 1
        source = node.args[0]  # the float weight itself
        assert source.op == "get_attr" and torch.equal(weight_value(quantized, source), floats[source.target])
    with quantize_weights_where_read(False):
        _, plain = qcore.quantize(model, (batches[0],), batches)
    assert torch.equal(quantized(batches[1]), plain(batches[1]))


def test_the_sensitivity_switches_of_a_model_quantized_where_read_give_the_same_sqnr(net):
    float_gm, batches = net
    plain = SwitchableModel(float_gm, batches, resume=False)
    with quantize_weights_where_read():
        where_read = SwitchableModel(float_gm, batches, resume=False)
    assert any(node.meta.get(QUANTIZED_WHERE_READ_KEY) for node in where_read.gm.graph.nodes)
    for kept in ([], ["fc"], ["conv", "head"], plain.layers):
        plain.quantize_only(kept)
        where_read.quantize_only(kept)
        assert where_read.run(batches) == plain.run(batches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_analysis_quantized_where_read_equals_the_one_with_quantized_copies_whole_and_block_wise(dtype):
    """float32 on the CPU takes the native kernel where read; bf16 a chain of ops there, torch's fused kernel on the
    torch path (a GPU)."""
    pytest.importorskip("transformers")
    model, batches = tiny_llama(layers=2, batch=2)
    float_gm = qcore.capture(model.to(dtype), batches[0])
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "equalization", "logits"}))
    plain = ModelAnalysis(float_gm, batches=batches, plan=plan).measurement
    with quantize_weights_where_read():
        whole = ModelAnalysis(float_gm, batches=batches, plan=plan).measurement
        blockwise = ModelAnalysis(float_gm, batches=batches, plan=plan, blockwise=True).measurement
    for where_read in (whole, blockwise):
        assert where_read.sqnr == plain.sqnr and where_read.variants == plain.variants
        assert where_read.logits == plain.logits
    with quantize_weights_where_read():
        on_cpu = ModelAnalysis(float_gm, batches=batches).quantized_gm
        with mock.patch.dict(native._state, {"library": None}):  # the torch path, as on a GPU
            torch_path = ModelAnalysis(float_gm, batches=batches)
            as_on_gpu = torch_path.quantized_gm
            with quantize_weights_where_read(False):
                copies = ModelAnalysis(float_gm, batches=batches, plan=plan).measurement
            assert ModelAnalysis(float_gm, batches=batches, plan=plan).measurement.sqnr == copies.sqnr
    for quantized, fused_expected in ((on_cpu, False), (as_on_gpu, dtype == torch.bfloat16)):
        # finite weights with zero points 0 in fp16/bf16: torch's kernel, one op (on the CPU it is slower)
        fused = [node for node in quantized.graph.nodes if node.target is fake_quantize_finite_per_channel]
        assert bool(fused) == fused_expected


@pytest.mark.parametrize("recipe", [True, "smooth:search"])
def test_a_large_models_fix_trial_rewrites_each_weight_where_it_is_read_with_the_same_numbers(recipe):
    pytest.importorskip("transformers")
    model, batches = tiny_llama(layers=2, batch=2)
    float_gm = qcore.capture(model, batches[0])
    plain = ModelAnalysis(float_gm, batches=batches).variant(equalize=recipe).sqnr
    with quantize_weights_where_read():  # as the pipeline runs a model of 256 MiB or more
        analysis = ModelAnalysis(float_gm, batches=batches)
        assert analysis.variant(equalize=recipe).sqnr == plain
        layers = ["model.layers.0.mlp.down_proj"]
        trial = analysis.variant(equalize=recipe, layers=layers)
        equalized = trial._equalized(trial.equalizable_layers if recipe is True else recipe)
    rewritten = [node for node in equalized.graph.nodes if node.meta.get(REWRITTEN_KEY)]
    assert rewritten and not deferred_parameters(equalized)
    nodes = list(equalized.graph.nodes)
    originals = {name: p.data_ptr() for name, p in float_gm.named_parameters()}
    for node in rewritten:  # computed from the shared original, right before the op that reads it
        assert nodes.index(next(iter(node.users))) == nodes.index(node) + 1
        assert weight_value(equalized, node.args[0]).data_ptr() == originals[node.meta["qcore_float_weight"]]
    assert all(weight.dim() < 2 for name, weight in equalized.named_parameters() if weight.data_ptr() not in
               originals.values())  # only biases and norms' weights are rewritten copies
    with quantize_weights_where_read():  # each rewritten weight is quantized over itself, made for that read alone
        quantized = trial.quantized_gm
    over = [node for node in quantized.graph.nodes if node.target is fake_quantize_over_input]
    assert over and all(node.args[0].meta.get(REWRITTEN_KEY) and len(node.args[0].users) == 1 for node in over)
    # on the torch path (a GPU) a bf16 one is quantized by torch's fused kernel, with the same numbers
    bf16_gm = qcore.capture(copy.deepcopy(model).to(torch.bfloat16), batches[0])
    with mock.patch.dict(native._state, {"library": None}):
        expected = ModelAnalysis(bf16_gm, batches=batches).variant(equalize=recipe, layers=layers).sqnr
        with quantize_weights_where_read():
            trial = ModelAnalysis(bf16_gm, batches=batches).variant(equalize=recipe, layers=layers)
            assert trial.sqnr == expected
            nodes = list(trial.quantized_gm.graph.nodes)
    fused = [node for node in nodes if node.target is fake_quantize_finite_per_channel]
    assert any(node.args[0].meta.get(REWRITTEN_KEY) for node in fused)
    assert not any(node.target in (fake_quantize_over_input, fake_quantize_per_channel_steps) for node in nodes)
    # the model's own equalized graph is kept for its later passes: it holds its weights
    with quantize_weights_where_read():
        own = ModelAnalysis(float_gm, batches=batches, equalize=recipe)
        assert not any(node.meta.get(REWRITTEN_KEY) for node in own.quantized_input_gm.graph.nodes)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from(DTYPES), per_channel=st.booleans(),
       grouped=st.booleans())
def test_a_variants_weight_quantized_by_rows_where_read_equals_it_quantized_whole(seed, dtype, per_channel, grouped):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(24, 10, generator=generator) * 2).to(dtype)
    rows = 24 if grouped else 1  # a grouped conv's factor has a row per output channel
    factor = (torch.rand(rows, 10, generator=generator) + 0.5).to(dtype)
    observer = PerChannelMinMaxObserver() if per_channel else MinMaxObserver(qscheme=torch.per_tensor_symmetric)
    observer(weight / factor)
    expected = fake_quantize_with(observer, weight / factor)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(variants, "_ROWS_ELEMENTS", 30)  # three rows at a time
        assert torch.equal(ScaledWeightQuantizer(observer, factor)(weight), expected)


@pytest.mark.parametrize("per_channel", [True, False])
def test_a_large_weight_quantized_where_read_is_compared_a_few_rows_at_a_time_with_the_same_sqnr(net, per_channel,
                                                                                                 monkeypatch):
    measure = importlib.import_module("qcore.measure.passes")  # the module, not qcore.measure.passes the function
    metrics = importlib.import_module("qcore.numeric.metrics")
    float_gm, batches = net
    monkeypatch.setattr(metrics, "_ROWS_ELEMENTS", 40)  # every weight is "large": compared a few rows at a time
    quantizer = qcore.Int8StaticQuantizer(per_channel=per_channel)
    plain = measure_model(float_gm, batches, quantizer).sqnr
    quantized_rows, rows_of = [], measure._quantized_weight_rows

    def recorded(*args):
        rows = rows_of(*args)
        return None if rows is None else lambda part: quantized_rows.append(rows(part).numel()) or rows(part)

    monkeypatch.setattr(measure, "_quantized_weight_rows", recorded)
    with quantize_weights_where_read():
        where_read = measure_model(float_gm, batches, quantizer).sqnr
    weights = {layer: entry.weight_sqnr_db for layer, entry in where_read.layers.items()}
    assert weights == {layer: entry.weight_sqnr_db for layer, entry in plain.layers.items()}
    assert all(value is not None and 0 < value < float("inf") for value in weights.values())
    # the conv (8 x 27), fc (32 x 128), head (10 x 32) and table (10 x 6) weights, never whole: one row or a few
    assert quantized_rows and max(quantized_rows) <= 128 and len(quantized_rows) >= 8 + 32 + 10


def test_the_parts_of_large_weights_compared_where_read_are_quantized_into_reused_buffers(monkeypatch):
    """Each part of a weight over a million elements lives for its own comparison: the parts of two weights of one
    shape are made in the same pooled buffer, not in fresh pages each, and the SQNRs are the quantized copies'."""
    measure = importlib.import_module("qcore.measure.passes")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 1024), nn.ReLU(), nn.Linear(1024, 1536), nn.ReLU(),
                          nn.Linear(1536, 1024)).eval()
    batches = [torch.randn(4, 1536) for _ in range(2)]
    float_gm = qcore.capture(model, (batches[0],))
    plain = measure_model(float_gm, batches).sqnr
    buffers, rows_of = [], measure._quantized_weight_rows

    def recorded(*args):
        rows = rows_of(*args)
        return None if rows is None else lambda part: buffers.append(
            (tuple((made := rows(part)).shape), made.data_ptr())) or made

    monkeypatch.setattr(measure, "_quantized_weight_rows", recorded)
    with quantize_weights_where_read():
        where_read = measure_model(float_gm, batches).sqnr
        pooled = {buffer.data_ptr() for entries in scratch._POOL.get()._buffers.values() for buffer, _, _ in entries}
    weights = {layer: entry.weight_sqnr_db for layer, entry in where_read.layers.items()}
    assert weights == {layer: entry.weight_sqnr_db for layer, entry in plain.layers.items()}
    assert all(0 < value < float("inf") for value in weights.values())
    assert {pointer for _, pointer in buffers} <= pooled
    assert len(buffers) >= 6  # each of the three weights (1.5 million elements) in two parts or more
    shared = {shape: [pointer for made, pointer in buffers if made == shape] for shape, _ in buffers}
    shared = {shape: pointers for shape, pointers in shared.items() if len(pointers) > 1}
    assert set(shared) == {(682, 1536), (342, 1536)}  # the first and third weights' parts
    assert all(len(set(pointers)) == 1 for pointers in shared.values()), shared


def test_a_bf16_models_fix_trial_quantizes_each_rewritten_weight_over_itself_with_the_same_numbers():
    """bf16 weights rewritten where read are quantized over themselves on torch ops, qparams laid out once."""
    pytest.importorskip("transformers")
    model, batches = tiny_llama(layers=2, batch=2)
    float_gm = qcore.capture(model.to(torch.bfloat16), batches[0])
    plain = ModelAnalysis(float_gm, batches=batches).variant(equalize=True).sqnr
    with quantize_weights_where_read():
        analysis = ModelAnalysis(float_gm, batches=batches)
        assert analysis.variant(equalize=True).sqnr == plain
        trial = analysis.variant(equalize=True, layers=["model.layers.0.mlp.down_proj"])
        quantized = trial.quantized_gm
    over = [node for node in quantized.graph.nodes if node.target is fake_quantize_per_channel_steps]
    assert over and all(node.args[-1] is True and node.args[0].meta.get(REWRITTEN_KEY) for node in over)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convert_on_the_torch_path_quantizes_weight_copies_with_the_fused_kernel_to_the_same_values(dtype):
    """A weight quantized once, at convert (a model under 256 MiB), on the torch path: finite weights with zero
    points 0 take torch's fused kernel, and give what the chain of ops gives, bit for bit."""
    from qcore.quantization import convert

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():
        model[0].weight[3] *= 1e-30  # a channel of tiny values next to ordinary ones
        model[2].weight[1] = 0.0  # a channel of zeros
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    float_gm = qcore.capture(model.to(dtype), x)

    def copies(fused: bool) -> dict[str, torch.Tensor]:
        kernel = mock.Mock(wraps=convert.fake_quantize_finite_per_channel)
        with mock.patch.dict(native._state, {"library": None}), \
                mock.patch.object(convert, "fake_quantize_finite_per_channel", kernel), \
                mock.patch.object(convert, "_fused_kernel_takes", convert._fused_kernel_takes if fused else
                                  (lambda values, observer: False)):
            quantized = ModelAnalysis(float_gm, batches=[x]).quantized_gm
        assert kernel.call_count == (2 if fused else 0)
        return {name: buffer for name, buffer in quantized.named_buffers() if name.startswith("qcore_fq_")}

    fused, chain = copies(fused=True), copies(fused=False)
    assert fused.keys() == chain.keys() and len(fused) == 2
    for name, value in fused.items():
        assert value.dtype == dtype
        assert torch.equal(value, chain[name]) and torch.equal(value.signbit(), chain[name].signbit())
