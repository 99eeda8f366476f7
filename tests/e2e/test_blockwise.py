"""Block-wise analysis (qcore.measure.blockwise): the blocks chained compute the model, and every measurement equals the
whole-model analysis's; one block's quantized copy is alive at a time."""
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcore
from qcore.analysis import AnalysisPlan, BlockwiseUnsupported, ModelAnalysis, quantized_layers
from qcore.graph.inputs import call_model
from qcore.measure.blockwise import BlockwiseError, block_stack, measure_blockwise, split_into_blocks
from qcore.measure.passes import ProbedModel, measure_model
from qcore.quantization.calibrate import calibrate
from qcore.report.detectors import (
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
)
from qcore.rewrites.equalize import equalize
from qcore.rewrites.smoothing import smooth
from tests.helpers import STACK_SOURCE
from tests.models import SmallMLP, tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    model, batches = tiny_llama(layers=3, batch=2)
    return qcore.capture(model, batches[0]), batches


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """A residual stack with a stem and a head, and a dict output (FX keeps it as a dict)."""

    def __init__(self, blocks=4, width=16):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        hidden = self.blocks(self.stem(x))
        return {"scores": self.head(hidden), "hidden": hidden}


def _chain(blocks, batch):
    env, result = {}, None
    for index, block in enumerate(blocks):
        result = call_model(block.gm, batch) if index == 0 else block.gm(*[env[n] for n in block.inputs])
        if index < len(blocks) - 1:
            env.update(zip(block.outputs, result))
    return result


PLAN = AnalysisPlan(measurements=frozenset({"sqnr", "detectors", "equalization", "logits"}),
                    detectors={"per_channel": PerChannelDetector(), "dynamic_static": DynamicStaticDetector(),
                               "input_weight_equalization": InputWeightEqualizationDetector(0.5),
                               "outliers": OutlierDetector()})


