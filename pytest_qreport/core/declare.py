"""`qmodel`: declare a model for the quality gate; the function stays a normal pytest fixture."""
from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["MODELS_ATTRIBUTE", "ModelDeclaration", "declarations_in", "model_name_problem", "qmodel", "safe_name"]

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class ModelDeclaration:
    """One declared model and the settings given in its qmodel(...) call (only those given)."""

    name: str
    factory: Callable[[], Any]
    source_file: str
    settings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    line: int = 0


# the declarations live in the declaring module itself (a conftest.py), not in a global of this package: they go
# when the module goes, and a conftest imported again starts afresh
MODELS_ATTRIBUTE = "__qreport_models__"


def declarations_in(module: Any) -> list[ModelDeclaration]:
    """The models a module (a conftest.py) declares, in declaration order."""
    return list(getattr(module, MODELS_ATTRIBUTE, None) or ())


def model_name_problem(name: Any, fix: str = "qmodel(name='...')") -> str:
    """Why `name` cannot name a model ("" when it can): it names the baseline file and goes into node ids."""
    if isinstance(name, str) and _NAME.fullmatch(name) and name not in (".", ".."):
        return ""
    return (f"the model name {name!r} is not allowed: a model name is letters, digits, '_', '-' and '.', without "
            f"path separators, and not '.' or '..' (it names the model's baseline file); give it {fix}")


def safe_name(name: str) -> str:
    """`name` with every character a node id or file name could not carry replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)).strip(".") or "_"


def qmodel(calibration: Any = None, *, name: str | None = None, **settings: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare a model factory for `pytest --qreport`; the decorated function is also a fixture.

    calibration: a fixture name, a callable returning batches, or an iterable of batches (each batch a tensor, a
    tuple of args or a dict of kwargs). name: the model's name in node ids and reports (default: the function's).
    Every other keyword is a setting of the schema (README, "Options"): example_inputs, quantizer, the checks'
    thresholds (sqnr_min_db, model_sqnr_min_db, weight_sqnr_min_db, ...), layers, skip_layers, float_layers,
    checks, severity, equalize, check_options, baseline_tolerance_db. They are checked when the model is
    collected: an unknown keyword errors that model's items, naming the closest valid one. The model function and
    the fixtures it names may request other fixtures.
    """
    given = {key: value for key, value in settings.items() if value is not None}
    if calibration is not None:
        given["calibration"] = calibration

    def decorate(factory: Callable[..., Any]) -> Any:
        source = inspect.getsourcefile(factory) or inspect.getfile(factory)
        declaration = ModelDeclaration(name=name or factory.__name__, factory=factory,
                                       source_file=os.path.realpath(source), settings=given)
        registered = factory.__globals__.setdefault(MODELS_ATTRIBUTE, [])
        declaration.line = factory.__code__.co_firstlineno
        earlier = next((d for d in registered if d.name == declaration.name), None)
        if earlier is not None:
            declaration.error = (
                f"model {declaration.name!r} is declared twice in {source} (lines {earlier.line} and "
                f"{declaration.line}); the second would silently replace the first. Rename one function, or give "
                "it qmodel(name='...').")
        registered[:] = [d for d in registered if d.name != declaration.name] + [declaration]
        return pytest.fixture(name=declaration.name)(factory)

    return decorate
