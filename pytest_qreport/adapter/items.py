"""Collectors and items: one item per (model, check, layer) under the conftest that declares the model. Each is a
thin adapter over the model's ModelPipeline: it supplies fixture values and reports what the pipeline holds."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import pytest

from ..core.baseline import baseline_path
from ..core.batches import as_batches, first_batch, resolve_model, resolve_source
from ..core.declare import ModelDeclaration, declarations_in, model_group, model_name_problem, safe_name
from ..core.errors import QReportCheckFailed, QReportError, QReportModelError
from ..core.explain import error_finding, explain
from ..core.findings import Finding
from ..core.layer_cache import model_cache_key
from ..core.memory import ANALYSIS_FACTOR, MemoryLedger, budgeted_estimate, holds_capture, on_accelerator
from ..core.nodeids import item_name, model_scope
from ..core.numbers import printable
from ..core.pipeline import (
    ModelPipeline,
    Stage,
    analyze_in_session,
    artifact_group,
    collect_model,
    settings_and_quantizer,
)
from ..core.results import ModelFacts
from ..core.runtime import torch_threads, young_garbage_collection
from ..xdist.crashes import CRASH_DIR_KEY, analysis_guard, crashed_message, previous_crash
from .progress import AnalysisProgress
from .state import STATE_KEY

__all__ = ["QReportFile", "QReportItem", "QReportWarning"]


def qreport_check(request) -> None:
    """Body of every qreport item; the item's setup and runtest do the work."""


def _fixture_probe(names: list[str]):
    """A function whose parameters are `names`, so that pytest resolves exactly those fixtures for it."""

    def qreport_fixtures(**values: Any) -> None:
        """Stands in for a test function that requests the model's fixtures at collection."""

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    qreport_fixtures.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])  # type: ignore[attr-defined]
    return qreport_fixtures


