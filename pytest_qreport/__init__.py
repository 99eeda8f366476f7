"""pytest-qreport: a quantization-quality gate for PyTorch models, as a pytest plugin."""
from .checks.detectors import DetectorCheck
from .declare import ModelDeclaration, qmodel
from .findings import Finding
from .registry import Check, CheckRegistry, ModelContext

__all__ = ["Check", "CheckRegistry", "DetectorCheck", "Finding", "ModelContext", "ModelDeclaration", "qmodel"]
