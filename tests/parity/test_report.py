"""ModelReport and detectors against torch.ao's, on FX-traceable models, plus the fixed bugs."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.fx._model_report import detector as ao_detector
from torch.ao.quantization.fx._model_report.model_report import ModelReport as AOModelReport
from torch.ao.quantization.qconfig import default_qconfig
from torch.ao.quantization.quantize_fx import prepare_fx

import qcore
from qcore.report import (
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    ModelReport,
    ModelReportError,
    OutlierDetector,
    PerChannelDetector,
)


class TanhMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class TanhCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.Tanh()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        x = self.act(self.conv2(self.act(self.conv1(x))))
        return self.fc(torch.flatten(x, 1))


def _mlp_data(nonstationary=False, zero_column=False):
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(8):
        x = torch.randn(64, 16, generator=g)
        x[:, 3] *= 8  # a wide channel
        x[torch.randint(0, 64, (2,), generator=g), 5] = 40.0  # rare spikes: outliers in channel 5
        if nonstationary:
            x = x * (0.2 + 3 * (i % 2))
        if zero_column:
            x[:, 7] = 0.0
        out.append(x)
    return out


def _cnn_data():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(6)]


CASES = {
    "mlp": (TanhMLP, _mlp_data),
    "mlp_nonstationary": (TanhMLP, lambda: _mlp_data(nonstationary=True)),
    "cnn": (TanhCNN, _cnn_data),
}


def _torch_ao_report(model, data, detector):
    prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), (data[0],))
    report = AOModelReport(prepared, {detector})
    observed = report.prepare_detailed_calibration()
    with torch.no_grad():
        for batch in data:
            observed(batch)
    return report.generate_model_report(remove_inserted_observers=False)[detector.get_detector_name()][1]


def _calibrated_report(detectors, model=None, data=None):
    model, data = model or TanhMLP().eval(), data or _mlp_data()
    report = ModelReport(model, detectors, example_inputs=data[0])
    observed = report.prepare_detailed_calibration()
    with torch.no_grad():
        for batch in data:
            observed(batch)
    return report


def _our_report(model, data, detector):
    report = _calibrated_report([detector], model, data)
    return report.generate_model_report(remove_inserted_observers=False)[detector.get_detector_name()][1]


def _close(a, b, rel=1e-4):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.allclose(a, b, rtol=rel, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("case", CASES)
def test_dynamic_static_matches_torch_ao(case):
    make, data_fn = CASES[case]
    torch.manual_seed(0)
    model, data = make().eval(), data_fn()
    ours = _our_report(model, data, DynamicStaticDetector(tolerance=0.5))
    theirs = _torch_ao_report(model, data, ao_detector.DynamicStaticDetector(tolerance=0.5))
    assert set(theirs) <= set(ours)  # torch.ao covers linear only; we add conv
    for fqn, entry in theirs.items():
        for key in ("dynamic_recommended", "input_activation_dynamic_static_data_classification",
                    "output_activation_dynamic_static_data_classification"):
            assert ours[fqn][key] == entry[key], (fqn, key)
        for key in ("input_activation_dynamic_static_comp_stat", "output_activation_dynamic_static_comp_stat"):
            assert _close(ours[fqn][key], entry[key]), (fqn, key)
    if case == "mlp_nonstationary":
        assert ours["fc1"]["dynamic_recommended"]


@pytest.mark.parametrize("case", CASES)
def test_input_weight_equalization_matches_torch_ao(case):
    make, data_fn = CASES[case]
    torch.manual_seed(0)
    model, data = make().eval(), data_fn()
    ours = _our_report(model, data, InputWeightEqualizationDetector(ratio_threshold=0.6))
    theirs = _torch_ao_report(model, data, ao_detector.InputWeightEqualizationDetector(ratio_threshold=0.6))
    assert set(theirs) and set(theirs) == set(ours)
    for fqn, entry in theirs.items():
        assert ours[fqn]["input_weight_equalization_recommended"] == entry["input_weight_equalization_recommended"]
        for key in ("input_weight_channel_comparison_metrics", "input_activation_per_channel_max",
                    "input_activation_per_channel_min", "weight_per_channel_max", "weight_per_channel_min"):
            assert _close(ours[fqn][key], entry[key]), (fqn, key)


@pytest.mark.parametrize("case", CASES)
def test_outlier_detector_matches_torch_ao(case):
    make, data_fn = CASES[case]
    torch.manual_seed(0)
    model, data = make().eval(), data_fn()
    ours = _our_report(model, data, OutlierDetector(reference_percentile=0.95))
    theirs = _torch_ao_report(model, data, ao_detector.OutlierDetector(reference_percentile=0.95))
    assert set(ours) == set(theirs)   # every leaf module torch.ao observes: the Tanh, the ReLU, the pooling
    assert {"fc1", "fc2", "fc3"} <= set(ours) or {"conv1", "conv2", "fc"} <= set(ours)
    for fqn in theirs:
        assert ours[fqn]["outliers_detected"] == theirs[fqn]["outliers_detected"], fqn
        assert _close(ours[fqn]["outlier_detection_percentile_ratios"],
                      theirs[fqn]["outlier_detection_percentile_ratios"]), fqn
        assert _close(ours[fqn]["input_activation_per_channel_max"], theirs[fqn]["input_activation_per_channel_max"])
        assert _close(ours[fqn]["constant_batch_counts"], theirs[fqn]["constant_batch_counts"])
    if case == "mlp":
        assert ours["fc1"]["outliers_detected"][5]


def test_per_channel_detector_matches_torch_ao():
    model, data = TanhMLP().eval(), _mlp_data()
    for ao_mapping, per_channel in ((get_default_qconfig_mapping("x86"), True),
                                    (QConfigMapping().set_global(default_qconfig), False)):
        prepared = prepare_fx(model, ao_mapping, (data[0],))
        theirs = ao_detector.PerChannelDetector("x86").generate_detector_report(prepared)[1]
        detector = PerChannelDetector("x86", quantizer=qcore.Int8StaticQuantizer(per_channel=per_channel))
        ours = detector.generate_detector_report(qcore.capture(model, data[0]))[1]
        for fqn in ("fc1", "fc2", "fc3"):
            assert ours[fqn] == theirs[fqn]


# ---- the torch.ao bugs we do not copy ----

def test_all_zero_channel_is_not_an_outlier():
    model, data = TanhMLP().eval(), _mlp_data(zero_column=True)
    ours = _our_report(model, data, OutlierDetector())
    theirs = _torch_ao_report(model, data, ao_detector.OutlierDetector())
    assert theirs["fc1"]["outliers_detected"][7]  # torch.ao: ratio inf, flagged
    assert not ours["fc1"]["outliers_detected"][7]
    assert math.isnan(float(ours["fc1"]["outlier_detection_percentile_ratios"][7]))


class TokensThenConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, inputs):
        x, image = inputs
        return self.fc(x).sum() + self.conv(image).sum()


def test_reports_name_the_axis_their_statistics_were_taken_along():
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(2, 5, 6, generator=g), torch.randn(2, 3, 4, 4, generator=g)] for _ in range(3)]
    outliers = _our_report(TokensThenConv().eval(), data, OutlierDetector())
    assert outliers["fc"]["outlier_detection_channel_axis"] == 2  # the features of [batch, tokens, features]
    assert len(outliers["fc"]["outliers_detected"]) == 6
    assert outliers["conv"]["outlier_detection_channel_axis"] == 1
    assert len(outliers["conv"]["outliers_detected"]) == 3
    equalization = _our_report(TokensThenConv().eval(), data, InputWeightEqualizationDetector(0.5))
    assert equalization["fc"]["input_weight_channel_axis"] == 2
    assert equalization["conv"]["input_weight_channel_axis"] == 1


class ConstantInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.zeros_like(x) + 1.0)


def test_constant_activation_is_reported_not_raised():
    model, data = ConstantInput().eval(), [torch.randn(8, 4) for _ in range(3)]
    with pytest.raises(ValueError, match="Range for Epoch is 0"):
        _torch_ao_report(model, data, ao_detector.DynamicStaticDetector())
    ours = _our_report(model, data, DynamicStaticDetector())
    assert ours["fc"]["input_activation_dynamic_static_data_classification"] == "constant"
    assert not bool(ours["fc"]["dynamic_recommended"])


def test_shared_observer_serves_every_detector_with_its_own_settings():
    model, data = TanhMLP().eval(), _mlp_data()
    detectors = [OutlierDetector(reference_percentile=0.9), InputWeightEqualizationDetector(0.6),
                 DynamicStaticDetector()]
    report = _calibrated_report(detectors, model, data)
    together = report.generate_model_report(False)
    inserted = [n for n in report.model.graph.nodes if n.meta.get("qcore_inserted") == "report"]
    # one shared pre observer and one post observer per layer, and the outlier observer of the Tanh module
    assert len(inserted) == 2 * 3 + 1
    alone = {
        "outlier_detector": _our_report(model, data, OutlierDetector(reference_percentile=0.9)),
        "input_weight_equalization_detector": _our_report(model, data, InputWeightEqualizationDetector(0.6)),
        "dynamic_vs_static_detector": _our_report(model, data, DynamicStaticDetector()),
    }
    for name, expected in alone.items():
        for fqn, features in expected.items():
            for key, value in features.items():
                got = together[name][1][fqn][key]
                assert _close(got, value) if isinstance(value, torch.Tensor) else got == value, (name, fqn, key)


def test_generating_twice_gives_the_same_report():
    model, data = TanhMLP().eval(), _mlp_data()
    report = ModelReport(model, [OutlierDetector(), InputWeightEqualizationDetector(0.6)], example_inputs=data[0])
    observed = report.prepare_detailed_calibration()
    with torch.no_grad():
        for batch in data:
            observed(batch)
    first = report.generate_model_report(False)
    second = report.generate_model_report(False)
    for name in first:
        for fqn, features in first[name][1].items():
            for key, value in features.items():
                other = second[name][1][fqn][key]
                assert _close(value, other) if isinstance(value, torch.Tensor) else value == other


def test_misuse_is_a_clear_error():
    model, data = TanhMLP().eval(), _mlp_data()
    report = ModelReport(model, [OutlierDetector()], example_inputs=data[0])
    with pytest.raises(ModelReportError, match="before prepare"):
        report.generate_model_report(False)
    report.prepare_detailed_calibration()
    with pytest.raises(ModelReportError, match="already called"):
        report.prepare_detailed_calibration()
    report.generate_model_report(remove_inserted_observers=True)
    with pytest.raises(ModelReportError, match="removed"):
        report.generate_model_report(False)
    assert not any(n.meta.get("qcore_inserted") == "report" for n in report.model.graph.nodes)


def test_attention_style_inputs_use_the_feature_axis():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(16, 16)

        def forward(self, x):
            return self.q(x)

    g = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 10, 16, generator=g) for _ in range(4)]
    for batch in data:
        batch[..., 2] *= 50
    ours = _our_report(Attention().eval(), data, OutlierDetector())
    assert len(ours["q"]["outliers_detected"]) == 16  # features, not tokens
    report = _our_report(Attention().eval(), data, InputWeightEqualizationDetector(0.6))
    assert report["q"]["input_activation_per_channel_max"].shape == (16,)


def test_qconfig_mapping_feeds_the_quantizer():
    model, data = TanhMLP().eval(), _mlp_data(nonstationary=True)
    report = ModelReport(model, [DynamicStaticDetector(), PerChannelDetector()], example_inputs=data[0])
    observed = report.prepare_detailed_calibration()
    with torch.no_grad():
        for batch in data:
            observed(batch)
    report.generate_model_report(False)
    mapping = report.generate_qconfig_mapping()
    assert mapping["fc1"] == {"per_channel": True, "is_dynamic": True}
    float_gm, quant_gm = qcore.quantize(model, data[0], data, qcore.Int8StaticQuantizer(layer_overrides=mapping))
    assert any(getattr(n.target, "__name__", "") == "fake_quantize_dynamic" for n in quant_gm.graph.nodes)


@pytest.mark.parametrize("layout", ["channels_last", "conv"])
def test_sampled_percentile_within_stated_rank_bound(layout):
    """Channels with more than sample_size values use a sample: the estimate stays between the exact
    quantiles at p - 0.03 and p + 0.03 (the documented bound)."""
    from qcore.report.observer import ReportObserver

    g = torch.Generator().manual_seed(0)
    if layout == "conv":
        x = torch.randn(8, 6, 40, 40, generator=g) ** 3
        observer, rows = ReportObserver(ch_axis=1, percentiles=(0.975,)), x.movedim(1, -1).reshape(-1, 6)
    else:
        x = torch.randn(12_000, 6, generator=g) ** 3
        observer, rows = ReportObserver(ch_axis=-1, percentiles=(0.975,)), x
    observer(x)
    estimate = rows.amax(0) / observer.average_ratios(0.975).float()
    low = torch.quantile(rows, 0.945, dim=0, interpolation="lower")
    high = torch.quantile(rows, 1.0, dim=0, interpolation="lower")
    assert rows.shape[0] > observer.sample_size
    assert torch.all(estimate >= low) and torch.all(estimate <= high)
    mid_low = torch.quantile(rows, 0.945, dim=0)
    mid_high = torch.quantile(rows, 0.995, dim=0)
    assert torch.all((estimate >= mid_low) & (estimate <= mid_high))


@given(count=st.integers(1, 3000), size=st.integers(1, 600), seed=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_sorted_sample_is_a_seeded_randperm_prefix_sorted(count, size, seed):
    """The observers' shared sample: randperm's first `size` positions, ascending (everything when count <= size)."""
    from qcore.report.observer import sorted_sample

    expected = torch.arange(count) if count <= size else \
        torch.randperm(count, generator=torch.Generator().manual_seed(seed + count))[:size].sort().values
    assert torch.equal(sorted_sample(count, size, seed), expected)


@given(shape=st.lists(st.integers(1, 7), min_size=2, max_size=4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_channel_sample_offsets_address_the_sampled_positions(shape, data):
    """Channel 0's offsets, plus c times the channel stride, are the flat indices of the sampled positions of
    channel c, in the order of the other dimensions."""
    from qcore.report.observer import channel_sample_offsets, sorted_sample

    axis = data.draw(st.integers(0, len(shape) - 1))
    size = data.draw(st.integers(1, 40))
    values = torch.arange(math.prod(shape)).reshape(shape)
    others = values.movedim(axis, 0).reshape(shape[axis], -1)  # [channel, position over the other dims]
    offsets = channel_sample_offsets(tuple(shape), axis, size, 0)
    chosen = sorted_sample(others.shape[1], size, 0)
    stride = math.prod(shape[axis + 1:])
    for channel in range(shape[axis]):
        assert torch.equal(values.reshape(-1)[offsets + channel * stride], others[channel, chosen])


def test_report_observer_streams_without_host_copies(forbid_host_sync):
    from qcore.report.observer import ReportObserver

    observer = ReportObserver(ch_axis=1, percentiles=(0.9, 0.975))
    sizes = None
    for _ in range(5):
        observer(torch.randn(4, 3, 80, 80))
        current = [tuple(b.shape) for b in observer.buffers()]
        assert sizes is None or current == sizes
        sizes = current


def test_more_than_2_pow_24_values_in_one_channel():
    from qcore.report.observer import ReportObserver

    observer = ReportObserver(ch_axis=1, percentiles=(0.975,))
    observer(torch.randn(1, 1, 2**24 + 8))
    assert observer.num_batches_tracked == 1 and math.isfinite(float(observer.average_ratios(0.975)[0]))


def test_visualizer_tables_and_plots():
    report = _calibrated_report([OutlierDetector(), DynamicStaticDetector()])
    report.generate_model_report(False)
    visualizer = report.generate_visualizer()
    assert visualizer.get_all_unique_module_fqns() == {"fc1", "act", "fc2", "fc3"}   # Tanh: torch.ao's scope
    assert "outlier_detection_percentile_ratios" in visualizer.get_all_unique_feature_names()
    # plottable features are tensor-valued ones, as in torch.ao
    assert "outlier_detection_channel_axis" not in visualizer.get_all_unique_feature_names()
    assert "outlier_detection_channel_axis" in visualizer.get_all_unique_feature_names(False)
    tables = visualizer.generate_filtered_tables(feature_filter="ratio", module_fqn_filter="fc2")
    headers, rows = tables["channel_level_info"]
    assert headers[:3] == ["idx", "layer_fqn", "channel"] and len(rows) == 32 and rows[0][1] == "fc2"
    assert "fc2" in visualizer.generate_table_visualization(feature_filter="dynamic")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install"):
            visualizer.generate_plot_visualization("percentile_ratios")
    else:
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = visualizer.generate_histogram_visualization("percentile_ratios", path=os.path.join(folder, "h.png"))
            assert os.path.getsize(path) > 0


def test_custom_detector_subclass_works_the_same_way():
    from qcore.report import DetectorBase, ReportObserver
    from qcore.report.detectors import observer_name

    class MeanAbsDetector(DetectorBase):
        """Flags layers whose input range exceeds a bound."""

        def __init__(self, bound):
            super().__init__()
            self.bound = bound

        def get_detector_name(self):
            return "range_detector"

        def determine_observer_insert_points(self, model):
            return {observer_name(op.layer, self.get_detector_name(), "pre"):
                    self._point(op.node, op.activation_inputs[0], ReportObserver(per_channel=False), post=False)
                    for op in self.layers(model)}

        def generate_detector_report(self, model):
            info = {}
            for op in self.layers(model):
                observer = self._observer(model, op.layer, "pre")
                span = float(observer.epoch_activation_max - observer.epoch_activation_min)
                info[op.layer] = {"input_range": span, "too_wide": span > self.bound}
            return "ranges", info

    report = _calibrated_report([MeanAbsDetector(bound=10.0), OutlierDetector()])
    reports = report.generate_model_report(remove_inserted_observers=True)
    assert reports["range_detector"][1]["fc1"]["too_wide"] is True  # the inputs have spikes of 40
    assert reports["range_detector"][1]["fc2"]["too_wide"] is False  # tanh outputs stay in [-1, 1]


def _same(a, b):
    """Equal to the bit (nan where nan), as tensors of one dtype."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_reports_of_all_layers_at_once_equal_each_layers_own():
    """The detectors compute every layer's values laid end to end (one chain of ops, one host read): each value is
    what the layer's own observer and weight give alone, a grouped conv's included."""
    from qcore.rewrites.equalize import weight_column_ranges

    torch.manual_seed(0)
    model, data = TanhCNN().eval(), _cnn_data()
    for batch in data:
        batch[:, 1] = 0.0  # an input channel always zero: nan outlier ratios
    detectors = [InputWeightEqualizationDetector(ratio_threshold=0.6), OutlierDetector(reference_percentile=0.95),
                 DynamicStaticDetector(tolerance=0.5)]
    report = _calibrated_report(detectors, model, data)
    reports = report.generate_model_report(remove_inserted_observers=False)
    graph = report.model
    equalization, outliers, dynamic = (reports[d.get_detector_name()][1] for d in detectors)
    assert {"conv1", "conv2", "fc"} <= set(equalization) and set(dynamic) == {"conv1", "conv2", "fc"}
    for layer, entry in equalization.items():
        observer = detectors[0]._observer(graph, layer, "pre")
        in_min, in_max = observer.min_val, observer.max_val
        w_min, w_max = weight_column_ranges(dict(model.named_parameters())[layer + ".weight"].detach())
        weight_ratio = (w_max - w_min) / (w_max.max() - w_min.min())
        input_ratio = (in_max - in_min) / (in_max.max() - in_min.min())
        weight_ratio = weight_ratio.repeat(input_ratio.numel() // weight_ratio.numel())
        comparison = torch.sqrt(weight_ratio) / torch.sqrt(input_ratio)
        assert _same(entry["input_weight_channel_comparison_metrics"], comparison), layer
        recommended = ((comparison >= 0.6) & (comparison <= 1 / 0.6)).tolist()
        assert entry["input_weight_equalization_recommended"] == recommended
        for key, value in (("input_activation_global_max", in_max.max()), ("input_activation_global_min", in_min.min()),
                           ("weight_global_max", w_max.max()), ("weight_global_min", w_min.min()),
                           ("input_activation_per_channel_max", in_max), ("weight_per_channel_min", w_min)):
            assert _same(entry[key], value), (layer, key)
    assert equalization["conv2"]["weight_per_channel_max"].numel() * 2 == \
        equalization["conv2"]["input_activation_per_channel_max"].numel()  # the grouped conv
    for layer, entry in outliers.items():
        observer = detectors[1]._observer(graph, layer, "pre")
        ratios = observer.average_ratios(0.95).abs()
        ratios = torch.where(ratios < 1, 1 / ratios, ratios)
        assert _same(entry["outlier_detection_percentile_ratios"], ratios), layer
        assert entry["outliers_detected"] == (ratios > 3.5).tolist()
        assert _same(entry["outlier_detection_batches_used"], observer.batches_used(0.95).to(torch.int32))
        assert _same(entry["input_activation_per_channel_max"], observer.max_val)
    assert any(torch.isnan(entry["outlier_detection_percentile_ratios"]).any() for entry in outliers.values())
    for layer, entry in dynamic.items():
        pre = detectors[2]._observer(graph, layer, "pre")
        post = detectors[2]._observer(graph, layer, "post")
        for observer, key in ((pre, "input_activation_dynamic_static_comp_stat"),
                              (post, "output_activation_dynamic_static_comp_stat")):
            alone = float(observer.extreme_sums.sum()) / observer.num_batches_tracked / float(observer.extremes.sum())
            assert float(entry[key]) == float(torch.tensor(alone)), (layer, key)
    widened = detectors[1]._observer(graph, "conv2", "pre").double()  # an observer of other dtypes: a group of its own
    again = detectors[1].generate_detector_report(graph)[1]
    ratios = widened.average_ratios(0.95).abs()
    assert widened.max_val.dtype == torch.float64 and _same(again["conv2"]["input_activation_per_channel_max"],
                                                             widened.max_val)
    assert _same(again["conv2"]["outlier_detection_percentile_ratios"], torch.where(ratios < 1, 1 / ratios, ratios))
    assert all(_same(again[layer][key], outliers[layer][key]) for layer in outliers if layer != "conv2"
               for key in ("outlier_detection_percentile_ratios", "input_activation_per_channel_max"))


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, 90), min_size=1, max_size=8), fewest=st.integers(0, 60), seed=st.integers(0, 99),
       queued=st.booleans())
