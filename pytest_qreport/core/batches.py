"""Calibration batches and the places settings come from: a fixture name, a callable, or the value itself."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["as_batches", "first_batch", "is_single_batch", "resolve_model", "resolve_source"]


def is_single_batch(source: Any) -> bool:
    """True for one tensor or one dict of kwargs: one batch, not a sequence of rows or keys."""
    return isinstance(source, dict) or (hasattr(source, "shape") and hasattr(source, "dtype"))


def as_batches(source: Any) -> list[Any]:
    """Calibration batches as a list (one tensor or one dict of kwargs is one batch)."""
    return [source] if is_single_batch(source) else list(source)


def first_batch(batches: Any) -> Any:
    """The first batch of a batch source (the batch itself for a single batch); ValueError when it is empty."""
    if is_single_batch(batches):
        return batches
    if isinstance(batches, (list, tuple)):
        if not batches:
            raise ValueError("the calibration batches are empty")
        return batches[0]
    return next(iter(batches))


def resolve_source(source: Any, fixture_value: Callable[[str], Any]) -> Any:
    """A setting's value from where it is given: a fixture name (looked up with `fixture_value`), a callable
    (called), or the value itself."""
    if isinstance(source, str):
        return fixture_value(source)
    return source() if callable(source) else source


def resolve_model(source: Any, fixture_value: Callable[[str], Any]) -> Any:
    """A model setting's value (quantized=): a fixture name (looked up), a model (itself: a module is callable but
    is not called), or a callable returning the model (called)."""
    if isinstance(source, str):
        return fixture_value(source)
    if hasattr(source, "forward") or not callable(source):
        return source
    return source()
