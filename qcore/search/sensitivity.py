"""Per-layer sensitivity, and a verified set of layers to keep in float.

One prepared and converted graph serves every measurement: each fake-quant node becomes a switch, and a
layer's switches are its input, weight and output quantizers (the observer groups its annotation asked
for). Toggling them gives the model-output SQNR with only one layer quantized, or with one layer left in
float, without re-capturing or re-preparing. Metrics stream as sums over the batches.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qcore.graph.capture import clone_graph_module
from qcore.graph.inputs import call_model, move_to
from qcore.graph.ops import INSERTED_KEY, fetch_attr, find_quantizable_ops, is_weight_value, layer_places
from qcore.measure.screens import screened_ladder, screened_within_budget, shortest_head
from qcore.numeric.metrics import signal_and_noise, sqnr_from_sums
from qcore.observe.segmented import fake_quantize_experts_where_read, fake_quantize_per_expert
from qcore.quantization.calibrate import model_device
from qcore.quantization.calibrated import CalibratedObservers, calibrate_kept
from qcore.quantization.convert import convert, restore_model_state
from qcore.quantization.prepare import prepare
from qcore.quantization.quantizer import Int8StaticQuantizer, Quantizer, with_layer_overrides
from qcore.runtime.progress import trial_step, trials_allowed
from qcore.search.resume import ResumableGraph

__all__ = ["REMEASURED_CANDIDATES", "FloatLayersFix", "FloatReference", "LayerSensitivity", "SensitivityResult",
           "SwitchableModel", "SwitchedRuns", "best_first", "find_float_layers", "layer_sensitivity",
           "measured_output_sqnr", "with_float_layers"]

_GROUP_KEY = "qcore_observer_group"


@dataclass(frozen=True)
class LayerSensitivity:
    """Model-output SQNR with only this layer quantized, and with only this layer left in float."""

    layer: str
    only_quantized_db: float
    only_float_db: float
    gain_db: float  # only_float_db minus the SQNR with every layer quantized, over the same batches
    batches: int  # the batches only_float_db and gain_db cover


@dataclass(frozen=True)
class SensitivityResult:
    """Layers ranked by how much leaving each in float helps the model's output, most first."""

    all_quantized_db: float
    layers: tuple[LayerSensitivity, ...]
    skipped: tuple[str, ...]  # quantized layers left out by the layer budget
    batches: int
    unmeasured: tuple[str, ...] = ()  # layers within the layer budget that the fix budget left unmeasured


@dataclass(frozen=True)
class FloatLayersFix:
    """A small set of layers whose float-ification reaches `target_db`, with the SQNR measured after
    re-quantizing the model with exactly that set kept in float."""

    float_layers: tuple[str, ...]
    estimated_db: float   # from the switches, during the search
    measured_db: float    # re-prepared and re-calibrated with with_float_layers(quantizer, float_layers)
    target_db: float
    reached: bool
    # with compare_with_ranking: how many layers of the ranking, taken in order, reach the target (0: not within
    # max_float_layers); None when not asked
    naive_top_k: int | None = None
    stopped: bool = False  # the fix budget ran out before the search did (the set is measured all the same)


class _Switch(nn.Module):
    """Applies one fake quantization, or passes its input through when off."""

    def __init__(self, function: Any) -> None:
        super().__init__()
        self.function, self.enabled = function, True

    def forward(self, x: Any, *args: Any) -> Any:
        return self.function(x, *args) if self.enabled else x