def _equal(a, b):
    """Equal structures of builtins and tensors (tensors equal in dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or a != a and b != b  # nan equals nan here


def _propagated(sqnr):
    """The propagated and weight SQNR (the whole model's extra passes skip the shadow one)."""
    return {k: (v.sqnr_db, v.weight_sqnr_db) for k, v in sqnr.layers.items()}, sqnr.outputs


def _same_measurement(whole, blockwise):
    assert list(whole.sqnr.layers) == list(blockwise.sqnr.layers)
    assert whole.sqnr == blockwise.sqnr  # every layer's propagated, shadow and weight SQNR, and every output's
    assert _equal(whole.detector_reports, blockwise.detector_reports)
    assert sum(len(entries) for entries in whole.detector_reports.values()) > 20
    assert whole.variants == blockwise.variants and whole.smoothing == blockwise.smoothing
    assert whole.unmeasured == blockwise.unmeasured
    assert whole.logits == blockwise.logits


def test_llama_blocks_chained_compute_the_model(llama):
    float_gm, batches = llama
    assert block_stack(float_gm) == "model.layers"
    blocks = split_into_blocks(float_gm)
    assert [b.indices for b in blocks] == [(0,), (1,), (2,)]
    assert blocks[0].inputs == () and blocks[-1].outputs == ()
    whole = call_model(float_gm, batches[1])
    assert torch.equal(_chain(blocks, batches[1])["logits"], whole["logits"])
    # parameters are shared with the model, not copied
    model_storage = {p.data_ptr() for p in float_gm.parameters()}
    assert all(p.data_ptr() in model_storage for b in blocks for p in b.gm.parameters())


def test_llama_blockwise_analysis_equals_the_whole_model_analysis(llama):
    float_gm, batches = llama
    whole = ModelAnalysis(float_gm, batches=batches, plan=PLAN)
    blockwise = ModelAnalysis(float_gm, batches=batches, plan=PLAN, blockwise=True)
    _same_measurement(whole.measurement, blockwise.measurement)
    assert whole.logits.kl_nats > 0 and whole.logits.float_perplexity > 1  # measured, not empty
    assert set(whole.measurement.detector_reports) == set(PLAN.detectors)


def test_llama_blockwise_equalized_and_variant_trials_equal_the_whole_model(llama):
    float_gm, batches = llama
    for recipe in (True, "smooth:0.5"):
        whole = ModelAnalysis(float_gm, batches=batches, equalize=recipe)
        blockwise = ModelAnalysis(float_gm, batches=batches, equalize=recipe, blockwise="model.layers")
        assert whole.sqnr == blockwise.sqnr, recipe
        assert _propagated(whole.unequalized_sqnr) == _propagated(blockwise.unequalized_sqnr)
        assert 0 < blockwise.equivalence_error == whole.equivalence_error < 1e-5
    plain, blocks = ModelAnalysis(float_gm, batches=batches), ModelAnalysis(float_gm, batches=batches, blockwise=True)
    layers = plain.equalizable_layers[:3]
    assert plain.variant(equalize=layers).sqnr == blocks.variant(equalize=layers).sqnr
    assert _propagated(plain.equalized_sqnr) == _propagated(blocks.equalized_sqnr)


def test_fx_stack_with_a_dict_output_blocks_two_at_a_time():
    torch.manual_seed(1)
    model = Stack().eval()
    batches = [torch.randn(4, 8) for _ in range(3)]
    float_gm = qcore.capture(model, batches[0], method="fx")
    blocks = split_into_blocks(float_gm, "blocks", blocks_per_step=2)
    assert [b.indices for b in blocks] == [(0, 1), (2, 3)]
    chained, whole = _chain(blocks, batches[0]), call_model(float_gm, batches[0])
    assert set(chained) == {"scores", "hidden"} and all(torch.equal(chained[k], whole[k]) for k in whole)
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors", "equalization"}), detectors=PLAN.detectors)
    _same_measurement(ModelAnalysis(float_gm, batches=batches, plan=plan).measurement,
                      ModelAnalysis(float_gm, batches=batches, plan=plan, blockwise=True).measurement)


@settings(max_examples=12, deadline=None)
@given(blocks=st.integers(2, 5), per_step=st.integers(1, 3), seed=st.integers(0, 1000))
def test_chained_blocks_equal_the_graph(blocks, per_step, seed):
    torch.manual_seed(seed)
    model = Stack(blocks=blocks, width=8).eval()
    x = torch.randn(3, 8)
    float_gm = qcore.capture(model, x)
    split = split_into_blocks(float_gm, "blocks", blocks_per_step=per_step)
    assert len(split) == -(-blocks // per_step)
    assert sorted(i for b in split for i in b.indices) == list(range(blocks))
    chained, whole = _chain(split, x), call_model(float_gm, x)
    assert all(torch.equal(chained[k], whole[k]) for k in whole)


def test_one_block_quantized_at_a_time(llama):
    float_gm, batches = llama
    alive = []

    def count_copies(block):
        gc.collect()
        names = [type(o).__name__ for o in gc.get_objects() if type(o).__name__.startswith("GraphModule")]
        alive.append({name: names.count(name) for name in set(names) if "Block" in name})

    measure_blockwise(float_gm, batches, on_block=count_copies)
    # when block i is quantized, every earlier block's quantized and instrumented copies are gone: alive are the
    # float and the prepared graph of each block not measured yet
    assert [sum(counts.values()) for counts in alive] == [6, 4, 2]


def test_planned_variants_hold_no_copy_of_the_weights(llama):
    """The equalization variants' quantized weights are made when a block's shadows are added, not for the whole
    model when the variants are planned."""
    float_gm, batches = llama
    layers = [entry.layer for entry in quantized_layers(float_gm) if entry.equalizable]
    probed = ProbedModel(float_gm, None, None, layers, "search")
    calibrate(probed.prepared, batches)
    variants, _, _ = probed.read()
    assert {v.method for v in variants} >= {"input_weight", "smoothing"}
    held = [t for v in variants for t in (v.factor, v.low, v.high, *v.extras.values()) if isinstance(t, torch.Tensor)]
    smallest_weight = min(p.numel() for name, p in float_gm.named_parameters() if "proj" in name)
    assert held and max(t.numel() for t in held) < smallest_weight
    assert torch.equal(variants[0].extras["weight"](), variants[0].extras["weight"]())


@pytest.mark.parametrize("rewrite", ["equalize", "smooth"])
def test_an_equalized_model_is_rewritten_one_block_at_a_time(llama, rewrite):
    """Block-wise, an equalized or smoothed model's rewritten weights are made for one block at a time (and for
    its calibration), never for the whole model, and measure what the eagerly rewritten model measures."""
    float_gm, batches = llama
    layers = [entry.layer for entry in quantized_layers(float_gm) if entry.equalizable]

    def rewritten(deferred):
        if rewrite == "smooth":
            return smooth(float_gm, batches, 0.5, deferred=deferred)
        return equalize(float_gm, layers, batches, deferred=deferred)

    deferred = rewritten(True)
    originals = {p.data_ptr() for p in float_gm.parameters()}
    assert {p.data_ptr() for p in deferred.parameters()} <= originals
    seen = []

    def whole_model_never_rewritten(block):
        seen.append(block.indices)
        assert {p.data_ptr() for p in deferred.parameters()} <= originals

    assert measure_blockwise(deferred, batches, on_block=whole_model_never_rewritten).sqnr == \
        measure_model(rewritten(False), batches).sqnr
    assert seen == [(0,), (1,), (2,)]


def test_a_model_without_a_stack_says_so():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    float_gm = qcore.capture(SmallMLP(features=8).eval(), x)
    with pytest.raises(BlockwiseError, match="no stack of numbered blocks"):
        ModelAnalysis(float_gm, batches=[x], blockwise=True).sqnr  # noqa: B018
    with pytest.raises(BlockwiseError, match="no stack of numbered blocks at 'decoder'"):
        split_into_blocks(qcore.capture(Stack().eval(), x), "decoder")


def test_whole_model_searches_refuse_a_blockwise_analysis(llama):
    float_gm, batches = llama
    analysis = ModelAnalysis(float_gm, batches=batches, blockwise=True)
    for ask in (lambda: analysis.sensitivity(), lambda: analysis.float_layers_fix(40.0),
                lambda: analysis.quantized_gm, lambda: analysis.logits_on(batches)):
        with pytest.raises(BlockwiseUnsupported, match="one block at a time"):
            ask()


CONFTEST = """
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


""" + STACK_SOURCE + """


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 8, generator=g) for _ in range(3)]


@qmodel(calibration="batches", blockwise=BLOCKWISE, model_sqnr_min_db=60.0,
        checks=["sqnr", "model_sqnr", "weight_sqnr", "per_channel", "outlier", "sensitivity"])
def stack():
    torch.manual_seed(0)
    return Stack().eval()
"""


def _rows(path):
    import json

    rows = json.loads(path.read_text())["rows"]
    return {(r["check"], r["layer"]): (r["verdict"], r["value"]) for r in rows}


def test_a_blockwise_model_reports_the_whole_model_numbers_serially_and_under_xdist(pytester):
    runs = {}
    # the three modes serially, and block-wise once more under -n 2 (each -n 2 run starts two workers)
    for mode, workers in (("False", []), ("True", []), ("'layers'", []), ("True", ["-n", "2", "-p", "xdist"])):
        pytester.makeconftest(CONFTEST.replace("BLOCKWISE", mode))
        run = pytester.runpytest
        name = f"{mode}{'-xdist' if workers else ''}"
        result = run("--qreport", "-p", "no:randomly", "-p", "no:cacheprovider", f"--qreport-json={name}.json",
                     *workers)
        runs[name] = (result, _rows(pytester.path / f"{name}.json"))
    whole, blockwise, named, under_xdist = (runs[name][1] for name in ("False", "True", "'layers'", "True-xdist"))
    sensitivity = ("sensitivity", "model")
    assert whole[sensitivity][0] in ("pass", "warn") and blockwise[sensitivity][0] == "skip"
    for rows in (whole, blockwise, named, under_xdist):
        rows.pop(sensitivity, None)
    assert blockwise == whole == named == under_xdist and len(whole) > 20  # every layer's number, the output too
    assert whole[("model_sqnr", "output")][0] == "fail"  # 60 dB is out of reach: the advice runs
    text = runs["True"][0].stdout.str()
    assert "No float_layers search ran: the model is analysed one block at a time (blockwise)" in text
    # the hint works: blockwise=False runs the search
    assert "float_layers=[" in runs["False"][0].stdout.str() and "float_layers=[" not in text


def test_auto_goes_blockwise_when_the_whole_model_would_exceed_the_budget(pytester):
    pytester.makeconftest(CONFTEST.replace("BLOCKWISE", "'auto'").replace(', "sensitivity"', ""))
    # the whole model's estimate is 5 x 269 KiB; its biggest block's 5 x 69 KiB
    result = pytester.runpytest("--qreport", "-p", "no:randomly", "--qreport-memory-budget=1MiB",
                                "--qreport-json=auto.json")
    assert "errors" not in result.parseoutcomes()
    assert "No float_layers search ran: the model is analysed one block at a time" in result.stdout.str()
    # a budget under one block's estimate: the item errors and says so
    result = pytester.runpytest("--qreport", "-p", "no:randomly", "--qreport-memory-budget=200KiB")
    assert "its analysis, even one block at a time (blockwise), is estimated to need" in result.stdout.str()
    assert result.parseoutcomes()["errors"] > 10 and "passed" not in result.parseoutcomes()


def test_a_stack_that_is_not_there_errors_the_model_items(pytester):
    pytester.makeconftest(CONFTEST.replace("BLOCKWISE", "'decoder.layers'"))
    result = pytester.runpytest("--qreport", "-p", "no:randomly")
    assert "model 'stack': blockwise='decoder.layers': no stack of numbered blocks at 'decoder.layers'" in \
        result.stdout.str()
    assert "passed" not in result.parseoutcomes()
