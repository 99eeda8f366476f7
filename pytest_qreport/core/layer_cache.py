"""The layer-list cache: collection lists a model's items without capturing it when nothing it depends on changed.

An entry holds what collection needs of a captured model (each check's layers, how it was captured), in
pytest's cache directory (`.pytest_cache/d/qreport-layers/`), one JSON file per key, written atomically. The
key digests the model's code (the source files of its module classes and of the declaring conftest.py and of
the session's check classes), its parameters' names, shapes and dtypes, its example inputs' structure, shapes
and dtypes, the model's settings, and the torch, qcore and Python versions: any change is a new key. The
worker that analyses the model captures it at the analysis, once per process.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from typing import Any

from .files import write_atomically

__all__ = ["LayerCache", "model_cache_key"]

_FORMAT = 1


def _file_digest(path: str | None, seen: dict[str, str]) -> str:
    if not path or not os.path.isfile(path):
        return ""
    if path not in seen:
        with open(path, "rb") as handle:
            seen[path] = hashlib.sha256(handle.read()).hexdigest()
    return seen[path]


def _source_file(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None


def _tensor_layout(value: Any) -> Any:
    """The structure, shapes and dtypes of a batch (not its values)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(value)
    return [str(spec), [[type(leaf).__name__, str(getattr(leaf, "dtype", "")), list(getattr(leaf, "shape", []))]
                        if hasattr(leaf, "shape") else repr(leaf) for leaf in leaves]]


def model_cache_key(model: Any, example_inputs: Any, declaring_file: str, settings: Any, check_classes: list,
                    quantizer: Any) -> str:
    """A digest of everything a model's item list depends on (see the module docstring)."""
    import torch

    import qcore
    from qcore.analysis import describe

    seen: dict[str, str] = {}
    classes = sorted({type(module) for module in model.modules()} | set(check_classes) | {type(quantizer)},
                     key=lambda c: f"{c.__module__}.{c.__qualname__}")
    files = sorted({path for c in classes if (path := _source_file(c))} | {declaring_file})
    settings_description = {name: describe(getattr(settings, name)) for name in (
        "layers", "skip_layers", "float_layers", "checks", "equalize", "check_options")}
    content = {
        "format": _FORMAT, "torch": str(torch.__version__), "qcore": str(qcore.__version__),
        "python": sys.version.split()[0], "classes": [f"{c.__module__}.{c.__qualname__}" for c in classes],
        "files": {path: _file_digest(path, seen) for path in files},
        "parameters": [[name, str(t.dtype), list(t.shape)] for name, t in model.state_dict().items()
                       if isinstance(t, torch.Tensor)],
        "training": bool(getattr(model, "training", False)), "inputs": _tensor_layout(example_inputs),
        "settings": settings_description, "quantizer": describe(quantizer),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


class LayerCache:
    """Entries {"items": {check: [layer]}, "capture": {...}} by key, in a directory (None: no cache)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry for `key`, or None (absent, unreadable, or of another format)."""
        if self.directory is None:
            return None
        try:
            with open(os.path.join(self.directory, f"{key}.json"), encoding="utf-8") as handle:
                entry = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("format") != _FORMAT or not isinstance(entry.get("items"), dict):
            return None
        return entry

    def store(self, key: str, items: dict[str, list[str]], capture: dict[str, str],
              parameter_bytes: int | None = None) -> None:
        """Write the entry for `key` atomically (a concurrent reader sees the old file or the new one)."""
        if self.directory is None:
            return
        try:
            write_atomically(os.path.join(self.directory, f"{key}.json"), json.dumps(
                {"format": _FORMAT, "items": items, "capture": capture, "parameter_bytes": parameter_bytes}))
        except (OSError, TypeError, ValueError):
            return  # a read-only cache directory: the next run captures again
