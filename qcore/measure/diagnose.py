"""Explanations for models that cannot be measured: where values stop being finite, what the outputs hold,
where two runs of the same batch part ways, and which tensors are below the quantizer's resolution.

These run only after something went wrong, so they may cost a forward pass or two.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from qcore.graph.inputs import as_args_kwargs, call_model, move_to
from qcore.graph.ops import FQN_KEY
from qcore.quantization.calibrate import model_device

__all__ = ["NonDeterministicModelError", "NonFinite", "Nondeterminism", "ResolutionLimit", "describe_outputs",
           "first_non_finite", "first_nondeterministic", "resolution_limits"]
_COMPARED_ELEMENTS = 1 << 20  # of two outputs compared at a time in float64

# an activation or weight that int8 can give fewer levels than this is below the quantizer's resolution
RESOLUTION_LEVELS = 16


class NonFinite(tuple):
    """(node name, module FQN or "", batch index) of the first value that is NaN or inf."""

    __slots__ = ()

    def __new__(cls, node: str, fqn: str, batch: int) -> NonFinite:
        return super().__new__(cls, (node, fqn, batch))

    def describe(self) -> str:
        """'node linear (module fc1) on calibration batch 0'."""
        node, fqn, batch = self
        return f"node {node}{f' (module {fqn})' if fqn else ''} on calibration batch {batch}"


class _FiniteWatch(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.first: fx.Node | None = None

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        if self.first is None and node.op not in ("placeholder", "get_attr"):
            leaves = pytree.tree_leaves(value)
            if any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                   for t in leaves):
                self.first = node
        return value


def _interpreter_args(gm: fx.GraphModule, batch: Any) -> tuple:
    """A batch as positional arguments for an fx.Interpreter (a missing keyword takes its default)."""
    args, kwargs = as_args_kwargs(batch)
    if not kwargs:
        return args
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(kwargs.get(str(n.target).lstrip("*"), n.args[0] if n.args else None) for n in placeholders)


def first_non_finite(gm: fx.GraphModule, batches: Iterable[Any]) -> NonFinite | None:
    """The first node, in graph order, whose float output holds NaN or inf, on the first batch where one does."""
    with torch.no_grad():
        for index, batch in enumerate(batches):
            watch = _FiniteWatch(gm)
            watch.run(*_interpreter_args(gm, move_to(batch, model_device(gm))))
            if watch.first is not None:
                return NonFinite(watch.first.name, str(watch.first.meta.get(FQN_KEY, "")), index)
    return None


def describe_outputs(gm: fx.GraphModule, batch: Any) -> list[str]:
    """What each output leaf of the model is, e.g. 'output.0: float32 tensor', 'output.1: int (not a tensor)'."""
    args, kwargs = as_args_kwargs(batch)
    with torch.no_grad():
        leaves = pytree.tree_leaves(gm(*args, **kwargs))
    described = []
    for index, leaf in enumerate(leaves):
        name = "output" if len(leaves) == 1 else f"output.{index}"
        kind = (f"{str(leaf.dtype).replace('torch.', '')} tensor" if isinstance(leaf, torch.Tensor)
                else f"{type(leaf).__name__} (not a tensor)")
        described.append(f"{name}: {kind}")
    return described or ["no output leaves (the model returns None or an empty container)"]


class NonDeterministicModelError(RuntimeError):
    """Two float runs of the model on the same batch differ, so its quantization error cannot be measured."""


@dataclass(frozen=True)
class Nondeterminism:
    """Where two float runs on one batch part ways: the first node (graph order) whose values differ."""

    node: str
    fqn: str
    target: str
    output_sqnr_db: float  # of one run's output against the other's: how far apart the references are

    def describe(self) -> str:
        """'node dropout (aten.dropout.default, module drop)'."""
        where = ", ".join(part for part in (self.target, f"module {self.fqn}" if self.fqn else "") if part)
        return f"node {self.node} ({where})" if where else f"node {self.node}"


def _tolerance(gm: fx.GraphModule) -> float:
    tensors = [t for t in list(gm.parameters()) + list(gm.buffers()) if t.is_floating_point()]
    dtype = tensors[0].dtype if tensors else torch.float32
    return max(1e-5, 16 * torch.finfo(dtype).eps)


def _differs(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if not a.numel():
        return False
    scales, largest = [], []
    for start in range(0, a.numel(), _COMPARED_ELEMENTS):  # float64 working values stay small (an LM's logits)
        x, y = a[start:start + _COMPARED_ELEMENTS].double(), b[start:start + _COMPARED_ELEMENTS].double()
        scales.append(torch.nan_to_num(x, posinf=0.0, neginf=0.0).abs().max())
        same = (torch.isnan(x) & torch.isnan(y)) | (x == y)
        largest.append(torch.nan_to_num(torch.where(same, torch.zeros_like(x), (x - y).abs()), nan=math.inf).max())
    scale = float(torch.stack(scales).max())
    return float(torch.stack(largest).max()) > tolerance * (scale or 1.0)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Digests(fx.Interpreter):
    """Keeps, per node, two float64 sums of each tensor it computes: enough to see that a run differs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.digests: dict[str, torch.Tensor] = {}

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        if node.op not in ("placeholder", "get_attr", "output"):
            sums = [torch.stack([t.detach().double().abs().sum(), t.detach().double().square().sum()])
                    for t in _tensor_leaves(value) if t.numel()]
            if sums:
                self.digests[node.name] = torch.cat(sums)
        return value


