"""Parameters that a rewrite (input-weight equalization, smoothing) computes from the originals when they are
needed, instead of a rewritten copy of every weight held for the whole analysis: a block-wise analysis makes one
block's at a time.

A deferred graph holds its original tensors at the rewritten targets, and in its meta the rules that rewrite
them; it computes the rewritten model only inside `materialized`. Whole-graph consumers (prepare's weight
observers, a float forward) go through `rewritten_value` or `materialized`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["DEFERRED_KEY", "Rule", "defer", "deferred_parameters", "materialized", "rewrite", "rewritten_value"]

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
