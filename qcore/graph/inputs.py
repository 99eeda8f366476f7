"""Model inputs: a tensor, a tuple of args, or a dict of kwargs."""
from __future__ import annotations

from typing import Any

import torch

from qcore.runtime.deferred import batched_updates
from qcore.runtime.progress import graph_run

__all__ = ["as_args_kwargs", "call_model", "describe_batch", "move_to", "named_inputs"]


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
    graph_run()
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


def named_inputs(inputs: Any) -> list[tuple[str, Any]]:
    """A batch's arguments by name: 'arg 0', 'arg 1', ... for the positional ones, the keywords' own."""
    args, kwargs = as_args_kwargs(inputs)
    return [(f"arg {index}", value) for index, value in enumerate(args)] + list(kwargs.items())


def describe_batch(inputs: Any) -> str:
    """What a batch holds, for an error message: each tensor's dtype and shape by its argument
    ('input_ids: int64 [2, 16]'), other values by type."""
    named = named_inputs(inputs)

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).replace('torch.', '')} {list(value.shape)}"
        return type(value).__name__

    return "; ".join(f"{name}: {one(value)}" for name, value in named) or "no arguments"
