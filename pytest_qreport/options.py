"""Command-line options, ini keys, and how a model's settings resolve: CLI > qmodel(...) > ini > default."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALL_CHECKS = ("sqnr", "weight_sqnr", "model_sqnr")

# setting -> (cli flag, ini key, default, help)
SETTINGS: dict[str, tuple[str, str, Any, str]] = {
    "sqnr_min_db": ("--qreport-sqnr-min-db", "qreport_sqnr_min_db", 20.0,
                    "minimum per-layer SQNR in dB (propagated error)"),
    "model_sqnr_min_db": ("--qreport-model-sqnr-min-db", "qreport_model_sqnr_min_db", 20.0,
                          "minimum SQNR of the model's final output in dB"),
    "weight_sqnr_min_db": ("--qreport-weight-sqnr-min-db", "qreport_weight_sqnr_min_db", 30.0,
                           "minimum SQNR of each quantized weight in dB"),
    "layers": ("--qreport-layers", "qreport_layers", None, "comma-separated layer globs to check (default: all)"),
    "skip_layers": ("--qreport-skip-layers", "qreport_skip_layers", None, "comma-separated layer globs to skip"),
    "checks": ("--qreport-checks", "qreport_checks", None,
               "comma-separated checks to run: " + ", ".join(ALL_CHECKS) + " (default: all)"),
    "calibration": ("--qreport-calibration", "qreport_calibration", None,
                    "fixture name giving calibration batches, for models that do not name one"),
    "example_inputs": ("--qreport-example-inputs", "qreport_example_inputs", None,
                       "fixture name giving example inputs (default: the first calibration batch)"),
    "quantizer": ("--qreport-quantizer", "qreport_quantizer", "int8",
                  "int8, int8_per_tensor, int8_histogram, or module:attribute of a Quantizer (factory)"),
}
_FLOATS = {"sqnr_min_db", "model_sqnr_min_db", "weight_sqnr_min_db"}
_LISTS = {"layers", "skip_layers", "checks"}


def add_options(parser) -> None:
    """Register the plugin's command-line flags and ini keys."""
    group = parser.getgroup("qreport", "quantization quality report")
    group.addoption("--qreport", action="store_true", default=False,
                    help="collect and run quantization-quality items for models declared with @qmodel")
    group.addoption("--qreport-table", choices=("failures", "all"), default=None,
                    help="summary rows to print: failures (default) or all")
    group.addoption("--qreport-junitxml", metavar="PATH", default=None,
                    help="write a dedicated JUnit XML file, one testsuite per model")
    parser.addini("qreport_table", "summary rows to print: failures or all", default="failures")
    for setting, (flag, ini, _default, text) in SETTINGS.items():
        group.addoption(flag, dest=f"qreport_{setting}", default=None, help=text)
        parser.addini(ini, text, default=None)


@dataclass
class ModelSettings:
    """The effective settings of one model."""

    sqnr_min_db: float
    model_sqnr_min_db: float
    weight_sqnr_min_db: float
    layers: list[str] | None
    skip_layers: list[str] | None
    checks: list[str]
    calibration: Any
    example_inputs: Any
    quantizer: Any


def _parse(setting: str, value: Any) -> Any:
    if value is None:
        return None
    if setting in _FLOATS:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting} must be a number of dB, got {value!r}") from None
    if setting in _LISTS:
        if isinstance(value, str):
            return [p.strip() for p in value.replace("\n", ",").split(",") if p.strip()]
        return [str(v) for v in value]
    return value


def resolve_settings(config, declaration) -> ModelSettings:
    """Merge CLI, the qmodel(...) arguments, ini and defaults for one declared model."""
    values = {}
    for setting, (_flag, ini, default, _text) in SETTINGS.items():
        cli = config.getoption(f"qreport_{setting}")
        ini_value = config.getini(ini) or None
        chosen = next((v for v in (cli, getattr(declaration, setting), ini_value) if v is not None), default)
        values[setting] = _parse(setting, chosen)
    checks = values["checks"] or list(ALL_CHECKS)
    unknown = [c for c in checks if c not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown qreport check(s) {unknown}; known checks: {', '.join(ALL_CHECKS)}")
    values["checks"] = checks
    return ModelSettings(**values)


def table_mode(config) -> str:
    """'all' or 'failures'."""
    return config.getoption("qreport_table") or config.getini("qreport_table") or "failures"
