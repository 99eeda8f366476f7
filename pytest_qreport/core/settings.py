"""The settings of the gate, declared once (see schema.py), and how they resolve: command line, then
`qmodel(...)`, then ini, then the default. Session-wide values (command line and ini) are parsed once at
start-up; a bad one is a pytest.UsageError.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .schema import (
    Setting,
    blockwise_value,
    boolean,
    byte_size,
    check_names,
    choice,
    closest,
    device_value,
    equalize_value,
    fix_budget_value,
    globs,
    layer_format_pairs,
    layer_override_pairs,
    mapping,
    positive_integer,
    severity_pairs,
    text,
    tolerance_pairs,
)
from .shards import shard_value

__all__ = ["DEFAULT_TOLERANCE", "MODEL_SETTINGS", "SESSION_SETTINGS", "ModelSettings", "add_options", "argparse_help",
           "model_schema", "resolve_settings", "session_settings", "table_mode"]

DEFAULT_TOLERANCE = 0.5
TABLE_MODES = ("failures", "all")
_NOT_ON_COMMAND_LINE = frozenset({"qmodel"})

# settings of every model, whatever its checks; each check's own thresholds live on the check (Check.settings)
MODEL_SETTINGS: tuple[Setting, ...] = (
    Setting("calibration", text, None, "fixture name giving calibration batches (in qmodel: also a callable or an "
            "iterable of batches)", metavar="NAME", shown_default="—"),
    Setting("eval_batches", text, None, "fixture name giving evaluation batches for kl_divergence, top1_agreement, "
            "perplexity and task_metric (default: the calibration batches; in qmodel: also a callable or an "
            "iterable of batches)", metavar="NAME", shown_default="calibration"),
    Setting("quantized", text, None, "the quantized model to gate, as shipped (artifact mode): a fixture name or a "
            "callable returning it (a torchao, compressed-tensors, ModelOpt, bitsandbytes, quanto, HQQ or GPTQModel "
            "model), or a dict of names to such artifacts, each gated as `model[name]` against the one reference; "
            "the model function then returns its float reference, and nothing is quantized by the plugin",
            places=_NOT_ON_COMMAND_LINE,
            shown_default="—"),
    Setting("example_inputs", text, None, "fixture name giving example inputs (default: the first calibration "
            "batch)", metavar="NAME", shown_default="first batch"),
    Setting("quantizer", text, "int8", "int8, int8_per_tensor, int8_histogram, a deployed format (W8A8, W8A16, "
            "W4A16, W4A16_ASYM, FP8, FP8_DYNAMIC, FP8_BLOCK, MXFP8, MXFP4, NVFP4, NVFP4A16), module:attribute of a "
            "Quantizer (factory), or a name resolved by a pytest_qreport_make_quantizer hook (in qmodel: also a "
            "qcore.Quantizer)", metavar="NAME", shown_default="`int8`"),
    Setting("layers", globs, None, "comma-separated layer globs to check (default: all)", metavar="GLOBS",
            shown_default="all"),
    Setting("skip_layers", globs, None, "comma-separated layer globs to leave out of the checks (they are still "
            "quantized)", metavar="GLOBS", shown_default="none"),
    Setting("layer_formats", layer_format_pairs, None, "per-layer formats on top of the model's quantizer (a "
            "format such as W8A8, FP8 or NVFP4): 'glob=FORMAT,...', float to keep a layer in float (a dict in "
            "qmodel); merged key by key", metavar="PAIRS", merge=True, shown_default="none"),
    Setting("layer_overrides", layer_override_pairs, None, "per-layer int8 settings on top of the model's quantizer: "
            "{glob: {'per_channel': bool, 'is_dynamic': bool, 'activation_observer': 'minmax' | 'histogram', "
            "'skip': bool}}, as the verified fixes print them; merged key by key", places=_NOT_ON_COMMAND_LINE,
            merge=True, shown_default="none"),
    Setting("float_layers", globs, None, "comma-separated layer globs to keep in float (unquantized), through the "
            "quantizer's layer_overrides", metavar="GLOBS", shown_default="none"),
    Setting("checks", check_names, None, "comma-separated checks to run (default: every registered check)",
            metavar="LIST", shown_default="all"),
    Setting("severity", severity_pairs, None, "per-check severity, e.g. 'outlier=warn,per_channel=off' (fail, warn "
            "or off; a dict in qmodel); merged key by key", metavar="PAIRS", merge=True, shown_default="all `fail`"),
    Setting("equalize", equalize_value, None, "equalize models before quantizing: true (input-weight), cross_layer, "
            "smooth, smooth:search, smooth:<alpha>, false, or (in qmodel) a list of layers or layer globs",
            shown_default="off"),
    Setting("blockwise", blockwise_value, "auto", "analyse one block of the model's stack (model.layers) at a time, "
            "holding one block's quantized weights: true, false, a stack's module path, or auto (when the whole "
            "model's analysis is estimated to exceed the memory budget)", metavar="{auto,true,false,PATH}",
            shown_default="`auto`"),
    Setting("device", device_value, None, "torch device to analyse the model on (cuda, cuda:1, cpu): the model and "
            "its batches are moved there (default: auto, where the model's parameters are)", metavar="DEVICE",
            shown_default="`auto`"),
    Setting("baseline_tolerance_db", tolerance_pairs, None, "how much worse than its baseline a value may get "
            "(default 0.5, in the metric's unit); a number, or per check: 'sqnr=0.3,outlier=1.0,*=0.5'",
            metavar="TOL", merge=True, shown_default="0.5"),
    Setting("fix_budget", fix_budget_value, 1.0, "what the fix searches of a model's failing items may spend, as a "
            "multiple of its verdict pass (the calibration and comparison passes every verdict comes from), counted "
            "in graph runs on one batch: 0 for verdicts only, unlimited for every search to its end", metavar="X",
            shown_default="1"),
    Setting("check_options", mapping, None, "options per check, custom checks included (they read them as "
            "self.options), e.g. {'outlier': {'ratio_threshold': 5.0}}", places=_NOT_ON_COMMAND_LINE, merge=True,
            shown_default="—"),
    Setting("detector_options", mapping, None, "the older name of check_options for the detector checks (merged "
            "into it)", places=_NOT_ON_COMMAND_LINE, merge=True, shown_default="—"),
)

# settings of the whole run
SESSION_SETTINGS: tuple[Setting, ...] = (
    Setting("table", choice(*TABLE_MODES), "failures", "summary rows to print: failures (default) or all",
            scope="session", places=frozenset({"cli", "ini"}), metavar="{failures,all}", shown_default="`failures`"),
    Setting("junitxml", text, None, "write a dedicated JUnit XML file, one testsuite per model", scope="session",
            places=frozenset({"cli"}), metavar="PATH", shown_default="—"),
    Setting("json", text, None, "write every row, baseline, delta, fingerprint and timing as JSON (schema 1)",
            scope="session", places=frozenset({"cli"}), metavar="PATH", shown_default="—"),
    Setting("html", text, None, "write a self-contained HTML report with per-layer charts (pip install "
            "'pytest-qreport[html]')", scope="session", places=frozenset({"cli"}), metavar="PATH", shown_default="—"),
    Setting("update_baseline", boolean, False, "write or rewrite the baseline files of the models that ran (never "
            "of a model that errored)", scope="session", places=frozenset({"cli"}), flag_action="store_true",
            shown_default="off"),
    Setting("baseline_strict", boolean, False, "fail layers missing from a baseline, stale baseline entries, and "
            "models without a baseline", scope="session", places=frozenset({"cli", "ini"}), flag_action="store_true",
            shown_default="off"),
    Setting("baseline_dir", text, None, "where baselines live (default: __qreport__/ beside each declaring "
            "conftest.py); on the command line relative to the invocation directory, in the ini file to the rootdir",
            scope="session", places=frozenset({"cli", "ini"}), metavar="DIR", shown_default="`__qreport__/`"),
    Setting("threads", positive_integer, 1, "torch threads for the analysis (default 1, so that serial and -n N "
            "runs agree)", scope="session", places=frozenset({"cli", "ini"}), metavar="N", shown_default="1"),
    Setting("shard", shard_value, None, "run shard I of N (e.g. 2/4): whole models only, spread over the shards by "
            "their recorded seconds (the durations file, else the cache, else item counts); other tests are left "
            "alone; merge the shards' JSON reports with python -m pytest_qreport.merge", scope="session",
            places=frozenset({"cli", "ini"}), metavar="I/N", shown_default="—"),
    Setting("durations", text, ".qreport_durations", "the file of each model's seconds that --qreport-shard spreads "
            "models by (commit it, as pytest-split's .test_durations), relative to the rootdir", scope="session",
            places=frozenset({"cli", "ini"}), metavar="PATH", shown_default="`.qreport_durations`"),
    Setting("store_durations", boolean, False, "write each model's seconds in this run into the durations file "
            "(merged with the models it already holds)", scope="session", places=frozenset({"cli"}),
            flag_action="store_true", shown_default="off"),
    Setting("memory_budget", byte_size, None, "host memory the analyses may add, shared by the -n workers (e.g. "
            "16GiB; default: what is available when the session starts); a model estimated to need more errors at "
            "once, and a worker waits while the others' analyses hold too much (a model on a GPU uses the GPU's "
            "memory instead, and is not held to it)", scope="session",
            places=frozenset({"cli", "ini"}), metavar="SIZE", shown_default="available memory"),
)


def model_schema(check_classes: Iterable[Any] = ()) -> dict[str, Setting]:
    """Every per-model setting by name: the general ones, then each check's own (Check.settings)."""
    declared = list(MODEL_SETTINGS) + [setting for check in check_classes for setting in getattr(check, "settings", ())]
    return {setting.name: setting for setting in declared}


