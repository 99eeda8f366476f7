"""qcore: capture, pt2e-style prepare/convert, streaming observers and the numeric suite, free of torch.ao."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("pytest-qreport")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
from qcore.formats.presets import PRESETS, Preset, TensorFormat, preset
from qcore.graph.capture import CaptureError, capture
from qcore.graph.ops import QuantizableOp, find_quantizable_ops
from qcore.measure.diagnose import NonDeterministicModelError
from qcore.observe.observers import (
    DerivedObserver,
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from qcore.quantization.calibrate import CalibrationError, calibrate
from qcore.quantization.convert import convert, quantize
from qcore.quantization.format_quantizer import FormatQuantizer
from qcore.quantization.prepare import QuantizationConfigError, get_edge_or_node_to_group_id, prepare
from qcore.quantization.quantizer import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    Int8StaticQuantizer,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)
from qcore.report import ModelReport

__all__ = [
    "CalibrationError", "CaptureError", "DerivedObserver", "DerivedQuantizationSpec", "FixedQParamsObserver",
    "FixedQParamsQuantizationSpec", "FormatQuantizer", "HistogramObserver", "Int8StaticQuantizer", "MinMaxObserver",
    "ModelReport", "MovingAverageMinMaxObserver", "PRESETS", "Preset", "TensorFormat", "preset",
    "NonDeterministicModelError", "ObserverBase", "PerChannelMinMaxObserver", "PlaceholderObserver",
    "QuantizableOp", "QuantizationAnnotation", "QuantizationConfigError", "QuantizationSpec",
    "QuantizationSpecBase", "Quantizer", "SharedQuantizationSpec", "calibrate", "capture", "convert",
    "find_quantizable_ops", "get_edge_or_node_to_group_id", "prepare", "quantize",
]
