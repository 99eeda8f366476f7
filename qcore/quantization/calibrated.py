"""Calibrated activation observers kept for the configurations of the same float model that follow.

A fix trial quantizes the same float graph on the same batches under another quantizer. Its activation observers
that watch the same values with the same settings as an observer already calibrated would end in the same state,
so they take that state instead of watching the batches again; when every one of them does, the trial needs no
calibration pass at all. Only observers whose state is what they saw are kept (the range and histogram observers
and a format's amax), never one that derives its qparams from others or a user's own observer class.
"""
from __future__ import annotations

import copy

import torch
from torch import fx, nn

from qcore.graph.ops import INSERTED_KEY, is_weight_value, original_input
from qcore.observe.observers import (
    DerivedObserver,
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
    copied,
    share_qparams,
)
from qcore.observe.segmented import PerExpertObservers, SegmentedMinMaxObserver, SegmentedMovingAverageMinMaxObserver
from qcore.quantization.calibrate import calibrate
from qcore.quantization.format_quantizer import FormatObserver

__all__ = ["CalibratedObservers", "calibrate_kept", "observer_calls", "watched_values"]

_STATEFUL = (MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver, HistogramObserver,
             FormatObserver, SegmentedMinMaxObserver, SegmentedMovingAverageMinMaxObserver)
# what an observer is told rather than sees: the experts convert leaves in float or quantizes from each batch's own
# range, whose statistics it keeps all the same (an observer given others takes the same state, keeping its own)
_NOT_STATE = frozenset({"training", "float_experts", "dynamic_experts"})
_STATELESS = (PlaceholderObserver, FixedQParamsObserver, DerivedObserver)


def watched_values(prepared: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """{observer module name: the original values it watches, in the order the graph calls it on them}."""
    return {name: [call[0] for call in calls] for name, calls in observer_calls(prepared).items()}


def observer_calls(prepared: fx.GraphModule) -> dict[str, list[tuple[fx.Node, ...]]]:
    """{observer module name: the arguments of each of its calls, in graph order}: the original value it watches,
    then what else it reads (an observer of a grouped projection's experts: the counts of their rows)."""
    calls: dict[str, list[tuple[fx.Node, ...]]] = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and node.meta.get(INSERTED_KEY) == "observer":
            calls.setdefault(str(node.target), []).append((original_input(node.args[0]), *node.args[1:]))
    return calls


def _settings(observer: nn.Module) -> list:
    """An observer's class and settings, and those of the observers it holds (one per expert), for its signature."""
    own = sorted((key, repr(value)) for key, value in vars(observer).items()
                 if not key.startswith("_") and key not in _NOT_STATE)
    held = [_settings(child) for child in observer.children() for child in
            (child if isinstance(child, nn.ModuleList) else [child])]
    return [type(observer).__qualname__, own, *held]


def _keepable(observer: nn.Module) -> bool:
    """Whether an observer's state is what it saw (and so is one observer's of the same values and settings): the
    range and histogram observers, of every expert at once or one per expert."""
    if isinstance(observer, PerExpertObservers):
        return all(type(child) in _STATEFUL for child in observer.per_expert)
    return type(observer) in _STATEFUL


class CalibratedObservers:
    """Calibrated activation observers of one float graph and batch set, by what they watch and how."""

    def __init__(self) -> None:
        self._states: dict[str, nn.Module] = {}
        self._snapshots: set[str] = set()  # signatures whose kept state nothing calls: keep()'s copies, done ones

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, signature: object) -> bool:
        return signature in self._states

    def signatures(self, prepared: fx.GraphModule) -> dict[str, str | None]:
        """{observer module name: signature} of the prepared graph's activation observers, read before calibration:
        the values they watch (original node names) and their class and settings; None for one that cannot be kept
        (a user's own observer class). Observers with no state to calibrate are left out."""
        found: dict[str, str | None] = {}
        for name, calls in observer_calls(prepared).items():
            observer = prepared.get_submodule(name)
            if isinstance(observer, _STATELESS) or any(is_weight_value(call[0]) for call in calls):
                continue  # weights are observed at prepare, once: nothing to keep
            if not _keepable(observer):
                found[name] = None
                continue
            watched = [call[0].name if len(call) == 1 else tuple(getattr(a, "name", repr(a)) for a in call)
                       for call in calls]
            settings = _settings(observer)
            found[name] = repr((settings[0], watched, *settings[1:]))
        return found

    def take(self, prepared: fx.GraphModule, signatures: dict[str, str | None]) -> list[str]:
        """Give each observer of `signatures` that has a kept twin its twin's state, frozen so that calibration
        passes it by; returns the names of those still to calibrate. A kept state nothing calls any more shares its
        tensors, not copies: neither it nor the frozen observer writes them again (a live one's are copied)."""
        missing = []
        for name, signature in signatures.items():
            kept = None if signature is None else self._states.get(signature)
            if kept is None:
                missing.append(name)
                continue
            observer = prepared.get_submodule(name)
            shared = signature in self._snapshots
            for key, buffer in kept._buffers.items():
                observer._buffers[key] = None if buffer is None else _taken(buffer, shared)
            for key, value in vars(kept).items():
                if not key.startswith("_") and key not in _NOT_STATE:
                    setattr(observer, key, _taken(value, shared) if isinstance(value, torch.Tensor) else
                            copy.copy(value))
            for key, child in kept._modules.items():  # one observer per expert: each expert's state
                observer._modules[key] = child if shared else copied(child)
            observer.frozen = True
            share_qparams(observer, kept)
        return missing

    def adopt(self, signature: str, observer: nn.Module, done: bool = False) -> None:
        """Keep `observer`, calibrated elsewhere, as the state of `signature` (its signature in another prepared
        graph of the same float graph); a signature kept already keeps its state. done=True: no graph calls the
        observer any more (its caller detached it), so observers that take its state share its tensors."""
        if signature not in self._states:
            self._states[signature] = observer
            if done:
                self._snapshots.add(signature)

    def keep(self, prepared: fx.GraphModule, signatures: dict[str, str | None]) -> None:
        """After calibration: keep a copy of each observer of `signatures` not kept yet."""
        for name, signature in signatures.items():
            if signature is not None and signature not in self._states:
                observer = prepared.get_submodule(name)
                self._states[signature] = copied(observer)
                self._snapshots.add(signature)
                share_qparams(observer, self._states[signature])


def _taken(value: torch.Tensor, shared: bool) -> torch.Tensor:
    """A kept state's tensor as an observer takes it: itself where nothing writes it again, else a copy."""
    return value if shared else value.clone()


def calibrate_kept(prepared: fx.GraphModule, batches: list, observers: CalibratedObservers | None) -> None:
    """Calibrate `prepared` on `batches` (a float graph's prepared copy, its code not generated yet:
    prepare(..., recompile=False)), its activation observers that `observers` holds taking their kept state instead:
    no pass when it holds every one, and then no code generated (convert generates the code that runs). Those
    calibrated are kept in it."""
    signatures = observers.signatures(prepared) if observers is not None else {}
    if observers is None or observers.take(prepared, signatures):
        prepared.recompile()
        calibrate(prepared, batches)
        if observers is not None:
            observers.keep(prepared, signatures)
