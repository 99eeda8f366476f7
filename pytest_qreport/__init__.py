"""pytest-qreport: a quantization-quality gate for PyTorch models, as a pytest plugin."""
from .checks.detectors import DetectorCheck
from .core.declare import ModelDeclaration, qmodel
from .core.findings import Finding
from .core.registry import Check, CheckRegistry, ModelContext

__all__ = ["Check", "CheckRegistry", "DetectorCheck", "Finding", "ModelContext", "ModelDeclaration", "qmodel"]