class QReportFile(pytest.File):
    """A conftest.py that declares models with @qmodel."""

    def __init__(self, *, module: Any, **kwargs) -> None:
        super().__init__(**kwargs)
        self.module = module

    def collect(self) -> Iterator[pytest.Item]:
        session = self.config.stash[STATE_KEY]
        registry = session.refresh_registry()
        declarations = declarations_in(self.module)
        first = session.declared_models  # the session-wide index of this file's first model (the same in every worker)
        session.declared_models += len(declarations)
        # under xdist, capture the models this worker claims, then take the others' layer lists (see rendezvous)
        # the artifacts of one declaration are collected together, by whoever claims the declaration's first one
        claims: dict[str, int] = {}
        for index, declaration in enumerate(declarations):
            claims.setdefault(declaration.fixture, first + index)
        awaited = [(index, declaration) for index, declaration in enumerate(declarations)
                   if self._collect(declaration, first + index, registry, claims[declaration.fixture]) is not None]
        for index, declaration in awaited:
            self._collect(declaration, first + index, registry, claims[declaration.fixture], wait=True)
        for declaration in declarations:
            yield from self._items(declaration)

    def _items(self, declaration: ModelDeclaration) -> Iterator[pytest.Item]:
        session = self.config.stash[STATE_KEY]
        key = (str(self.path), declaration.name)
        pipeline: ModelPipeline = session.models[key]
        make = QReportItem.from_parent
        if pipeline.stage in (Stage.COLLECTION_FAILED, Stage.SKIPPED):
            shown = safe_name(declaration.name) if model_name_problem(declaration.name) else declaration.name
            yield make(self, name=item_name(shown, "capture"), callobj=qreport_check,
                       model_key=key, check="capture", layer="", declared_line=declaration.line)
            return
        for check, layer in pipeline.checks_and_layers():
            yield make(self, name=item_name(declaration.name, check, layer), callobj=qreport_check, model_key=key,
                       check=check, layer=layer, declared_line=declaration.line)
        options = session.settings["baseline"]
        if options["update"] or options["strict"] or os.path.exists(str(pipeline.baseline_path)):
            yield make(self, name=item_name(declaration.name, "baseline"), callobj=qreport_check, model_key=key,
                       check="baseline", layer="", declared_line=declaration.line)

    def _collect(self, declaration: ModelDeclaration, index: int, registry, claim_index: int,
                 wait: bool = False) -> ModelPipeline | None:
        """Collect the model of `declaration` into the session's models, unless a declaration of it came first.
        Under xdist, a model another worker claimed (by `claim_index`: its group's first model's index) is left for
        a second call with `wait`: returns its pipeline, still declared, with its cache key."""
        session = self.config.stash[STATE_KEY]
        key = (str(self.path), declaration.name)
        if key in session.models:
            return None
        if wait and self._recall_awaited(key, index):
            return None
        problem = model_name_problem(declaration.name)
        if problem:
            session.models[key] = ModelPipeline(declaration.name).collection_failed(
                f"model {declaration.name!r} of {self.path}: {problem}")
            return None
        path = str(baseline_path(self.path.parent, declaration.name, session.settings["baseline"]["dir"]))
        known = [*session.models.items(), *session.awaited.items()]
        sharing = next((k[0] for k, m in known if m.baseline_path == path), None)
        if sharing:
            pipeline = ModelPipeline(declaration.name).collection_failed(
                f"model {declaration.name!r} of {self.path} and the model of the same name in {sharing} would "
                f"share the baseline file {path} (--qreport-baseline-dir); give one of them qmodel(name='...')")
        else:
            pipeline = self._collect_model(declaration, index, registry, session.settings, claim_index,
                                           claim=not wait)
        pipeline.baseline_path = path
        if pipeline.stage is Stage.DECLARED:
            session.awaited[key] = pipeline
            return pipeline
        session.models[key] = pipeline
        return None

    def _recall_awaited(self, key: tuple[str, str], index: int) -> bool:
        """Take the layer list the worker that claimed the model stored; False when none came (capture it here)."""
        session = self.config.stash[STATE_KEY]
        awaited = session.awaited.pop(key, None)
        rendezvous = session.capture_rendezvous
        entry = awaited and rendezvous is not None and rendezvous.wait(index)
        if not entry:
            return False
        session.models[key] = awaited.recalled(awaited.settings, awaited.quantizer, entry["items"],
                                               entry.get("capture", {}), entry.get("key") or "",
                                               _parameter_bytes(entry))
        return True

    def _settings(self, declaration: ModelDeclaration, registry, session_settings) -> tuple[Any, Any] | ModelPipeline:
        """(settings, quantizer) of a declaration, or its failed pipeline."""
        name = declaration.name
        try:
            if declaration.error:
                raise ValueError(declaration.error)
            return settings_and_quantizer(declaration, session_settings, registry, self.ihook)
        except ValueError as error:
            text = str(error)
            return ModelPipeline(name).collection_failed(text if f"'{name}'" in text else f"model {name!r}: {text}")

    def _collect_model(self, declaration: ModelDeclaration, index: int, registry,
                       session_settings, claim_index: int, claim: bool = True) -> ModelPipeline:
        """Resolve settings, quantizer and fixtures, capture, and list items; any error lands on the model."""
        name = declaration.name
        resolved = self._settings(declaration, registry, session_settings)
        if isinstance(resolved, ModelPipeline):
            return resolved
        settings, quantizer = resolved
        session = self.config.stash[STATE_KEY]
        rendezvous = session.capture_rendezvous if claim else None
        if rendezvous is not None and not rendezvous.claim(claim_index):  # another worker builds it: wait for it
            return ModelPipeline(name, settings=settings, quantizer=quantizer)
        pipeline: ModelPipeline | None = None
        try:
            if declaration.group is not None:
                pipeline = session.group_collected.pop((str(self.path), name), None)
                if pipeline is None:
                    pipeline = self._collect_group(declaration, registry, session_settings)
                return pipeline
            names = self._fixture_names(declaration, settings)
            with young_garbage_collection():  # the model object is freed before the next model is built
                pipeline = self._collect_with_fixtures(name, names, settings, registry, quantizer,
                                                       session_settings["threads"])
            return pipeline
        except pytest.skip.Exception as skipped:
            return ModelPipeline(name).skipped(f"model {name!r}: {skipped.msg}")
        except Exception as error:  # noqa: BLE001 - reported on the model's item
            return ModelPipeline(name).collection_failed(explain(name, "capture/set-up", error), error)
        finally:
            if rendezvous is not None:  # collected or failed: a waiter stops waiting either way
                rendezvous.mark_done(index, _rendezvous_entry(pipeline))

    def _collect_group(self, declaration: ModelDeclaration, registry, session_settings) -> ModelPipeline:
        """Every artifact of `declaration`'s group not collected yet, from one set-up of the fixtures: the reference
        is built once, and their analyses measure them in one pass (qcore's ArtifactGroup). Returns `declaration`'s
        pipeline; the others wait in the session for their own collection."""
        session, path = self.config.stash[STATE_KEY], str(self.path)
        members: dict[str, tuple[Any, Any]] = {}
        pipelines: dict[str, ModelPipeline] = {}
        for declared in declarations_in(self.module):
            if declared.fixture != declaration.fixture or (path, declared.name) in session.models:
                continue
            resolved = self._settings(declared, registry, session_settings)
            if isinstance(resolved, ModelPipeline):
                pipelines[declared.name] = resolved
            else:
                members[declared.name] = resolved
        try:
            # the artifacts' own fixtures are set up one by one below, so that one that fails errors alone
            names = list(dict.fromkeys(name for member, (settings, _) in members.items()
                                       for name in self._fixture_names(self._declared(member), settings)
                                       if name != settings.quantized))
            threads = session_settings["threads"]
            with young_garbage_collection(), torch_threads(threads), \
                    self._fixtures_at_collection(declaration.fixture, [*names, "request"]) as values:
                group, request = artifact_group(), values["request"]
                for member, (settings, quantizer) in members.items():
                    try:
                        quantized = resolve_model(settings.quantized, request.getfixturevalue)
                        pipelines[member] = collect_model(member, settings, registry, quantizer,
                                                          values[declaration.fixture], None, quantized, group=group)
                    except Exception as error:  # noqa: BLE001 - reported on that artifact's items
                        pipelines[member] = ModelPipeline(member).collection_failed(
                            explain(member, "capture/set-up", error), error)
        except pytest.skip.Exception as skipped:
            for member in members:
                pipelines[member] = ModelPipeline(member).skipped(f"model {member!r}: {skipped.msg}")
        except Exception as error:  # noqa: BLE001 - the reference or a fixture failed: every artifact's error
            for member in members:
                pipelines[member] = ModelPipeline(member).collection_failed(
                    explain(member, "capture/set-up", error), error)
        mine = pipelines.pop(declaration.name)
        session.group_collected.update({(path, member): pipeline for member, pipeline in pipelines.items()})
        return mine

    def _declared(self, name: str) -> ModelDeclaration:
        return next(d for d in declarations_in(self.module) if d.name == name)

    def _collect_with_fixtures(self, name: str, names: list[str], settings, registry, quantizer,
                               threads: int) -> ModelPipeline:
        """_collect_or_recall with the model's fixtures set up for it, and torn down again."""
        # the model's fixtures may compute (BatchNorm settling, training): same thread count as the analysis
        with torch_threads(threads), self._fixtures_at_collection(name, names) as values:
            if settings.quantized is not None:  # artifact mode: both models, matched by module name, no capture
                quantized = resolve_model(settings.quantized, values.__getitem__)
                return collect_model(name, settings, registry, quantizer, values[name], None, quantized)
            example = self._example_inputs(settings, values.__getitem__)
            return self._collect_or_recall(name, settings, registry, quantizer, values[name], example)

    def _collect_or_recall(self, name: str, settings, registry, quantizer, model: Any,
                           example: Any) -> ModelPipeline:
        """The model's items from the layer cache, to capture at its analysis; or capture it now and cache them."""
        session = self.config.stash[STATE_KEY]
        cache, key, rendezvous = session.layer_cache, None, session.capture_rendezvous
        if cache.directory is not None and hasattr(model, "modules"):
            key = model_cache_key(model, example, str(self.path), settings, registry.checks(), quantizer)
            entry = cache.load(key)
            if entry is not None:
                return ModelPipeline(name).recalled(settings, quantizer, entry["items"], entry.get("capture", {}), key,
                                                    _parameter_bytes(entry))
        pipeline = collect_model(name, settings, registry, quantizer, model, example)
        pipeline.cache_key = key
        if key is not None:
            cache.store(key, pipeline.items, pipeline.capture, pipeline.parameter_bytes)
        if rendezvous is not None:
            rendezvous.mark_captured(model_scope(self.nodeid, name))
        return self._held_or_dropped(pipeline)

    def _held_or_dropped(self, pipeline: ModelPipeline) -> ModelPipeline:
        """The captured model, kept for its analysis while the process's kept captures fit their share of the
        memory budget; else only its items, to capture again at its analysis (see core.memory.holds_capture)."""
        session = self.config.stash[STATE_KEY]
        if pipeline.context is None:
            return pipeline
        model_bytes = pipeline.parameter_bytes or 0
        if holds_capture(model_bytes, session.held_capture_bytes, session.memory_budget):
            session.held_capture_bytes += model_bytes
            return pipeline
        assert pipeline.settings is not None
        return ModelPipeline(pipeline.name).recalled(pipeline.settings, pipeline.quantizer, pipeline.items,
                                                     pipeline.capture, pipeline.cache_key or "", model_bytes)

    @staticmethod
    def _fixture_names(declaration: ModelDeclaration, settings) -> list[str]:
        """The fixtures collection needs: the model's own fixture, and the example-inputs or calibration one."""
        names = [declaration.fixture]
        if isinstance(settings.quantized, str):
            names.append(settings.quantized)
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

    def _example_inputs(self, settings, fixture_value) -> Any:
        """The example inputs: their own source, else the first calibration batch."""
        if settings.example_inputs is not None:
            return resolve_source(settings.example_inputs, fixture_value)
        replayable = self.config.stash[STATE_KEY].replayable
        return first_batch(replayable(resolve_source(settings.calibration, fixture_value)))


