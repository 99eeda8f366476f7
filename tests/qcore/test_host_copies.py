"""A whole measurement copies nothing to the host per batch: the CPU-side check of what a GPU run needs (every
value a host sync would read, `.item()`, `float(t)`, `bool(t)`, goes through aten._local_scalar_dense)."""
import torch
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
