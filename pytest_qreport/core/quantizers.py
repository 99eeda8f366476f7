"""The built-in quantizer names, resolved through the pytest_qreport_make_quantizer hook."""
from __future__ import annotations

import importlib
from typing import Any

import pytest

__all__ = ["BUILTIN_QUANTIZERS", "model_quantizer", "pytest_qreport_make_quantizer", "resolve_quantizer"]

BUILTIN_QUANTIZERS: dict[str, dict[str, Any]] = {
    "int8": {"per_channel": True},
    "int8_per_tensor": {"per_channel": False},
    "int8_histogram": {"per_channel": True, "activation_observer": "histogram"},
}


def _instance(spec: Any) -> Any:
    """A Quantizer from an instance or a factory of one, else None."""
    import qcore

    if isinstance(spec, qcore.Quantizer):
        return spec
    if callable(spec):
        made = spec()
        if isinstance(made, qcore.Quantizer):
            return made
    return None


@pytest.hookimpl(trylast=True)
def pytest_qreport_make_quantizer(name: str) -> Any:
    """int8, int8_per_tensor, int8_histogram, or 'module:attribute' naming a Quantizer or a factory of one."""
    import qcore

    if name in BUILTIN_QUANTIZERS:
        return qcore.Int8StaticQuantizer(**BUILTIN_QUANTIZERS[name])
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"quantizer {name!r}: cannot import it ({error})") from error
        made = _instance(target)
        if made is None:
            raise ValueError(f"quantizer {name!r} is neither a qcore.Quantizer nor a factory of one")
        return made
    return None


def resolve_quantizer(spec: Any, hook: Any) -> Any:
    """A Quantizer from a name (through the hook), an instance, or a factory; ValueError naming the fix."""
    if spec is None:
        spec = "int8"
    if isinstance(spec, str):
        made = hook.pytest_qreport_make_quantizer(name=spec)
        if made is None:
            raise ValueError(f"unknown quantizer {spec!r}: use {', '.join(BUILTIN_QUANTIZERS)}, 'module:attribute', "
                             "or a name that a pytest_qreport_make_quantizer hook resolves")
        return made
    made = _instance(spec)
    if made is None:
        raise ValueError(f"quantizer must be a qcore.Quantizer, a factory of one, or a name; got {spec!r}")
    return made


def model_quantizer(settings: Any, hook: Any) -> Any:
    """The model's quantizer, keeping its float_layers unquantized; ValueError naming the fix."""
    quantizer = resolve_quantizer(settings.quantizer, hook)
    if not settings.float_layers:
        return quantizer
    from qcore.sensitivity import with_float_layers

    try:
        return with_float_layers(quantizer, settings.float_layers)
    except ValueError as error:
        raise ValueError(f"float_layers={settings.float_layers!r}: {error}") from None
