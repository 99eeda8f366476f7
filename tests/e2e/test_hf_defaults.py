"""Transformers models as users declare them (default configs: use_cache=True, weight norm, Conv1D, x @ W.T):
each is captured and analysed under int8 and the deployed formats with no error item. The whole zoo is
benchmarks/bench_hf_zoo.py; this is its smoke subset."""
import importlib.util
import json
import pathlib

import pytest
import torch
from torch import nn

import qcore
from qcore.graph.ops import fetch_attr
from qcore.quantization.format_quantizer import FormatQuantizer

transformers = pytest.importorskip("transformers")

ZOO = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hf_zoo"


def _architectures():
    spec = importlib.util.spec_from_file_location("hf_zoo_architectures", ZOO / "architectures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def architectures():
    return _architectures()


def _zoo_rows(pytester, monkeypatch, names, *args):
    pytester.makeconftest((ZOO / "conftest.py").read_text())
    pytester.makepyfile(architectures=(ZOO / "architectures.py").read_text())
    monkeypatch.setenv("QREPORT_ZOO", ",".join(names))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=zoo.json", *args)
    return result, json.loads((pytester.path / "zoo.json").read_text())["rows"]


def test_default_configs_run_with_no_error_item_under_int8(pytester, monkeypatch, architectures):
    result, rows = _zoo_rows(pytester, monkeypatch, architectures.SMOKE)
    errors = [(row["model"], row["check"], row["layer"], row["message"][:200]) for row in rows
              if row["verdict"] == "error"]
    assert errors == []
    per_model = {name: [row for row in rows if row["model"] == name] for name in architectures.SMOKE}
    assert all(len(items) > 40 for items in per_model.values()), {k: len(v) for k, v in per_model.items()}
    assert result.ret in (0, 1)  # tiny random models may fail thresholds; nothing errors


def test_gpt2_conv1d_layers_get_items_under_a_format(pytester, monkeypatch):
    result, rows = _zoo_rows(pytester, monkeypatch, ["gpt2"], "--qreport-quantizer=W4A16",
                             "--qreport-checks=sqnr,weight_sqnr")
    layers = {row["layer"] for row in rows if row["check"] == "sqnr"}
    for block in (0, 1):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert f"transformer.h.{block}.{name}" in layers
    assert not [row for row in rows if row["verdict"] == "error"]


def test_capture_turns_the_cache_off_for_the_capture_only(architectures):
    model, batches = architectures.ARCHITECTURES["llama"][1]()
    assert model.config.use_cache
    gm = qcore.capture(model, batches[0], name="llama")
    assert model.config.use_cache  # restored
    leaves = torch.utils._pytree.tree_leaves(gm(**batches[1]))
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    with torch.no_grad():
        expected = model(**batches[1]).logits
    torch.testing.assert_close(leaves[0], expected)


def test_a_model_returning_an_unknown_object_is_told_how_to_fix_it():
    class Box:
        def __init__(self, value):
            self.value = value

    class ReturnsBox(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return Box(self.fc(x))

    with pytest.raises(qcore.CaptureError, match="cannot flatten into tensors.*register_dataclass"):
        qcore.capture(ReturnsBox().eval(), torch.randn(2, 4), name="boxed")


class WeightNormConv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1), dim=2)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.conv(x).mean(-1))


def test_a_weight_computed_from_parameters_is_folded_and_quantized_as_a_weight():
    model, x = WeightNormConv().eval(), torch.randn(3, 4, 10)
    gm = qcore.capture(model, x)
    conv = next(op for op in qcore.find_quantizable_ops(gm) if op.layer == "conv")
    assert conv.weight.op == "get_attr"
    torch.testing.assert_close(fetch_attr(gm, conv.weight_target), model.conv.weight.detach())
    torch.testing.assert_close(gm(x), model(x))
    from qcore.analysis import measure_sqnr

    assert measure_sqnr(gm, [x, torch.randn(3, 4, 10)]).layers["conv"].weight_sqnr_db > 30


class TransposedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        return x @ self.proj.weight.T + self.proj.bias  # transformers' FalconLinear


def test_x_at_w_transposed_is_a_linear_with_its_weight():
    x = torch.randn(2, 5, 16)
    ours = qcore.capture(TransposedWeight().eval(), x)
    (op,) = qcore.find_quantizable_ops(ours)
    assert op.kind == "linear" and op.weight.op == "get_attr" and op.layer == "proj"
    torch.testing.assert_close(ours(x), TransposedWeight().eval()(x))
    for name in ("W4A16", "NVFP4"):  # the same numbers as the nn.Linear it is
        linear = nn.Sequential(TransposedWeight().proj).eval()
        reference = qcore.quantize(qcore.capture(linear, x), x, [x], quantizer=FormatQuantizer(name))[1]
        quantized = qcore.quantize(ours, x, [x], quantizer=FormatQuantizer(name))[1]
        torch.testing.assert_close(quantized(x), reference(x))


def test_conv1d_addmm_takes_a_format_as_the_equal_linear_does():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv1d = Conv1D(96, 128).eval()  # weight stored [in, out] = [128, 96]
    linear = nn.Linear(128, 96).eval()
    with torch.no_grad():
        linear.weight.copy_(conv1d.weight.t())
        linear.bias.copy_(conv1d.bias)
    x = torch.randn(4, 7, 128)
    for name in ("W4A16", "NVFP4", "MXFP4", "FP8_DYNAMIC"):
        ours = qcore.quantize(qcore.capture(conv1d, x), x, [x], quantizer=FormatQuantizer(name))[1]
        reference = qcore.quantize(qcore.capture(linear, x), x, [x], quantizer=FormatQuantizer(name))[1]
        (op,) = [op for op in qcore.find_quantizable_ops(ours) if op.weight is not None]
        assert op.kind == "addmm"
        torch.testing.assert_close(ours(x), reference(x), rtol=1e-5, atol=1e-5)
        assert not torch.equal(ours(x), conv1d(x))  # quantized, not skipped