def add_options(parser, check_classes: Iterable[Any]) -> None:
    """Register the plugin's command-line flags and ini keys, all from the schema (the general settings, the
    session's, and the settings of `check_classes`: the checks known before pytest parses its options)."""
    group = parser.getgroup("qreport", "quantization quality report (a model's settings: the command line "
                            "overrides qmodel(...), which overrides the ini file, which overrides the default)")
    group.addoption("--qreport", action="store_true", default=False,
                    help="collect and run quantization-quality items for models declared with @qmodel")
    for setting in (*SESSION_SETTINGS, *model_schema(check_classes).values()):
        if setting.flag:
            if setting.flag_action:
                # None when not given, so that the ini key can apply
                default = None if setting.ini else setting.default
                group.addoption(setting.flag, dest=setting.dest, action=setting.flag_action, default=default,
                                help=argparse_help(option_help(setting)))
            else:
                group.addoption(setting.flag, dest=setting.dest, metavar=setting.metavar, default=None,
                                help=argparse_help(option_help(setting)))
        if setting.ini:
            parser.addini(setting.ini, setting.help, default=None)


def shown_default(setting: Setting) -> str:
    """The default as the options table and --help show it."""
    return setting.shown_default or ("—" if setting.default is None else f"{setting.default}")


def option_help(setting: Setting) -> str:
    """A flag's --help text: what it does, its default, and what it overrides."""
    text = setting.help.removesuffix("; merged key by key")  # said below, with what it is merged over
    if "default" not in text:
        default = shown_default(setting).replace("`", "")
        text += f" (default: {'none' if default == '—' else default})"
    if "qmodel" in setting.places:
        over = "merged key by key over" if setting.merge else "overrides"
        text += f"; {over} qmodel({setting.name}=...)"
    return text


