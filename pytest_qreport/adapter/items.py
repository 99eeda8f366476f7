"""Collectors and items: one item per (model, check, layer) under the conftest that declares the model."""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Iterator
from typing import Any, cast

import pytest

from .baseline import baseline_path
from .capture_cache import model_cache_key
from .capture_share import model_scope
from .crashes import CRASH_DIR_KEY, analysis_guard, crashed_message, previous_crash
from .declare import ModelDeclaration, declarations_in
from .findings import Finding
from .options import resolve_settings
from .quantizers import model_quantizer
from .runner import (
    ModelState,
    QReportCheckFailed,
    QReportError,
    QReportModelError,
    analyze,
    as_batches,
    collect_model,
    explain,
    is_single_batch,
    torch_threads,
)

__all__ = ["STATE_KEY", "QReportFile", "QReportItem", "QReportWarning", "parse_item_nodeid"]

STATE_KEY: pytest.StashKey = pytest.StashKey()
_PREFIX = "::qreport/"


def parse_item_nodeid(nodeid: str) -> tuple[str, str, str, str] | None:
    """(file, model, check, layer) of a qreport item's node id, or None for other tests."""
    if _PREFIX not in nodeid:
        return None
    file, name = nodeid.split(_PREFIX, 1)
    name = name.rsplit("@", 1)[0]  # --dist loadgroup appends "@<group>"; layer names hold no "@"
    model, _, rest = name.partition("/")
    check, _, layer = rest.partition("/")
    return (file, model, check, layer) if model and check else None


def qreport_check(request) -> None:
    """Body of every qreport item; the item's setup and runtest do the work."""


def _fixture_probe(names: list[str]):
    """A function whose parameters are `names`, so that pytest resolves exactly those fixtures for it."""

    def qreport_fixtures(**values: Any) -> None:
        """Stands in for a test function that requests the model's fixtures at collection."""

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    qreport_fixtures.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])  # type: ignore[attr-defined]
    return qreport_fixtures


def _first_batch(batches: Any) -> Any:
    if is_single_batch(batches):
        return batches
    if isinstance(batches, (list, tuple)):
        if not batches:
            raise ValueError("the calibration batches are empty")
        return batches[0]
    return next(iter(batches))


