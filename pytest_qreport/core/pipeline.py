"""One model's life in a process, as one object with explicit stages:

    declared ─► collected ─► analysed ─► judged
        │           │            └─► analysis failed
        │           └─► (recalled from the layer cache: captured on first use, then analysed)
        └─► collection failed, or skipped

Items and the `qreport` fixture are thin adapters over it: they supply fixture values and report what it holds.
"""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import QReportModelError
from .experts import expert_item_names, expert_items, expert_layers_of, item_members, merge_expert_findings
from .explain import error_finding, explain, is_measurement_error
from .findings import Finding
from .judge import compare_with_baseline
from .memory import LARGE_MODEL_BYTES, estimated_analysis_bytes
from .registry import Check, CheckRegistry, ModelContext
from .results import ModelFacts
from .runtime import quiet_torch_trace_log, torch_threads, trim_heap, young_garbage_collection
from .settings import ModelSettings

__all__ = ["ARTIFACT_SKIP", "ModelPipeline", "Stage", "analyze_in_session", "artifact_group", "collect_model",
           "fingerprint", "format_refusal_message", "is_artifact", "on_device", "refusal_globs", "select_layers",
           "settings_and_quantizer"]

ARTIFACT_SKIP = ("concerns choosing a quantizer, and in artifact mode (quantized=) the model is quantized already; "
                 "its layers are judged by the sqnr, weight_sqnr and output checks")


def is_artifact(analysis: Any) -> bool:
    """Whether a model's analysis measures a quantized model the user gave (quantized=), not qcore's simulation."""
    return bool(getattr(analysis, "artifact", False))


class Stage(enum.Enum):
    """Where a model's pipeline stands."""

    DECLARED = "declared"
    COLLECTED = "collected"
    COLLECTION_FAILED = "collection failed"
    SKIPPED = "skipped"
    ANALYSED = "analysed"
    ANALYSIS_FAILED = "analysis failed"
    JUDGED = "judged"


def select_layers(names: Iterable[str], layers: list[str] | None, skip_layers: list[str] | None,
                  items: Mapping[str, str] | None = None) -> list[str]:
    """Keep names matching any `layers` glob (all if none) and no `skip_layers` glob, in order; a glob also
    matches the layers inside the module it names (`head` matches `head.1`), and, through `items` ({layer: the name
    of the item it is measured under}), the layers of the item it names (an MoE projection's experts)."""
    from qcore.analysis import matches_layer

    items = items or {}
    kept = []
    for name in names:
        aliases = (name, items.get(name, ""))
        if layers and not any(matches_layer(g, *aliases) for g in layers):
            continue
        if skip_layers and any(matches_layer(g, *aliases) for g in skip_layers):
            continue
        kept.append(name)
    return kept


def listed_layer_names(layers: Iterable[str], items: Mapping[str, str]) -> str:
    """The names a layer setting may give, for a message: each layer's, an MoE projection's experts as the one name
    of their item (a model with thousands of expert layers lists its projections)."""
    return ", ".join(dict.fromkeys(items.get(layer) or layer for layer in layers))