def test_an_observer_leaves_batches_of_fewer_values_out_of_its_ratios_as_torch_ao_fed_only_the_others(
        rows, fewest, seed, queued):
    """min_ratio_values: the ratios of torch.ao's observer fed only the batches of at least that many rows, the
    ranges of torch.ao's observer fed every batch (the native kernel, the torch ops, and their queued form)."""
    import contextlib

    from torch.ao.quantization.fx._model_report.model_report_observer import ModelReportObserver

    from qcore.report import ReportObserver
    from qcore.runtime import deferred

    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(n, 12, generator=g) * torch.rand(12, generator=g) * 4 for n in rows]
    ours = ReportObserver(ch_axis=-1, percentiles=(0.975,), min_ratio_values=fewest)
    kept, every = (ModelReportObserver(ch_axis=1, comp_percentile=0.975) for _ in range(2))
    for batch in batches:
        with deferred.batched_updates() if queued else contextlib.nullcontext():
            ours(batch)
        every(batch)
        if batch.shape[0] >= fewest:
            kept(batch)
    used = ours.batches_used(0.975)
    assert used.tolist() == (kept.percentile_batches_tracked.tolist() if any(n >= fewest for n in rows)
                             else [0.0] * 12)
    if any(n >= fewest for n in rows):
        assert _close(ours.average_ratios(0.975), kept.average_percentile_ratio)
    else:
        assert torch.isnan(ours.average_ratios(0.975)).all()  # no batch gave a ratio
    assert torch.equal(ours.min_val, every.min_val) and torch.equal(ours.max_val, every.max_val)
    assert _close(ours.average_batch_activation_range, every.average_batch_activation_range)
    assert _close(ours.constant_channels, every.constant_channels) and ours.num_batches_tracked == len(rows)


def test_a_shared_observer_takes_the_fewest_values_of_the_detector_that_wants_ratios():
    """Observers two detectors share at one place: the percentile ratios' batch rule travels with the ratios."""
    from qcore.report import ReportObserver
    from qcore.report.model_report import _merge

    ranges = ReportObserver(ch_axis=-1)
    assert _merge(ranges, ReportObserver(ch_axis=-1, percentiles=(0.975,), min_ratio_values=40))
    assert ranges.percentiles == (0.975,) and ranges.min_ratio_values == 40
    assert _merge(ranges, ReportObserver(ch_axis=-1)) and ranges.min_ratio_values == 40
    assert not _merge(ranges, ReportObserver(ch_axis=-1, percentiles=(0.9,), min_ratio_values=10))
    with pytest.raises(ValueError, match="min_ratio_values"):
        ReportObserver(min_ratio_values=-1)
