"""`qmodel`: declare a model for the quality gate; the function stays a normal pytest fixture."""
from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["ModelDeclaration", "declarations_in", "qmodel"]


@dataclass
class ModelDeclaration:
    """One declared model and the settings given in its qmodel(...) call (None = not given)."""

    name: str
    factory: Callable[[], Any]
    source_file: str
    calibration: Any = None
    example_inputs: Any = None
    quantizer: Any = None
    sqnr_min_db: float | None = None
    model_sqnr_min_db: float | None = None
    weight_sqnr_min_db: float | None = None
    layers: list[str] | None = None
    skip_layers: list[str] | None = None
    float_layers: list[str] | None = None
    checks: list[str] | None = None
    severity: Any = None
    equalize: Any = None
    equalization_min_gain_db: float | None = None
    detector_options: dict[str, dict] | None = None
    check_options: dict[str, dict] | None = None
    baseline_tolerance_db: Any = None
    error: str | None = None
    line: int = 0


_DECLARED: dict[str, list[ModelDeclaration]] = {}


def declarations_in(path: str | os.PathLike) -> list[ModelDeclaration]:
    """The models declared in one file, in declaration order."""
    return list(_DECLARED.get(os.path.realpath(os.fspath(path)), []))


def _as_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(v) for v in value]


def _unknown_keywords(model: str, unknown: dict[str, Any]) -> str | None:
    if not unknown:
        return None
    valid = [p for p in inspect.signature(qmodel).parameters if p != "unknown"]
    problems = []
    for keyword in unknown:
        match = difflib.get_close_matches(keyword, valid, n=1)
        problems.append(f"{keyword!r}" + (f" (did you mean {match[0]!r}?)" if match else ""))
    return (f"model {model!r}: qmodel() got unknown keyword argument(s) {', '.join(problems)}; valid keywords: "
            f"{', '.join(valid)}")


def qmodel(
    calibration: Any = None,
    *,
    example_inputs: Any = None,
    quantizer: Any = None,
    sqnr_min_db: float | None = None,
    model_sqnr_min_db: float | None = None,
    weight_sqnr_min_db: float | None = None,
    layers: Any = None,
    skip_layers: Any = None,
    float_layers: Any = None,
    checks: Any = None,
    severity: Any = None,
    equalize: Any = None,
    equalization_min_gain_db: float | None = None,
    detector_options: dict[str, dict] | None = None,
    check_options: dict[str, dict] | None = None,
    baseline_tolerance_db: Any = None,
    name: str | None = None,
    **unknown: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Declare a model factory for `pytest --qreport`; the decorated function is also a fixture.

    calibration: a fixture name, a callable returning batches, or an iterable of batches (each batch a
    tensor, a tuple of args or a dict of kwargs). example_inputs: defaults to the first batch.
    quantizer: a qcore Quantizer, a factory of one, or a name ("int8", "int8_per_tensor", "int8_histogram").
    sqnr_min_db / model_sqnr_min_db / weight_sqnr_min_db: thresholds in dB. layers / skip_layers: globs of
    the layers to check / to leave out of the checks (still quantized). float_layers: globs of layers to keep in
    float (unquantized), through the quantizer's layer_overrides.
    checks: which checks to run (default: all). severity: {check: "fail" | "warn" | "off"} or
    "outlier=warn,per_channel=off". detector_options: constructor arguments per detector check, e.g.
    {"outlier": {"ratio_threshold": 5.0}}; check_options: the same for any check, custom ones too.
    equalize: True (input-weight equalization of every eligible layer),
    "cross_layer", or a list of layer names; the model is equalized before it is quantized.
    equalization_min_gain_db: the gain at which an `equalization` item fails (default 1.0).
    baseline_tolerance_db: how much worse than the committed baseline a value may get, a number or
    {check: number}. The model function, the calibration fixture and the example-inputs fixture may request
    other fixtures.
    """

    def decorate(factory: Callable[..., Any]) -> Any:
        source = inspect.getsourcefile(factory) or inspect.getfile(factory)
        declaration = ModelDeclaration(
            name=name or factory.__name__, factory=factory, source_file=os.path.realpath(source),
            calibration=calibration, example_inputs=example_inputs, quantizer=quantizer,
            sqnr_min_db=sqnr_min_db, model_sqnr_min_db=model_sqnr_min_db, weight_sqnr_min_db=weight_sqnr_min_db,
            layers=_as_list(layers), skip_layers=_as_list(skip_layers), float_layers=_as_list(float_layers),
            checks=_as_list(checks), severity=severity,
            equalize=equalize, equalization_min_gain_db=equalization_min_gain_db,
            detector_options=detector_options, check_options=check_options,
            baseline_tolerance_db=baseline_tolerance_db,
            error=_unknown_keywords(name or factory.__name__, unknown),
        )
        registered = _DECLARED.setdefault(declaration.source_file, [])
        declaration.line = factory.__code__.co_firstlineno
        earlier = next((d for d in registered if d.name == declaration.name and d.line != declaration.line), None)
        if earlier is not None:  # the same line again is the same conftest imported again, not a duplicate
            declaration.error = (
                f"model {declaration.name!r} is declared twice in {source} (lines {earlier.line} and "
                f"{declaration.line}); the second would silently replace the first. Rename one function, or give "
                "it qmodel(name='...').")
        registered[:] = [d for d in registered if d.name != declaration.name] + [declaration]
        fixture = pytest.fixture(name=declaration.name)(factory)
        return fixture

    return decorate
