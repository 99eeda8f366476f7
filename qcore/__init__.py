"""qcore: capture, pt2e-style prepare/convert, streaming observers and the numeric suite, free of torch.ao."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("pytest-qreport")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
from .calibrate import CalibrationError, calibrate
from .capture import CaptureError, capture
from .convert import convert, quantize
from .diagnose import NonDeterministicModelError
from .format_quantizer import FormatQuantizer
from .graph import QuantizableOp, find_quantizable_ops
from .observers import (
    DerivedObserver,
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from .prepare import QuantizationConfigError, get_edge_or_node_to_group_id, prepare
from .presets import PRESETS, Preset, TensorFormat, preset
from .quantizer import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    Int8StaticQuantizer,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)
from .report import ModelReport

__all__ = [
    "CalibrationError", "CaptureError", "DerivedObserver", "DerivedQuantizationSpec", "FixedQParamsObserver",
    "FixedQParamsQuantizationSpec", "FormatQuantizer", "HistogramObserver", "Int8StaticQuantizer", "MinMaxObserver",
    "ModelReport", "MovingAverageMinMaxObserver", "PRESETS", "Preset", "TensorFormat", "preset",
    "NonDeterministicModelError", "ObserverBase", "PerChannelMinMaxObserver", "PlaceholderObserver",
    "QuantizableOp", "QuantizationAnnotation", "QuantizationConfigError", "QuantizationSpec",
    "QuantizationSpecBase", "Quantizer", "SharedQuantizationSpec", "calibrate", "capture", "convert",
    "find_quantizable_ops", "get_edge_or_node_to_group_id", "prepare", "quantize",
]
