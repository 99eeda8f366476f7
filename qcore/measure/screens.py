"""Screens: a fix's own SQNR on the layers a detector names, measured inside the model's comparison pass.

A detector's heuristic names layers after the calibration pass (its observers watch that pass), and its fix is a
per-layer quantizer change (`layer_overrides`). A screen quantizes the model with that change on the named layers
(its new activation observers calibrated in one more pass; those it shares with the model's are taken as they
are), and the comparison pass that follows runs each named layer of that quantized copy on its float input as
one more shadow: each layer's own SQNR with the fix, over every batch, exactly as a separate trial of the same
quantizer would measure it, without that trial's float and quantized passes (to the last bit of a row's sums
where a large weight's few rows run in one matmul with the layer's own shadow: pair_shadow_matmuls). Only the named
layers' weights are quantized in the copy.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import fx

from qcore.graph.capture import clone_graph_module, graph_view
from qcore.graph.ops import INSERTED_KEY, find_quantizable_ops, observation_point, original_input
from qcore.measure.probes import Probe
from qcore.numeric.instrument import QPARAMS_DIGEST_KEY, qparams_digest
from qcore.quantization.calibrated import CalibratedObservers, calibrate_kept, observer_calls
from qcore.quantization.convert import QPARAMS_KEY, convert, restore_model_state
from qcore.quantization.prepare import prepare
from qcore.quantization.quantizer import Quantizer, with_layer_overrides
from qcore.runtime.progress import trial_step, trials_allowed

__all__ = ["HeadSearch", "ObserversAhead", "Screen", "ScreenedLayers", "quantize_for_screen", "screened_ladder",
           "screened_within_budget", "shortest_head"]


def screened_ladder(pool: Sequence[str], alone: Mapping[str, float], base: float, higher: bool = True) -> list[str]:
    """The order a float_layers search tries `pool` (its candidates, largest own error first) in: the layers
    measured to help when kept in float alone (`alone`: {layer: the metric then}, against `base` with none), the
    most first, then the others in the pool's order. A layer may help only with another in float (its error
    hidden behind the other's), so none is dropped."""
    def value(name: str) -> float:
        return alone.get(name, math.nan)

    helping = [name for name in pool if not math.isnan(value(name)) and (value(name) > base if higher
                                                                          else value(name) < base)]
    helping.sort(key=lambda name: -value(name) if higher else value(name))  # stable: pool order among equals
    return helping + [name for name in pool if name not in helping]


def screened_within_budget(names: Sequence[str], measure: Callable[[str], float]) -> tuple[dict[str, float], bool]:
    """({name: measure(name)} for `names` in their order, most promising first, until the fix budget left holds no
    more than the whole-model trial that follows the screen; whether it stopped there)."""
    found: dict[str, float] = {}
    for name in names:
        if not trials_allowed(whole=True):  # the confirmation that follows a screen, kept in hand
            return found, True
        found[name] = measure(name)
    return found, False


class HeadSearch(NamedTuple):
    """What shortest_head found: the head, how many screens and confirmations ran, and whether the fix budget
    stopped the bisection (the head is then the shortest that met the screen so far, confirmed all the same)."""

    head: list[str]
    screened: int
    confirmed: int
    stopped: bool = False


