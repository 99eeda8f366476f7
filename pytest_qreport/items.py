"""Collectors and items: one item per (model, check, layer) under the conftest that declares the model."""
from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from .declare import declarations_in
from .options import resolve_settings
from .runner import ModelState, QReportCheckFailed, QReportError, QReportModelError, analyze, collect_model

CHECK_ORDER = ("capture", "sqnr", "weight_sqnr", "model_sqnr", "per_channel", "dynamic_static",
               "input_weight_equalization", "outlier", "equalization", "equalization_equivalence")


def qreport_check(request) -> None:
    """Body of every qreport item; the item's runtest does the work."""


class QReportFile(pytest.File):
    """A conftest.py that declares models with @qmodel."""

    def collect(self):
        state = self.config.stash[STATE_KEY]
        for index, declaration in enumerate(declarations_in(self.path)):
            key = (str(self.path), declaration.name)
            if key not in state.models:
                try:
                    settings = resolve_settings(self.config, declaration)
                except ValueError as error:
                    model = ModelState(declaration.name, collect_error=f"model {declaration.name!r}: {error}")
                else:
                    model = collect_model(declaration, settings, lambda name: self._fixture_value(name))
                state.models[key] = model
            model = state.models[key]
            if model.collect_error:
                yield QReportItem.from_parent(self, name=f"qreport/{declaration.name}/capture", callobj=qreport_check,
                                              model_key=key, check="capture", layer="", position=(index, 0, 0))
                continue
            for check, layer in model.checks_and_layers():
                yield QReportItem.from_parent(
                    self, name=f"qreport/{declaration.name}/{check}/{layer}", callobj=qreport_check, model_key=key,
                    check=check, layer=layer,
                    position=(index, CHECK_ORDER.index(check), model.items[check].index(layer)))

    def _fixture_value(self, name: str) -> Any:
        """Evaluate an argument-free fixture at collection (only to get example inputs for capture)."""
        definitions = self.session._fixturemanager.getfixturedefs(name, self)
        if not definitions:
            raise QReportModelError(f"fixture {name!r} not found for {self.path}; define it in a conftest.py "
                                    "that this directory sees, or pass qmodel(calibration=...) batches directly")
        function = definitions[-1].func
        if any(p.default is p.empty for p in inspect.signature(function).parameters.values()):
            raise QReportModelError(
                f"fixture {name!r} takes arguments, so it cannot give example inputs at collection; "
                "pass qmodel(example_inputs=...) a tensor, tuple or dict instead")
        value = function()
        return next(value) if inspect.isgenerator(value) else value


class QReportItem(pytest.Function):
    """One check of one layer of one model."""

    def __init__(self, *, model_key: tuple[str, str], check: str, layer: str, position: tuple, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_key, self.check, self.layer, self.position = model_key, check, layer, position
        self.model_name = model_key[1]
        self.extra_keyword_matches.update({self.model_name, check})
        # with `-n N --dist loadgroup`, all of a model's items go to one worker, which analyses it once
        self.add_marker(pytest.mark.xdist_group(name=self.model_name))
        self.qreport_row: dict | None = None

    def setup(self) -> None:
        super().setup()
        model = self.config.stash[STATE_KEY].models[self.model_key]
        if model.collect_error:
            self._record_error(model.collect_error)
            raise QReportModelError(model.collect_error)
        analyze(model, self._request.getfixturevalue)
        if model.analysis_error:
            self._record_error(model.analysis_error)
            raise QReportModelError(model.analysis_error)

    def runtest(self) -> None:
        model = self.config.stash[STATE_KEY].models[self.model_key]
        found = model.findings[(self.check, self.layer)]
        self.qreport_row = found
        for key in ("model", "check", "layer", "metric", "value", "threshold"):
            self.user_properties.append((key, found[key]))
        if found["verdict"] == "fail":
            raise QReportCheckFailed(found["message"])
        if found["verdict"] == "warn":
            warnings.warn(found["message"], QReportWarning, stacklevel=1)

    def _record_error(self, message: str) -> None:
        self.qreport_row = {"model": self.model_name, "check": self.check, "layer": self.layer, "metric": "",
                            "value": float("nan"), "threshold": float("nan"), "verdict": "error",
                            "message": message, "details": {}, "order": 0}

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, QReportError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def _repr_failure_py(self, excinfo, style=None):
        # setup errors are rendered here, not by repr_failure
        if isinstance(excinfo.value, QReportError):
            return str(excinfo.value)
        return super()._repr_failure_py(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, self.name


class QReportWarning(UserWarning):
    """A finding whose check is set to 'warn'."""


STATE_KEY: pytest.StashKey = pytest.StashKey()