@dataclass
class ModelPipeline:
    """Everything one process knows about one declared model, and the one way it moves between stages."""

    name: str
    stage: Stage = Stage.DECLARED
    settings: ModelSettings | None = None
    quantizer: Any = None
    context: ModelContext | None = None  # None while collected from the layer cache and not captured yet
    items: dict[str, list[str]] = field(default_factory=dict)  # check -> layers, in item order
    capture: dict[str, str] = field(default_factory=dict)  # {"method": "export" | "fx", "export_error": ...}
    cache_key: str | None = None
    parameter_bytes: int | None = None  # of the captured model (its parameters and buffers), once known
    baseline_path: str | None = None
    fingerprint: dict[str, Any] | None = None
    findings: dict[tuple[str, str], Finding] | None = None
    error: str = ""  # why collection or analysis failed, or why the model is skipped
    error_cause: BaseException | None = None
    error_reported_at: str = ""  # the item of this process whose report holds the whole error
    seconds: dict[str, float] = field(default_factory=dict)  # per stage: capture, calibration, comparison, ...
    fix_budget: dict[str, Any] = field(default_factory=dict)  # what the fix searches spent (FixBudgetUse.as_dict)

    # -- transitions -------------------------------------------------------------------------------------------
    def collection_failed(self, message: str, cause: BaseException | None = None) -> ModelPipeline:
        """declared -> collection failed."""
        return self._move(Stage.COLLECTION_FAILED, message, cause)

    def skipped(self, reason: str) -> ModelPipeline:
        """declared -> skipped (a fixture called pytest.skip)."""
        return self._move(Stage.SKIPPED, reason)

    def analysis_failed(self, message: str, cause: BaseException | None = None) -> ModelPipeline:
        """collected -> analysis failed."""
        return self._move(Stage.ANALYSIS_FAILED, message, cause)

    def error_report(self, item: str) -> str:
        """What item `item` of a model that failed reports: the whole error on the first item of this process to
        report it, its first line and a pointer to that item on every other one."""
        if not self.error_reported_at or self.error_reported_at == item:
            self.error_reported_at = item
            return self.error
        return f"{self.error.splitlines()[0]}\n(the whole report is on {self.error_reported_at})"

    def _move(self, stage: Stage, message: str, cause: BaseException | None = None) -> ModelPipeline:
        self.stage, self.error, self.error_cause = stage, message, cause
        return self

    def recalled(self, settings: ModelSettings, quantizer: Any, items: dict[str, list[str]], capture: dict[str, str],
                 cache_key: str, parameter_bytes: int | None = None) -> ModelPipeline:
        """declared -> collected, from the layer cache: the model is captured on first use (`attach_capture`)."""
        self.settings, self.quantizer, self.cache_key = settings, quantizer, cache_key
        self.parameter_bytes = parameter_bytes
        self.items, self.capture = {c: list(ls) for c, ls in items.items()}, dict(capture)
        self.stage = Stage.COLLECTED
        return self

    def attach_capture(self, fresh: ModelPipeline) -> None:
        """Take the capture of a recalled model; analysis failed if its layers differ from the cached ones."""
        if fresh.items != self.items:
            self.analysis_failed(f"model {self.name!r}: its layers differ from the cached list it was collected with "
                                 "(something the cache key does not cover changed). Re-run pytest; --cache-clear "
                                 "drops the cached lists.")
            return
        self.context, self.capture = fresh.context, fresh.capture
        self.seconds.update(fresh.seconds)

    def release(self) -> None:
        """Drop the captured graphs and the analysis once the findings are known (items read nothing else): the
        process then holds one model's graphs at a time, not every model's until it exits."""
        if self.stage is not Stage.COLLECTED:
            self.context = None

    @property
    def needs_capture(self) -> bool:
        """True for a model collected from the layer cache and not captured yet in this process."""
        return self.stage is Stage.COLLECTED and self.context is None

    @property
    def failed(self) -> bool:
        """True when collection or analysis failed."""
        return self.stage in (Stage.COLLECTION_FAILED, Stage.ANALYSIS_FAILED)

    def checks_and_layers(self) -> list[tuple[str, str]]:
        """(check, layer) pairs in item order."""
        return [(check, layer) for check in self.items for layer in self.items[check]]

    def finding(self, check: str, layer: str) -> Finding:
        """The finding of one item, once the model is analysed (and judged)."""
        assert self.findings is not None, f"model {self.name!r} is {self.stage.value}, not analysed"
        return self.findings[(check, layer)]

    def facts(self) -> ModelFacts:
        """What reporters need of this model, sent once."""
        return ModelFacts(name=self.name, baseline_path=self.baseline_path, fingerprint=self.fingerprint,
                          capture=self.capture, error=self.error if self.failed else "", seconds=self.seconds,
                          fix_budget=self.fix_budget)

    # -- analysis ----------------------------------------------------------------------------------------------
    def analyze(self, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None],
                threads: int = 1, baseline: dict[str, Any] | None = None,
                resolve: Callable[[Any], list[Any]] | None = None, progress: Any = None) -> None:
        """collected -> analysed (-> judged with `baseline` options), or analysis failed. Measures once, on
        `threads` torch threads; later calls do nothing. `resolve` turns another batch setting (eval_batches: a
        fixture name, a callable or batches) into batches. `progress(stages, done, total)` hears where the
        analysis stands (qcore.runtime.progress); `seconds` gets the time of each stage."""
        if self.stage is not Stage.COLLECTED:
            return
        from qcore.analysis import StageTimes, tracked

        before = sum(self.seconds.values())
        start = time.perf_counter()
        budget = self.settings.fix_budget if self.settings is not None else None
        times = StageTimes(seconds=self.seconds, fix_budget=None if budget is None or math.isinf(budget) else budget)
        try:
            with tracked(progress, times):
                self._analyze(batches, modify, threads, baseline, resolve)
        finally:  # what no stage covers: detector reports, screens, judging
            self.fix_budget = times.budget_use().as_dict()
            staged = sum(self.seconds.values()) - before
            self.seconds["other"] = self.seconds.get("other", 0.0) + max(0.0, time.perf_counter() - start - staged)

    def _analyze(self, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None], threads: int,
                 baseline: dict[str, Any] | None, resolve: Callable[[Any], list[Any]] | None) -> None:
        assert self.context is not None and self.settings is not None
        if resolve is not None:
            self.context.resolve = resolve
        try:
            weights = self.parameter_bytes  # measured at collection, or kept in the layer cache
            if weights is None:
                weights = estimated_analysis_bytes(self.context.analysis.float_gm)[0]
            large = weights >= LARGE_MODEL_BYTES
            from qcore.analysis import quantize_weights_where_read

            with torch_threads(threads), young_garbage_collection(large), quiet_torch_trace_log(), \
                    quantize_weights_where_read(large):
                found = self._measure(batches, modify, threads, large)
        except Exception as error:  # noqa: BLE001 - reported on every item of the model
            self.analysis_failed(explain(self.name, "the analysis", error), error)
            return
        self.stage = Stage.ANALYSED
        if baseline is not None and self.baseline_path is not None:
            found = compare_with_baseline(self, found, baseline)
            self.stage = Stage.JUDGED
        self.findings = {(f.check, f.layer): f for f in found}

    def _measure(self, batches: Callable[[], Iterable[Any]], modify: Callable[[list[Finding]], None],
                 threads: int, large: bool = False) -> list[Finding]:
        assert self.context is not None and self.settings is not None
        analysis = self.context.analysis
        try:
            given = batches()
        except Exception as error:
            error.qcore_stage = "loading the calibration batches"  # type: ignore[attr-defined]
            raise
        analysis.attach_batches(given)
        found: list[Finding] = []
        for check_name, layers in self.items.items():
            if layers:
                found += self._check_findings(check_name, layers)
                if large:  # a check's freed working set would stay resident under the next one's (glibc's heap)
                    trim_heap()
        modify(found)
        self.fingerprint = fingerprint(analysis, self.settings.equalize, threads)
        if self.settings.eval_batches is not None:
            from qcore.analysis import calibration_digest

            self.fingerprint["evaluation"] = calibration_digest(self.context.eval_batches())
        return found

    def _check_findings(self, check_name: str, layers: list[str]) -> list[Finding]:
        """One check's findings of its items `layers`, an expert projection's judged on its worst expert."""
        assert self.context is not None and self.settings is not None
        check = self.context.checks[check_name]
        if is_artifact(self.context.analysis) and not check.measures_artifacts:
            return self._layer_findings(check_name, layers)  # skipped: no layers to ask it for
        experts = expert_layers_of(self.context.analysis)
        members = item_members(layers, select_layers(
            self.context.checks[check_name].layers(self.context), self.settings.layers, self.settings.skip_layers,
            expert_item_names(experts)), experts) if experts else {}
        if not members:
            return self._layer_findings(check_name, layers)
        measured = [member for item in layers for member in members.get(item, [item])]
        found = {f.layer: f for f in self._layer_findings(check_name, measured)}
        higher = self.context.checks[check_name].higher_is_better
        artifact = is_artifact(self.context.analysis)
        return [merge_expert_findings(item, members[item], found, experts, higher, artifact) if item in members
                else found[item] for item in layers]

    def _layer_findings(self, check_name: str, layers: list[str]) -> list[Finding]:
        """One check's findings with the model's severity; a check that raises errors its own items only."""
        assert self.context is not None and self.settings is not None
        check = self.context.checks[check_name]
        severity = self.settings.severity.get(check_name, check.default_severity)
        if is_artifact(self.context.analysis) and not check.measures_artifacts:
            why = check.artifact_skip or ARTIFACT_SKIP
            return [Finding(model=self.name, check=check_name, layer=layer, metric=check.metric, value=math.nan,
                            threshold=math.nan, verdict="skip",
                            message=f"model {self.name!r}: check {check_name!r} {why}.") for layer in layers]
        refused = {entry.layer: entry for entry in self.context.analysis.layers if entry.format_refusal}
        if any(layer in refused for layer in layers):
            measurable = [layer for layer in layers if layer not in refused]
            by_layer = {f.layer: f for f in (self._layer_findings(check_name, measurable) if measurable else [])}
            written = refusal_globs(refused, expert_layers_of(self.context.analysis))
            return [by_layer[layer] if layer in by_layer else error_finding(
                self.name, check_name, layer, format_refusal_message(self.name, refused[layer], written[layer]))
                for layer in layers]
        try:
            found = {f.layer: f.with_severity(severity) for f in check.findings(self.context, list(layers))
                     if f.check == check_name}
        except Exception as error:  # noqa: BLE001 - one check's failure must not hide the others
            if is_measurement_error(error):
                raise
            message = explain(self.name, f"check {check_name!r}", error)
            return [error_finding(self.name, check_name, layer, message) for layer in layers]
        return [found.get(layer) or error_finding(
            self.name, check_name, layer, f"model {self.name!r}: check {check_name!r} returned no finding for "
            f"layer {layer}; its findings() must return one per layer it is given.") for layer in layers]


