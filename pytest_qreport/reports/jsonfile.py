"""--qreport-json PATH: every row of the session as JSON, written atomically by the controller.

Schema 1::

    {
      "schema": 1,
      "created": "2026-11-22T03:40:00+00:00",
      "versions": {"pytest_qreport": "0.1.0", "qcore": "0.1.0", "torch": "2.13.0", "python": "3.11.7"},
      "models": {"<model>": {"baseline_path": "...", "fingerprint": {...} | null,
                             "capture": {"method": "export" | "fx", "export_error": "..."}, "error": "...",
                             "seconds": {"capture": 1.2, "calibration": 0.4, "comparison": 0.6, "trials": 2.1,
                                         "other": 0.3}, "line": 12,
                             "fix_budget": {"fix_budget": 1.0 | null, "verdict_runs": 16.0, "trial_runs": 13.4,
                                            "share": 0.84 | null, "verdict_seconds": 1.0, "trial_seconds": 2.1,
                                            "stopped_searches": 1}}},
      "rows": [{"model", "check", "layer", "metric", "value", "threshold", "verdict", "message", "details",
                "waiver", "nodeid", "duration", "baseline", "delta", "baseline_status"}, ...]
    }

A model's key is its name, or "<conftest path>::<name>" when conftests in two directories declare the
same name; its rows carry the same key in "model". Rows come in collection order; `duration` is the item's
check time; a model's analysis time is in its "seconds", per stage, and what its fix searches spent of its
fix budget (in graph runs on one batch; null: unlimited) in its "fix_budget". Non-finite numbers are the strings
"nan", "inf" and "-inf", so that the file is strict JSON. A --qreport-shard run adds
"shard": {"index": I, "count": N, "units": [every model's unit, in collection order], "run": [this shard's units]}.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
from collections.abc import Mapping
from typing import Any

import pytest

from ..core.findings import Finding
from ..core.numbers import normalized
from ..core.results import ModelFacts, RunResults
from .outputs import write_report

__all__ = ["JSON_SCHEMA", "build_report", "pytest_qreport_report"]

JSON_SCHEMA = 1


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        value = normalized(value)  # nan_to_num's FLT_MAX is an infinity here too
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def build_report(rows: list[Finding], models: Mapping[str, ModelFacts],
                 shard: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report as builtins (schema 1); `shard`: what a --qreport-shard run ran (the merge reads it)."""
    import torch

    import qcore

    report = {
        "schema": JSON_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"pytest_qreport": qcore.__version__, "qcore": qcore.__version__, "torch": str(torch.__version__),
                     "python": platform.python_version()},
        "models": {name: {key: value for key, value in facts.to_dict().items() if key != "name"}
                   for name, facts in sorted(models.items())},
        "rows": [row.to_dict() for row in rows],
    }
    if shard is not None:
        report["shard"] = dict(shard)
    return _strict(report)


def pytest_qreport_report(results: RunResults, config: pytest.Config) -> str | None:
    """Write --qreport-json when it is given (and the run completed); ReportError when it cannot be written."""
    return write_report(config, results, "--qreport-json", "JSON report",
                        lambda: json.dumps(build_report(list(results.rows), results.models, results.shard), indent=1,
                                           sort_keys=True, allow_nan=False) + "\n")