class QReportItem(pytest.Function):
    """One check of one layer of one model."""

    def __init__(self, *, model_key: tuple[str, str], check: str, layer: str, declared_line: int = 0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_key, self.check, self.layer, self.declared_line = model_key, check, layer, declared_line
        self.model_name = model_key[1]
        self.extra_keyword_matches.update({self.model_name, check})
        # with `-n N --dist loadgroup`, all of a model's items go to one worker, which analyses it once
        self.add_marker(pytest.mark.xdist_group(name=model_group(self.model_name)))
        self.qreport_row: Finding | None = None
        self.qreport_setup_error = ""

    @property
    def pipeline(self) -> ModelPipeline:
        """The pipeline of this item's model."""
        return self.config.stash[STATE_KEY].models[self.model_key]

    def model_facts(self) -> ModelFacts:
        """What the controller needs of this item's model, sent with its row."""
        return dataclasses.replace(self.pipeline.facts(), line=self.declared_line)

    def setup(self) -> None:
        super().setup()
        pipeline = self.pipeline
        if pipeline.stage is Stage.SKIPPED:
            pytest.skip(pipeline.error)
        if pipeline.stage is Stage.COLLECTED:  # the model's first item in this process
            request = cast(pytest.FixtureRequest, self.funcargs["request"])
            with self._memory_reserved(pipeline) as reserve:
                if pipeline.needs_capture:
                    self._capture_recalled(pipeline, request)
                if pipeline.stage is Stage.COLLECTED:
                    self._analyze(pipeline, request, reserve)
                pipeline.release()
        if pipeline.failed:
            message = pipeline.error_report(self.nodeid)
            self._record_error(message)
            self._setup_error(message)
        found = pipeline.finding(self.check, self.layer)
        if found.verdict == "error":  # a check or the baseline file failed: an error of this item, not a failure
            self.qreport_row = found
            self._setup_error(found.message)

    @contextlib.contextmanager
    def _memory_reserved(self, pipeline: ModelPipeline) -> Iterator[Callable[[int], None]]:
        """Under xdist, hold the model's share of the memory budget from before it is captured again here (so that
        a model waiting for memory is not built yet) until its analysis ends: its parameter bytes and its analysis
        estimate, the whole budget at most; yields the function that sets the share once the estimate is known."""
        session = self.config.stash[STATE_KEY]
        crash_dir, budget = getattr(self.config, "workerinput", {}).get(CRASH_DIR_KEY), session.memory_budget
        if not crash_dir or budget is None:
            yield lambda nbytes: None
            return
        ledger, key, model_bytes = MemoryLedger(crash_dir), "::".join(self.model_key), pipeline.parameter_bytes
        first = budget if model_bytes is None else min(budget, int(model_bytes * (1 + ANALYSIS_FACTOR)))
        with ledger.reserved(key, first, budget):
            yield lambda nbytes: ledger.resize(key, nbytes)

    def _analyze(self, pipeline: ModelPipeline, request: pytest.FixtureRequest,
                 reserve: Callable[[int], None]) -> None:
        """Run the model's analysis (once per process: the first item's setup), guarded against worker crashes;
        `reserve` is told the memory it is expected to need."""
        settings = self.config.stash[STATE_KEY].settings
        worker = getattr(self.config, "workerinput", {})
        crash_dir, worker_id = worker.get(CRASH_DIR_KEY), worker.get("workerid", "")
        crashed = previous_crash(crash_dir, self.model_key) if crash_dir else None
        if crashed:
            pipeline.analysis_failed(crashed_message(pipeline.name, crashed))
            return
        assert pipeline.context is not None
        budget = self.config.stash[STATE_KEY].memory_budget
        assert pipeline.settings is not None
        analysis = pipeline.context.analysis
        # its tensors take the device's memory, not the host's (an offloaded model's wait on the meta device: host)
        if on_accelerator(analysis.float_gm) and not getattr(analysis, "offloaded", False):
            reserve(0)
        else:
            estimate, refusal = budgeted_estimate(pipeline.name, pipeline.context.analysis,
                                                  pipeline.settings.blockwise, budget,
                                                  given=settings["memory_budget"] is not None)
            if refusal:
                pipeline.analysis_failed(refusal)
                return
            reserve(estimate + (pipeline.parameter_bytes or 0))
        progress = AnalysisProgress(self, pipeline.name)
        with analysis_guard(crash_dir, self.model_key, worker_id):
            analyze_in_session(pipeline, lambda: self._calibration_batches(pipeline, request), self.ihook, settings,
                               lambda source: as_batches(resolve_source(source, request.getfixturevalue)),
                               progress=progress)
        progress.done(pipeline.seconds)

    def _capture_recalled(self, pipeline: ModelPipeline, request: pytest.FixtureRequest) -> None:
        """Capture a model whose items came from the layer cache (once per process: the first item's setup); for an
        artifact of a group (qmodel(quantized={...})), every artifact of the group waiting here, on one reference."""
        assert pipeline.settings is not None
        session = self.config.stash[STATE_KEY]
        group = model_group(pipeline.name)
        if group != pipeline.name:
            path = self.model_key[0]
            waiting = {name: other for (where, name), other in session.models.items()
                       if where == path and model_group(name) == group and other.needs_capture}
            self._collect_group_again(waiting, group, request)
            return
        try:
            with torch_threads(session.settings["threads"]):
                fresh = self._collected_again(pipeline, request)
        except Exception as error:  # noqa: BLE001 - reported on every item of the model
            pipeline.analysis_failed(explain(pipeline.name, "capture", error), error)
            return
        pipeline.attach_capture(fresh)

    def _collect_group_again(self, waiting: dict[str, ModelPipeline], group: str,
                             request: pytest.FixtureRequest) -> None:
        """The artifacts of one group collected again in this process on one reference, each attached to its
        pipeline; an artifact that fails fails alone."""
        session = self.config.stash[STATE_KEY]
        try:
            with torch_threads(session.settings["threads"]):
                reference = request.getfixturevalue(group)
        except Exception as error:  # noqa: BLE001 - the reference failed: every artifact's error
            for name, pipeline in waiting.items():
                pipeline.analysis_failed(explain(name, "capture", error), error)
            return
        shared = artifact_group()
        for name, pipeline in waiting.items():
            assert pipeline.settings is not None
            try:
                with torch_threads(session.settings["threads"]):
                    quantized = resolve_model(pipeline.settings.quantized, request.getfixturevalue)
                    fresh = collect_model(name, pipeline.settings, session.registry, pipeline.quantizer, reference,
                                          None, quantized, group=shared)
            except Exception as error:  # noqa: BLE001 - reported on that artifact's items
                pipeline.analysis_failed(explain(name, "capture", error), error)
                continue
            pipeline.attach_capture(fresh)

    def _collected_again(self, pipeline: ModelPipeline, request: pytest.FixtureRequest) -> ModelPipeline:
        """The model collected again in this process, from its fixtures (and its artifact's, in artifact mode)."""
        assert pipeline.settings is not None
        settings, session = pipeline.settings, self.config.stash[STATE_KEY]
        model = request.getfixturevalue(pipeline.name)
        if settings.quantized is not None:
            return collect_model(pipeline.name, settings, session.registry, pipeline.quantizer, model, None,
                                 resolve_model(settings.quantized, request.getfixturevalue))
        if settings.example_inputs is None:
            example = first_batch(session.replayable(resolve_source(settings.calibration, request.getfixturevalue)))
        else:
            example = resolve_source(settings.example_inputs, request.getfixturevalue)
        return collect_model(pipeline.name, settings, session.registry, pipeline.quantizer, model, example)

    def _calibration_batches(self, pipeline: ModelPipeline, request: pytest.FixtureRequest) -> list:
        assert pipeline.settings is not None
        source = resolve_source(pipeline.settings.calibration, request.getfixturevalue)
        batches = as_batches(self.config.stash[STATE_KEY].replayable(source))
        if not batches:
            raise QReportModelError(f"model {pipeline.name!r}: the calibration source gave no batches")
        return batches

    def runtest(self) -> None:
        found = self.pipeline.finding(self.check, self.layer)
        self.qreport_row = found
        for key in ("model", "check", "layer", "metric", "value", "threshold"):
            self.user_properties.append((key, getattr(found, key)))
        for key, value in self.pipeline.capture.items():
            self.user_properties.append((f"capture_{key}", value))
        if found.waiver:
            self.user_properties.append(("waiver", found.waiver))
        if found.note:
            self.user_properties.append(("note", found.note))
        if found.baseline_status:
            self.user_properties.append(("baseline_status", found.baseline_status))
        for key in ("baseline", "delta"):
            if getattr(found, key) is not None:
                self.user_properties.append((key, getattr(found, key)))
        if found.verdict == "error":
            raise QReportModelError(found.message)
        if found.verdict == "skip":
            pytest.skip(printable(found.message))
        if found.verdict == "fail":
            raise QReportCheckFailed(found.message)
        if found.verdict == "warn":  # shown at the model's declaration, not at this file
            warnings.warn_explicit(printable(found.message), QReportWarning, filename=str(self.path),
                                   lineno=self.declared_line or 1)

    def _setup_error(self, message: str) -> NoReturn:
        """Stop this item's setup with `message` as its whole report: an error of the item, whose report costs what
        its message costs (pytest formats no traceback for it), so a model's hundreds of error items take
        milliseconds."""
        self.qreport_setup_error = printable(message)
        pytest.fail(self.qreport_setup_error, pytrace=False)

    def _record_error(self, message: str) -> None:
        self.qreport_row = error_finding(self.model_name, self.check, self.layer, message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, QReportError):
            return printable(str(excinfo.value))
        return super().repr_failure(excinfo)

    def reportinfo(self):
        # pytest -v prints a node id whose trailing test name equals this domain with its dots turned into "::"
        # (Class.method), which would make `stem.0` unpasteable; a domain that is not the id's tail is left alone
        return self.path, None, f"{self.name} "


class QReportWarning(UserWarning):
    """A finding whose check is set to 'warn'."""


def _parameter_bytes(entry: dict[str, Any]) -> int | None:
    """The model's parameter bytes a layer-cache entry records (None in an entry written before they were)."""
    value = entry.get("parameter_bytes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _rendezvous_entry(pipeline: ModelPipeline | None) -> dict[str, Any] | None:
    """What the workers that left a model to this one need of it (None when it was not collected)."""
    if pipeline is None or pipeline.stage is not Stage.COLLECTED:
        return None
    return {"key": pipeline.cache_key, "items": pipeline.items, "capture": pipeline.capture,
            "parameter_bytes": pipeline.parameter_bytes}
