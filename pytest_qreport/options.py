"""Command-line options, ini keys, and how a model's settings resolve: CLI > qmodel(...) > ini > default."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SQNR_CHECKS = ("sqnr", "weight_sqnr", "model_sqnr")
DETECTOR_CHECKS = ("per_channel", "dynamic_static", "input_weight_equalization", "outlier")
EQUALIZATION_CHECKS = ("equalization", "equalization_equivalence")
ALL_CHECKS = SQNR_CHECKS + DETECTOR_CHECKS + EQUALIZATION_CHECKS
SEVERITIES = ("fail", "warn", "off")

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
    "equalize": ("--qreport-equalize", "qreport_equalize", None,
                 "equalize models before quantizing: true (input-weight), cross_layer, or false"),
    "equalization_min_gain_db": ("--qreport-equalization-min-gain-db", "qreport_equalization_min_gain_db", 1.0,
                                 "equalization items fail when equalizing a layer gains at least this many dB"),
    "severity": ("--qreport-severity", "qreport_severity", None,
                 "per-check severity, e.g. 'outlier=warn,per_channel=off' (fail, warn or off; default fail)"),
}
_FLOATS = {"sqnr_min_db", "model_sqnr_min_db", "weight_sqnr_min_db", "equalization_min_gain_db"}
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
    equalize: Any
    equalization_min_gain_db: float
    severity: dict[str, str]
    detector_options: dict[str, dict]


def _parse(setting: str, value: Any) -> Any:
    if value is None:
        return None
    if setting in _FLOATS:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting} must be a number of dB, got {value!r}") from None
    if setting == "equalize":
        return parse_equalize(value)
    if setting in _LISTS:
        if isinstance(value, str):
            return [p.strip() for p in value.replace("\n", ",").split(",") if p.strip()]
        return [str(v) for v in value]
    return value


def parse_equalize(value: Any) -> Any:
    """None (off), True (input-weight on every eligible layer), "cross_layer", or a list of layer names."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "false", "no", "off", "none"):
            return None
        if text in ("1", "true", "yes", "on", "input_weight"):
            return True
        if text == "cross_layer":
            return "cross_layer"
        raise ValueError(f"equalize must be true, false, input_weight or cross_layer, not {value!r}")
    if value is False:
        return None
    if value is True or isinstance(value, (list, tuple)):
        return value if value is True else list(value)
    raise ValueError(f"equalize must be True, False, 'cross_layer' or a list of layer names, not {value!r}")


def parse_severity(value: Any) -> dict[str, str]:
    """{check: level} from a dict or 'check=level' pairs separated by commas, spaces or newlines."""
    if value is None:
        return {}
    pairs = value.items() if isinstance(value, dict) else (
        part.split("=", 1) if "=" in part else (part, "") for part in str(value).replace(",", " ").split())
    result = {}
    for check, level in pairs:
        check, level = str(check).strip(), str(level).strip()
        if check not in ALL_CHECKS:
            raise ValueError(f"severity for unknown check {check!r}; known checks: {', '.join(ALL_CHECKS)}")
        if level not in SEVERITIES:
            raise ValueError(f"severity of {check} must be one of {', '.join(SEVERITIES)}, not {level!r}")
        result[check] = level
    return result


def resolve_settings(config, declaration) -> ModelSettings:
    """Merge CLI, the qmodel(...) arguments, ini and defaults for one declared model."""
    values = {}
    severity = {check: "fail" for check in ALL_CHECKS}  # merged key by key: ini, then qmodel, then CLI
    for source in (config.getini("qreport_severity") or None, declaration.severity,
                   config.getoption("qreport_severity")):
        severity.update(parse_severity(source))
    for setting, (_flag, ini, default, _text) in SETTINGS.items():
        if setting == "severity":
            continue
        cli = config.getoption(f"qreport_{setting}")
        ini_value = config.getini(ini) or None
        chosen = next((v for v in (cli, getattr(declaration, setting), ini_value) if v is not None), default)
        values[setting] = _parse(setting, chosen)
    checks = values["checks"] or list(ALL_CHECKS)
    unknown = [c for c in checks if c not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown qreport check(s) {unknown}; known checks: {', '.join(ALL_CHECKS)}")
    checks = [c for c in checks if c != "equalization_equivalence" or values["equalize"]]
    values["checks"] = [c for c in checks if severity[c] != "off"]
    values["severity"] = severity
    values["detector_options"] = dict(declaration.detector_options or {})
    return ModelSettings(**values)


def table_mode(config) -> str:
    """'all' or 'failures'."""
    return config.getoption("qreport_table") or config.getini("qreport_table") or "failures"
