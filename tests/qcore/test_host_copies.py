"""A whole measurement copies nothing to the host per batch: the CPU-side check of what a GPU run needs (every
value a host sync would read, `.item()`, `float(t)`, `bool(t)`, goes through aten._local_scalar_dense)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import qcore
from qcore.measure.passes import measure_model
from qcore.measure.screens import Screen
from qcore.report import DynamicStaticDetector, InputWeightEqualizationDetector, OutlierDetector, PerChannelDetector


class _CountScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2, self.head = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64), \
            nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(self.norm(torch.relu(self.fc1(x))))))


def _reads(batch_count: int) -> int:
    torch.manual_seed(0)
    model = _Net().eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 32, generator=g) for _ in range(batch_count)]
    for x in batches:
        x[3, 5] = 12.0  # an outlier channel, so that the outlier screen names layers
    float_gm = qcore.capture(model, batches[0])
    histogram = {"activation_observer": "histogram"}
    layers = ["fc1", "fc2", "head"]
    screens = (Screen("outlier", lambda reports: {layer: histogram for layer in layers}, {layer: histogram
                                                                                           for layer in layers}),
               Screen("per_channel", lambda reports: {layer: {"per_channel": True} for layer in layers}))
    detectors = {"per_channel": PerChannelDetector(), "dynamic_static": DynamicStaticDetector(),
                 "input_weight": InputWeightEqualizationDetector(0.5), "outlier": OutlierDetector()}
    counter = _CountScalarReads()
    with counter:
        measured = measure_model(float_gm, batches, qcore.Int8StaticQuantizer(per_channel=False), detectors=detectors,
                                 equalization_layers=layers, smoothing="search", logits=True, screens=screens)
    assert measured.screens["outlier"].own_sqnr_db and measured.variants and measured.sqnr.outputs
    return counter.reads


def test_a_measurement_reads_no_value_to_the_host_per_batch():
    # calibration (the quantizer's, the detectors' and the screens' observers, the variants' statistics) and the
    # comparison pass (propagated, shadow, variant and screen comparators, logits): what is read back is read once
    # per measurement, the same for 3 batches as for 9
    assert _reads(3) == _reads(9)


def test_a_converted_graph_keeps_per_channel_qparams_as_compact_arrays_of_the_observers_values():
    # a converted LLM holds a scale, zero point and range per weight channel in its nodes' metadata: as arrays of 8
    # bytes a value, not lists of float objects; per-tensor qparams stay one-element lists
    from array import array

    from qcore.quantization.convert import QPARAMS_KEY, convert
    from qcore.quantization.prepare import prepare

    torch.manual_seed(0)
    model = _Net().eval()
    batches = [torch.randn(16, 32) for _ in range(2)]
    prepared = prepare(qcore.capture(model, batches[0]), qcore.Int8StaticQuantizer(per_channel=True))
    for x in batches:
        prepared(x)
    observers = {str(node.target): prepared.get_submodule(str(node.target)) for node in prepared.graph.nodes
                 if node.op == "call_module" and hasattr(prepared.get_submodule(str(node.target)), "calculate_qparams")}
    expected = {name: [t.tolist() for t in observer.calculate_qparams()] for name, observer in observers.items()}
    quantized = convert(prepared)
    per_channel = [node.meta[QPARAMS_KEY] for node in quantized.graph.nodes
                   if len(node.meta.get(QPARAMS_KEY, {}).get("scale") or ()) > 1]
    per_tensor = [node.meta[QPARAMS_KEY] for node in quantized.graph.nodes
                  if len(node.meta.get(QPARAMS_KEY, {}).get("scale") or ()) == 1]
    assert len(per_channel) == 3 and per_tensor  # the three weights; the activations
    for meta in per_channel:
        assert isinstance(meta["scale"], array) and meta["scale"].typecode == "d"
        assert isinstance(meta["zero_point"], array) and meta["zero_point"].typecode == "q"
        assert isinstance(meta["min_val"], array) and len(meta["min_val"]) == len(meta["scale"])
        assert [list(meta["scale"]), list(meta["zero_point"])] in expected.values()
    for meta in per_tensor:
        assert isinstance(meta["scale"], list) and isinstance(meta["zero_point"], list)


@given(st.lists(st.floats(min_value=1e-6, max_value=10.0), min_size=2, max_size=64), st.integers(0, 63))
@settings(max_examples=40, deadline=None)
def test_a_qparams_digest_tells_per_channel_qparams_apart_by_every_channel(scales, changed):
    from array import array

    from torch import fx

    from qcore.numeric.instrument import qparams_digest
    from qcore.quantization.convert import QPARAMS_KEY

    def node_with(values: list[float]) -> fx.Node:
        graph = fx.Graph()
        node = graph.placeholder("weight")
        node.meta[QPARAMS_KEY] = {"dtype": "torch.int8", "quant_min": -127, "quant_max": 127, "ch_axis": 0,
                                  "scale": array("d", values), "zero_point": array("q", [0] * len(values))}
        return node

    other = list(scales)
    other[changed % len(other)] = other[changed % len(other)] * 2
    assert qparams_digest(node_with(scales)) == qparams_digest(node_with(list(scales)))
    assert qparams_digest(node_with(scales)) != qparams_digest(node_with(other))
    longer = node_with(scales)  # the same bytes split otherwise between entries read apart
    longer.meta[QPARAMS_KEY]["zero_point"] = array("q", [0] * (len(scales) + 1))
    assert qparams_digest(longer) != qparams_digest(node_with(scales))


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=64),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]))
@settings(max_examples=60, deadline=None)
def test_convert_reads_a_tensors_values_to_a_host_array_as_tolist_gives_them(values, dtype):
    from qcore.quantization.convert import _host_array

    tensor = torch.tensor(values, dtype=torch.float32).to(dtype) if dtype.is_floating_point else \
        torch.tensor([int(v) if v == v and abs(v) < 2**31 else 0 for v in values], dtype=dtype)
    host = _host_array(tensor)
    expected = tensor.tolist()
    assert host.typecode == ("d" if dtype.is_floating_point else "q") and len(host) == len(expected)
    assert all((a == b and type(a) is type(b)) or (a != a and b != b) for a, b in zip(host, expected))