def argparse_help(text: str) -> str:
    """`text` with `%` escaped: argparse formats every help string with `%` (a bare one breaks `pytest --help`)."""
    return text.replace("%", "%%")


class ModelSettings:
    """The effective settings of one model, read as attributes (`settings.sqnr_min_db`); immutable."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def defaults(cls, check_classes: Iterable[Any] = (), **values: Any) -> ModelSettings:
        """Every setting at its default, with `values` instead where given (for code that calls qcore directly)."""
        schema = model_schema(check_classes)
        unknown = sorted(set(values) - set(schema))
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}{closest(unknown[0], schema)}")
        resolved = {name: setting.default for name, setting in schema.items()}
        resolved.update(severity={}, check_options={}, baseline_tolerance_db={"*": DEFAULT_TOLERANCE}, checks=[])
        resolved.update(values)
        return cls(resolved)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}{closest(name, self._values)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ModelSettings are immutable; use replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelSettings) and self._values == other._values

    def __repr__(self) -> str:
        return f"ModelSettings({self._values!r})"

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name."""
        return dict(self._values)

    def replace(self, **changes: Any) -> ModelSettings:
        """A copy with some settings changed."""
        return ModelSettings({**self._values, **changes})

    def tolerance(self, check: str) -> float:
        """The baseline tolerance of one check."""
        tolerance = self._values.get("baseline_tolerance_db") or {}
        return tolerance.get(check, tolerance.get("*", DEFAULT_TOLERANCE))


def _parsed(setting: Setting, raw: Any, checks: Sequence[str], where: str = "") -> Any:
    """`raw` parsed by its setting; ValueError naming the setting (and where it was given)."""
    try:
        return setting.value(raw, checks)
    except ValueError as error:
        message = f"{setting.name} {error}" if str(error).startswith("must") else str(error)
        raise ValueError(f"{where}: {message}" if where else message) from error


def session_settings(config, registry) -> dict[str, Any]:
    """The command-line and ini values, parsed and validated once against the registry's checks; ValueError if bad.

    {"cli": {setting: value}, "ini": {...}} for the per-model settings, "threads" and "baseline" ({"update",
    "strict", "dir"}) for the session's."""
    parsed: dict[str, Any] = {"cli": {}, "ini": {}}
    known_checks = registry.names()
    for setting in model_schema(registry.checks()).values():
        cli = config.getoption(setting.dest, default=None) if setting.flag else None
        ini = _ini(config, setting.ini) if setting.ini else None
        parsed["cli"][setting.name] = _parsed(setting, cli, known_checks, setting.flag or "")
        parsed["ini"][setting.name] = _parsed(setting, ini, known_checks, f"ini {setting.ini}")
    values = {setting.name: _session_value(config, setting) for setting in SESSION_SETTINGS}
    parsed["threads"] = values["threads"]
    parsed["memory_budget"] = values["memory_budget"]
    parsed["table"] = values["table"]
    parsed["shard"] = values["shard"]
    parsed["store_durations"] = bool(values["store_durations"])
    parsed["durations"] = os.path.join(str(config.rootpath), values["durations"])
    parsed["baseline"] = {"update": bool(values["update_baseline"]), "strict": bool(values["baseline_strict"]),
                          "dir": _baseline_dir(config)}
    return parsed