class _WeightSwitch(nn.Module):
    """The fake-quantized weight, or the float one when off."""

    def __init__(self, quantized: torch.Tensor, original: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("quantized", quantized, persistent=False)
        self.register_buffer("original", original, persistent=False)
        self.enabled = True

    def forward(self) -> torch.Tensor:
        return self.quantized if self.enabled else self.original


class _WhereReadWeightSwitch(nn.Module):
    """A weight quantized where it is read, by `function` from the call's arguments, or the float one when off."""

    def __init__(self, function: Any, original: torch.Tensor) -> None:
        super().__init__()
        self.function, self.enabled = function, True
        self.register_buffer("original", original, persistent=False)

    def forward(self, *args: Any) -> torch.Tensor:
        return self.function(*args) if self.enabled else self.original


class _ExpertsSwitch(nn.Module):
    """A grouped projection's fake quantization of rows by expert, for the experts switched on only: the rows of the
    others pass as they are (its kept-float mask)."""

    def __init__(self, function: Any, experts: int) -> None:
        super().__init__()
        self.function, self.experts = function, experts
        self.on: tuple[bool, ...] = (True,) * experts
        self._float: torch.Tensor | None = None  # ~on, made once a setting

    def set_experts(self, on: Sequence[bool]) -> None:
        """Which experts' rows are quantized."""
        if tuple(on) != self.on:
            self.on, self._float = tuple(on), None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, *args: Any) -> torch.Tensor:
        if not any(self.on):
            return x
        if all(self.on):
            return self.function(x, counts, *args)
        if self._float is None:
            self._float = torch.tensor([not on for on in self.on], device=x.device)
        scale, zero_point, quant_min, quant_max, kept_float, *rest = args
        kept = self._float if kept_float is None else (kept_float.to(x.device) | self._float)
        return self.function(x, counts, scale, zero_point, quant_min, quant_max, kept, *rest)


