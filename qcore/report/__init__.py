"""qcore.report: ModelReport, its detectors and observer, and the visualizer."""
from .detectors import (
    DetectorBase,
    DetectorQConfigInfo,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
)
from .model_report import ModelReport, ModelReportError
from .observer import ReportObserver

__all__ = ["DetectorBase", "DetectorQConfigInfo", "DynamicStaticDetector", "InputWeightEqualizationDetector",
           "ModelReport", "ModelReportError", "OutlierDetector", "PerChannelDetector", "ReportObserver"]
