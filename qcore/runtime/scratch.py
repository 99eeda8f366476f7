"""Output buffers reused for large values that live briefly on the CPU.

A weight quantized where it is read lives from that read to its layer's matmul. On the CPU a fresh allocation of
tens of MB comes from the system as new pages, each zeroed on its first write: for a 46 MB weight that costs ten
times the fake quantization that fills it (and an LM head's, every batch of every pass). Within `reused_outputs()`,
`reused_like()` hands out a buffer of the same shape that nothing holds any more instead: no tensor, view or storage
other than the pool's refers to it, which the storage's use count tells.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch

from qcore.runtime import native

__all__ = ["ScratchBuffers", "broadcasts_to", "elementwise", "reused_like", "reused_outputs"]

# smaller allocations come from the heap's free lists already
MIN_REUSED_BYTES = 1 << 20
_POOL: contextvars.ContextVar[ScratchBuffers | None] = contextvars.ContextVar("qcore_scratch_buffers", default=None)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class ScratchBuffers:
    """At most `per_shape` buffers of each CPU shape and dtype, each handed out again once nothing else holds it."""

    def __init__(self, per_shape: int = 2) -> None:
        self.per_shape = per_shape
        # (shape, dtype) -> [(buffer, its storage, the storage's use count when only the pool holds it)]
        self._buffers: dict[tuple, list[tuple[torch.Tensor, torch.UntypedStorage, int]]] = {}

    def empty_like(self, x: torch.Tensor) -> torch.Tensor:
        """A contiguous uninitialized tensor of x's shape and dtype on a free pooled buffer, or on a new one (pooled
        while the pool has room for its shape). Each is a view of the pooled buffer, so that while it, or a view of
        it, is alive the storage's use count says the buffer is taken."""
        entries = self._buffers.setdefault((tuple(x.shape), x.dtype), [])
        for buffer, storage, idle in entries:
            if _use_count(storage._cdata) == idle:  # type: ignore[misc]
                return buffer.view(buffer.shape)
        buffer = torch.empty(x.shape, dtype=x.dtype)
        if len(entries) >= self.per_shape:
            return buffer
        storage = buffer.untyped_storage()
        entries.append((buffer, storage, _use_count(storage._cdata)))  # type: ignore[misc]
        return buffer.view(buffer.shape)

    def clear(self) -> None:
        """Let every pooled buffer go."""
        self._buffers.clear()


@contextlib.contextmanager
def reused_outputs(per_shape: int = 2) -> Iterator[ScratchBuffers]:
    """Within the block, reused_like() of a large CPU tensor reuses buffers nothing holds any more; they go at the
    end of the block."""
    pool = ScratchBuffers(per_shape)
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)
        pool.clear()


def reused_like(x: torch.Tensor) -> torch.Tensor | None:
    """A contiguous uninitialized tensor of x's shape and dtype from reused_outputs()'s pool, for a large float32 CPU
    x outside autograd; None where no pool is open or x is not such a tensor. Not on the torch path (QCORE_NATIVE=0):
    it stands for a GPU, whose caching allocator reuses memory already, so its op count stays a GPU's. Not for
    bfloat16 or float16: their weights are rewritten on chains of slower ops, beside which fresh pages cost little,
    and the pool would hold two of each weight shape for the whole analysis."""
    pool = _POOL.get()
    if (pool is None or _use_count is None or not x.is_cpu or x.dtype != torch.float32 or native.kernel() is None
            or x.layout is not torch.strided or x.numel() * x.element_size() < MIN_REUSED_BYTES
            or (x.requires_grad and torch.is_grad_enabled())):
        return None
    return pool.empty_like(x)


def elementwise(op: Callable[..., torch.Tensor], x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """op(x, other) of a binary elementwise op (torch.mul, torch.div), into a reused buffer where one is free and the
    result has x's shape and dtype: the same values. A matrix times or divided by one factor a column or one a row
    (a weight rewritten where it is read) is one pass of the native kernel, whose large outputs are streamed out as
    the rows kernels' are: written with plain stores, as torch's op writes them, such an output costs up to three
    times as much in an analysis whose matmuls read the weights on the other core."""
    if ((other.is_floating_point() and other.dtype != x.dtype) or other.requires_grad
            or not broadcasts_to(other.shape, x.shape)):
        return op(x, other)
    out = reused_like(x)
    if out is None:
        return op(x, other)
    lines = _factor_lines(x, other) if op is torch.mul or op is torch.div else None
    if lines is None:
        return op(x, other, out=out)
    library = native.kernel()
    assert library is not None  # reused_like hands out buffers only where it is built
    x, factors = x.contiguous(), other.contiguous()
    library.qcore_scale_lines(x.data_ptr(), factors.data_ptr(), int(lines == "columns"), int(op is torch.div),
                              out.data_ptr(), x.shape[0], x.shape[1], native.threads(x.numel()),
                              native.streams(out.nbytes))
    return out


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of `shape` broadcasts to `target` without widening it (torch.broadcast_shapes(target,
    shape) == target), without torch's checks: a weight rewritten where it is read asks at every read."""
    return len(shape) <= len(target) and all(size == 1 or size == wanted
                                             for size, wanted in zip(reversed(shape), reversed(target)))


def _factor_lines(x: torch.Tensor, other: torch.Tensor) -> str | None:
    """"columns" where `other` is one float32 factor a column of the matrix x ([1, columns] or [columns]), "rows"
    where it is one a row ([rows, 1]), else None."""
    if x.dim() != 2 or other.dtype != torch.float32 or other.device != x.device:
        return None
    if tuple(other.shape) in ((1, x.shape[1]), (x.shape[1],)):
        return "columns"
    if tuple(other.shape) == (x.shape[0], 1):
        return "rows"
    return None