class QReportFile(pytest.File):
    """A conftest.py that declares models with @qmodel."""

    def collect(self) -> Iterator[pytest.Item]:
        session = self.config.stash[STATE_KEY]
        registry = session.refresh_registry()
        order = {name: index for index, name in enumerate(registry.names())}
        declarations = declarations_in(self.path)
        first = session.declared_models  # the session-wide index of this file's first model (the same in every worker)
        session.declared_models += len(declarations)
        rendezvous = session.capture_rendezvous
        # under xdist, capture the models this worker owns before waiting for the others' layer lists
        for index in sorted(range(len(declarations)), key=lambda i: not (rendezvous and rendezvous.owns(first + i))):
            try:
                self._model_state(declarations[index], first + index, registry)
            finally:
                if rendezvous is not None and rendezvous.owns(first + index):
                    rendezvous.mark_done(first + index)
        for index, declaration in enumerate(declarations):
            key = (str(self.path), declaration.name)
            model = session.models[key]
            if model.collect_error or model.skip_reason:
                yield QReportItem.from_parent(self, name=f"qreport/{declaration.name}/capture", callobj=qreport_check,
                                              model_key=key, check="capture", layer="", position=(index, -1, 0))
                continue
            for check, layers in model.items.items():
                for position, layer in enumerate(layers):
                    yield QReportItem.from_parent(
                        self, name=f"qreport/{declaration.name}/{check}/{layer}", callobj=qreport_check,
                        model_key=key, check=check, layer=layer, position=(index, order[check], position))
            options = session.settings["baseline"]
            if options["update"] or options["strict"] or os.path.exists(str(model.baseline_path)):
                yield QReportItem.from_parent(self, name=f"qreport/{declaration.name}/baseline",
                                              callobj=qreport_check, model_key=key, check="baseline", layer="",
                                              position=(index, len(order), 0))

    def _model_state(self, declaration: ModelDeclaration, index: int, registry) -> None:
        """Collect the model of `declaration` into the session's models, unless a declaration of it came first."""
        session = self.config.stash[STATE_KEY]
        key = (str(self.path), declaration.name)
        if key in session.models:
            return
        path = str(baseline_path(self.path.parent, declaration.name, session.settings["baseline"]["dir"]))
        sharing = next((k[0] for k, m in session.models.items() if m.baseline_path == path), None)
        model = ModelState(declaration.name, collect_error=(
            f"model {declaration.name!r} of {self.path} and the model of the same name in {sharing} would "
            f"share the baseline file {path} (--qreport-baseline-dir); give one of them qmodel(name='...')")
        ) if sharing else self._collect_model(declaration, index, registry, session.settings)
        model.baseline_path = path
        session.models[key] = model

    def _collect_model(self, declaration: ModelDeclaration, index: int, registry, session_settings) -> ModelState:
        """Resolve settings, quantizer and fixtures, capture, and list items; any error lands on the model."""
        name = declaration.name
        try:
            if declaration.error:
                raise ValueError(declaration.error)
            settings = resolve_settings(session_settings, declaration, registry)
            quantizer = model_quantizer(settings, self.ihook)
        except ValueError as error:
            text = str(error)
            return ModelState(name, collect_error=text if f"'{name}'" in text else f"model {name!r}: {text}")
        try:
            names = self._fixture_names(declaration, settings)
            # the model's fixtures may compute (BatchNorm settling, training): same thread count as the analysis
            with torch_threads(session_settings["threads"]), self._fixtures_at_collection(name, names) as values:
                example = self._example_inputs(name, settings, values, self.config.stash[STATE_KEY].replayable)
                return self._collect_or_recall(name, index, settings, registry, quantizer, values[name], example)
        except pytest.skip.Exception as skipped:
            return ModelState(name, skip_reason=f"model {name!r}: {skipped.msg}")
        except Exception as error:  # noqa: BLE001 - reported on the model's item
            return ModelState(name, collect_error=explain(name, "capture/set-up", error), error_cause=error)

    def _collect_or_recall(self, name: str, index: int, settings, registry, quantizer, model: Any,
                           example: Any) -> ModelState:
        """The model's items from the layer cache, to capture at its analysis; or capture it now and cache them.
        Under xdist, a worker that does not own the model waits for its owner's entry (see capture_share)."""
        session = self.config.stash[STATE_KEY]
        cache, key, rendezvous = session.layer_cache, None, session.capture_rendezvous
        if cache.directory is not None and hasattr(model, "modules"):
            key = model_cache_key(model, example, str(self.path), settings, registry.checks(), quantizer)
            entry = cache.load(key)
            if entry is None and rendezvous is not None and not rendezvous.owns(index):
                entry = rendezvous.wait(key, index, cache)
            if entry is not None:
                return ModelState(name, settings, items={c: list(ls) for c, ls in entry["items"].items()},
                                  capture=dict(entry.get("capture", {})), quantizer=quantizer, cache_key=key)
        state = collect_model(name, settings, registry, quantizer, model, example)
        if key is not None:
            cache.store(key, state.items, state.capture)
        if rendezvous is not None and state.context is not None:
            rendezvous.mark_captured(model_scope(self.nodeid, name))
        return state

    @staticmethod
    def _fixture_names(declaration: ModelDeclaration, settings) -> list[str]:
        """The fixtures collection needs: the model's own fixture, and the example-inputs or calibration one."""
        names = [declaration.name]
        for source in (settings.example_inputs, None if settings.example_inputs is not None else settings.calibration):
            if isinstance(source, str) and source not in names:
                names.append(source)
        if settings.example_inputs is None and settings.calibration is None:
            raise QReportModelError(f"model {declaration.name!r} has no calibration batches: pass "
                                    "qmodel(calibration='fixture_name') or set qreport_calibration in the ini file.")
        return names

    @contextlib.contextmanager
    def _fixtures_at_collection(self, model: str, names: list[str]) -> Iterator[dict[str, Any]]:
        """Set up `names` (and what they request) as pytest would for a test, then tear them down again."""
        for fixture in names:
            if not fixture.isidentifier():
                raise QReportModelError(f"model {model!r}: {fixture!r} is not a valid fixture name")
        probe = pytest.Function.from_parent(self, name=f"qreport/{model}/[fixtures]", callobj=_fixture_probe(names))
        hook = probe.ihook
        try:
            try:
                hook.pytest_runtest_setup(item=probe)
            except pytest.FixtureLookupError as error:
                raise QReportModelError(
                    f"model {model!r}: fixture {error.argname!r} not found for {self.path}; define it in a conftest.py "
                    "that this directory sees, or pass qmodel(calibration=...) batches directly") from None
            except pytest.fail.Exception as error:
                raise QReportModelError(
                    f"model {model!r}: its fixtures {names} could not be set up at collection: {error.msg}. A "
                    "parametrized fixture cannot feed a qmodel; for models that need one, build the model inside "
                    "your own test with the qreport fixture.") from error
            yield {name: probe.funcargs[name] for name in names}
        finally:
            hook.pytest_runtest_teardown(item=probe, nextitem=None)

    @staticmethod
    def _example_inputs(model: str, settings, values: dict[str, Any], replayable) -> Any:
        source = settings.example_inputs
        if source is not None:
            return values[source] if isinstance(source, str) else (source() if callable(source) else source)
        calibration = settings.calibration
        batches = values[calibration] if isinstance(calibration, str) else (
            calibration() if callable(calibration) else calibration)
        return _first_batch(replayable(batches))