def format_refusal_message(model: str, layer: Any, written: str | None = None) -> str:
    """Why a layer cannot take its format, and the layer_formats entry that fixes it (a format that fits any
    shape: per output channel and per token); `written`: the entry's key, a glob where the layer is one of an MoE
    block's experts that its format refuses alike (refusal_globs)."""
    fitting = "W8A16" if layer.format in ("W4A16", "W4A16_ASYM", "NVFP4A16", "W8A16") else "FP8_DYNAMIC"
    key = written or layer.layer
    return (f"model {model!r}, layer {layer.layer}: it cannot be quantized as {layer.format_refusal}. Nothing is "
            f"skipped silently: give it a format that fits with layer_formats={{{key!r}: {fitting!r}}}, or "
            f"keep it in float with layer_formats={{{key!r}: 'float'}}.")


def refusal_globs(refused: Mapping[str, Any], experts: Mapping[str, Any]) -> dict[str, str]:
    """{refused layer: the layer_formats key its fix writes}: an expert's projection (or block) as a glob where its
    format refuses every expert of it alike, so that one entry fixes the item (qcore's compact_expert_layers)."""
    from qcore.analysis import compact_expert_layers, matches_layer

    written = {layer: layer for layer in refused}
    alike: dict[tuple[str, str], list[str]] = {}
    for layer, entry in refused.items():
        if layer in experts:
            alike.setdefault((entry.format, entry.format_refusal), []).append(layer)
    for layers in alike.values():
        for key in compact_expert_layers(layers, experts):
            for layer in layers:
                if written[layer] == layer and matches_layer(key, layer):
                    written[layer] = key
    return written


