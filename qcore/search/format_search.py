"""The format fix: when a model quantized to deployed formats misses its output SQNR, move layers up a ladder of
formats (for example NVFP4 -> MXFP8 -> W8A16 -> float), greedily, keeping the fewest moves that reach the target,
then re-quantize that set for real and measure it.

The search runs on one copy of the float graph whose linear and conv layers carry format switches: each weight
switch keeps its weight fake-quantized in every format asked for so far, and each input switch the calibration
amax of the layer's input, so that trying a move costs one forward pass over a couple of batches.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qcore.formats.presets import preset
from qcore.graph.capture import clone_graph_module
from qcore.graph.inputs import call_model, move_to
from qcore.graph.ops import fetch_attr, find_quantizable_ops
from qcore.quantization.calibrate import model_device
from qcore.quantization.calibrated import CalibratedObservers
from qcore.quantization.format_quantizer import (
    FORMAT_KINDS,
    FormatQuantizer,
    fake_quantize_weight,
    layer_shapes,
    preset_refusal,
)
from qcore.runtime.progress import trials_allowed
from qcore.search.sensitivity import (
    REMEASURED_CANDIDATES,
    FloatReference,
    SwitchedRuns,
    best_first,
    measured_output_sqnr,
)

__all__ = ["LADDERS", "FormatFix", "FormatSwitchModel", "search_formats"]

# each format's next, more precise rungs, in order; "float" is the top of every ladder
LADDERS: dict[str, tuple[str, ...]] = {
    "NVFP4": ("MXFP8", "W8A16", "float"), "NVFP4A16": ("W8A16", "float"), "MXFP4": ("MXFP8", "W8A16", "float"),
    "MXFP8": ("W8A16", "float"), "FP8": ("FP8_DYNAMIC", "W8A16", "float"),
    "FP8_BLOCK": ("FP8_DYNAMIC", "W8A16", "float"), "FP8_DYNAMIC": ("W8A16", "float"), "W8A8": ("W8A16", "float"),
    "W4A16": ("W8A16", "float"), "W4A16_ASYM": ("W8A16", "float"), "W8A16": ("float",),
}


@dataclass(frozen=True)
class FormatFix:
    """The moves found (layer -> its new format, "float" included), the output SQNR the search estimated on its
    batches, the SQNR measured after quantizing with the moves on every batch, the target, and whether it was met."""

    layer_formats: dict[str, str]
    estimated_db: float
    measured_db: float
    target_db: float
    reached: bool
    stopped: bool = False  # the fix budget ran out before the search did (the moves are measured all the same)


class _WeightSwitch(nn.Module):
    """A layer's weight in the chosen format (kept per format once computed), or the float weight."""

    def __init__(self, weight: torch.Tensor, transposed: bool = False) -> None:
        super().__init__()
        self.weight, self.choice, self.transposed = weight, "float", transposed
        self._formats: dict[str, torch.Tensor] = {}

    def forward(self) -> torch.Tensor:
        if self.choice == "float":
            return self.weight
        if self.choice not in self._formats:
            with torch.no_grad():
                self._formats[self.choice] = fake_quantize_weight(preset(self.choice).weight, self.weight,
                                                                  self.transposed)
        return self._formats[self.choice]


class _InputSwitch(nn.Module):
    """A layer's input in the chosen format's activation format (float for weight-only formats); while
    calibrating, it keeps the input's amax (the static scale of FP8 per tensor and NVFP4's global scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.choice, self.calibrating = "float", False
        self.amax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        if self.calibrating:
            seen = x.detach().abs().amax().to(torch.float32)
            self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
            return x
        activation = None if self.choice == "float" else preset(self.choice).activation
        return x if activation is None else activation.fake_quantize(x, self.amax)


class FormatSwitchModel(SwitchedRuns):
    """A copy of a float graph whose linear and conv layers can each be given any format, calibrated once."""

    def __init__(self, float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: FormatQuantizer, *,
                 resume: bool = True) -> None:
        """resume=False: every run computes the whole graph (qcore.search.resume otherwise)."""
        self.float_gm, self.gm = float_gm, clone_graph_module(float_gm, share_parameters=True)
        self.start: dict[str, str] = {}  # layer -> its format under `quantizer` ("float": kept in float)
        self.shapes: dict[str, tuple[Any, list]] = {}  # layer -> (weight shape, input shapes)
        self._switches: dict[str, tuple[_WeightSwitch, _InputSwitch]] = {}
        graph = self.gm.graph
        switch_nodes: list[fx.Node] = []
        for index, op in enumerate(find_quantizable_ops(self.gm)):
            if op.kind not in FORMAT_KINDS or op.weight is None or op.weight.op != "get_attr":
                continue
            chosen = quantizer.layer_preset(op.fqn, op.layer, op.item)
            self.shapes[op.layer] = layer_shapes(op)
            # as the quantizer does: a layer whose shapes cannot take its format stays in float
            refused = chosen is None or bool(preset_refusal(chosen, *self.shapes[op.layer]))
            self.start[op.layer] = "float" if refused else chosen.name  # type: ignore[union-attr]
            weight = fetch_attr(self.gm, str(op.weight.target))
            switches = (_WeightSwitch(weight, transposed=op.kind == "addmm"), _InputSwitch())
            self.gm.add_module(f"qcore_weight_switch_{index}", switches[0])
            self.gm.add_module(f"qcore_input_switch_{index}", switches[1])
            source = op.activation_inputs[0]
            with graph.inserting_before(op.node):
                weight_node = graph.call_module(f"qcore_weight_switch_{index}", ())
                input_node = graph.call_module(f"qcore_input_switch_{index}", (source,))
            op.node.replace_input_with(op.weight, weight_node)
            op.node.replace_input_with(source, input_node)
            self._switches[op.layer] = switches
            switch_nodes += [weight_node, input_node]
        graph.lint()
        self.gm.recompile()
        self._init_runs(float_gm, switch_nodes, resume)
        self._calibrate(batches)

    def _calibrate(self, batches: Sequence[Any]) -> None:
        device = model_device(self.float_gm)
        for _weight, switch in self._switches.values():
            switch.calibrating = True
        with torch.no_grad():
            for batch in batches:
                call_model(self.gm, move_to(batch, device))
        for _weight, switch in self._switches.values():
            switch.calibrating = False

    def fits(self, layer: str, name: str) -> bool:
        """Whether the layer's weight and input can take the format."""
        return name == "float" or not preset_refusal(preset(name), *self.shapes[layer])

    def assign(self, formats: dict[str, str]) -> None:
        """Give each layer its format ("float": unquantized)."""
        for layer, name in formats.items():
            weight, inputs = self._switches[layer]
            weight.choice = inputs.choice = name

    def _switch_state(self) -> list[Any]:
        return [switch.choice for pair in self._switches.values() for switch in pair]


