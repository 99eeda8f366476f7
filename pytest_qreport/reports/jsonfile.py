"""--qreport-json PATH: every row of the session as JSON, written atomically by the controller.

Schema 1::

    {
      "schema": 1,
      "created": "2026-11-22T03:40:00+00:00",
      "versions": {"pytest_qreport": "0.1.0", "qcore": "0.1.0", "torch": "2.13.0", "python": "3.11.7"},
      "models": {"<model>": {"baseline_path": "...", "fingerprint": {...} | null}},
      "rows": [{"model", "check", "layer", "metric", "value", "threshold", "verdict", "message", "details",
                "waiver", "nodeid", "duration", "baseline", "delta", "baseline_status"}, ...]
    }

A model's key is its name, or "<conftest path>::<name>" when conftests in two directories declare the
same name; its rows carry the same key in "model". Rows come in collection order; `duration` is the item's
seconds (the first item of a model includes its analysis). Non-finite numbers are the strings "nan", "inf"
and "-inf", so that the file is strict JSON.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
from typing import Any

import pytest

from .findings import Finding, RunOutcome
from .junit import keep_previous_file, write_atomically

__all__ = ["JSON_SCHEMA", "build_report", "pytest_qreport_report"]

JSON_SCHEMA = 1


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def build_report(rows: list[Finding], models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report as builtins (schema 1)."""
    import torch

    import qcore

    return _strict({
        "schema": JSON_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"pytest_qreport": qcore.__version__, "qcore": qcore.__version__, "torch": str(torch.__version__),
                     "python": platform.python_version()},
        "models": {name: {"baseline_path": info.get("baseline_path"), "fingerprint": info.get("fingerprint")}
                   for name, info in sorted(models.items())},
        "rows": [row.to_dict() for row in rows],
    })


def pytest_qreport_report(rows: list[Finding], config: pytest.Config, outcome: RunOutcome) -> None:
    """Write --qreport-json when it is given (and the run completed)."""
    path = config.getoption("qreport_json", default=None)
    if path and not keep_previous_file(config, "--qreport-json", path, outcome):
        from .items import STATE_KEY

        report = build_report(rows, config.stash[STATE_KEY].models_by_label())
        write_atomically(path, json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n")