class _ExpertsWeightSwitch(nn.Module):
    """A grouped projection's quantized [E, ...] weight for the experts switched on, the float one's slices for the
    others (made once a setting)."""

    def __init__(self, quantized: torch.Tensor, original: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("quantized", quantized, persistent=False)
        self.register_buffer("original", original, persistent=False)
        self.on: tuple[bool, ...] = (True,) * quantized.shape[0]
        self._mixed: torch.Tensor | None = None

    def set_experts(self, on: Sequence[bool]) -> None:
        """Which experts' weights are quantized."""
        if tuple(on) != self.on:
            self.on, self._mixed = tuple(on), None

    def forward(self) -> torch.Tensor:
        if all(self.on):
            return self.quantized
        if not any(self.on):
            return self.original
        if self._mixed is None:
            kept = torch.tensor([expert for expert, on in enumerate(self.on) if not on], device=self.original.device)
            self._mixed = self.quantized.index_copy(0, kept, self.original.index_select(0, kept).to(
                self.quantized.dtype))
        return self._mixed


class _ExpertsWhereReadWeightSwitch(nn.Module):
    """A grouped projection's [E, ...] weight quantized where it is read (fake_quantize_experts_where_read) for the
    experts switched on, the float weight's slices for the others."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.on: tuple[bool, ...] = (True,) * experts

    def set_experts(self, on: Sequence[bool]) -> None:
        """Which experts' weights are quantized."""
        self.on = tuple(on)

    def forward(self, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                quant_max: int, kept_float: Sequence[int] = ()) -> torch.Tensor:
        if not any(self.on):
            return weight
        off = (*kept_float, *(expert for expert, on in enumerate(self.on) if not on))
        return fake_quantize_experts_where_read(weight, scale, zero_point, quant_min, quant_max, off)


class SwitchedRuns(ABC):
    """Model-output SQNR runs of a graph whose switch modules select each layer's quantization: each setting
    measured once per set of batches, and run from the values recorded before its first change (qcore.search.resume)."""

    gm: fx.GraphModule

    def _init_runs(self, float_gm: fx.GraphModule, switch_nodes: list[fx.Node], resume: bool) -> None:
        self.reference = FloatReference(float_gm)
        # (switch setting, batch id) -> that batch's (signal, noise) sums per output leaf
        self._sums: dict[tuple, list[torch.Tensor]] = {}
        self._resumable = ResumableGraph(self.gm, switch_nodes if resume else [], self._switch_state)

    @abstractmethod
    def _switch_state(self) -> list[Any]:
        """One hashable per switch node, in their order: what each selects now."""

    def run(self, batches: Iterable[Any]) -> float:
        """Model-output SQNR (dB) against the float graph over `batches`, worst output leaf.

        Every setting is compared with the same float outputs, so those are computed once per batch and kept (the
        output leaves of the batches measured: 2 batches by default in the searches). A run after record() starts
        each batch from the values recorded before the first layer whose switches differ from the recorded
        setting. A setting measured before on a batch is not run on it again: its sums are kept per batch, so a
        setting estimated on one batch and then measured on two runs the second batch only (the float_layers
        search's ranking and the sensitivity check's share their one-layer-in-float runs).
        """
        return self._measure(list(batches), record=False)

    def record(self, batches: Iterable[Any]) -> float:
        """run(), keeping the values later runs of the same batches can start from (the last two settings)."""
        return self._measure(list(batches), record=True)

    def best_measured(self, settings: Mapping[str, Callable[[], None]], batches: list[Any], remeasured: int,
                      best_first: Callable[[list[tuple[float, str]]], list[tuple[float, str]]]
                      ) -> list[tuple[float, str]]:
        """(SQNR over `batches`, name) of the `remeasured` settings whose SQNR on the first batch is best, sorted by
        `best_first`; `settings` are {name: a function that sets the switches}. The others run on the first batch
        only: a search estimates every candidate there and measures the promising ones on every batch."""
        estimates = []
        for name, apply in settings.items():
            apply()
            estimates.append((self.run(batches[:1]), name))
        measured = []
        for _, name in best_first(estimates)[:remeasured]:
            settings[name]()
            measured.append((self.run(batches), name))
        return best_first(measured)

    def _measure(self, batches: list[Any], record: bool) -> float:
        state = tuple(self._switch_state())
        step = self._resumable.record if record else self._resumable.run
        per_batch = []
        for batch in batches:
            # batches are kept by the float reference once measured, so their ids stay theirs
            key = (state, id(batch))
            if key not in self._sums or (record and not self._resumable.recorded(id(batch))):
                self._sums[key] = self.reference.batch_sums(self.gm, batch,
                                                             lambda batch, moved: step(id(batch), moved))
            per_batch.append(self._sums[key])
        return _worst_output_sqnr(per_batch)

    def forget(self) -> None:
        """Drop what record() kept."""
        self._resumable.forget()


class SwitchableModel(SwitchedRuns):
    """A quantized copy of a float graph whose layers' quantizers can be switched on and off."""

    def __init__(self, float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: Quantizer | None = None, *,
                 resume: bool = True, observers: CalibratedObservers | None = None) -> None:
        """resume=False: every run computes the whole graph (qcore.search.resume otherwise). `observers`: the
        activation observers calibrated earlier on this graph and these batches, whose states are taken instead of
        calibrating again."""
        prepared = prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False),
                           quantizer or Int8StaticQuantizer(), recompile=False)
        owners = _group_owners(prepared)
        expert_owners = _expert_owners(prepared)
        calibrate_kept(prepared, list(batches), observers)
        self.gm = convert(prepared)
        restore_model_state(self.gm, float_gm)
        self.float_gm = float_gm
        order = layer_places(find_quantizable_ops(prepared, grouped=True))
        self.layers = sorted(dict.fromkeys(
            [*(name for names in owners.values() for name in names),
             *(name for experts in expert_owners.values() for names in experts for name in names)]),
            key=lambda name: order.get(name, (len(order), 0, 0)))
        # in graph order, as the switch nodes: a layer's quantizer, on when one of `owners` is quantized; or a grouped
        # projection's, one switch of every expert's, each expert on when one of its own layers is
        self._switches: list[tuple[Any, frozenset[str] | list[frozenset[str]]]] = []
        self._init_runs(float_gm, self._install(owners, expert_owners), resume)

    def _install(self, owners: dict[str, set[str]], expert_owners: dict[str, list[set[str]]]) -> list[fx.Node]:
        graph = self.gm.graph
        nodes = []
        for index, node in enumerate(list(graph.nodes)):
            if node.meta.get(INSERTED_KEY) != "qdq":
                continue
            name = f"qcore_switch_{index}"
            experts = expert_owners.get(node.meta.get(_GROUP_KEY, ""))
            if experts is not None and (node.op == "get_attr" or node.target in (
                    fake_quantize_per_expert, fake_quantize_experts_where_read)):
                switch_of_experts: Any
                experts_args: tuple = ()
                if node.target is fake_quantize_experts_where_read:
                    switch_of_experts, experts_args = _ExpertsWhereReadWeightSwitch(len(experts)), node.args
                elif node.op == "get_attr":
                    original = node.meta.get("qcore_float_weight")
                    if original is None:
                        continue
                    switch_of_experts = _ExpertsWeightSwitch(fetch_attr(self.gm, str(node.target)),
                                                             fetch_attr(self.gm, original))
                else:
                    switch_of_experts, experts_args = _ExpertsSwitch(node.target, len(experts)), node.args
                nodes.append(self._replace(node, name, switch_of_experts, experts_args))
                self._switches.append((switch_of_experts, [frozenset(names) for names in experts]))
                continue
            if experts is not None:  # quantized otherwise (where read): on when any of its experts is
                owners = {**owners, node.meta[_GROUP_KEY]: {name for names in experts for name in names}}
            if is_weight_value(node):
                original = node.meta.get("qcore_float_weight")
                if original is None:
                    continue
                if node.op == "get_attr":
                    switch: nn.Module = _WeightSwitch(fetch_attr(self.gm, str(node.target)),
                                                      fetch_attr(self.gm, original))
                    args: tuple = ()
                else:  # quantized where it is read (quantize_weights_where_read): when on
                    switch, args = _WhereReadWeightSwitch(node.target, fetch_attr(self.gm, original)), node.args
            else:
                switch, args = _Switch(node.target), node.args
            nodes.append(self._replace(node, name, switch, args))
            self._switches.append((switch, frozenset(owners.get(node.meta.get(_GROUP_KEY, ""), ()))))
        graph.lint()
        self.gm.recompile()
        return nodes

    def _replace(self, node: fx.Node, name: str, switch: nn.Module, args: tuple) -> fx.Node:
        """`node` (a quantization) replaced by a call of `switch`, held as submodule `name`, on `args`."""
        graph = self.gm.graph
        self.gm.add_submodule(name, switch)
        with graph.inserting_before(node):
            replacement = graph.call_module(name, args)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        return replacement

    def quantize_only(self, quantized: Iterable[str]) -> None:
        """Switch on the quantizers of `quantized` layers only (a quantizer shared by several layers is on
        when any of them is; quantizers no layer owns, such as an add's output, are on when most layers are)."""
        chosen = set(quantized)
        majority = len(chosen) * 2 > len(self.layers)
        for switch, owners in self._switches:
            if isinstance(owners, list):  # each expert's
                switch.set_experts([bool(names & chosen) for names in owners])
            else:
                switch.enabled = bool(owners & chosen) if owners else majority

    def _switch_state(self) -> list[Any]:
        return [switch.on if isinstance(owners, list) else switch.enabled for switch, owners in self._switches]