def shortest_head(ladder: Sequence[str], screen: Callable[[list[str]], bool], confirm: Callable[[list[str]], bool]
                  ) -> HeadSearch:
    """The shortest head of `ladder` (candidates, best first) that meets a target on a screen and on every batch,
    else the whole ladder. `screen(head)` and `confirm(head)` say whether keeping `head` in float meets the target on
    the screen's batches and on every batch. Keeping more layers in float is taken not to make the output worse, so
    the head is found by bisection on the screen; every head returned is confirmed, and one that meets the target
    only on the screen is not returned for one that does. When the fix budget left no longer holds the costliest
    whole-model trial so far (trials_allowed(whole=True): the confirmation to come), the bisection stops at the
    shortest head that met the screen so far, which is confirmed and returned; when it is
    out before the first screen, the whole ladder is confirmed and returned; when it does not hold the whole
    ladder's confirmation after the head's fell short, the head is returned as measured."""
    ladder = list(ladder)
    if not ladder:
        return HeadSearch([], 0, 0)

    def confirmed(head: list[str]) -> bool:  # a whole-model trial: the budget keeps one in hand for the next
        with trial_step():
            return confirm(head)

    if not trials_allowed():  # no screen within the budget: the whole ladder, the most the fix may keep, measured
        confirmed(ladder)
        return HeadSearch(ladder, 0, 1, stopped=True)
    if not screen(ladder):  # no head meets it on the screen: the whole ladder is the best found
        confirmed(ladder)
        return HeadSearch(ladder, 1, 1)
    low, high, screened, stopped = 1, len(ladder), 1, False
    while low < high:
        if not trials_allowed(whole=True):  # the confirmation to come, kept in hand
            low, stopped = high, True  # `high` is the shortest head that met the screen
            break
        middle = (low + high) // 2
        screened += 1
        if screen(ladder[:middle]):
            high = middle
        else:
            low = middle + 1
    if confirmed(ladder[:low]) or low == len(ladder) or stopped:
        return HeadSearch(ladder[:low], screened, 1, stopped)
    if not trials_allowed(whole=True):  # the head, measured short of the target, is what the budget found
        return HeadSearch(ladder[:low], screened, 1, stopped=True)
    confirmed(ladder)  # the screen's head falls short on every batch: the whole ladder, measured
    return HeadSearch(ladder, screened, 2)


@dataclass(frozen=True)
class Screen:
    """A fix to screen: `candidates(reports)` gives {layer: its layer_overrides change} from the detectors'
    reports ({detector key: {layer: raw entry}}) of the calibration pass. `ahead`, for a fix that adds activation
    observers, is every change it may make ({layer: change}): their observers then watch the model's calibration
    pass (ObserversAhead), so the screen's quantized copy needs no calibration pass of its own."""

    name: str
    candidates: Callable[[Mapping[str, Mapping[str, Any]]], Mapping[str, Mapping[str, Any]]] = field(compare=False)
    ahead: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ScreenedLayers:
    """What a screen measured: the changes it made ({layer: change}) and each changed layer's own SQNR with them
    (dB, float input, every batch); `shadows` holds each one's (shadow_signature, shadow record), which a later
    pass over the same float graph and batches takes instead of running the same shadow again."""

    changes: Mapping[str, Mapping[str, Any]]
    own_sqnr_db: Mapping[str, float]
    shadows: Mapping[str, tuple[tuple | None, Mapping[str, float]]] = field(default_factory=dict, compare=False,
                                                                             repr=False)


def quantize_for_screen(float_gm: fx.GraphModule, batches: list[Any], quantizer: Quantizer,
                        changes: Mapping[str, Mapping[str, Any]], observers: CalibratedObservers,
                        model_quantized: fx.GraphModule | None = None) -> fx.GraphModule:
    """`float_gm` quantized with `changes` merged into `quantizer`'s layer_overrides, calibrated where `observers`
    has no twin of an activation observer, with only the changed layers' weights quantized (the others stay
    float: the screen copies the changed layers only). A weight that `model_quantized` (the model's converted
    graph of `float_gm`) quantized the same way is shared from it, not quantized again. ValueError for a quantizer
    without layer_overrides."""
    changed = with_layer_overrides(quantizer, {layer: dict(change) for layer, change in changes.items()})
    prepared = prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False), changed,
                       recompile=False)
    _unobserve_other_weights(prepared, set(changes))
    calibrate_kept(prepared, batches, observers)  # the observers ahead calibrated most screens: no pass
    quantized = convert(prepared, keep_float_weights=False, recompile=False, weights_from=model_quantized)
    restore_model_state(quantized, float_gm)  # calibration ran forward, which may update buffers in place
    for node in quantized.graph.nodes:  # a float per weight channel, held once (the model's); a digest tells them
        digest = qparams_digest(node)
        if digest is not None:
            node.meta[QPARAMS_DIGEST_KEY] = digest
        node.meta.pop(QPARAMS_KEY, None)
    return quantized


