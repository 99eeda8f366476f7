"""pytest-qreport: a quantization-quality gate for PyTorch models, as a pytest plugin."""
from .declare import ModelDeclaration, qmodel

__all__ = ["ModelDeclaration", "qmodel"]
