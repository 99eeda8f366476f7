"""The end of a --qreport process: what runs after the tests does not make the garbage collector walk the heap
the run built (torch.export's modules, the analyses' caches, 21,000 reports under xdist)."""
from __future__ import annotations

from typing import Any

import pytest

from ..core.runtime import freeze_heap_at_exit, young_garbage_collection

__all__ = ["QuietHeapAtEnd"]


class QuietHeapAtEnd:
    """Registered with --qreport in every process, controller and workers alike."""

    def __init__(self) -> None:
        freeze_heap_at_exit()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self) -> Any:
        """Every plugin's terminal summary, with the collector on the objects the summaries make only: one that
        imports a library there (hypothesis does) otherwise sets off full collections of the session's heap at
        each process's end."""
        with young_garbage_collection(map_large_allocations=False):
            return (yield)
