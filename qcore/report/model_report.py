"""ModelReport: insert the detectors' observers, calibrate, and turn the statistics into reports."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import fx, nn

from qcore.graph.capture import capture
from qcore.graph.ops import INSERTED_KEY, observation_point
from qcore.report.detectors import (
    DETECTOR_EXPERT_KEY,
    DETECTOR_IS_POST_OBS_KEY,
    DETECTOR_OBS_ARGS_KEY,
    DETECTOR_OBS_TO_INSERT_KEY,
    DETECTOR_TARGET_NODE_KEY,
    DetectorBase,
    DetectorQConfigInfo,
    InputWeightEqualizationDetector,
)
from qcore.report.observer import ExpertsReportObservers, ReportObserver

__all__ = ["ModelReport", "ModelReportError"]


def _merge(existing: ReportObserver, wanted: ReportObserver) -> bool:
    """Fold `wanted` into `existing` when one observer can serve both; True if it did."""
    if existing.per_channel and wanted.per_channel and existing.ch_axis != wanted.ch_axis:
        return False
    if existing.percentiles and wanted.percentiles and existing.min_ratio_values != wanted.min_ratio_values:
        return False  # their ratios would come from different batches
    if wanted.percentiles:
        existing.min_ratio_values = wanted.min_ratio_values
    if wanted.per_channel and not existing.per_channel:
        existing.ch_axis = wanted.ch_axis
    existing.per_channel = existing.per_channel or wanted.per_channel
    existing.add_percentiles(wanted.percentiles)
    return True


class ModelReportError(ValueError, RuntimeError):
    """ModelReport methods called out of order (a ValueError, as torch.ao raises)."""


class ModelReport:
    """Diagnose a model's quantization friendliness with a set of detectors.

    `model` is an nn.Module (captured with qcore.capture on `example_inputs`) or a qcore GraphModule.
    Flow: prepare_detailed_calibration() -> run batches -> generate_model_report(...).
    Observers that several detectors want at the same place are shared: one observer computes every
    requested percentile.
    """

    def __init__(self, model: nn.Module, detectors: Iterable[DetectorBase], example_inputs: Any = None) -> None:
        detectors = list(detectors)
        if not detectors:
            raise ValueError("ModelReport needs at least one detector")
        names = [d.get_detector_name() for d in detectors]
        if len(set(names)) != len(names):
            raise ValueError(f"detector names must be unique, got {names}")
        if not isinstance(model, fx.GraphModule):
            if example_inputs is None:
                raise ValueError("pass example_inputs to capture an nn.Module (or pass a qcore GraphModule)")
            model = capture(model, example_inputs, fold_bn=False)  # torch.ao reports on the unfused model
        self._model: fx.GraphModule = model
        self._desired_report_detectors = detectors
        self._desired_detector_names = set(names)
        self._detector_name_to_observer_fqns: dict[str, set[str]] = {name: set() for name in names}
        self._prepared_flag = False
        self._removed_observers = False
        self._generated_reports: dict[str, dict] = {}

    def get_desired_reports_names(self) -> set[str]:
        """Names of the requested detectors."""
        return set(self._desired_detector_names)

    def get_observers_of_interest(self) -> dict[str, set[str]]:
        """Detector name -> names of the observers it reads."""
        return {k: set(v) for k, v in self._detector_name_to_observer_fqns.items()}

    @property
    def model(self) -> fx.GraphModule:
        """The GraphModule observers are inserted into."""
        return self._model

    def prepare_detailed_calibration(self, recompile: bool = True) -> fx.GraphModule:
        """Insert every detector's observers (sharing equal ones) and return the model to calibrate
        (recompile=False: the caller recompiles it after its own edits)."""
        if self._prepared_flag:
            raise ModelReportError("prepare_detailed_calibration was already called on this ModelReport; "
                                   "calibrate and generate the report next")
        shared: dict[tuple, list[ReportObserver]] = {}
        for detector in self._desired_report_detectors:
            points = detector.determine_observer_insert_points(self._model)
            self._detector_name_to_observer_fqns[detector.get_detector_name()] = set(points)
            by_experts: dict[tuple, list[tuple[str, int, nn.Module]]] = {}
            for name, point in points.items():
                observed = point[DETECTOR_OBS_ARGS_KEY][0]
                observer = point[DETECTOR_OBS_TO_INSERT_KEY]
                if DETECTOR_EXPERT_KEY in point:  # one expert of a grouped projection: gathered below
                    expert, counts = point[DETECTOR_EXPERT_KEY]
                    if isinstance(observer, ReportObserver):  # shared as a layer's are (gate and up read one row)
                        candidates = shared.setdefault((observed, point[DETECTOR_IS_POST_OBS_KEY], counts, expert), [])
                        existing = next((o for o in candidates if _merge(o, observer)), None)
                        if existing is not None:
                            self._model.add_submodule(name, existing)  # an alias for the detector to find
                            continue
                        candidates.append(observer)
                    key = (observed, point[DETECTOR_IS_POST_OBS_KEY], counts, point[DETECTOR_TARGET_NODE_KEY])
                    by_experts.setdefault(key, []).append((name, expert, observer))
                    continue
                if isinstance(observer, ReportObserver):
                    candidates = shared.setdefault((observed, point[DETECTOR_IS_POST_OBS_KEY]), [])
                    existing = next((o for o in candidates if _merge(o, observer)), None)
                    if existing is not None:
                        self._model.add_submodule(name, existing)  # an alias for the detector to find
                        continue
                    candidates.append(observer)
                self._insert(name, observer, observed, point[DETECTOR_TARGET_NODE_KEY])
            for (observed, _, counts, reader), members in by_experts.items():
                self._insert_experts(detector.get_detector_name(), members, observed, counts, reader)
        if recompile:
            self._model.recompile()
        self._prepared_flag = True
        return self._model

    def _insert(self, name: str, observer: nn.Module, observed: fx.Node, reader: fx.Node | None = None) -> None:
        self._model.add_submodule(name, observer)
        with self._model.graph.inserting_after(observation_point(observed, reader)):
            node = self._model.graph.call_module(name, (observed,))
        node.meta[INSERTED_KEY] = "report"

    def _insert_experts(self, detector: str, members: list[tuple[str, int, nn.Module]], observed: fx.Node,
                        counts: fx.Node, reader: fx.Node) -> None:
        """One call of the experts' observers on the rows by expert (ExpertsReportObservers), each observer also
        registered under its own name, where the detector finds it as on the per-expert graph."""
        experts = int(counts.meta["val"].shape[0]) if "val" in counts.meta else 1 + max(e for _, e, _ in members)
        wrapper = ExpertsReportObservers({expert: observer for _, expert, observer in members}, experts)
        name = f"{members[0][0]}__experts"
        self._model.add_submodule(name, wrapper)
        self._detector_name_to_observer_fqns[detector].add(name)
        for member, _, observer in members:
            self._model.add_submodule(member, observer)
        anchor = max(observation_point(observed, reader), counts)
        with self._model.graph.inserting_after(anchor):
            node = self._model.graph.call_module(name, (observed, counts))
        node.meta[INSERTED_KEY] = "report"

    def _check_ready(self, action: str) -> None:
        if not self._prepared_flag:
            raise ModelReportError(f"cannot {action} before prepare_detailed_calibration() and calibration")
        if self._removed_observers:
            raise ModelReportError(f"cannot {action}: the observers were removed by "
                                   "generate_model_report(remove_inserted_observers=True)")

    def generate_model_report(self, remove_inserted_observers: bool) -> dict[str, tuple[str, dict]]:
        """{detector name: (text report, {layer fqn: {feature: value}})}; observer state is left untouched."""
        self._check_ready("generate a report")
        reports = {d.get_detector_name(): d.generate_detector_report(self._model)
                   for d in self._desired_report_detectors}
        self._generated_reports = {name: report[1] for name, report in reports.items()}
        if remove_inserted_observers:
            self._remove_observers()
        return reports

    def _remove_observers(self) -> None:
        for node in list(self._model.graph.nodes):
            if node.meta.get(INSERTED_KEY) == "report":
                self._model.graph.erase_node(node)
        for names in self._detector_name_to_observer_fqns.values():
            for name in names:
                if hasattr(self._model, name):
                    delattr(self._model, name)
        self._model.recompile()
        self._removed_observers = True

    def generate_visualizer(self):
        """A ModelReportVisualizer over the last generated report."""
        from qcore.report.visualizer import ModelReportVisualizer

        if not self._generated_reports:
            raise ModelReportError("generate_model_report() must run before generate_visualizer()")
        merged: dict[str, dict[str, Any]] = {}
        for report in self._generated_reports.values():
            for fqn, features in report.items():
                merged.setdefault(fqn, {}).update(features)
        return ModelReportVisualizer(merged)

    def _combined_info(self) -> dict[str, DetectorQConfigInfo]:
        self._check_ready("generate a mapping")
        combined: dict[str, DetectorQConfigInfo] = {}
        for detector in self._desired_report_detectors:
            for fqn, info in detector.get_qconfig_info(self._model).items():
                entry = combined.setdefault(fqn, DetectorQConfigInfo(fqn))
                entry.is_activation_dynamic |= info.is_activation_dynamic
                entry.is_weight_per_channel |= info.is_weight_per_channel
                entry.is_equalization_recommended |= info.is_equalization_recommended
        return combined

    def generate_qconfig_mapping(self) -> dict[str, dict[str, bool]]:
        """Per-layer overrides {fqn: {"per_channel": bool, "is_dynamic": bool}}, for
        Int8StaticQuantizer(layer_overrides=...)."""
        return {fqn: info.as_override() for fqn, info in self._combined_info().items()}

    def generate_equalization_mapping(self) -> dict[str, dict[str, bool]]:
        """{fqn: {"equalize": True}} for the layers where input-weight equalization is recommended."""
        if not any(isinstance(d, InputWeightEqualizationDetector) for d in self._desired_report_detectors):
            raise ModelReportError("generate_equalization_mapping needs an InputWeightEqualizationDetector")
        return {fqn: {"equalize": True} for fqn, info in self._combined_info().items()
                if info.is_equalization_recommended}
