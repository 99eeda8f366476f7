"""What an analysis is expected to need in memory, the budget it must fit, and the reservations that keep the
analyses of concurrent pytest-xdist workers within one budget together. The gate refuses an analysis that
cannot fit before it starts, so that no model is killed halfway by the out-of-memory killer."""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .files import write_atomically

__all__ = ["ANALYSIS_FACTOR", "HELD_CAPTURES_SHARE", "LARGE_MODEL_BYTES", "MemoryLedger", "available_memory",
           "budgeted_estimate", "estimated_analysis_bytes", "estimated_blockwise_bytes", "holds_capture", "human_bytes",
           "on_accelerator", "over_budget_message"]

# What an analysis with every default check may add beyond the model itself, in its parameter bytes. Cautious for
# the large models the budget concerns (blockwise="auto" goes block-wise sooner than it must) and about right for
# small ones, whose activations outweigh their weights; the performance page gives the measured peaks.
ANALYSIS_FACTOR = 5.0

# A model with at least this many parameter bytes trades time for memory: its analysis maps large allocations
# (core.runtime) and quantizes its weights where they are read (qcore.quantization.convert), so that no quantized
# copy of them is held: not the model's own, nor that of a screen (qcore.measure.screens) or a trial.
LARGE_MODEL_BYTES = 256 << 20

# Collection captures every model before the first analysis starts. The captures a process keeps until their
# analysis (so as not to capture them twice) hold at most this share of the memory budget together; a model past
# it is captured again by the process that analyses it, so that a waiting model does not crowd out a running one.
HELD_CAPTURES_SHARE = 1 / 8

try:
    import fcntl
except ImportError:  # Windows: reservations are not shared between workers
    fcntl = None  # type: ignore[assignment]


def available_memory() -> int | None:
    """The memory the system can give without swapping (Linux's MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def on_accelerator(float_gm: Any) -> bool:
    """Whether a model's parameters, so its analysis's tensors, are on a device other than the CPU: then its memory is
    that device's, which the budget does not cover (an out-of-memory error there is raised, not a kill)."""
    from qcore.analysis import model_device

    return model_device(float_gm).type != "cpu"


def _storage_tensors(tensors: list[Any]) -> list[Any]:
    """The tensors that hold storage: a quantized tensor subclass (torchao's) holds its inner tensors'."""
    import torch

    found = []
    for tensor in tensors:
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
            found.append(tensor)
        else:
            names, _ = tensor.__tensor_flatten__()
            found += _storage_tensors([getattr(tensor, name) for name in names])
    return found


def estimated_analysis_bytes(module: Any) -> tuple[int, int]:
    """(parameter and buffer bytes of `module`, the memory its analysis is expected to add: ANALYSIS_FACTOR times
    those bytes). Storages shared by several tensors count once."""
    seen, total = set(), 0
    for tensor in _storage_tensors([*module.parameters(), *module.buffers()]):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total, int(total * ANALYSIS_FACTOR)


def estimated_blockwise_bytes(float_gm: Any, stack: str | None = None) -> tuple[int, int]:
    """(the biggest block's parameter and buffer bytes, what a block-wise analysis is expected to add: ANALYSIS_FACTOR
    times those bytes); BlockwiseError when the graph has no stack of blocks."""
    from qcore.analysis import split_into_blocks

    biggest = max(estimated_analysis_bytes(block.gm)[0] for block in split_into_blocks(float_gm, stack))
    return biggest, int(biggest * ANALYSIS_FACTOR)


def budgeted_estimate(model: str, analysis: Any, mode: bool | str, budget: int | None, given: bool
                      ) -> tuple[int, str]:
    """(what the model's analysis is expected to add, "") or (0, why it must not start). The analysis goes
    block-wise when `mode` (its blockwise setting) says so, or, for "auto", when the whole model's estimate
    exceeds the budget and a block-wise one does not: then `analysis.blockwise` is set."""
    from qcore.analysis import BlockwiseError

    if getattr(analysis, "artifact", False):
        return _artifact_estimate(model, analysis, mode, budget)
    weights, estimate = estimated_analysis_bytes(analysis.float_gm)
    blockwise: tuple[int, int] | str | None = None
    if analysis.blockwise or (mode == "auto" and budget is not None and estimate > budget):
        try:
            blockwise = estimated_blockwise_bytes(
                analysis.float_gm, analysis.blockwise if isinstance(analysis.blockwise, str) else None)
        except BlockwiseError as error:
            if analysis.blockwise:
                return 0, f"model {model!r}: blockwise={mode!r}: {error}"
            blockwise = str(error)
        else:
            analysis.blockwise = analysis.blockwise or True
            weights, estimate = blockwise
    if budget is not None and estimate > budget:
        return 0, over_budget_message(model, weights, estimate, budget, given=given, blockwise=blockwise)
    return estimate, ""


