"""Command-line options, ini keys, and how a model's settings resolve: CLI > qmodel(...) > ini > default.

Session-wide values (CLI and ini) are parsed once at start-up; a bad one is a pytest.UsageError.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .registry import SEVERITIES

__all__ = ["DEFAULT_TOLERANCE", "SETTINGS", "ModelSettings", "add_options", "closest", "parse_equalize",
           "parse_severity", "parse_threads", "parse_tolerance", "resolve_settings", "session_settings", "table_mode"]

# setting -> (cli flag, ini key, default, help)
SETTINGS: dict[str, tuple[str, str, Any, str]] = {
    "sqnr_min_db": ("--qreport-sqnr-min-db", "qreport_sqnr_min_db", 20.0,
                    "minimum per-layer SQNR in dB (propagated error)"),
    "model_sqnr_min_db": ("--qreport-model-sqnr-min-db", "qreport_model_sqnr_min_db", 20.0,
                          "minimum SQNR of the model's final output in dB"),
    "weight_sqnr_min_db": ("--qreport-weight-sqnr-min-db", "qreport_weight_sqnr_min_db", 30.0,
                           "minimum SQNR of each quantized weight in dB"),
    "layers": ("--qreport-layers", "qreport_layers", None, "comma-separated layer globs to check (default: all)"),
    "skip_layers": ("--qreport-skip-layers", "qreport_skip_layers", None,
                    "comma-separated layer globs to leave out of the checks (they are still quantized)"),
    "float_layers": ("--qreport-float-layers", "qreport_float_layers", None,
                     "comma-separated layer globs to keep in float (unquantized), through the quantizer's "
                     "layer_overrides"),
    "checks": ("--qreport-checks", "qreport_checks", None,
               "comma-separated checks to run (default: every registered check)"),
    "calibration": ("--qreport-calibration", "qreport_calibration", None,
                    "fixture name giving calibration batches, for models that do not name one"),
    "example_inputs": ("--qreport-example-inputs", "qreport_example_inputs", None,
                       "fixture name giving example inputs (default: the first calibration batch)"),
    "quantizer": ("--qreport-quantizer", "qreport_quantizer", "int8",
                  "int8, int8_per_tensor, int8_histogram, module:attribute of a Quantizer (factory), or a name "
                  "resolved by a pytest_qreport_make_quantizer hook"),
    "equalize": ("--qreport-equalize", "qreport_equalize", None,
                 "equalize models before quantizing: true (input-weight), cross_layer, smooth, smooth:search, "
                 "smooth:<alpha>, or false"),
    "equalization_min_gain_db": ("--qreport-equalization-min-gain-db", "qreport_equalization_min_gain_db", 1.0,
                                 "equalization items fail when equalizing a layer gains at least this many dB"),
    "severity": ("--qreport-severity", "qreport_severity", None,
                 "per-check severity, e.g. 'outlier=warn,per_channel=off' (fail, warn or off)"),
    "baseline_tolerance_db": ("--qreport-baseline-tolerance-db", "qreport_baseline_tolerance_db", None,
                              "how much worse than its baseline a value may get (default 0.5, in the metric's "
                              "unit); a number, or per check: 'sqnr=0.3,outlier=1.0,*=0.5'"),
}
DEFAULT_TOLERANCE = 0.5
_FLOATS = {"sqnr_min_db", "model_sqnr_min_db", "weight_sqnr_min_db", "equalization_min_gain_db"}
_NON_NEGATIVE = {"equalization_min_gain_db"}
_LISTS = {"layers", "skip_layers", "float_layers", "checks"}
TABLE_MODES = ("failures", "all")


def add_options(parser) -> None:
    """Register the plugin's command-line flags and ini keys."""
    group = parser.getgroup("qreport", "quantization quality report")
    group.addoption("--qreport", action="store_true", default=False,
                    help="collect and run quantization-quality items for models declared with @qmodel")
    group.addoption("--qreport-table", choices=TABLE_MODES, default=None,
                    help="summary rows to print: failures (default) or all")
    group.addoption("--qreport-junitxml", metavar="PATH", default=None,
                    help="write a dedicated JUnit XML file, one testsuite per model")
    parser.addini("qreport_table", "summary rows to print: failures or all", default="failures")
    group.addoption("--qreport-update-baseline", action="store_true", default=False,
                    help="write or rewrite the baseline files of the models that ran (never of a model that errored)")
    group.addoption("--qreport-baseline-strict", action="store_true", default=None,
                    help="fail layers missing from a baseline, stale baseline entries, and models without a baseline")
    parser.addini("qreport_baseline_strict", "like --qreport-baseline-strict (true/false)", type="bool",
                  default=False)
    group.addoption("--qreport-baseline-dir", metavar="DIR", default=None,
                    help="where baselines live (default: __qreport__/ beside each declaring conftest.py)")
    parser.addini("qreport_baseline_dir", "where baselines live, relative to the rootdir", default=None)
    group.addoption("--qreport-threads", metavar="N", default=None,
                    help="torch threads for the analysis (default 1, so that serial and -n N runs agree)")
    parser.addini("qreport_threads", "torch threads for the analysis (default 1)", default=None)
    group.addoption("--qreport-json", metavar="PATH", default=None,
                    help="write every row, baseline, delta, fingerprint and timing as JSON (schema 1)")
    group.addoption("--qreport-html", metavar="PATH", default=None,
                    help="write a self-contained HTML report with per-layer charts (pip install "
                         "'pytest-qreport[html]')")
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
    float_layers: list[str] | None
    checks: list[str]
    calibration: Any
    example_inputs: Any
    quantizer: Any
    equalize: Any
    equalization_min_gain_db: float
    severity: dict[str, str]
    check_options: dict[str, dict]
    baseline_tolerance_db: dict[str, float] = field(default_factory=lambda: {"*": DEFAULT_TOLERANCE})

    def tolerance(self, check: str) -> float:
        """The baseline tolerance of one check."""
        return self.baseline_tolerance_db.get(check, self.baseline_tolerance_db.get("*", DEFAULT_TOLERANCE))


