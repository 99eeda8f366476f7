"""The ModelReport detectors (also importable as qcore.report.detectors)."""
from .report.detectors import (
    DetectorBase,
    DetectorQConfigInfo,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
)

__all__ = ["DetectorBase", "DetectorQConfigInfo", "DynamicStaticDetector", "InputWeightEqualizationDetector",
           "OutlierDetector", "PerChannelDetector"]