class FloatReference:
    """A float graph's output leaves per batch, computed on first use and kept, against which quantized copies'
    outputs are measured."""

    def __init__(self, float_gm: fx.GraphModule) -> None:
        self.float_gm = float_gm
        self._references: dict[int, tuple[Any, Any, list[torch.Tensor]]] = {}

    def batch_sums(self, gm: fx.GraphModule, batch: Any, run: Callable[[Any, Any], Any] | None = None
                   ) -> list[torch.Tensor]:
        """The (signal, noise) sums of each output leaf of `gm` against the float graph on one batch."""
        if id(batch) not in self._references:  # the batch is kept too, so its id cannot be reused
            self._references[id(batch)] = (batch, *self._float_run(batch))
        _, moved, reference = self._references[id(batch)]
        return _output_sums(gm, batch, moved, reference, run)

    def unkept_batch_sums(self, gm: fx.GraphModule, batch: Any) -> list[torch.Tensor]:
        """batch_sums of `gm` run whole; the float outputs of a batch not kept already are computed and dropped."""
        _, moved, reference = self._references.get(id(batch)) or (batch, *self._float_run(batch))
        return _output_sums(gm, batch, moved, reference, None)

    def _float_run(self, batch: Any) -> tuple[Any, list[torch.Tensor]]:
        """(the batch on the float graph's device, the float graph's output leaves on it)."""
        moved = move_to(batch, model_device(self.float_gm))
        with torch.no_grad():
            return moved, _float_leaves(call_model(self.float_gm, moved))


def _output_sums(gm: fx.GraphModule, batch: Any, moved: Any, reference: list[torch.Tensor],
                 run: Callable[[Any, Any], Any] | None) -> list[torch.Tensor]:
    """The (signal, noise) sums of each output leaf of `gm` (run whole, or by `run(batch, moved)`) against
    `reference`, the float graph's leaves on the batch."""
    with torch.no_grad():
        actual = _float_leaves(call_model(gm, moved) if run is None else run(batch, moved))
        return [signal_and_noise(a, b) for a, b in zip(reference, actual)]


