"""How an analysis runs in this process: on a fixed number of torch threads, without the cyclic garbage collector."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
from collections.abc import Iterator

__all__ = ["garbage_collection_paused", "quiet_torch_trace_log", "torch_threads"]


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block on `threads` torch threads, then restore the count (float rounding depends on it)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Run the block without Python's cyclic garbage collector, then free what it left and return freed heap to
    the system. An analysis builds many graph objects: full collections over every object of the session would
    cost more than the analysis itself. Graph modules are reference cycles, so what the block discarded is all
    young, and one young-generation collection frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect(1)
        _trim_heap()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)




@contextlib.contextmanager
def quiet_torch_trace_log() -> Iterator[None]:
    """Silence torch's structured-trace logger ("torch.__trace", for tlparse) during the block: torch.export and
    each graph code generation log empty DEBUG records to it, and pytest, which attaches its capture handlers to
    that logger too, would show them under a failing test's captured log."""
    trace_log = logging.getLogger("torch.__trace")
    disabled = trace_log.disabled
    trace_log.disabled = True
    try:
        yield
    finally:
        trace_log.disabled = disabled
