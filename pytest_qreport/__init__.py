"""pytest-qreport: a quantization-quality gate for PyTorch models, as a pytest plugin."""
from .checks.detectors import DetectorCheck
from .core.declare import ModelDeclaration, qmodel
from .core.errors import QReportAssertionError, ReportError
from .core.findings import Finding, RunOutcome
from .core.registry import Check, CheckRegistry, ModelContext
from .core.results import ModelFacts, RunResults
from .core.schema import Setting
from .fixes import FixSearch, fix_search

__all__ = ["Check", "CheckRegistry", "DetectorCheck", "Finding", "FixSearch", "ModelContext", "ModelDeclaration",
           "ModelFacts", "QReportAssertionError", "ReportError", "RunOutcome", "RunResults", "Setting", "fix_search",
           "qmodel"]