def _worst_output_sqnr(per_batch: Sequence[list[torch.Tensor]]) -> float:
    """The worst output leaf's SQNR (dB) from per-batch (signal, noise) sums, added in batch order."""
    sums: list[torch.Tensor] = []
    for pairs in per_batch:
        for index, pair in enumerate(pairs):
            if index == len(sums):
                sums.append(pair)
            else:
                sums[index] = sums[index] + pair
    values = [sqnr_from_sums(*(float(v) for v in pair.tolist())) for pair in sums]
    return min(values) if values else math.nan


def measured_output_sqnr(float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: Quantizer,
                         reference: FloatReference, observers: CalibratedObservers | None = None) -> float:
    """The worst output leaf's SQNR (dB) of `float_gm` quantized by `quantizer` over every batch, exactly as a
    pass of its own measures it: prepared, calibrated (the observers `observers` holds take their kept state),
    converted, and run on each batch against `reference`'s float outputs (computed, not kept, for the batches it
    lacks). No layer's SQNR is measured: a search reads the output's. A whole-model trial: the fix budget keeps one
    in hand for the search step it follows (trial_step)."""
    with trial_step():
        prepared = prepare(clone_graph_module(float_gm, share_parameters=True, recompile=False), quantizer,
                           recompile=False)
        calibrate_kept(prepared, list(batches), observers)
        quant_gm = convert(prepared)
        restore_model_state(quant_gm, float_gm)  # calibration ran forward, which may update buffers in place
        return _worst_output_sqnr([reference.unkept_batch_sums(quant_gm, batch) for batch in batches])


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _group_owners(prepared: fx.GraphModule) -> dict[str, set[str]]:
    """{observer module name: layers whose input, weight or output it observes}; tags observer nodes."""
    owners: dict[str, set[str]] = {}
    for node in prepared.graph.nodes:
        if node.meta.get(INSERTED_KEY) == "observer":
            node.meta[_GROUP_KEY] = str(node.target)
    for op in find_quantizable_ops(prepared):
        touching = [a for a in op.node.all_input_nodes if a.meta.get(INSERTED_KEY) == "observer"]
        output = op.output or op.node
        touching += [u for u in output.users if u.meta.get(INSERTED_KEY) == "observer"]
        for observer in touching:
            owners.setdefault(str(observer.target), set()).add(op.layer)
    return owners


def _expert_owners(prepared: fx.GraphModule) -> dict[str, list[set[str]]]:
    """{observer module name: for each expert, the layers whose rows, weight or output of that expert it observes}
    of a grouped capture's projections (observers of every expert at once)."""
    owners: dict[str, list[set[str]]] = {}
    for op in find_quantizable_ops(prepared, grouped=True):
        if op.kind != "grouped_linear":
            continue
        touching = [a for a in op.node.all_input_nodes if a.meta.get(INSERTED_KEY) == "observer"]
        touching += [u for u in op.node.users if u.meta.get(INSERTED_KEY) == "observer"]
        for observer in touching:
            experts = owners.setdefault(str(observer.target), [set() for _ in op.expert_layers])
            for names, layer in zip(experts, op.expert_layers, strict=True):
                names.add(layer)
    return owners


