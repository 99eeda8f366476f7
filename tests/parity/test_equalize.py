"""Equalization: torch.ao's scale function and _convert_equalization_ref, float equivalence, quantization."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.fx import _equalize as ao_eq
from torch.ao.quantization.quantize_fx import prepare_fx

import qcore
from qcore.graph.deferred import deferred_parameters, materialized
from qcore.numeric import compare
from qcore.rewrites.equalize import (
    EqualizationError,
    InputEqualizationObserver,
    WeightEqualizationObserver,
    calculate_equalization_scale,
    cross_layer_equalize,
    equalize,
)
from qcore.rewrites.smoothing import smooth


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _skewed(shape, n=4, seed=0, axis=1):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 2, shape[axis])
    view = [1] * len(shape)
    view[axis] = -1
    return [torch.randn(shape, generator=g) * spread.view(view) for _ in range(n)]


def test_scale_function_matches_torch_ao():
    x, w = _skewed((16, 12))[0], torch.randn(8, 12)
    w[:, 3] = 0.0  # a zero-range weight column: scale 1
    ours_in, ours_w = InputEqualizationObserver(), WeightEqualizationObserver()
    ref_in, ref_w = ao_eq._InputEqualizationObserver(), ao_eq._WeightEqualizationObserver()
    ours_in(x), ours_w(w), ref_in(x), ref_w(w)
    ours = calculate_equalization_scale(ours_in, ours_w)
    ref = ao_eq.calculate_equalization_scale(ref_in, ref_w)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    assert float(ours[3]) == 1.0


@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=5), seed=st.integers(0, 3))
@settings(max_examples=40, deadline=None)
def test_weight_column_ranges_equal_one_reduction_over_the_other_dims(shape, seed):
    """The weight observer's per-column (axis 1) min and max, linear and conv kernels alike, with NaN kept."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if seed == 3:
        w.view(-1)[0] = float("nan")
    observer = WeightEqualizationObserver()
    observer(w)
    others = [d for d in range(w.dim()) if d != 1]
    torch.testing.assert_close(observer.min_val, w.amin(dim=others), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(observer.max_val, w.amax(dim=others), rtol=0, atol=0, equal_nan=True)


def test_shared_weight_column_ranges_reduce_each_weight_once_and_see_a_change_in_place(monkeypatch):
    """Within weight_column_ranges_shared() the detector and the variants' plan share one reduction of a weight
    (a view of it, detached or not, is the same weight); a weight changed in place, or another view, is reduced
    again; outside the block every call reduces."""
    import qcore.rewrites.equalize as equalize_module

    reductions = []
    reduce = equalize_module._column_ranges
    monkeypatch.setattr(equalize_module, "_column_ranges", lambda w: reductions.append(w.shape) or reduce(w))
    weight = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    with equalize_module.weight_column_ranges_shared():
        first = equalize_module.weight_column_ranges(weight[1].detach())
        again = equalize_module.weight_column_ranges(weight[1])
        assert again[0] is first[0] and again[1] is first[1] and len(reductions) == 1
        equalize_module.weight_column_ranges(weight[2])  # another expert's slice
        assert len(reductions) == 2
        with torch.no_grad():
            weight[1, 0, 0] = 100.0
        changed = equalize_module.weight_column_ranges(weight[1])
        assert len(reductions) == 3 and float(changed[1][0]) == 100.0
    for low, high in (first, changed):
        assert low.dtype == high.dtype == torch.float32
    torch.testing.assert_close(changed[0], weight[1].amin(dim=0), rtol=0, atol=0)
    equalize_module.weight_column_ranges(weight[1])
    equalize_module.weight_column_ranges(weight[1])
    assert len(reductions) == 5


class Linear2(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.linear1 = nn.Linear(width, width)
        self.linear2 = nn.Linear(width, 3)

    def forward(self, x):
        return self.linear2(self.linear1(x))


class Linear1(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("make", [Linear1, Linear2])
def test_matches_torch_ao_convert_equalization_ref(make):
    torch.manual_seed(0)
    model, data = make().eval(), _skewed((32, 6))
    eq_config = {"object_type": [(nn.Linear, ao_eq.default_equalization_qconfig)]}
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(), (data[0],),
                          _equalization_config=eq_config)
    for batch in data:
        prepared(batch)
    reference = ao_eq._convert_equalization_ref(prepared)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ours = equalize(qcore.capture(model, data[0]), names, data)
    for name in names:  # same rewritten weights and biases
        ours_layer = dict(ours.named_modules())[name]
        ref_layer = dict(reference.named_modules())[name]
        ref_weight = ref_layer.weight() if callable(ref_layer.weight) else ref_layer.weight
        expected = ref_weight.dequantize() if ref_weight.is_quantized else ref_weight
        torch.testing.assert_close(ours_layer.weight, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours_layer.bias, ref_layer.bias, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        for batch in data:
            torch.testing.assert_close(ours(batch), reference(batch), rtol=1e-5, atol=1e-6)
    # same scale for the first layer (the only one with an input mul)
    ref_scale = next(v for k, v in reference.named_buffers() if "equalization_scale" in k)
    torch.testing.assert_close(torch.tensor(ours.meta["qcore_equalization_scales"][names[0]]),
                               ref_scale.reshape(-1), rtol=1e-5, atol=0)
    muls = [n for n in ours.graph.nodes if n.meta.get("qcore_inserted") == "equalization"]
    assert len(muls) == 1  # none between connected layers


# ---- float equivalence on random shapes ----

class ConvChain(nn.Module):
    def __init__(self, c_in, c_mid, groups, depthwise, dims):
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.first = conv(c_in, c_mid, 3, padding=1)
        self.grouped = conv(c_mid, c_mid, 3, padding=1, groups=groups)
        self.depthwise = conv(c_mid, c_mid * 2, 3, padding=1, groups=c_mid) if depthwise else None
        self.dims = dims

    def forward(self, x):
        x = torch.relu(self.first(x))
        x = self.grouped(x)
        if self.depthwise is not None:
            x = torch.relu(self.depthwise(x))
        return x


class FunctionalChain(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(b, a) / a**0.5) for a, b in zip(sizes, sizes[1:])])
        self.biases = nn.ParameterList([nn.Parameter(torch.randn(b)) for b in sizes[1:]])

    def forward(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = F.linear(x, w, b)
            if i % 2 == 0:
                x = torch.relu(x)
        return x


def _check_equivalent(model, data, method):
    gm = qcore.capture(model.eval(), data[0], method=method)
    layers = [op.layer for op in qcore.find_quantizable_ops(gm)]
    for equalized in (equalize(gm, layers, data), cross_layer_equalize(gm)):
        with torch.no_grad():
            for batch in data:
                assert _rel(equalized(batch), gm(batch)) <= 1e-5


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=5), tokens=st.booleans(),
       method=st.sampled_from(["export", "fx"]), seed=st.integers(0, 1000))
