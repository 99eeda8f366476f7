"""Run calibration batches through a prepared model."""
from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any, Protocol

import torch
from torch import nn

from qcore.graph.inputs import call_model, describe_batch, move_to, named_inputs
from qcore.runtime.progress import batch_done, stage

__all__ = ["CalibrationError", "OutputSink", "calibrate", "model_device"]


class CalibrationError(RuntimeError):
    """Calibration could not run (no batches, or the model failed on a batch: `batch` is its index, else None)."""

    def __init__(self, message: str, batch: int | None = None) -> None:
        super().__init__(message)
        self.batch = batch


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU if it has none)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


class OutputSink(Protocol):
    """Where a pass puts the outputs it keeps: a list, or anything with its append (measure.FirstOutputs)."""

    def append(self, output: Any, /) -> None:
        """Keep one output."""


def calibrate(model: nn.Module, batches: Iterable[Any], keep_first_output: OutputSink | None = None, *,
              keep_all: bool = False, every_output: OutputSink | None = None) -> int:
    """Feed every batch to `model` under no_grad, on the model's device; returns the batch count. The first
    batch's output (keep_all: every batch's) is appended to `keep_first_output` when given, and every batch's to
    `every_output`."""
    device = model_device(model)
    count = 0
    total = len(batches) if isinstance(batches, Sized) else None
    first, first_shapes = "", None
    with torch.no_grad(), stage("calibration", total):
        for index, batch in enumerate(batches):
            if index == 0:
                first, first_shapes = describe_batch(batch), _tensor_shapes(batch)
            try:
                output = call_model(model, move_to(batch, device))
            except Exception as error:  # noqa: BLE001 - re-raised with the batch index
                message = _batch_failed(index, total, batch, first, error) + _rows_differ(batch, first_shapes)
                raise CalibrationError(message, batch=index) from error
            if (index == 0 or keep_all) and keep_first_output is not None:
                keep_first_output.append(output)
            if every_output is not None:
                every_output.append(output)
            count += 1
            batch_done(count, total)
    if count == 0:
        raise CalibrationError("no calibration batches: give at least one batch")
    return count


def _tensor_shapes(batch: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]] | None:
    """(argument, dtype, shape) of each tensor a batch holds; None where it holds something else too."""
    named = named_inputs(batch)
    if not named or not all(isinstance(value, torch.Tensor) and value.dim() > 0 for _, value in named):
        return None
    return [(name, value.dtype, tuple(value.shape)) for name, value in named]


def _rows_differ(batch: Any, first: list[tuple[str, torch.dtype, tuple[int, ...]]] | None) -> str:
    """What a failing batch that differs from the first in its batch size alone says: the size the model was
    captured for, and how to give it ('' when it differs otherwise, or not at all)."""
    shapes = _tensor_shapes(batch)
    if first is None or shapes is None or len(shapes) != len(first):
        return ""
    rows = {shape[0] for _, _, shape in shapes}
    captured = {shape[0] for _, _, shape in first}
    same_otherwise = all(name == other and dtype == other_dtype and shape[1:] == other_shape[1:]
                         for (name, dtype, shape), (other, other_dtype, other_shape) in zip(shapes, first))
    if not same_otherwise or len(rows) != 1 or len(captured) != 1 or rows == captured:
        return ""
    return (f". It differs from the first batch in its batch size alone ({rows.pop()} rows against "
            f"{captured.pop()}), and the captured model computes with the first batch's size: give every batch that "
            "size (a DataLoader's drop_last=True drops a smaller last batch).")


def _batch_failed(index: int, total: int | None, batch: Any, first: str, error: BaseException) -> str:
    """'calibration batch 2 of 4 failed: <error> (batch 2: ...; batch 0: ...)': the stage, the cause, and what the
    failing batch holds beside the first, which the model was captured with."""
    of = f" of {total}" if total is not None else ""
    holds = describe_batch(batch)
    compared = f"; batch 0, which the model was captured with: {first}" if index and holds != first else ""
    return f"calibration batch {index}{of} failed: {type(error).__name__}: {error} (batch {index}: {holds}{compared})"