def layer_sensitivity(float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: Quantizer | None = None, *,
                      layers: Sequence[str] | None = None, max_layers: int | None = None,
                      max_batches: int | None = None, model: SwitchableModel | None = None,
                      only_quantized: bool | int = True, confirmed: int | None = None) -> SensitivityResult:
    """Rank the quantized layers (or `layers`) by the output SQNR gained when each alone stays in float.

    Costs one pass of the quantized model per layer over `max_batches` batches (all by default), and one more for
    each layer whose only_quantized_db is measured: every layer's (True), none (False: nan, a search that ranks by
    the gain needs no more) or, given a count, the first that many of the ranking's (the ones a report lists);
    layers past `max_layers` (graph order) are skipped and listed.

    `confirmed`, a count: every layer is estimated on the first batch only (a screen), and the `confirmed` best
    estimates are measured on every batch; the ranking lists those first, by their measured gain, then the others
    by their estimate (each entry's `batches` says which). None measures every layer on every batch.
    """
    model = model or SwitchableModel(float_gm, batches, quantizer)
    subset = list(batches)[:max_batches] if max_batches else list(batches)
    chosen = [name for name in model.layers if layers is None or name in layers]
    measured, skipped = chosen[:max_layers] if max_layers else chosen, chosen[max_layers:] if max_layers else []
    screen = subset[:1] if confirmed is not None and len(subset) > 1 else subset
    model.quantize_only(model.layers)
    baseline = model.record(subset)
    screen_baseline = baseline if screen is subset else model.run(screen)  # the recorded batch's sums: no run
    gains: dict[str, tuple[float, float, int]] = {}  # layer -> (only_float_db, gain_db, batches)
    for layer in measured:
        if not trials_allowed():  # the fix budget is spent: the layers not screened are listed as unmeasured
            break
        model.quantize_only([name for name in model.layers if name != layer])
        value = model.run(screen)
        gains[layer] = (value, value - screen_baseline, len(screen))
    unmeasured = tuple(layer for layer in measured if layer not in gains)
    measured = [layer for layer in measured if layer in gains]

    def by_gain(layers: list[str]) -> list[str]:
        return [name for _, name in best_first([(gains[name][1], name) for name in layers])]

    ranked = by_gain(measured)
    if screen is not subset:
        confirmed_layers = []
        for layer in ranked[:confirmed]:
            if not trials_allowed():
                break
            confirmed_layers.append(layer)
            model.quantize_only([name for name in model.layers if name != layer])
            value = model.run(subset)  # the first batch's sums are kept: the other batches run
            gains[layer] = (value, value - baseline, len(subset))
        ranked = by_gain(confirmed_layers) + ranked[len(confirmed_layers):]
    alone = ranked if only_quantized is True else ranked[:int(only_quantized)]
    only: dict[str, float] = {}
    if alone:  # "only this layer quantized" starts from the float run's values
        model.quantize_only([])
        model.record(subset)
        for layer in alone:
            if not trials_allowed():
                break
            model.quantize_only([layer])
            only[layer] = model.run(subset)
    model.quantize_only(model.layers)
    model.forget()
    return SensitivityResult(baseline, tuple(LayerSensitivity(name, only.get(name, math.nan), *gains[name])
                                             for name in ranked), tuple(skipped), len(subset), unmeasured)


def with_float_layers(quantizer: Quantizer, layers: Iterable[str]) -> Quantizer:
    """A copy of `quantizer` that keeps the layers matching `layers` (globs) in float, through its
    `layer_overrides`; ValueError for a quantizer without them."""
    if not isinstance(getattr(quantizer, "layer_overrides", None), dict):
        raise ValueError(f"{type(quantizer).__name__} has no layer_overrides, so it cannot keep layers in float; "
                         "use qcore.Int8StaticQuantizer or a quantizer that honours layer_overrides={glob: "
                         "{'skip': True}}")
    return with_layer_overrides(quantizer, {glob: {"skip": True} for glob in layers})


# a widened float_layers search also screens the first layers in graph order alone: as many as the sensitivity
# ranking measures by default, whose runs it shares
EARLY_LAYERS = 32