def test_linear_chains_stay_float_equivalent(sizes, tokens, method, seed):
    torch.manual_seed(seed)
    shape = (3, 5, sizes[0]) if tokens else (6, sizes[0])
    _check_equivalent(FunctionalChain(sizes), _skewed(shape, n=2, seed=seed, axis=-1), method)


@settings(max_examples=12, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), depthwise=st.booleans(), dims=st.sampled_from([1, 2]),
       c_in=st.integers(1, 5), seed=st.integers(0, 1000))
def test_conv_chains_grouped_and_depthwise_stay_float_equivalent(groups, depthwise, dims, c_in, seed):
    torch.manual_seed(seed)
    shape = (2, c_in, 9) if dims == 1 else (2, c_in, 6, 6)
    _check_equivalent(ConvChain(c_in, 8, groups, depthwise, dims), _skewed(shape, n=2, seed=seed), "export")


def test_cross_layer_equalization_balances_ranges():
    torch.manual_seed(0)
    model = ConvChain(3, 8, 1, False, 2).eval()
    with torch.no_grad():
        model.first.weight[2] *= 50
        model.first.bias[2] *= 50
    data = _skewed((2, 3, 6, 6))
    gm = qcore.capture(model, data[0])
    balanced = cross_layer_equalize(gm)
    r1 = balanced.first.weight.abs().reshape(8, -1).amax(1)
    r2 = balanced.grouped.weight.abs().movedim(1, 0).reshape(8, -1).amax(1)
    torch.testing.assert_close(r1, r2, rtol=1e-4, atol=1e-6)  # s = sqrt(r1 r2) / r2 equalizes the two ranges


