"""qcore.report: ModelReport, its detectors and observer, and the visualizer."""
from qcore.report.coverage import ExpertCoverageDetector, TokenCounter
from qcore.report.detectors import (
    DetectorBase,
    DetectorQConfigInfo,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
    percentile_estimate_tokens,
)
from qcore.report.model_report import ModelReport, ModelReportError
from qcore.report.observer import ReportObserver

__all__ = ["DetectorBase", "DetectorQConfigInfo", "DynamicStaticDetector", "ExpertCoverageDetector",
           "InputWeightEqualizationDetector", "TokenCounter",
           "ModelReport", "ModelReportError", "OutlierDetector", "PerChannelDetector", "ReportObserver",
           "percentile_estimate_tokens"]
