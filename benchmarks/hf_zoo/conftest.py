"""The transformers zoo as a model repository: one @qmodel per architecture of `architectures.py`.

QREPORT_ZOO selects architectures (comma-separated names; all by default).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from architectures import ARCHITECTURES  # noqa: E402

from pytest_qreport import qmodel  # noqa: E402

_SELECTED = [name for name in os.environ.get("QREPORT_ZOO", "").split(",") if name] or list(ARCHITECTURES)


def _declare(name: str) -> None:
    built: dict = {}

    def model():
        built["model"], built["batches"] = ARCHITECTURES[name][1]()
        return built["model"]

    def calibration():
        return built["batches"] if "batches" in built else ARCHITECTURES[name][1]()[1]

    model.__name__ = name
    globals()[name] = qmodel(calibration=calibration, name=name)(model)


for _name in _SELECTED:
    _declare(_name)
