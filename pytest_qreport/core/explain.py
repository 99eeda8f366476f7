"""Errors as users read them: the model, the user's own frame where it failed, the error and what to do."""
from __future__ import annotations

import os
import sysconfig
import traceback

from .errors import QReportError, QReportModelError
from .findings import Finding

__all__ = ["error_finding", "explain", "is_measurement_error"]


def is_measurement_error(error: BaseException) -> bool:
    """Calibration failures concern the whole model, not one check."""
    import qcore

    return isinstance(error, (qcore.CalibrationError, QReportModelError))


def error_finding(model: str, check: str, layer: str, message: str) -> Finding:
    """The row of an item that errored: nothing was measured."""
    return Finding(model=model, check=check, layer=layer, metric="", value=float("nan"), threshold=float("nan"),
                   verdict="error", message=message)


_PACKAGE_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep + name
                      for name in ("qcore", "pytest_qreport")) + tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})


_QCORE_DIR = _PACKAGE_DIRS[0]


def _user_frames(error: BaseException, cause_only: bool = False) -> list[traceback.FrameSummary]:
    """The frames of the traceback (innermost last) that are the user's code, not torch, qcore or pytest; with
    cause_only, those of the error's cause only (where the model ran)."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ and not cause_only else []
    cause = error.__cause__
    if cause is not None and cause.__traceback__ is not None:
        frames = frames + traceback.extract_tb(cause.__traceback__)
    return [f for f in frames if not f.filename.startswith(_PACKAGE_DIRS) and "site-packages" not in f.filename
            and "/torch/" not in f.filename and "<" not in f.filename[:1]]


def _qcore_frame(error: BaseException | None) -> tuple[str, str] | None:
    """(what failed, where) for the innermost frame of `error` outside torch when it is qcore's own code (an
    observer's, say), not the code that runs the model (qcore.graph.inputs, a graph module's generated code); else
    None."""
    frames = list(traceback.walk_tb(error.__traceback__)) if error is not None else []
    for frame, line in reversed(frames):
        filename = frame.f_code.co_filename
        if "/torch/" in filename:
            continue
        if not filename.startswith(_QCORE_DIR + os.sep) or filename.endswith(os.sep + "inputs.py"):
            return None
        owner = frame.f_locals.get("self")
        name = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
        return name, f"{os.path.basename(filename)}:{line}"
    return None


def explain(model: str, stage: str, error: BaseException) -> str:
    """A message naming the model, the user's frame where it failed (first), the error and what to do."""
    import torch

    import qcore

    if isinstance(error, (QReportError, qcore.CaptureError, qcore.NonDeterministicModelError)):
        text = str(error)
        return text if f"'{model}'" in text else f"model '{model}': {text}"
    stage = getattr(error, "qcore_stage", "") or stage
    if isinstance(error, torch.OutOfMemoryError):
        return (f"model {model!r}: {stage} ran out of memory on its device: {str(error).splitlines()[0]}\n"
                "The memory budget (--qreport-memory-budget) covers the host, not an accelerator's memory. Free "
                "the device's memory, run on one with more, or analyse this model on the CPU (--qreport-device=cpu); "
                "other models run on.")
    frames = _user_frames(error)
    where = f" in {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    trace = "".join(traceback.format_list(frames[-3:])) if frames else ""
    yours = f"\nYour code, innermost last:\n{trace.rstrip()}" if trace else ""
    if isinstance(error, qcore.CalibrationError) and error.batch is not None:  # names its stage and batch itself
        batch, _, cause = str(error).partition(" failed: ")
        own = _qcore_frame(error.__cause__)
        if own is not None and not _user_frames(error, cause_only=True):  # what qcore added to the model failed
            return (f"model {model!r}: {batch} failed in qcore's {own[0]} ({own[1]}), which the analysis adds to "
                    f"the model, not in the model: {cause}\nThe batch is not at fault: report this message to "
                    "pytest-qreport; other models run on.")
        return (f"model {model!r}: {batch} failed{where}: {cause}\nFix the calibration batches: each must be an "
                "input forward() takes, like the first, which the model was captured with; other models run on."
                + yours)
    return (f"model {model!r}: {stage} failed{where}: {type(error).__name__}: {error}\n"
            "Fix the model or its calibration fixture; other models run on." + yours)