def _session_value(config, setting: Setting) -> Any:
    """A session setting: the command line, else the ini key, else the default; ValueError naming the place."""
    cli = config.getoption(setting.dest) if setting.flag else None
    if cli is not None and cli is not False:
        return _parsed(setting, cli, (), setting.flag or "")
    ini = _ini(config, setting.ini) if setting.ini else None
    if ini is not None:
        return _parsed(setting, ini, (), f"ini {setting.ini}")
    return setting.default


def _ini(config, key: str) -> Any:
    """An ini value, None when not set (or when the key was declared by no plugin loaded at start-up)."""
    try:
        return config.getini(key) or None
    except ValueError:
        return None


def _baseline_dir(config) -> str | None:
    """--qreport-baseline-dir (relative to the invocation dir) or the ini key (relative to the rootdir)."""
    cli, ini = config.getoption("qreport_baseline_dir"), config.getini("qreport_baseline_dir")
    if cli:
        return str(config.invocation_params.dir / cli)
    return str(config.rootpath / ini) if ini else None


def resolve_settings(session: dict[str, Any], declaration, registry) -> ModelSettings:
    """Merge the command line, the qmodel(...) arguments, ini and defaults for one declared model; ValueError if
    bad (an unknown qmodel keyword names the closest valid one)."""
    known = registry.names()
    schema = model_schema(registry.checks())
    given = dict(declaration.settings)
    unknown = [keyword for keyword in given if keyword not in schema or "qmodel" not in schema[keyword].places]
    if unknown:
        valid = [name for name, s in schema.items() if "qmodel" in s.places] + ["name"]
        problems = ", ".join(f"{keyword!r}{closest(keyword, valid)}" for keyword in unknown)
        raise ValueError(f"model {declaration.name!r}: qmodel() got unknown keyword argument(s) {problems}; valid "
                         f"keywords: {', '.join(valid)}")
    values: dict[str, Any] = {}
    for name, setting in schema.items():
        declared = _parsed(setting, given.get(name), known)
        sources = (session["ini"].get(name), declared, session["cli"].get(name))  # lowest priority first
        if setting.merge:
            merged: dict[str, Any] = {}
            for source in sources:
                merged.update(source or {})
            values[name] = merged
        else:
            values[name] = next((v for v in reversed(sources) if v is not None), setting.default)
    artifact = values.get("quantized") is not None  # checks may judge a shipped artifact more leniently
    severity = {check.name: (check.artifact_severity if artifact and check.artifact_severity else
                             check.default_severity) for check in registry.checks()}
    values["severity"] = {**severity, **values["severity"]}
    values["baseline_tolerance_db"] = {"*": DEFAULT_TOLERANCE, **values["baseline_tolerance_db"]}
    values["check_options"] = {**values.pop("detector_options"), **values["check_options"]}
    chosen = values["checks"] or known
    values["checks"] = [c for c in known if c in chosen and values["severity"][c] != "off"]
    return ModelSettings(values)


def table_mode(config) -> str:
    """'all' or 'failures'."""
    return config.getoption("qreport_table") or config.getini("qreport_table") or "failures"


def options_table(check_classes: Iterable[Any]) -> str:
    """The README's options table (markdown), generated from the schema: one row per setting."""
    rows = ["| `qmodel(...)` argument | command line | ini key | default | meaning |", "|---|---|---|---|---|",
            "| — | `--qreport` | — | off | turn the plugin on; without it nothing is collected and torch is not "
            "imported |"]
    for setting in (*model_schema(check_classes).values(), *SESSION_SETTINGS):
        argument = f"`{setting.name}`" if "qmodel" in setting.places else "—"
        value = "" if setting.flag_action else f" {setting.metavar}"
        flag = f"`{setting.flag}{value}`" if setting.flag else "—"
        ini = f"`{setting.ini}`" if setting.ini else "—"
        default = shown_default(setting)
        rows.append(f"| {argument} | {flag} | {ini} | {default} | {setting.help.replace('|', '/')} |")
    rows.append("| `name` | — | — | function name | the model's name in node ids and reports |")
    return "\n".join(rows)