class QReportItem(pytest.Function):
    """One check of one layer of one model."""

    def __init__(self, *, model_key: tuple[str, str], check: str, layer: str, position: tuple, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_key, self.check, self.layer, self.position = model_key, check, layer, position
        self.model_name = model_key[1]
        self.extra_keyword_matches.update({self.model_name, check})
        # with `-n N --dist loadgroup`, all of a model's items go to one worker, which analyses it once
        self.add_marker(pytest.mark.xdist_group(name=self.model_name))
        self.qreport_row: Finding | None = None

    @property
    def qreport_model_info(self) -> dict:
        """What the controller needs of this item's model: its name, baseline file and fingerprint."""
        model = self.config.stash[STATE_KEY].models[self.model_key]
        return {"model": model.name, "baseline_path": model.baseline_path, "fingerprint": model.fingerprint}

    def setup(self) -> None:
        super().setup()
        model = self.config.stash[STATE_KEY].models[self.model_key]
        if model.skip_reason:
            pytest.skip(model.skip_reason)
        if model.collect_error:
            self._record_error(model.collect_error)
            raise QReportModelError(model.collect_error) from model.error_cause
        request = cast(pytest.FixtureRequest, self.funcargs["request"])
        hook, settings = self.ihook, self.config.stash[STATE_KEY].settings
        if model.context is None and model.findings is None and model.analysis_error is None:
            self._capture_recalled(model, request)
        if model.findings is None and model.analysis_error is None:
            worker = getattr(self.config, "workerinput", {})
            crash_dir, worker_id = worker.get(CRASH_DIR_KEY), worker.get("workerid", "")
            crashed = previous_crash(crash_dir, self.model_key) if crash_dir else None
            if crashed:
                model.analysis_error = crashed_message(model.name, crashed)
            with analysis_guard(crash_dir, self.model_key, worker_id):
                analyze(model, lambda: self._calibration_batches(model, request),
                        lambda found: hook.pytest_qreport_modify_findings(model=model.name, findings=found),
                        threads=settings["threads"], baseline=settings["baseline"])
        if model.analysis_error:
            self._record_error(model.analysis_error)
            raise QReportModelError(model.analysis_error) from model.error_cause
        found = model.findings[(self.check, self.layer)]
        if found.verdict == "error":  # a check or the baseline file failed: an error of this item, not a failure
            self.qreport_row = found
            raise QReportModelError(found.message)

    def _capture_recalled(self, model: ModelState, request: pytest.FixtureRequest) -> None:
        """Capture a model whose items came from the layer cache (once per process: the first item's setup)."""
        assert model.settings is not None
        session = self.config.stash[STATE_KEY]
        try:
            with torch_threads(session.settings["threads"]):
                source = model.settings.example_inputs
                if source is None:
                    example = _first_batch(session.replayable(self._calibration_source(model, request)))
                else:
                    example = request.getfixturevalue(source) if isinstance(source, str) else (
                        source() if callable(source) else source)
                fresh = collect_model(model.name, model.settings, session.registry, model.quantizer,
                                      request.getfixturevalue(model.name), example)
        except Exception as error:  # noqa: BLE001 - reported on every item of the model
            model.analysis_error, model.error_cause = explain(model.name, "capture", error), error
            return
        if fresh.items != model.items:
            model.analysis_error = (f"model {model.name!r}: its layers differ from the cached list it was collected "
                                    "with (something the cache key does not cover changed). Re-run pytest; "
                                    "--cache-clear drops the cached lists.")
            return
        model.context, model.capture = fresh.context, fresh.capture

    def _calibration_source(self, model: ModelState, request: pytest.FixtureRequest) -> Any:
        assert model.settings is not None
        source = model.settings.calibration
        return request.getfixturevalue(source) if isinstance(source, str) else (
            source() if callable(source) else source)

    def _calibration_batches(self, model: ModelState, request: pytest.FixtureRequest) -> list:
        batches = as_batches(self.config.stash[STATE_KEY].replayable(self._calibration_source(model, request)))
        if not batches:
            raise QReportModelError(f"model {model.name!r}: the calibration source gave no batches")
        return batches

    def runtest(self) -> None:
        model = self.config.stash[STATE_KEY].models[self.model_key]
        found: Finding = model.findings[(self.check, self.layer)]
        self.qreport_row = found
        for key in ("model", "check", "layer", "metric", "value", "threshold"):
            self.user_properties.append((key, getattr(found, key)))
        capture = found.details.get("capture") or {}
        for key in ("method", "export_error"):
            if key in capture:
                self.user_properties.append((f"capture_{key}", capture[key]))
        if found.waiver:
            self.user_properties.append(("waiver", found.waiver))
        if found.baseline_status:
            self.user_properties.append(("baseline_status", found.baseline_status))
        for key in ("baseline", "delta"):
            if getattr(found, key) is not None:
                self.user_properties.append((key, getattr(found, key)))
        if found.verdict == "error":
            raise QReportModelError(found.message)
        if found.verdict == "skip":
            pytest.skip(found.message)
        if found.verdict == "fail":
            raise QReportCheckFailed(found.message)
        if found.verdict == "warn":
            warnings.warn(found.message, QReportWarning, stacklevel=1)

    def _record_error(self, message: str) -> None:
        self.qreport_row = Finding(model=self.model_name, check=self.check, layer=self.layer, metric="",
                                   value=float("nan"), threshold=float("nan"), verdict="error", message=message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, QReportError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


class QReportWarning(UserWarning):
    """A finding whose check is set to 'warn'."""
