"""`qmodel`: declare a model for the quality gate; the function stays a normal pytest fixture."""
from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["MODELS_ATTRIBUTE", "ModelDeclaration", "artifact_member", "declarations_in", "model_group",
           "model_name_problem", "qmodel", "safe_name"]

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MEMBER = re.compile(r"([A-Za-z0-9_.-]+)\[([A-Za-z0-9_.-]+)\]")  # `llama[w4a16]`: one artifact of a declaration


def artifact_member(group: str, key: str) -> str:
    """The model name of artifact `key` of the declaration `group` (qmodel(quantized={key: ...})): `group[key]`."""
    return f"{group}[{key}]"


def model_group(name: str) -> str:
    """The declaration a model name belongs to: `llama` for `llama[w4a16]`, the name itself for a plain model."""
    member = _MEMBER.fullmatch(name)
    return member.group(1) if member else name


@dataclass
class ModelDeclaration:
    """One declared model and the settings given in its qmodel(...) call (only those given)."""

    name: str
    factory: Callable[[], Any]
    source_file: str
    settings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    line: int = 0
    fixture: str = ""  # the fixture that returns the model (the reference of an artifact group); default: `name`

    def __post_init__(self) -> None:
        self.fixture = self.fixture or self.name

    @property
    def group(self) -> str | None:
        """The declaration whose artifacts this model is one of (qmodel(quantized={...})), else None."""
        return self.fixture if self.fixture != self.name else None


# the declarations live in the declaring module itself (a conftest.py), not in a global of this package: they go
# when the module goes, and a conftest imported again starts afresh
MODELS_ATTRIBUTE = "__qreport_models__"


def declarations_in(module: Any) -> list[ModelDeclaration]:
    """The models a module (a conftest.py) declares, in declaration order."""
    return list(getattr(module, MODELS_ATTRIBUTE, None) or ())


def model_name_problem(name: Any, fix: str = "qmodel(name='...')") -> str:
    """Why `name` cannot name a model ("" when it can): it names the baseline file and goes into node ids."""
    if isinstance(name, str) and name not in (".", "..") and (_NAME.fullmatch(name) or _MEMBER.fullmatch(name)):
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
    Every other keyword is a setting of the schema (README, "Options"): quantized (artifact mode; a dict
    {name: artifact} declares one model `name[key]` per artifact against the one reference), example_inputs,
    quantizer, the checks' thresholds (sqnr_min_db, model_sqnr_min_db, weight_sqnr_min_db, ...), layers,
    skip_layers, float_layers, checks, severity, equalize, check_options, baseline_tolerance_db. They are checked
    when the model is collected: an unknown keyword errors that model's items, naming the closest valid one. The
    model function and the fixtures it names may request other fixtures.
    """
    given = {key: value for key, value in settings.items() if value is not None}
    if calibration is not None:
        given["calibration"] = calibration

    def decorate(factory: Callable[..., Any]) -> Any:
        source = inspect.getsourcefile(factory) or inspect.getfile(factory)
        model = name or factory.__name__
        registered = factory.__globals__.setdefault(MODELS_ATTRIBUTE, [])
        for declaration in _declarations(model, factory, os.path.realpath(source), given):
            declaration.line = factory.__code__.co_firstlineno
            earlier = next((d for d in registered if d.name == declaration.name), None)
            if earlier is not None:
                declaration.error = (
                    f"model {declaration.name!r} is declared twice in {source} (lines {earlier.line} and "
                    f"{declaration.line}); the second would silently replace the first. Rename one function, or "
                    "give it qmodel(name='...').")
            registered[:] = [d for d in registered if d.name != declaration.name] + [declaration]
        return pytest.fixture(name=model)(factory)

    return decorate


def _declarations(model: str, factory: Callable[..., Any], source: str,
                  settings: dict[str, Any]) -> list[ModelDeclaration]:
    """One declaration, or with quantized={key: artifact, ...} one per artifact, named `model[key]`, each with the
    model function's return value as its reference (the reference is loaded and run once for all of them)."""
    artifacts = settings.get("quantized")
    if not isinstance(artifacts, Mapping):
        return [ModelDeclaration(name=model, factory=factory, source_file=source, settings=settings)]
    bad = [key for key in artifacts if not (isinstance(key, str) and _NAME.fullmatch(key))]
    if bad or not artifacts:
        problem = (f"its keys {bad!r} are not names (letters, digits, '_', '-' and '.')" if bad else "it is empty")
        return [ModelDeclaration(name=model, factory=factory, source_file=source, settings=settings, error=(
            f"model {model!r}: quantized= maps names to the artifacts gated against one reference, and {problem}. "
            "Fix: quantized={'w4a16': 'w4a16_model', 'fp8': 'fp8_model'} (fixture names, callables or models)"))]
    return [ModelDeclaration(name=artifact_member(model, key), factory=factory, source_file=source,
                             settings={**settings, "quantized": artifact}, fixture=model)
            for key, artifact in artifacts.items()]