class _StateSnapshot:
    """The model's buffers, to put back between runs (forward may update running statistics in place)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.saved = gm, {name: b.detach().clone() for name, b in gm.named_buffers()}

    def restore(self) -> None:
        with torch.no_grad():
            for name, buffer in self.gm.named_buffers():
                if name in self.saved:
                    buffer.copy_(self.saved[name])


def outputs_agree(gm: fx.GraphModule, first: Any, second: Any) -> bool:
    """Whether two runs' outputs of `gm` are the same, with first_nondeterministic's tolerance."""
    first, second = _tensor_leaves(first), _tensor_leaves(second)
    tolerance = _tolerance(gm)
    return len(first) == len(second) and all(
        a.shape == b.shape and not _differs(a, b, tolerance) for a, b in zip(first, second))


def first_nondeterministic(gm: fx.GraphModule, batch: Any) -> Nondeterminism | None:
    """None when two runs of `gm` on `batch` (from the same buffers) agree; else the first node that differs.

    Costs two forward passes; two more, node by node, only when the outputs differ.
    """
    tolerance, snapshot, batch = _tolerance(gm), _StateSnapshot(gm), move_to(batch, model_device(gm))
    with torch.no_grad():
        first = _tensor_leaves(call_model(gm, batch))
        snapshot.restore()
        second = _tensor_leaves(call_model(gm, batch))
        snapshot.restore()
        pairs = [(a, b) for a, b in zip(first, second) if a.shape == b.shape]
        if len(first) == len(second) and not any(_differs(a, b, tolerance) for a, b in pairs):
            return None
        floats = [(a.double(), b.double()) for a, b in pairs if a.is_floating_point()]
        noise = sum(float((a - b).square().nan_to_num(nan=math.inf).sum()) for a, b in floats)
        signal = sum(float(a.square().nan_to_num(nan=0.0).sum()) for a, _ in floats)
        output_sqnr = 10 * math.log10(signal / noise) if noise and signal else -math.inf if noise else math.inf
        runs = []
        for _ in range(2):
            digests = _Digests(gm)
            digests.run(*_interpreter_args(gm, batch))
            snapshot.restore()
            runs.append(digests.digests)
    nodes = {node.name: node for node in gm.graph.nodes}
    for name, digest in runs[0].items():
        other = runs[1].get(name)
        if other is None or other.shape != digest.shape or _differs(digest, other, tolerance):
            node = nodes[name]
            target = str(node.target) if node.op != "call_module" else type(gm.get_submodule(str(node.target))).__name__
            return Nondeterminism(name, str(node.meta.get(FQN_KEY, "")), target, output_sqnr)
    return Nondeterminism("output", "", "", output_sqnr)  # only the outputs differ (e.g. a random op's tensor kwargs)


@dataclass(frozen=True)
class ResolutionLimit:
    """A quantized tensor whose observed range int8 can give fewer than RESOLUTION_LEVELS levels."""

    role: str  # "input", "output" or "weight"
    observed_range: float
    smallest_scale: float

    def describe(self) -> str:
        """'output range 1e-12 is below the quantizer's resolution (smallest scale 1.19e-07)'."""
        return (f"{self.role} range {self.observed_range:.3g} is below the quantizer's resolution (smallest scale "
                f"{self.smallest_scale:.3g})")


def _observed_range(qparams: dict[str, Any]) -> float | None:
    """The widest range, over the observer's channels, that its quantization grid has to cover (0 included)."""
    low, high = qparams.get("min_val"), qparams.get("max_val")
    if low is None or high is None or not low or not high:
        return None
    # float64 holds the host lists' Python floats exactly; a channel's width in one op for every channel
    below = torch.tensor(low, dtype=torch.float64).clamp(max=0.0)
    above = torch.tensor(high, dtype=torch.float64).clamp(min=0.0)
    widths = 2 * torch.maximum(-below, above) if "symmetric" in str(qparams.get("qscheme", "")) else above - below
    return float(widths.max())


def resolution_limits(quant_gm: fx.GraphModule) -> dict[str, tuple[ResolutionLimit, ...]]:
    """Per layer (by name), its quantized input, output and weight whose observed range is below the
    quantizer's resolution: int8 rounds such a tensor to (nearly) all zeros. Reads qparams kept by convert."""
    from qcore.graph.ops import find_quantizable_ops, is_weight_value
    from qcore.numeric.matching import layer_value
    from qcore.quantization.convert import QPARAMS_KEY

    limits: dict[str, tuple[ResolutionLimit, ...]] = {}
    for op in find_quantizable_ops(quant_gm):
        output = layer_value(op)
        tensors = [(("weight" if is_weight_value(n) else "input"), n) for n in op.node.all_input_nodes]
        tensors.append(("output", output))
        found = []
        for role, node in tensors:
            qparams = node.meta.get(QPARAMS_KEY)
            if not qparams or qparams.get("dynamic") or "eps" not in qparams:
                continue
            observed = _observed_range(qparams)
            if observed is not None and observed < RESOLUTION_LEVELS * qparams["eps"]:
                found.append(ResolutionLimit(role, observed, float(qparams["eps"])))
        if found:
            limits[op.layer] = tuple(found)
    return limits