def closest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _parse(setting: str, value: Any) -> Any:
    if value is None:
        return None
    if setting in _FLOATS:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting} must be a number of dB, got {value!r}") from None
        if math.isnan(number) or (setting in _NON_NEGATIVE and number < 0):
            raise ValueError(f"{setting} must be a {'non-negative ' if setting in _NON_NEGATIVE else ''}number "
                             f"of dB, got {value!r}")
        return number
    if setting == "equalize":
        return parse_equalize(value)
    if setting in _LISTS:
        if isinstance(value, str):
            return [p.strip() for p in value.replace("\n", ",").split(",") if p.strip()]
        return [str(v) for v in value]
    return value


def parse_equalize(value: Any) -> Any:
    """None (off), True (input-weight on every eligible layer), "cross_layer", "smooth", "smooth:search" or
    "smooth:<alpha>" (SmoothQuant-style smoothing), or a list of layer names."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "false", "no", "off", "none"):
            return None
        if text in ("1", "true", "yes", "on", "input_weight"):
            return True
        if text == "cross_layer":
            return "cross_layer"
        if text == "smooth" or text.startswith("smooth:"):
            from qcore.smoothing import smoothing_alpha

            smoothing_alpha(text)
            return text
        raise ValueError(f"equalize must be true, false, input_weight, cross_layer, smooth, smooth:search or "
                         f"smooth:<alpha>, not {value!r}")
    if value is False:
        return None
    if value is True or isinstance(value, (list, tuple)):
        return value if value is True else list(value)
    raise ValueError(f"equalize must be True, False, 'cross_layer' or a list of layer names, not {value!r}")


def parse_severity(value: Any, checks: Iterable[str]) -> dict[str, str]:
    """{check: level} from a dict or 'check=level' pairs separated by commas, spaces or newlines."""
    if value is None:
        return {}
    known = list(checks)
    pairs = value.items() if isinstance(value, dict) else (
        part.split("=", 1) if "=" in part else (part, "") for part in str(value).replace(",", " ").split())
    result = {}
    for check, level in pairs:
        check, level = str(check).strip(), str(level).strip()
        if check not in known:
            raise ValueError(f"severity for unknown check {check!r}{closest(check, known)}; known checks: "
                             f"{', '.join(known)}")
        if level not in SEVERITIES:
            raise ValueError(f"severity of {check} must be one of {', '.join(SEVERITIES)}, not {level!r}"
                             f"{closest(level, SEVERITIES)}")
        result[check] = level
    return result


def parse_tolerance(value: Any, checks: Iterable[str]) -> dict[str, float] | None:
    """{check or '*': tolerance} from a number, a dict, or 'check=number' pairs; ValueError if bad."""
    if value is None:
        return None
    known = list(checks)
    pairs: list[tuple[Any, Any]]
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, str) and "=" in value:
        pairs = [part.partition("=")[::2] for part in value.replace(",", " ").split()]
    else:
        pairs = [("*", value)]
    result = {}
    for check, raw in pairs:
        check = str(check).strip()
        if check != "*" and check not in known:
            raise ValueError(f"baseline tolerance for unknown check {check!r}{closest(check, known)}")
        try:
            number = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"baseline tolerance of {check} must be a number, got {raw!r}") from None
        if math.isnan(number) or number < 0:
            raise ValueError(f"baseline tolerance of {check} must be a non-negative number, got {raw!r}")
        result[check] = number
    return result


def parse_threads(value: Any) -> int:
    """The analysis thread count: a positive integer (default 1)."""
    if value is None or value == "":
        return 1
    try:
        threads = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"qreport_threads must be a positive integer, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"qreport_threads must be a positive integer, got {value!r}")
    return threads


def _check_names(names: list[str] | None, known: list[str]) -> None:
    for name in names or ():
        if name not in known:
            raise ValueError(f"unknown qreport check {name!r}{closest(name, known)}; known checks: {', '.join(known)}")


def session_settings(config, known_checks: list[str]) -> dict[str, Any]:
    """The CLI and ini values, parsed and validated once: {"cli": {...}, "ini": {...}}; ValueError if bad."""
    parsed: dict[str, Any] = {"cli": {}, "ini": {}}
    for setting, (flag, ini, _default, _text) in SETTINGS.items():
        for source, raw, where in (("cli", config.getoption(f"qreport_{setting}"), flag),
                                   ("ini", config.getini(ini) or None, f"ini {ini}")):
            try:
                value: Any = (parse_severity(raw, known_checks) if setting == "severity" else
                              parse_tolerance(raw, known_checks) if setting == "baseline_tolerance_db" else
                              _parse(setting, raw))
                if setting == "checks":
                    _check_names(value, known_checks)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from error
            parsed[source][setting] = value
    mode = config.getini("qreport_table") or "failures"
    if mode not in TABLE_MODES:
        raise ValueError(f"ini qreport_table must be one of {', '.join(TABLE_MODES)}, not {mode!r}")
    try:
        parsed["threads"] = parse_threads(config.getoption("qreport_threads") or config.getini("qreport_threads"))
    except ValueError as error:
        raise ValueError(f"--qreport-threads: {error}") from error
    strict = config.getoption("qreport_baseline_strict")
    parsed["baseline"] = {
        "update": bool(config.getoption("qreport_update_baseline")),
        "strict": bool(config.getini("qreport_baseline_strict") if strict is None else strict),
        "dir": _baseline_dir(config),
    }
    return parsed


def _baseline_dir(config) -> str | None:
    """--qreport-baseline-dir (relative to the invocation dir) or the ini key (relative to the rootdir)."""
    cli, ini = config.getoption("qreport_baseline_dir"), config.getini("qreport_baseline_dir")
    if cli:
        return str(config.invocation_params.dir / cli)
    return str(config.rootpath / ini) if ini else None


def resolve_settings(session: dict[str, Any], declaration, registry) -> ModelSettings:
    """Merge CLI, the qmodel(...) arguments, ini and defaults for one declared model; ValueError if bad."""
    known = registry.names()
    values: dict[str, Any] = {}
    severity = {check.name: check.default_severity for check in registry.checks()}
    severity.update(session["ini"]["severity"] or {})  # merged key by key: ini, then qmodel, then CLI
    severity.update(parse_severity(declaration.severity, known))
    severity.update(session["cli"]["severity"] or {})
    for setting, (_flag, _ini, default, _text) in SETTINGS.items():
        if setting == "severity":
            continue
        if setting == "baseline_tolerance_db":
            declared = parse_tolerance(declaration.baseline_tolerance_db, known)
        else:
            declared = _parse(setting, getattr(declaration, setting))
        given = (session["cli"][setting], declared, session["ini"][setting])
        values[setting] = next((v for v in given if v is not None), default)
    _check_names(values["checks"], known)
    options = {**(declaration.detector_options or {}), **(declaration.check_options or {})}
    for name in options:
        if name not in known:
            raise ValueError(f"check_options for unknown check {name!r}{closest(name, known)}; known checks: "
                             f"{', '.join(known)}")
    checks = values["checks"] or known
    values["checks"] = [c for c in known if c in checks and severity[c] != "off"]
    values["severity"] = severity
    values["check_options"] = {name: dict(value) for name, value in options.items()}
    tolerance = {"*": DEFAULT_TOLERANCE}
    for source in (session["ini"]["baseline_tolerance_db"], parse_tolerance(declaration.baseline_tolerance_db, known),
                   session["cli"]["baseline_tolerance_db"]):
        tolerance.update(source or {})  # merged key by key, like severity
    values["baseline_tolerance_db"] = tolerance
    return ModelSettings(**values)


def table_mode(config) -> str:
    """'all' or 'failures'."""
    return config.getoption("qreport_table") or config.getini("qreport_table") or "failures"
