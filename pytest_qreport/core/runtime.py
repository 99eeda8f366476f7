"""How an analysis runs in this process: on a fixed number of torch threads, with the cyclic garbage collector on its
own objects only."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import sys
from collections.abc import Iterator

__all__ = ["freeze_heap_at_exit", "quiet_torch_trace_log", "torch_threads", "trim_heap", "young_garbage_collection"]


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
def young_garbage_collection(map_large_allocations: bool = True) -> Iterator[None]:
    """Run the block with Python's cyclic garbage collector looking at the objects the block makes only: everything
    older is frozen (gc.freeze) for its duration, then thawed, and the heap's free pages go back to the system.
    An analysis builds and drops many graphs, which are reference cycles: left to accumulate they hold a copy of
    the weights each (an LLM's trials ran out of memory), while full collections over every object of the session
    would cost more than the analysis of a small model. With `map_large_allocations`, blocks of 1 MiB or more
    are mapped for the block's duration (a lower peak, more page faults)."""
    if map_large_allocations:
        _set_mmap_threshold(_MAPPED_FROM)
    frozen = gc.isenabled()
    if frozen:
        gc.collect(1)  # what is garbage now is not kept alive for the block's duration
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.collect()  # every generation, but the frozen objects are not looked at: the block's own only
            gc.unfreeze()
        trim_heap()
        if map_large_allocations:
            _set_mmap_threshold(_MAPPED_AFTER)


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
_MAPPED_FROM = 1 << 20
_MAPPED_AFTER = 32 << 20


def _set_mmap_threshold(size: int) -> None:
    """Allocate blocks of `size` bytes or more with mmap (glibc; a no-op elsewhere), so that freeing them gives them
    back to the system. glibc otherwise raises its threshold as blocks are freed, up to 32 MiB, and keeps the
    freed blocks below it in its heap: an analysis's activation streams and quantized copies then stay resident.
    A mapped block is faulted in page by page each time it is allocated, though, which slows every forward of a
    small model; the threshold is a process setting, so it is set back to 32 MiB (where glibc's own would end)
    after the block instead of slowing down what follows.

    Setting the threshold also stops glibc's own adjustment of when free() shrinks the heap, which it keeps at
    twice the threshold: left at its 128 KiB start, every activation freed at the top of the heap would go back
    to the system and be faulted in again at the next allocation. So it is set to twice the threshold here too;
    the explicit trim after each analysis still gives the free pages back."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(_M_MMAP_THRESHOLD, size)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * size)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


_freezing_at_exit: list[bool] = []


def freeze_heap_at_exit() -> None:
    """At interpreter exit, freeze every object (gc.freeze) before CPython's final collection would walk them all.
    A process that imported torch.export and analysed models holds hundreds of thousands of objects, and walking
    them costs seconds of its exit, which an xdist controller waits for once per worker. Objects are still freed
    by reference counting as the modules are cleared; only those in reference cycles are left to the operating
    system, as CPython already does with objects alive at exit. Registered once per process; the other atexit
    handlers run as before (none of them needs the collector)."""
    if not _freezing_at_exit:
        atexit.register(gc.freeze)
        _freezing_at_exit.append(True)


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
