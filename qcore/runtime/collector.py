"""When Python's cyclic garbage collector runs its full collections while qcore builds and runs its graphs."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["full_collections_deferred"]

# gen-1 collections between two full ones: more than a measurement makes, so that none runs before its end
_DEFERRED_FULL_THRESHOLD = 1 << 30


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Run the block with the collector's full collections deferred to its end; the younger generations are
    collected as before.

    A measurement builds graphs that all live until it returns: a prepared copy, a quantized one, the float graph
    with its shadows, a screen's copies. Each node is several tracked objects (an MoE's graphs hold hundreds of
    thousands), and CPython runs a full collection whenever the objects that survived the younger generations have
    grown by a quarter, so a measurement's full collections scan its own graphs again and again and find nothing
    to free. Garbage in cycles made during the block is collected with its generation while young, or else at the
    first full collection after the block: once the threshold is restored, the objects the block left pending make
    one due at the next collection of the middle generation."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, _DEFERRED_FULL_THRESHOLD))
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)