def settings_and_quantizer(declaration: Any, session: dict[str, Any], registry: CheckRegistry,
                           hook: Any) -> tuple[ModelSettings, Any]:
    """declared: a model's effective settings (command line, qmodel, ini, defaults) and its quantizer, as the items
    and the `qreport` fixture both take them; ValueError naming the problem."""
    from .quantizers import model_quantizer
    from .settings import resolve_settings

    settings = resolve_settings(session, declaration, registry)
    return settings, model_quantizer(settings, hook)


def analyze_in_session(pipeline: ModelPipeline, batches: Callable[[], Iterable[Any]], hook: Any,
                       session: dict[str, Any], resolve: Callable[[Any], list[Any]], *, judge: bool = True,
                       progress: Any = None) -> None:
    """collected -> analysed (-> judged against its baseline when `judge`): the session's thread count, the
    pytest_qreport_modify_findings hook, and `resolve` for the model's other batch settings, as the items and the
    `qreport` fixture both run it."""
    pipeline.analyze(batches, lambda found: hook.pytest_qreport_modify_findings(model=pipeline.name, findings=found),
                     threads=session["threads"], baseline=session["baseline"] if judge else None, resolve=resolve,
                     progress=progress)


def artifact_group() -> Any:
    """A new group for the artifacts of one declaration (qmodel(quantized={...})): measured in one pass."""
    from qcore.analysis import ArtifactGroup

    return ArtifactGroup()


