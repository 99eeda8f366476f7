"""Probes: what watches the calibration pass besides the quantizer's own observers. Each probe attaches its
observers to the prepared graph, reads what they saw once calibration is over, and detaches them before the
graph is converted, so that one calibration pass feeds every measurement of a model (see measure.py)."""
from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from qcore.graph.ops import INSERTED_KEY, observation_point
from qcore.report import ModelReport
from qcore.report.detectors import DetectorBase

__all__ = ["ChannelStatisticsProbe", "DetectorProbe", "Probe"]


class Probe(abc.ABC):
    """attach() before calibration, read() after it (results stay on the probe), detach() before convert."""

    @abc.abstractmethod
    def attach(self, prepared: fx.GraphModule) -> None:
        """Insert the probe's observers into the prepared graph (the caller recompiles it once for all)."""

    def read(self, prepared: fx.GraphModule) -> None:
        """Read what the observers saw (default: nothing to read; the observers hold it)."""

    @abc.abstractmethod
    def detach(self, prepared: fx.GraphModule) -> None:
        """Remove the probe's observers from the graph (convert recompiles it once for all)."""


class DetectorProbe(Probe):
    """ModelReport's detectors on the shared calibration pass; `reports` is {key: {layer: raw entry}} once read."""

    def __init__(self, detectors: Mapping[str, DetectorBase]) -> None:
        self.detectors = dict(detectors)
        self.reports: dict[str, dict[str, Any]] = {}
        self._report: ModelReport | None = None

    def attach(self, prepared: fx.GraphModule) -> None:
        self._report = ModelReport(prepared, list(self.detectors.values()))
        self._report.prepare_detailed_calibration(recompile=False)

    def read(self, prepared: fx.GraphModule) -> None:
        assert self._report is not None, "read() before attach()"
        reports = self._report.generate_model_report(remove_inserted_observers=False)
        self.reports = {key: dict(reports.get(detector.get_detector_name(), ("", {}))[1])
                        for key, detector in self.detectors.items()}

    def detach(self, prepared: fx.GraphModule) -> None:
        assert self._report is not None, "detach() before attach()"
        for node in [n for n in prepared.graph.nodes if n.meta.get(INSERTED_KEY) == "report"]:
            prepared.graph.erase_node(node)
        for name in set().union(*self._report.get_observers_of_interest().values()):
            if hasattr(prepared, name):
                delattr(prepared, name)


class ChannelStatisticsProbe(Probe):
    """One observer of one activation's channel ranges, for an equalization or smoothing variant.

    kind: "input_weight" (key: the QuantizableOp), "grouped_input_weight" (key: (a grouped projection's
    QuantizableOp, the experts wanted); the observer: its rows' ranges by expert) or "smoothing" (key: the
    SmoothingGroup). With `node` None the observer is another probe's (the input-weight equalization detector's,
    say) and nothing is inserted."""

    def __init__(self, kind: str, key: Any, observer: torch.nn.Module, node: fx.Node | None = None,
                 name: str = "", reads: tuple[fx.Node, ...] = ()) -> None:
        """`reads`: what else the observer is called with (a grouped projection's counts of rows by expert)."""
        self.kind, self.key, self.observer = kind, key, observer
        self._watched, self._name, self._reads = node, name, reads
        self._call: fx.Node | None = None

    def attach(self, prepared: fx.GraphModule) -> None:
        if self._watched is None:
            return
        prepared.add_submodule(self._name, self.observer)
        anchor = observation_point(self._watched)
        if self._reads:  # after what else it reads, too
            order = {node: index for index, node in enumerate(prepared.graph.nodes)}
            anchor = max([anchor, *self._reads], key=lambda node: order[node])
        with prepared.graph.inserting_after(anchor):
            self._call = prepared.graph.call_module(self._name, (self._watched, *self._reads))
        self._call.meta[INSERTED_KEY] = "equalization_observer"

    def detach(self, prepared: fx.GraphModule) -> None:
        if self._call is not None:
            prepared.graph.erase_node(self._call)
            delattr(prepared, self._name)
            self._call = None
