"""Model inputs: a tensor, a tuple of args, or a dict of kwargs."""
from __future__ import annotations

from typing import Any

import torch

from qcore.runtime.deferred import batched_updates

__all__ = ["as_args_kwargs", "call_model", "move_to"]


def as_args_kwargs(inputs: Any) -> tuple[tuple, dict]:
    """Split a batch into (args, kwargs): a dict is kwargs, a tuple/list is args, anything else one arg."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: Any, inputs: Any) -> Any:
    """Call `model` on a batch given as a tensor, a tuple of args, or a dict of kwargs; the statistics its observers
    and comparators queue run together as it returns (qcore.runtime.deferred)."""
    args, kwargs = as_args_kwargs(inputs)
    with batched_updates():
        return model(*args, **kwargs)


def move_to(inputs: Any, device: torch.device | str) -> Any:
    """Move every tensor of a batch to `device`."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: move_to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(move_to(v, device) for v in inputs)
    return inputs
