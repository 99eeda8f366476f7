"""Streaming statistics updated together: within one model call, the observers and comparators that run on torch ops
(a GPU, or the CPU without the native kernels) queue their batch instead of running a chain of small ops each, and
every queued update of one kind runs as one chain over all of them when the call returns. A GPU then launches a few
kernels per pass instead of a few per layer.

The queue holds copies (a later in-place op of the graph must not change what was observed): each kind at most
`PENDING_ELEMENTS` elements (or a multiple it names; `LAUNCH_BOUND_SCALE` times as many for values on a GPU and on
the torch path QCORE_NATIVE=0 stands for), and a kind runs early when it would hold more (the small
entries, a batch's range or per-channel statistics, wait for the end of the call). An owner called more than once in
a model call (an observer shared along view and permute ops) has its updates in rounds, run in order: the first
update of every owner, then the second, and so on; a kind whose update does not depend on the order (a running
minimum and maximum) sets `takes_rounds_together` on its flush, and gets every round's entries in one run. Nothing is
held across model calls.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qcore.runtime import native

__all__ = ["LAUNCH_BOUND_SCALE", "PENDING_ELEMENTS", "Flush", "batched_updates", "defer", "flat", "flat_copy",
           "run_pending", "seen_whole", "segment_lengths"]

PENDING_ELEMENTS = 1 << 21  # queued elements of a kind at most: 8 MB of float32 copies, and the working values of a run
# where each early run is a chain of kernel launches (a GPU, or the CPU without the native kernels, which stands for
# one), a kind holds this many times as many: a model call of a small model then runs each kind once or twice, not
# eight times, for a few hundred MB of device memory at the run's peak. A CPU model in bfloat16 (the torch path
# beside the native kernels) keeps the smaller queue: its memory is the host's.
LAUNCH_BOUND_SCALE = 4

Flush = Callable[[list[Any]], None]  # runs the queued entries of one kind, in the order they were queued


class _Queue:
    """The updates queued in one open scope, by kind."""

    def __init__(self) -> None:
        self.rounds: dict[Flush, list[list[Any]]] = {}
        self.owners: dict[Flush, dict[int, int]] = {}  # by kind, owner: its updates queued
        self.held: dict[Flush, int] = {}  # by kind, the elements its entries hold
        self.seen: dict[int, tuple[weakref.ref, int]] = {}  # by owner, the tensor it was last given whole (seen_whole)

    def run(self, kind: Flush | None = None) -> None:
        """Run and forget the queued updates, round by round: every kind's, or only `kind`'s (it is full: the other
        kinds wait for the end of the call)."""
        for flush in list(self.rounds) if kind is None else [kind]:
            queued = self.rounds.pop(flush)
            del self.owners[flush]
            del self.held[flush]
            if getattr(flush, "takes_rounds_together", False):  # its update does not depend on their order
                flush([entry for entries in queued for entry in entries])
            else:
                for entries in queued:
                    flush(entries)

    def owner_queued(self, owner: object) -> bool:
        """Whether `owner` has an update in this queue."""
        return any(id(owner) in owners for owners in self.owners.values())


class _Open(threading.local):
    """The queues open in this thread (a model call in another thread queues apart)."""

    def __init__(self) -> None:
        self.queues: list[_Queue] = []


_open_here = _Open()


@contextlib.contextmanager
def batched_updates() -> Iterator[None]:
    """Queue the updates `defer` is given inside, and run them on the way out (a nested scope joins the outer one;
    an exception drops what was queued, as the batch it came from failed)."""
    opened = _open_here.queues
    if opened:
        yield
        return
    queue = _Queue()
    opened.append(queue)
    try:
        yield
        queue.run()
    finally:
        opened.pop()


def defer(owner: object, flush: Flush, elements: int, entry: Callable[[], Any], scale: int = 1,
          device: torch.device | None = None) -> bool:
    """Queue `entry()` (owner's update of `elements` values on `device`, made only once it is taken) to run with
    `flush`, whose entries hold at most `scale` times PENDING_ELEMENTS values (a kind whose run works in less memory
    per value holds more; LAUNCH_BOUND_SCALE times that on a launch-bound device); False when no scope is open or
    the update alone is larger: the caller then updates now."""
    opened = _open_here.queues
    limit = scale * PENDING_ELEMENTS * (LAUNCH_BOUND_SCALE if device is not None and native.launch_bound(device) else 1)
    if not opened or elements > limit:
        return False
    queue = opened[-1]
    if queue.held.get(flush, 0) + elements > limit:
        queue.run(flush)
    owners = queue.owners.setdefault(flush, {})
    position = owners.get(id(owner), 0)
    rounds = queue.rounds.setdefault(flush, [])
    if position == len(rounds):
        rounds.append([])
    rounds[position].append(entry())
    owners[id(owner)] = position + 1
    queue.held[flush] = queue.held.get(flush, 0) + elements
    return True


def seen_whole(owner: object, x: torch.Tensor) -> bool:
    """Whether `owner` was given all of the tensor `x` views earlier in this model call, and no op wrote to it since
    (an observer shared along view ops sees the same values again); else notes x's tensor when x covers all of it.
    False outside a model call."""
    opened = _open_here.queues
    if not opened or x.requires_grad or x.is_inference():  # no version counter in inference mode
        return False
    viewed = x._base
    base = x if viewed is None else viewed
    if x.numel() != base.numel() or x.dtype != base.dtype:
        return False
    seen = opened[-1].seen
    noted = seen.get(id(owner))
    if noted is not None and noted[1] == base._version and noted[0]() is base:
        return True
    seen[id(owner)] = (weakref.ref(base), base._version)
    return False


def run_pending(owner: object) -> None:
    """Run the queued updates now if `owner` has one (before its state is read inside a scope)."""
    opened = _open_here.queues
    if opened and opened[-1].owner_queued(owner):
        opened[-1].run()


def flat(x: torch.Tensor) -> torch.Tensor:
    """x flattened, without grad (a view where it can be), to queue as it is: for a value nothing changes before the
    queue runs."""
    x = x.detach() if x.requires_grad else x  # detach is an op even under no_grad
    return x if x.dim() == 1 else x.reshape(-1)


def flat_copy(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x flattened into a new tensor (of `dtype`, or its own) to queue: an op after it in the graph may change x in
    place."""
    values = flat(x)
    return values.to(dtype or values.dtype, copy=True)


_LENGTHS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_LENGTHS_KEPT = 256  # queues of distinct compositions: each model call repeats its own from batch to batch


def segment_lengths(device: torch.device, sizes: tuple[int, ...]) -> torch.Tensor:
    """The sizes of a queue's entries as an int64 tensor on `device`, made once per composition: a host-to-device
    copy waits for the device, and the same composition comes again every batch."""
    key = (device, sizes)
    found = _LENGTHS.get(key)
    if found is None:
        if len(_LENGTHS) >= _LENGTHS_KEPT:
            del _LENGTHS[next(iter(_LENGTHS))]
        found = _LENGTHS[key] = torch.tensor(sizes, dtype=torch.int64, device=device)
    return found
