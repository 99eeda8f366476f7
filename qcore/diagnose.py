"""Explanations for models that cannot be measured: where values stop being finite, what the outputs hold.

These run only after something went wrong, so they may cost a forward pass or two.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .graph import FQN_KEY
from .inputs import as_args_kwargs

__all__ = ["NonFinite", "describe_outputs", "first_non_finite"]


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


def first_non_finite(gm: fx.GraphModule, batches: Iterable[Any]) -> NonFinite | None:
    """The first node, in graph order, whose float output holds NaN or inf, on the first batch where one does."""
    with torch.no_grad():
        for index, batch in enumerate(batches):
            args, kwargs = as_args_kwargs(batch)
            if kwargs:  # an Interpreter takes placeholders positionally; a missing one takes its default
                placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
                args = tuple(kwargs.get(str(n.target).lstrip("*"), n.args[0] if n.args else None)
                             for n in placeholders)
            watch = _FiniteWatch(gm)
            watch.run(*args)
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