def find_float_layers(float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: Quantizer | None, target_db: float,
                      *, max_float_layers: int = 8, candidates: int = 12, max_batches: int | None = 2,
                      sensitivity: SensitivityResult | None = None, model: SwitchableModel | None = None,
                      compare_with_ranking: bool = False, estimate: bool = True,
                      ranking: Sequence[str] | None = None, early_layers: int = EARLY_LAYERS,
                      observers: CalibratedObservers | None = None) -> FloatLayersFix:
    """Greedy search for a small set of layers to keep in float so that the output SQNR reaches `target_db`,
    then one exact measurement with that set skipped by the quantizer.

    Each step keeps in float the candidate whose float-ification helps most over the search batches (the first
    `max_batches`), until the target is met or `max_float_layers` are chosen, and never every layer (a fix that
    quantizes nothing is none). The candidates are the `candidates`
    layers that help most alone (from `sensitivity` when given). Every layer, and every candidate of a step, is
    estimated on the first search batch; only the best estimates are measured on the other batches
    (REMEASURED_CANDIDATES of a step, twice `candidates` of the ranking), and the best measured is chosen.
    estimate=False measures every one on every search batch.

    `ranking` (the candidates first, as ModelAnalysis.fix_candidates orders them) screens instead of the greedy
    search: its first `candidates` layers are each kept in float alone on the search batches (all at once first
    when they fit the budget: when that misses the target, no set of them meets it), and the shortest head of
    them, best first, that meets the target there is found by bisection (shortest_head), each head returned
    measured exactly on every batch. When that set falls short of the target, the same screen runs over those
    candidates and the first `early_layers` layers in graph order (an early layer's error grows through every
    layer after it, so keeping it in float can help the output more than a larger own error further on), each of
    them estimated alone on the first search batch only (the sensitivity check's ranking screens the same layers
    on the same batch and shares those runs), and the better measured set wins.

    `observers`: the activation observers calibrated earlier on `float_gm` and `batches`; the exact measurements
    take their states instead of calibrating again (measured_output_sqnr).
    """
    quantizer = quantizer or Int8StaticQuantizer()
    model = model or SwitchableModel(float_gm, batches, quantizer, observers=observers)
    subset = list(batches)[:max_batches] if max_batches else list(batches)
    if ranking is not None:
        limit = min(max_float_layers, len(model.layers) - 1)
        first = [name for name in ranking if name in model.layers][:candidates]
        screened = _screened_float_layers(model, float_gm, list(batches), subset, quantizer, target_db, first, limit,
                                          candidates, observers)
        wider = list(dict.fromkeys([*first, *model.layers[:early_layers]]))
        if screened.reached or len(wider) == len(first):
            return screened
        if not trials_allowed(whole=True):  # the budget left holds no screen and its confirmation: no wider search
            return replace(screened, stopped=True)
        widened = _screened_float_layers(model, float_gm, list(batches), subset, quantizer, target_db, wider, limit,
                                         len(wider), observers, alone_on_first=True)
        better = widened if widened.measured_db > screened.measured_db else screened
        return replace(better, stopped=screened.stopped or widened.stopped)
    if sensitivity is not None:
        pool = [entry.layer for entry in sensitivity.layers][:candidates]
        all_quantized_db = sensitivity.all_quantized_db
    else:
        pool, all_quantized_db = _candidate_pool(model, subset, candidates,
                                                 2 * candidates if estimate else len(model.layers))
    chosen: list[str] = []
    estimated_db = all_quantized_db
    most = min(max_float_layers, len(model.layers) - 1)  # a proper subset: keeping every layer quantizes nothing
    stopped = False
    while estimated_db < target_db and len(chosen) < most and len(chosen) < len(pool):
        if not trials_allowed(whole=True):  # the measurement of the set chosen, kept in hand
            stopped = True
            break
        model.quantize_only([name for name in model.layers if name not in chosen])
        model.record(subset)
        settings = _float_one_more(model, chosen, pool)
        best_db, best = model.best_measured(settings, subset, REMEASURED_CANDIDATES if estimate else len(settings),
                                            _last_name_first)[0]
        chosen.append(best)
        estimated_db = best_db
    model.quantize_only(model.layers)
    model.forget()
    measured_db = (measured_output_sqnr(float_gm, list(batches), with_float_layers(quantizer, chosen), model.reference,
                                        observers) if chosen else all_quantized_db)
    naive = None
    if compare_with_ranking:
        ranked = sensitivity or layer_sensitivity(float_gm, subset, quantizer, model=model, only_quantized=False)
        naive = _naive_top_k(model, ranked, subset, target_db, max_float_layers)
    return FloatLayersFix(tuple(chosen), estimated_db, measured_db, target_db, measured_db >= target_db, naive,
                          stopped)


REMEASURED_CANDIDATES = 3  # of a greedy step's estimates, how many best are measured on every search batch


