"""The built-in quantizer names, resolved through the pytest_qreport_make_quantizer hook: the int8 ones, and the
deployed formats by their compressed-tensors names (W8A8, W4A16, FP8, NVFP4, ...; see qcore.formats.presets)."""
from __future__ import annotations

import difflib
from typing import Any

import pytest

# the deployed formats' names, kept here so that naming one needs no torch import (a test checks they are qcore's)
FORMAT_NAMES = ("W8A8", "W8A16", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4",
                "NVFP4A16")

__all__ = ["BUILTIN_QUANTIZERS", "FORMAT_NAMES", "import_attribute", "model_quantizer", "pytest_qreport_make_quantizer",
           "resolve_quantizer"]

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
    if name in FORMAT_NAMES:
        return qcore.FormatQuantizer(name)
    if ":" in name:
        try:
            target = import_attribute(name)
        except ValueError as error:
            raise ValueError(f"quantizer {name!r}: {error}") from error.__cause__
        made = _instance(target)
        if made is None:
            raise ValueError(f"quantizer {name!r} is neither a qcore.Quantizer nor a factory of one")
        return made
    return None


def import_attribute(spec: str) -> Any:
    """The object 'module:attribute' names; ValueError saying why it cannot be imported."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import {spec} ({error})") from error


def resolve_quantizer(spec: Any, hook: Any) -> Any:
    """A Quantizer from a name (through the hook), an instance, or a factory; ValueError naming the fix."""
    if spec is None:
        spec = "int8"
    if isinstance(spec, str):
        made = hook.pytest_qreport_make_quantizer(name=spec)
        if made is None:
            names = [*BUILTIN_QUANTIZERS, *FORMAT_NAMES]
            match = difflib.get_close_matches(spec, names, n=1) or difflib.get_close_matches(spec.upper(), names, n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise ValueError(f"unknown quantizer {spec!r}{hint}: use {', '.join(names)}, 'module:attribute', or a "
                             "name that a pytest_qreport_make_quantizer hook resolves")
        return made
    made = _instance(spec)
    if made is None:
        raise ValueError(f"quantizer must be a qcore.Quantizer, a factory of one, or a name; got {spec!r}")
    return made


def model_quantizer(settings: Any, hook: Any) -> Any:
    """The model's quantizer, with its layer_formats and its float_layers applied; ValueError naming the fix."""
    quantizer = resolve_quantizer(settings.quantizer, hook)
    layer_formats = dict(getattr(settings, "layer_formats", None) or {})
    if layer_formats:
        quantizer = _with_layer_formats(quantizer, layer_formats)
    overrides = dict(getattr(settings, "layer_overrides", None) or {})
    if overrides:
        from qcore.analysis import with_layer_overrides

        try:
            quantizer = with_layer_overrides(quantizer, overrides)
        except ValueError as error:
            raise ValueError(f"layer_overrides={overrides!r}: {error}") from None
    if not settings.float_layers:
        return quantizer
    from qcore.analysis import with_float_layers

    try:
        return with_float_layers(quantizer, settings.float_layers)
    except ValueError as error:
        raise ValueError(f"float_layers={settings.float_layers!r}: {error}") from None


def _with_layer_formats(quantizer: Any, layer_formats: dict[str, str]) -> Any:
    """`quantizer` with per-layer formats on top: a format quantizer takes any; another quantizer only 'float'."""
    import qcore

    overrides = {glob: {"skip": True} if name == "float" else {"format": name} for glob, name in layer_formats.items()}
    if isinstance(quantizer, qcore.FormatQuantizer):
        return qcore.FormatQuantizer(quantizer.preset, {**quantizer.layer_overrides, **overrides})
    formats = sorted({name for name in layer_formats.values() if name != "float"})
    if formats or not isinstance(getattr(quantizer, "layer_overrides", None), dict):
        raise ValueError(f"layer_formats={layer_formats!r}: {type(quantizer).__name__} cannot give layers the "
                         f"formats {formats or ['float']}; choose a format as the model's quantizer (quantizer='W8A8', "
                         "'FP8', 'NVFP4', ...), on top of which layer_formats sets each layer's")
    from qcore.analysis import with_float_layers

    return with_float_layers(quantizer, list(layer_formats))