def collect_model(name: str, settings: ModelSettings, registry: CheckRegistry, quantizer: Any, model: Any,
                  example_inputs: Any, quantized: Any = None, group: Any = None) -> ModelPipeline:
    """declared -> collected: capture the model and list each check's layers (no calibration); in artifact mode
    (settings.quantized), match the quantized model's layers with the reference's instead (`group`: the
    artifact_group it is measured with). Errors propagate to the caller."""
    import qcore
    from qcore.analysis import AnalysisPlan, ModelAnalysis, experts_grouped, groups_experts, takes_grouped_capture

    if settings.quantized is not None:
        return collect_artifact(name, settings, registry, model, quantized, group)
    if not hasattr(model, "forward"):
        raise QReportModelError(f"model {name!r}: the qmodel function returned {type(model).__name__}, "
                                "not an nn.Module")
    from qcore.analysis import tracked

    if settings.device is not None:
        model, example_inputs = on_device(name, settings.device, model, example_inputs)
    with quiet_torch_trace_log(), tracked() as times:
        # an MoE model's fused experts as one op a projection, where its analysis measures that form; not on another
        # device than the CPU's, nor for a large model (weights quantized where read), where the grouped form holds
        # more memory than one Linear per expert for no gain in time (the performance page)
        grouped = settings.device in (None, "cpu") and groups_experts(model, quantizer) and \
            estimated_analysis_bytes(model)[0] < LARGE_MODEL_BYTES
        with experts_grouped(grouped):
            float_gm = qcore.capture(model, example_inputs, name=name)
        if grouped and not takes_grouped_capture(float_gm, quantizer):
            with experts_grouped(False):
                float_gm = qcore.capture(model, example_inputs, name=name)
    _check_globs(name, settings, quantizer, float_gm)
    analysis = ModelAnalysis(float_gm, quantizer, equalize=settings.equalize,
                             blockwise=False if settings.blockwise == "auto" else settings.blockwise)
    checks: dict[str, Check] = {}
    for check_name in settings.checks:
        checks[check_name] = registry.get(check_name)(settings.check_options.get(check_name))
    context = ModelContext(name, settings, analysis, checks)
    items = expert_item_names(analysis.expert_layers)
    capture = {"method": str(float_gm.meta.get("qcore_capture_method", "export"))}
    if "qcore_export_error" in float_gm.meta:
        capture["export_error"] = str(float_gm.meta["qcore_export_error"])
    weights = estimated_analysis_bytes(float_gm)[0]
    pipeline = ModelPipeline(name, Stage.COLLECTED, settings, quantizer, context, capture=capture,
                             parameter_bytes=weights, seconds=dict(times.seconds))
    selected: dict[str, list[str]] = {}
    for check_name, check in checks.items():
        check.bind(context)
        if check.applies(context):
            selected[check_name] = select_layers(check.layers(context), settings.layers, settings.skip_layers,
                                                 items)
            pipeline.items[check_name] = expert_items(selected[check_name], analysis.expert_layers)
    context.checks = {n: c for n, c in checks.items() if n in pipeline.items}
    needs = frozenset().union(*(check.needs for check in context.checks.values()))
    screens = tuple(screen for name, check in context.checks.items()
                    if (screen := check.screen(context, selected[name])) is not None)
    context.analysis = analysis.planned(AnalysisPlan(measurements=needs, detectors=context.detectors(),
                                                     screens=screens))
    return pipeline


