"""The built-in checks, registered through the same hook a third-party plugin or conftest.py uses."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .cosine import CosineCheck
from .detectors import DetectorCheck, DynamicStaticCheck, InputWeightEqualizationCheck, OutlierCheck, PerChannelCheck
from .equalization import EqualizationCheck, EqualizationEquivalenceCheck
from .experts import ExpertCoverageCheck, RoutingAgreementCheck
from .outputs import KlDivergenceCheck, PerplexityCheck, TaskMetricCheck, Top1AgreementCheck
from .sensitivity import SensitivityCheck
from .sqnr import ModelSqnrCheck, SqnrCheck, WeightSqnrCheck

if TYPE_CHECKING:
    from ..core.registry import CheckRegistry

__all__ = ["BUILTIN_CHECKS", "CosineCheck", "DetectorCheck", "DynamicStaticCheck", "EqualizationCheck",
           "EqualizationEquivalenceCheck", "ExpertCoverageCheck", "RoutingAgreementCheck",
           "InputWeightEqualizationCheck", "KlDivergenceCheck", "ModelSqnrCheck",
           "OutlierCheck", "PerChannelCheck", "PerplexityCheck", "SensitivityCheck", "SqnrCheck", "TaskMetricCheck",
           "Top1AgreementCheck", "WeightSqnrCheck", "pytest_qreport_register_checks"]

BUILTIN_CHECKS = (
    SqnrCheck,
    CosineCheck,
    WeightSqnrCheck,
    ExpertCoverageCheck,
    RoutingAgreementCheck,
    ModelSqnrCheck,
    KlDivergenceCheck,
    Top1AgreementCheck,
    PerplexityCheck,
    TaskMetricCheck,
    SensitivityCheck,
    PerChannelCheck,
    DynamicStaticCheck,
    InputWeightEqualizationCheck,
    OutlierCheck,
    EqualizationCheck,
    EqualizationEquivalenceCheck,
)


@pytest.hookimpl(tryfirst=True)
def pytest_qreport_register_checks(registry: CheckRegistry) -> None:
    """Register the built-in checks."""
    for check in BUILTIN_CHECKS:
        registry.register(check)