def _next_rung(model: FormatSwitchModel, layer: str, current: str) -> str | None:
    """The next format up the ladder that the layer's shapes can take (None at the top)."""
    return next((name for name in LADDERS.get(current, ()) if model.fits(layer, name)), None)


def search_formats(float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: FormatQuantizer, target_db: float,
                   *, max_moves: int = 16, candidates: int = 12, max_batches: int | None = 2,
                   model: FormatSwitchModel | None = None, estimate: bool = True,
                   observers: CalibratedObservers | None = None) -> FormatFix:
    """Greedy: each step makes the one move (a layer one rung up its ladder) that raises the output SQNR most over
    the search batches (the first `max_batches`), among the `candidates` layers whose first move helped most, until
    `target_db` is met or `max_moves` are made; then the moves are measured for real, quantizing with them over every
    batch. Every move is estimated on the first search batch and the best estimates measured on all (twice
    `candidates` of the first step, REMEASURED_CANDIDATES of a later one); estimate=False measures every one on all.
    `observers`: the activation observers calibrated earlier on `float_gm` and `batches`, whose states the real
    measurements take instead of calibrating again (a moved layer's observer watches with other settings, so it is
    calibrated)."""
    model = model or FormatSwitchModel(float_gm, batches, quantizer)
    subset = list(batches)[:max_batches] if max_batches else list(batches)
    current = dict(model.start)
    model.assign(current)
    estimate_db, pool, moves = model.run(subset), list(current), 0
    measured_db = math.nan

    def best_move() -> tuple[tuple[float, str, str], list[str]] | None:
        remeasured = (2 * candidates if moves == 0 else REMEASURED_CANDIDATES) if estimate else len(pool)
        return _best_move(model, current, pool, subset, remeasured)

    stopped = False
    while True:
        while estimate_db < target_db and moves < max_moves:
            if not trials_allowed(whole=True):  # the measurement of the moves made so far, kept in hand
                stopped = True
                break
            step = best_move()
            if step is None:
                break
            if moves == 0:  # later steps look only at the layers whose first move helped most
                pool = step[1][:candidates]
            (estimate_db, layer, rung), moves = step[0], moves + 1
            current[layer] = rung
            model.assign(current)
        changed = {layer: name for layer, name in current.items() if name != model.start[layer]}
        measured_db = _measure(float_gm, batches, quantizer, changed, model.reference, observers) if changed \
            else estimate_db
        if measured_db >= target_db or moves >= max_moves or stopped:
            break
        if not trials_allowed(whole=True):
            stopped = True
            break
        if best_move() is None:
            break
        estimate_db = -math.inf  # the estimate on a few batches was optimistic: one more move, then measure again
    model.forget()
    return FormatFix(changed, estimate_db, measured_db, target_db, measured_db >= target_db, stopped)


def _best_move(model: FormatSwitchModel, current: dict[str, str], pool: list[str], batches: list[Any],
               remeasured: int) -> tuple[tuple[float, str, str], list[str]] | None:
    """The move that raises the output SQNR most ((SQNR, layer, format)), with the pool's layers whose moves were
    measured on every batch ranked by their move's SQNR; None when no layer can move. Each move is estimated on the
    first batch, and the `remeasured` best estimates are measured on all."""
    model.assign(current)
    model.record(batches)
    rungs = {layer: rung for layer in pool if (rung := _next_rung(model, layer, current[layer])) is not None}

    def move(layer: str, rung: str) -> Callable[[], None]:
        return lambda: model.assign({**current, layer: rung})

    ranked = model.best_measured({layer: move(layer, rung) for layer, rung in rungs.items()}, batches, remeasured,
                                 best_first)
    model.assign(current)
    if not ranked:
        return None
    return (ranked[0][0], ranked[0][1], rungs[ranked[0][1]]), [layer for _db, layer in ranked]


def _measure(float_gm: fx.GraphModule, batches: Sequence[Any], quantizer: FormatQuantizer, changed: dict[str, str],
             reference: FloatReference, observers: CalibratedObservers | None) -> float:
    """The output SQNR with the moves made, quantized for real over every batch (measured_output_sqnr)."""
    overrides = {layer: {"skip": True} if name == "float" else {"format": name} for layer, name in changed.items()}
    fixed = FormatQuantizer(quantizer.preset, {**quantizer.layer_overrides, **overrides})
    return measured_output_sqnr(float_gm, list(batches), fixed, reference, observers)