def _artifact_estimate(model: str, analysis: Any, mode: bool | str, budget: int | None) -> tuple[int, str]:
    """An artifact's estimate and refusal: whole passes, or block by block when its blockwise setting says so, or
    for "auto" when a model is offloaded or whole passes would not fit the budget (analysis.choose_blocks)."""
    from qcore.analysis import BlockwiseArtifactError

    try:
        analysis.choose_blocks(mode, budget)
    except BlockwiseArtifactError as error:
        return 0, f"model {model!r}: blockwise={mode!r}: {error}"
    if analysis.stack is None:
        return analysis.whole_bytes(), ""
    part, onloaded = analysis.blockwise_bytes()
    if budget is not None and onloaded > budget:
        return 0, (f"model {model!r}: does not fit even one block at a time: {part} takes {human_bytes(onloaded)} "
                   f"onloaded in both models, over the memory budget of {human_bytes(budget)}. Fix: run it where "
                   "more memory is free, or on a GPU with qmodel(device='cuda'), or give the budget with "
                   "--qreport-memory-budget if more is free than was measured at the session's start")
    return onloaded, ""


def holds_capture(model_bytes: int, held_bytes: int, budget: int | None) -> bool:
    """Whether a process that holds `held_bytes` of captured models keeps one more of `model_bytes` from its
    collection to its analysis (see HELD_CAPTURES_SHARE); always, when no budget is known."""
    return budget is None or held_bytes + model_bytes <= budget * HELD_CAPTURES_SHARE


def human_bytes(count: float) -> str:
    """`count` bytes as the largest binary unit that keeps it above 1 (e.g. 13.6 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def over_budget_message(model: str, weights: int, estimate: int, budget: int, given: bool,
                        blockwise: tuple[int, int] | str | None = None) -> str:
    """Why a model's analysis was not started, and what would let it run. `blockwise`: the biggest block's bytes and
    the block-wise estimate when that was too much as well, or why the model cannot be analysed block-wise."""
    source = "--qreport-memory-budget / qreport_memory_budget" if given else (
        "the memory available when the session started; set it with --qreport-memory-budget")
    what = "its analysis"
    if isinstance(blockwise, tuple):
        what = "its analysis, even one block at a time (blockwise),"
        weights, estimate = blockwise
    held = "its biggest block's" if isinstance(blockwise, tuple) else "its"
    why_not = (f" It cannot be analysed one block at a time instead: {blockwise}." if isinstance(blockwise, str)
               else "")
    return (f"model {model!r}: {what} is estimated to need {human_bytes(estimate)} on top of the model "
            f"({ANALYSIS_FACTOR:g}x {held} {human_bytes(weights)} of parameters and buffers), more than the memory "
            f"budget of {human_bytes(budget)} ({source}).{why_not} It was not started, so that the out-of-memory "
            "killer cannot end the session halfway; the other models run on. Run it on a machine with more memory, "
            "or, if the estimate is too cautious for this model, raise the budget (--qreport-memory-budget=SIZE, "
            "e.g. 32GiB): the analysis then runs whatever it needs.")


class MemoryLedger:
    """Reservations of one run's concurrent analyses against one budget, in a JSON file beside the run's other
    shared state, guarded by a lock file. A reservation of a process that died is dropped."""

    def __init__(self, run_dir: str, poll: float = 0.2) -> None:
        self.path, self.lock_path, self.poll = Path(run_dir) / "memory.json", Path(run_dir) / "memory.lock", poll

    @contextlib.contextmanager
    def reserved(self, key: str, nbytes: int, budget: int) -> Iterator[None]:
        """Hold `nbytes` of the budget for the block; wait while the other reservations leave too little (one
        analysis that fits the budget alone always starts once it is alone)."""
        while not self._try_reserve(key, nbytes, budget):
            time.sleep(self.poll)
        try:
            yield
        finally:
            self._update(lambda held: held.pop(key, None))

    def resize(self, key: str, nbytes: int) -> None:
        """Set what a held reservation holds (without waiting: its holder has started)."""
        self._update(lambda held: held[key].__setitem__(1, int(nbytes)) if key in held else None)

    def held(self) -> dict[str, list[int]]:
        """{key: [pid, bytes]} of the live reservations."""
        return self._update(lambda held: None)

    def _try_reserve(self, key: str, nbytes: int, budget: int) -> bool:
        granted = []

        def reserve(held: dict[str, list[int]]) -> None:
            if not held or sum(entry[1] for entry in held.values()) + nbytes <= budget:
                held[key] = [os.getpid(), int(nbytes)]
                granted.append(True)

        self._update(reserve)
        return bool(granted)

    def _update(self, change: Any) -> dict[str, list[int]]:
        with open(self.lock_path, "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                held = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                held = {}
            before = dict(held)
            held = {k: v for k, v in held.items() if _alive(int(v[0]))}
            change(held)
            if held != before:
                write_atomically(self.path, json.dumps(held))
            return held


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