def collect_artifact(name: str, settings: ModelSettings, registry: CheckRegistry, model: Any,
                     quantized: Any, group: Any = None) -> ModelPipeline:
    """declared -> collected, in artifact mode: `model` is the float reference and `quantized` the model the user
    ships; their quantized layers are matched by module name (no capture, nothing quantized here)."""
    import torch

    from qcore.analysis import ArtifactAnalysis, ArtifactMismatchError, tracked

    for what, value in (("the qmodel function", model), ("quantized=", quantized)):
        if not isinstance(value, torch.nn.Module):
            raise QReportModelError(f"model {name!r}: {what} gave {type(value).__name__}, not an nn.Module; in "
                                    "artifact mode the model function returns the float reference and quantized= the "
                                    "quantized model")
    offloaded = any(getattr(value, "hf_device_map", None) for value in (model, quantized))
    if settings.device is not None and not offloaded:  # an offloaded model is onloaded to the device block by block
        model, _ = on_device(name, settings.device, model, None)
        quantized = quantized.to(settings.device)
    try:
        with tracked() as times:
            analysis = ArtifactAnalysis(model, quantized, device=settings.device if offloaded else None, group=group,
                                        member=name)
    except (ArtifactMismatchError, ValueError) as error:
        raise QReportModelError(f"model {name!r}: {error}") from None
    names = [entry.layer for entry in analysis.layers]
    items = expert_item_names(analysis.expert_layers)
    _check_artifact_globs(name, settings, names, items)
    float_layers = _artifact_float_layers(name, settings, names, items)
    checks = {check_name: registry.get(check_name)(settings.check_options.get(check_name))
              for check_name in settings.checks}
    context = ModelContext(name, settings, analysis, checks)
    weights = analysis.resident_bytes()
    pipeline = ModelPipeline(name, Stage.COLLECTED, settings, None, context, capture={"method": "eager (artifact)"},
                             parameter_bytes=weights, seconds=dict(times.seconds))
    for check_name, check in checks.items():
        if not check.measures_artifacts:
            pipeline.items[check_name] = ["model"]  # one item, skipped with the reason
            continue
        check.bind(context)
        if check.applies(context):
            # a layer float_layers keeps in float is the reference's module, measured by no per-layer item
            pipeline.items[check_name] = expert_items([layer for layer in select_layers(
                check.layers(context), settings.layers, settings.skip_layers, items) if layer not in float_layers],
                analysis.expert_layers)
    context.checks = {n: c for n, c in checks.items() if n in pipeline.items}
    needs = frozenset().union(*(check.needs for check in context.checks.values() if check.measures_artifacts))
    context.analysis = analysis.planned(logits="logits" in needs, float_layers=float_layers)
    return pipeline


def _artifact_float_layers(name: str, settings: ModelSettings, names: list[str], items: Mapping[str, str]
                           ) -> list[str]:
    """The artifact's layers that float_layers globs name (their reference modules are swapped in); a glob naming
    an MoE projection's item (`items`: {layer: its item's name}) names its experts' layers."""
    from qcore.analysis import matches_layer

    if not settings.float_layers:
        return []
    unmatched = [glob for glob in settings.float_layers
                 if not any(matches_layer(glob, layer, items.get(layer, "")) for layer in names)]
    if unmatched:
        raise QReportModelError(f"model {name!r}: float_layers {unmatched} match no quantized layer of the artifact; "
                                f"its layers: {listed_layer_names(names, items)}")
    return [layer for layer in names
            if any(matches_layer(glob, layer, items.get(layer, "")) for glob in settings.float_layers)]