def _screened_float_layers(model: SwitchableModel, float_gm: fx.GraphModule, batches: list[Any], subset: list[Any],
                           quantizer: Quantizer, target_db: float, ranking: Sequence[str], limit: int,
                           candidates: int, observers: CalibratedObservers | None = None,
                           alone_on_first: bool = False) -> FloatLayersFix:
    """find_float_layers with a `ranking`: the screen on `subset` through the switches, each head returned measured
    exactly (re-quantized with it in float) on every batch; at most `limit` layers kept in float. alone_on_first:
    each candidate kept in float alone (the ladder's order) is estimated on the first batch of `subset` only."""
    exact: dict[tuple[str, ...], float] = {}
    screened: dict[tuple[str, ...], float] = {}

    def in_float(head: Iterable[str], on: list[Any] = subset) -> float:
        kept = set(head)
        model.quantize_only([name for name in model.layers if name not in kept])
        return model.run(on)

    def measured(head: list[str]) -> float:
        if tuple(head) not in exact:
            exact[tuple(head)] = measured_output_sqnr(float_gm, batches, with_float_layers(quantizer, head),
                                                      model.reference, observers)
        return exact[tuple(head)]

    def screen(head: list[str]) -> bool:
        screened[tuple(head)] = in_float(head)
        return screened[tuple(head)] >= target_db

    model.quantize_only(model.layers)
    all_quantized_db = model.record(subset)
    alone = subset[:1] if alone_on_first else subset
    alone_base = all_quantized_db if alone is subset else model.run(alone)  # the recorded batch's sums: no run
    pool = [name for name in ranking if name in model.layers][:candidates]
    chosen: list[str] = []
    stopped = False
    if all_quantized_db < target_db and pool and limit > 0:
        if len(pool) <= limit and not screen(pool):
            # every candidate in float at once misses the target, so no set of them meets it: they are the most
            # the fix may keep, measured
            chosen = pool
        else:
            # largest own error first: the most promising first when the fix budget runs out
            singles, stopped = screened_within_budget(pool, lambda name: in_float([name], alone))
            ladder = screened_ladder([name for name in pool if name in singles], singles, alone_base)
            found = shortest_head(ladder[:limit], screen, lambda head: measured(head) >= target_db)
            chosen, stopped = found.head, stopped or found.stopped
    model.quantize_only(model.layers)
    model.forget()
    measured_db = measured(chosen) if chosen else all_quantized_db
    estimated_db = screened.get(tuple(chosen), all_quantized_db) if chosen else all_quantized_db
    return FloatLayersFix(tuple(chosen), estimated_db, measured_db, target_db, measured_db >= target_db,
                          stopped=stopped)


def _candidate_pool(model: SwitchableModel, batches: list[Any], candidates: int,
                    remeasured: int) -> tuple[list[str], float]:
    """(the `candidates` layers whose float-ification alone helps most over `batches`, the SQNR with every layer
    quantized): every layer estimated on the first batch, the `remeasured` best estimates measured on all."""
    model.quantize_only(model.layers)
    all_quantized_db = model.record(batches)
    ranked = model.best_measured(_float_one_more(model, [], model.layers), batches, remeasured, best_first)
    return [layer for _, layer in ranked][:candidates], all_quantized_db


def _float_one_more(model: SwitchableModel, chosen: list[str], layers: Iterable[str]) -> dict[str, Callable[[], None]]:
    """{layer: sets the switches with `chosen` and that layer in float} for each of `layers` not chosen."""
    def setting(layer: str) -> Callable[[], None]:
        return lambda: model.quantize_only([name for name in model.layers if name not in chosen and name != layer])

    return {layer: setting(layer) for layer in layers if layer not in chosen}


def best_first(found: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """(SQNR, name) pairs sorted best first, NaN last, equal SQNRs by name (as layer_sensitivity ranks)."""
    return sorted(found, key=lambda t: (-t[0] if not math.isnan(t[0]) else math.inf, t[1]))


def _last_name_first(found: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """(SQNR, name) pairs sorted best first, NaN last, of equal SQNRs the last name first (the greedy step's pick)."""
    return sorted(found, key=lambda t: (t[0] if not math.isnan(t[0]) else -math.inf, t[1]), reverse=True)


def _naive_top_k(model: SwitchableModel, ranking: SensitivityResult, batches: list, target_db: float,
                 limit: int) -> int:
    """How many layers of the ranking, taken in order, the switches need to reach the target (0: not within
    `limit`)."""
    order = [entry.layer for entry in ranking.layers]
    for k in range(1, min(limit, len(order)) + 1):
        model.quantize_only([name for name in model.layers if name not in order[:k]])
        if model.run(batches) >= target_db:
            model.quantize_only(model.layers)
            return k
    model.quantize_only(model.layers)
    return 0