def test_equalized_graph_quantizes_and_gains_sqnr():
    torch.manual_seed(0)
    model = Linear2(16).eval()
    data = _skewed((64, 16), n=6)
    gm = qcore.capture(model, data[0])
    quantizer = qcore.Int8StaticQuantizer(per_channel=False)
    _, plain = qcore.quantize(gm, data[0], data, quantizer)
    equalized = equalize(gm, ["linear1", "linear2"], data)
    _, quant_eq = qcore.quantize(equalized, data[0], data, quantizer)
    before = {r["layer"]: r["sqnr_db"] for r in compare(gm, plain, data)}
    after = {r["layer"]: r["sqnr_db"] for r in compare(equalized, quant_eq, data)}
    assert after["linear2"] > before["linear2"] + 1.0


@pytest.mark.parametrize("method", ["fx", "export"])
def test_rewrites_share_the_parameters_they_leave_alone_and_never_write_the_originals(method):
    """An equalized, smoothed or cross-layer-equalized copy holds new tensors for what it rewrites only."""
    model = Linear2(16).eval()
    data = _skewed((64, 16), n=3)
    gm = qcore.capture(model, data[0], method=method)
    before = {name: value.clone() for name, value in gm.state_dict().items()}
    originals = {name: value.data_ptr() for name, value in gm.named_parameters()}
    for rewritten in (equalize(gm, ["linear2"], data), cross_layer_equalize(gm), smooth(gm, data, 0.5)):
        pointers = {name: value.data_ptr() for name, value in rewritten.named_parameters()}
        shared = {name for name, pointer in pointers.items() if pointer in originals.values()}
        assert shared and shared != set(pointers)  # some parameters rewritten, the others the original tensors
        for name, value in gm.state_dict().items():
            assert torch.equal(value, before[name]), name
    only_linear2 = {name for name, value in equalize(gm, ["linear2"], data).named_parameters()
                    if value.data_ptr() not in originals.values()}
    assert only_linear2 and all("linear2" in name for name in only_linear2)


@pytest.mark.parametrize("rewrite", ["equalize", "smooth"])
def test_a_deferred_rewrite_holds_the_originals_and_makes_the_same_weights_when_materialized(rewrite):
    model = Linear2(16).eval()
    data = _skewed((64, 16), n=3)
    gm = qcore.capture(model, data[0])

    def rewritten(deferred):
        if rewrite == "smooth":
            return smooth(gm, data, 0.5, deferred=deferred)
        return equalize(gm, ["linear1", "linear2"], data, deferred=deferred)

    eager, deferred = rewritten(False), rewritten(True)
    rules = deferred_parameters(deferred)
    assert rules and all(torch.equal(v, gm.state_dict()[k]) for k, v in deferred.state_dict().items() if k in rules)
    with materialized([deferred], rules):
        assert set(deferred.state_dict()) == set(eager.state_dict())
        for name, value in eager.state_dict().items():
            assert torch.equal(deferred.state_dict()[name], value), name
        assert torch.equal(deferred(data[0]), eager(data[0]))
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in deferred.state_dict().items() if k in rules)


def test_bad_layers_are_clear_errors():
    gm = qcore.capture(Linear2().eval(), torch.randn(2, 6))
    with pytest.raises(EqualizationError, match="nope"):
        equalize(gm, ["nope"], [torch.randn(2, 6)])

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 6))

        def forward(self, x):
            return F.linear(F.linear(x, self.weight), self.weight)

    tied = qcore.capture(Tied().eval(), torch.randn(2, 6))
    with pytest.raises(EqualizationError, match="shared"):
        equalize(tied, [op.layer for op in qcore.find_quantizable_ops(tied)], [torch.randn(2, 6)])


def test_model_report_mapping_is_accepted():
    from qcore.report import InputWeightEqualizationDetector, ModelReport

    model, data = Linear2().eval(), _skewed((32, 6))
    report = ModelReport(model, [InputWeightEqualizationDetector(0.5)], example_inputs=data[0])
    observed = report.prepare_detailed_calibration()
    for batch in data:
        observed(batch)
    report.generate_model_report(False)
    mapping = report.generate_equalization_mapping()
    assert mapping
    equalized = equalize(qcore.capture(model, data[0]), mapping, data)
    assert set(equalized.meta["qcore_equalization_scales"]) == set(mapping)