def _check_artifact_globs(name: str, settings: ModelSettings, layers: list[str], items: Mapping[str, str]) -> None:
    """layers and skip_layers globs must match an artifact layer, an MoE projection's item (`items`: {layer: its
    item's name}) or an output item."""
    from qcore.analysis import matches_layer

    names = [*((layer, items.get(layer, "")) for layer in layers), ("output",), ("model",)]
    for setting, globs in (("layers", settings.layers), ("skip_layers", settings.skip_layers)):
        unmatched = [glob for glob in globs or () if not any(matches_layer(glob, *aliases) for aliases in names)]
        if unmatched:
            raise QReportModelError(f"model {name!r}: {setting} {unmatched} match no quantized layer of the artifact; "
                                    f"its layers: {listed_layer_names(layers, items)}")
    if settings.layer_formats or settings.layer_overrides or settings.equalize:
        given = [key for key in ("layer_formats", "layer_overrides", "equalize") if getattr(settings, key)]
        raise QReportModelError(f"model {name!r}: {', '.join(given)} choose how qcore quantizes a model, and in "
                                "artifact mode (quantized=) the model is quantized already. Fix: drop them, or drop "
                                "quantized= to gate qcore's simulation of the float model")


def on_device(name: str, device: str, model: Any, example_inputs: Any) -> tuple[Any, Any]:
    """The model moved to `device` (in place, as nn.Module.to does) and its example inputs copied there; the
    calibration and evaluation batches follow the model, one batch at a time."""
    import torch

    from qcore.analysis import move_to

    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch raises AssertionError for a build without CUDA
        available = "yes" if torch.cuda.is_available() else "no"
        raise QReportModelError(
            f"model {name!r}: device={device!r} cannot be used here ({str(error).splitlines()[0]}; torch "
            f"{torch.__version__}, CUDA available: {available}). Fix: --qreport-device=cpu (or auto, where the "
            f"model is), or run where that device and a torch build for it exist") from None
    return model.to(device), move_to(example_inputs, device)


def _check_globs(name: str, settings: ModelSettings, quantizer: Any, float_gm: Any) -> None:
    """A layer glob that matches no layer is a typo or a stale name: say so, with the layer names. Checked for
    layers, skip_layers, float_layers, layer_formats, equalize's layers and the quantizer's own layer_overrides."""
    import qcore
    from qcore.analysis import expert_views, matches_layer

    ops = [*qcore.find_quantizable_ops(float_gm), *expert_views(float_gm)]  # a grouped projection's experts too
    given = {"layers": settings.layers, "skip_layers": settings.skip_layers, "float_layers": settings.float_layers,
             "layer_formats": list(settings.layer_formats or ()),
             "equalize": list(settings.equalize) if isinstance(settings.equalize, (list, tuple)) else [],
             "layer_overrides": list(getattr(quantizer, "layer_overrides", None) or ())}
    special = ("output", "model")  # the whole-model items' names
    for setting, globs in given.items():
        unmatched = [g for g in globs or () if not any(matches_layer(g, *op.names) for op in ops)
                     and not (setting in ("layers", "skip_layers") and any(matches_layer(g, s) for s in special))]
        if unmatched:
            raise QReportModelError(f"model {name!r}: {setting} {unmatched} match no layer, nor a module holding one; "
                                    "layers: " + listed_layer_names([op.layer for op in ops],
                                                                    {op.layer: op.item for op in ops if op.item}))


def fingerprint(analysis: Any, equalize: Any, threads: int) -> dict[str, Any]:
    """What a model's numbers depend on: versions, quantizer, calibration data, equalization, threads, the kind of
    device."""
    import torch

    import qcore
    from qcore.analysis import calibration_digest, describe, model_device

    if is_artifact(analysis):  # the artifact's identity is recorded, not compared: its changing is what is gated
        return {"torch": str(torch.__version__), "qcore": str(qcore.__version__), "quantizer": "artifact",
                "artifact": analysis.digest, "calibration": calibration_digest(analysis.batches),
                "equalize": None, "threads": threads, "device": model_device(analysis.reference).type}
    return {"torch": str(torch.__version__), "qcore": str(qcore.__version__), "quantizer": describe(analysis.quantizer),
            "calibration": calibration_digest(analysis.batches), "equalize": describe(equalize), "threads": threads,
            "device": model_device(analysis.float_gm).type}