def _unobserve_other_weights(prepared: fx.GraphModule, layers: set[str]) -> None:
    """Feed the unchanged layers their float weights, so that convert quantizes the changed layers' only."""
    observers: dict[fx.Node, bool] = {}  # weight observer node: whether a changed layer reads it
    for op in find_quantizable_ops(prepared):
        for node in op.node.all_input_nodes:
            if node.meta.get(INSERTED_KEY) == "observer" and op.weight is not None and \
                    original_input(node) is op.weight:
                observers[node] = observers.get(node, False) or op.layer in layers
    for observer, read_by_changed_layer in observers.items():
        if not read_by_changed_layer:
            observer.replace_all_uses_with(observer.args[0])
            prepared.graph.erase_node(observer)


class ObserversAhead(Probe):
    """The activation observers that screens' fixes may add (each screen's `ahead` changes, all at once), watching
    the model's calibration pass beside its own observers. Once read they are kept in `observers`: a screen's copy
    that makes some of those changes takes their states wherever union-find grouped its observers the same way (the
    same values, class and settings), and calibrates only the others. An observer sees the same values in the same
    order as in a pass of its own, so it ends in the same state."""

    def __init__(self, float_gm: fx.GraphModule, quantizer: Quantizer, screens: Sequence[Screen],
                 observers: CalibratedObservers) -> None:
        self.float_gm, self.quantizer, self.observers = float_gm, quantizer, observers
        self.screens = [screen for screen in screens if screen.ahead]
        self._attached: list[tuple[str, str, list[fx.Node]]] = []  # (submodule name, signature, its call nodes)

    def attach(self, prepared: fx.GraphModule) -> None:
        own = set(self.observers.signatures(prepared).values())
        nodes = {node.name: node for node in prepared.graph.nodes}
        order = {node: index for index, node in enumerate(prepared.graph.nodes)}
        for screen in self.screens:
            try:
                changed = with_layer_overrides(self.quantizer, {layer: dict(c) for layer, c in screen.ahead.items()})
                # read for its observers, never run: a view of the float graph, not a copy of its module tree
                ahead = prepare(graph_view(self.float_gm), changed, recompile=False)
            except Exception:  # noqa: BLE001 - observers ahead only save a pass: the screen calibrates its own
                continue
            calls = {name: [[getattr(arg, "name", arg) for arg in call] for call in found]
                     for name, found in observer_calls(ahead).items()}
            for name, signature in self.observers.signatures(ahead).items():
                if signature is None or signature in own or signature in self.observers or \
                        not all(arg in nodes for call in calls[name] for arg in call if isinstance(arg, str)):
                    continue
                own.add(signature)
                target = f"qcore_ahead_{len(self._attached)}"
                prepared.add_submodule(target, ahead.get_submodule(name))
                inserted = []
                for value, *rest in calls[name]:  # the watched value, then what else the observer reads (counts)
                    args = (nodes[value], *(nodes[arg] if isinstance(arg, str) else arg for arg in rest))
                    # where prepare puts one: after the value, and after what else it reads
                    anchor = max([observation_point(nodes[value]), *(a for a in args[1:] if isinstance(a, fx.Node))],
                                 key=lambda node: order[node])
                    with prepared.graph.inserting_after(anchor):
                        inserted.append(prepared.graph.call_module(target, args))
                    inserted[-1].meta[INSERTED_KEY] = "observer_ahead"
                self._attached.append((target, signature, inserted))

    def read(self, prepared: fx.GraphModule) -> None:
        for target, signature, _ in self._attached:  # detached next: nothing calls them again
            self.observers.adopt(signature, prepared.get_submodule(target), done=True)

    def detach(self, prepared: fx.GraphModule) -> None:
        for target, _, inserted in self._attached:
            for node in inserted:
                prepared.graph.erase_node(node)
            delattr(prepared, target)
        self._attached = []
