"""Parameters that a rewrite (input-weight equalization, smoothing) computes from the originals when they are
needed, instead of a rewritten copy of every weight held for the whole analysis: a block-wise analysis makes one
block's at a time.

A deferred graph holds its original tensors at the rewritten targets, and in its meta the rules that rewrite
them; it computes the rewritten model only inside `materialized`. Whole-graph consumers (prepare's weight
observers, a float forward) go through `rewritten_value` or `materialized`. `read_rewritten_where_used` turns a
deferred graph into one that runs by itself, each rewritten weight computed right before the op that reads it
(a whole-model analysis of a large model: one rewritten weight alive at a time).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.ops import REWRITTEN_KEY

__all__ = ["DEFERRED_KEY", "Rule", "RewrittenTensor", "RuleFactors", "defer", "deferred_parameters", "materialized",
           "read_rewritten_where_used", "rewrite", "rewritten_value"]

DEFERRED_KEY = "qcore_deferred_parameters"
Rule = Callable[[torch.Tensor], torch.Tensor]


def defer(module: nn.Module, target: str, rule: Rule) -> None:
    """Record that `module`'s tensor at `target` is rule(what it is now); rules on one target apply in order."""
    module.meta.setdefault(DEFERRED_KEY, {}).setdefault(target, []).append(rule)


def deferred_parameters(module: nn.Module) -> Mapping[str, list[Rule]]:
    """{target: its rules} of a deferred graph ({} for any other module)."""
    meta = getattr(module, "meta", None)
    return meta.get(DEFERRED_KEY, {}) if isinstance(meta, dict) else {}


def _owner(module: nn.Module, target: str) -> tuple[Any, str] | None:
    *path, name = target.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return (owner, name) if hasattr(owner, name) else None


def rewritten_value(module: nn.Module, target: str) -> torch.Tensor:
    """The tensor at `target` with its deferred rules applied (the tensor itself when it has none)."""
    found = _owner(module, target)
    if found is None:
        raise AttributeError(f"{type(module).__name__} has no tensor {target!r}")
    value = getattr(*found)
    with torch.no_grad():
        for rule in deferred_parameters(module).get(target, []):
            value = rule(value.detach())
    return value


class RuleFactors:
    """A rule's factors laid out for the weight it rewrites, made once per weight dtype, device and shape (a weight
    rewritten where it is read runs its rule every batch)."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.make = make
        self.made: dict[tuple[torch.dtype, torch.device, torch.Size], torch.Tensor] = {}

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """The factors for `weight`."""
        key = (weight.dtype, weight.device, weight.shape)
        found = self.made.get(key)
        if found is None:
            found = self.made[key] = self.make(weight)
        return found


def _set(owner: Any, name: str, original: Any, value: torch.Tensor) -> None:
    if isinstance(original, nn.Parameter):
        value = nn.Parameter(value, requires_grad=original.requires_grad)
    setattr(owner, name, value)


def rewrite(module: nn.Module, target: str, rule: Rule, deferred: bool = False) -> None:
    """Replace the tensor at `target` by rule(it), a new tensor (the original, perhaps shared, is never written);
    deferred=True records the rule instead (see `defer`)."""
    if deferred:
        defer(module, target, rule)
        return
    found = _owner(module, target)
    if found is None:
        raise AttributeError(f"{type(module).__name__} has no tensor {target!r}")
    original = getattr(*found)
    with torch.no_grad():
        _set(*found, original, rule(original.detach()))


@contextlib.contextmanager
def materialized(modules: Sequence[nn.Module], rules: Mapping[str, list[Rule]],
                 targets: Iterable[str] | None = None) -> Iterator[None]:
    """Within: each of `modules` that has a tensor at a deferred target (of `targets`, default all) holds its
    rewritten value, computed once and shared by them; after: the original tensors again."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        with torch.no_grad():
            for target in [t for t in (rules if targets is None else targets) if t in rules]:
                value = None
                for module in modules:
                    found = _owner(module, target)
                    if found is None:
                        continue
                    original = getattr(*found)
                    if value is None:
                        value = original.detach()
                        for rule in rules[target]:
                            value = rule(value)
                    saved.append((*found, original))
                    _set(*found, original, value)
        yield
    finally:
        for owner, name, original in reversed(saved):  # the same owner saved twice ends on its first original
            setattr(owner, name, original)


class RewrittenTensor:
    """The target of a graph node that computes a rewritten tensor from its original where the graph reads it."""

    def __init__(self, target: str, rules: Sequence[Rule]) -> None:
        self.target, self.rules = target, tuple(rules)
        self.__name__ = "rewritten_" + target.replace(".", "_")  # the node's name, and its name in generated code

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        value = original  # the rules run without grad: no detach op (one per read, every batch)
        with torch.no_grad():
            for rule in self.rules:
                value = rule(value)
            if value.untyped_storage().data_ptr() == original.untyped_storage().data_ptr():
                value = value.clone()  # always a tensor of its own: a reader may write over it
        return value

    def __repr__(self) -> str:
        return f"RewrittenTensor({self.target!r}, {len(self.rules)} rules)"


def read_rewritten_where_used(gm: fx.GraphModule) -> None:
    """Make a deferred graph run by itself (in place): each deferred weight (2 or more dims) is computed by a node
    right before the first op that reads it, from the original, so that one is alive at a time; smaller tensors
    (biases, a norm's weight) are rewritten now. The graph holds no deferred rules after."""
    rules = dict(deferred_parameters(gm))
    if not rules:
        return
    readers: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in rules and node.users:
            readers.setdefault(str(node.target), []).append(node)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for target, target_rules in rules.items():
        found = _owner(gm, target)
        if found is None:
            raise AttributeError(f"{type(gm).__name__} has no tensor {target!r}")
        if getattr(*found).dim() < 2 or target not in readers:
            for rule in target_rules:
                rewrite(gm, target, rule)
            continue
        compute = RewrittenTensor(target, target_rules)
        for reader in readers[target]:
            first = min(reader.users, key=lambda user: order[user])
            with gm.graph.inserting_before(first):
                rewritten = gm.graph.call_function(compute, (reader,))
            rewritten.meta.update({REWRITTEN_KEY: True, "qcore_float_weight": target})
            if "val" in reader.meta:
                rewritten.meta["val"] = reader.meta["val"]
            reader.replace_all_uses_with(rewritten, delete_user_cb=lambda user, made=rewritten: user is not made)
    del gm.meta[DEFERRED_KEY]
    gm.graph.lint()
    gm.recompile()