def test_input_quantization_observer_sees_the_scaled_input():
    torch.manual_seed(0)
    model, data = Linear1().eval(), _skewed((32, 6))
    equalized = equalize(qcore.capture(model, data[0]), ["linear"], data)
    prepared = qcore.prepare(copy.deepcopy(equalized), qcore.Int8StaticQuantizer())
    linear = next(n for n in prepared.graph.nodes if n.target == torch.ops.aten.linear.default)
    observer = linear.args[0]
    assert observer.meta.get("qcore_inserted") == "observer"
    assert observer.args[0].meta.get("qcore_inserted") == "equalization"  # observer(mul(x, s)), not mul(observer(x))
    for batch in data:
        prepared(batch)
    scale = torch.tensor(equalized.meta["qcore_equalization_scales"]["linear"])
    seen = prepared.get_submodule(str(observer.target))
    expected = torch.cat([b * scale for b in data])
    assert float(seen.max_val) == pytest.approx(float(expected.max()), rel=1e-5)


class AddThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.a(x) + self.b(x))


def test_a_layer_after_a_quantized_producer_quantizes_its_scaled_input_again():
    # as torch.ao's equalization does: dequantize the producer's output, scale it, quantize it for the layer
    torch.manual_seed(0)
    model, data = AddThenLinear().eval(), _skewed((32, 6))
    equalized = equalize(qcore.capture(model, data[0]), ["head"], data)
    prepared = qcore.prepare(copy.deepcopy(equalized), qcore.Int8StaticQuantizer())
    head = [n for n in prepared.graph.nodes if n.target == torch.ops.aten.linear.default][-1]
    observer = head.args[0]
    assert observer.meta.get("qcore_inserted") == "observer"
    mul = observer.args[0]
    assert mul.meta.get("qcore_inserted") == "equalization"
    assert mul.args[0].meta.get("qcore_inserted") == "observer"  # the add's own output quantizer stays


class _Mixed(nn.Module):
    """Two linears of one width, a convolution and a grouped one: their equalization scales are made together."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 6), nn.Linear(12, 9)
        self.conv, self.grouped = nn.Conv2d(4, 6, 3), nn.Conv2d(6, 6, 1, groups=3)

    def forward(self, x, image):
        return self.a(x), self.b(x), self.grouped(self.conv(image))


@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       zeros=st.integers(0, 3))
@settings(max_examples=30, deadline=None)
def test_equalization_scales_made_together_equal_each_layers_alone(seed, dtype, zeros):
    """input_weight_scales lays several layers' ranges end to end: each layer's scale is, to the bit, what
    calculate_equalization_scale gives it alone from an input and a weight observer (zero ranges: scale 1)."""
    from qcore.graph.ops import find_quantizable_ops
    from qcore.rewrites.equalize import input_weight_scales

    generator = torch.Generator().manual_seed(seed)
    model = _Mixed().to(dtype).eval()
    gm = qcore.capture(model, (torch.randn(2, 12, dtype=dtype), torch.randn(1, 4, 5, 5, dtype=dtype)))
    ops = [op for op in find_quantizable_ops(gm) if op.weight_target is not None]
    ranges = []
    for op in ops:
        channels = qcore.graph.ops.fetch_attr(gm, op.weight_target).shape[1] * (3 if op.layer == "grouped" else 1)
        low = -torch.rand(channels, generator=generator) * 10
        high = torch.rand(channels, generator=generator) * 10
        low[:zeros], high[:zeros] = 0.0, 0.0  # zero input ranges: scale 1
        ranges.append((low, high))
    together = input_weight_scales(gm, [(op, low, high) for op, (low, high) in zip(ops, ranges)])
    assert len(together) == len(ops) == 4
    for op, (low, high), scale in zip(ops, ranges, together):
        inputs, weights = InputEqualizationObserver(), WeightEqualizationObserver()
        inputs.min_val, inputs.max_val = low, high
        weight = qcore.graph.ops.fetch_attr(gm, op.weight_target).detach()
        if op.layer == "grouped":  # channel g * in_per_group + j
            blocks = weight.reshape(3, 2, 2, -1)
            weights.min_val = blocks.amin(dim=(1, 3)).reshape(-1).float()
            weights.max_val = blocks.amax(dim=(1, 3)).reshape(-1).float()
        else:
            weights(weight)
        assert torch.equal(scale, calculate_equalization_scale(inputs, weights).reshape(-1)), op.layer
