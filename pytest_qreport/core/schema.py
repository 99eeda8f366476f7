"""The settings schema: each setting is declared once, as a `Setting`, and everything else comes from that
declaration: the command-line option, the ini key, the `qmodel(...)` keyword check, the `ModelSettings` fields and
the README's options table. A built-in check declares its own threshold settings on its class (`Check.settings`).
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PLACES", "SEVERITIES", "Parser", "Setting", "blockwise_value", "boolean", "check_names", "choice",
           "closest", "decibels", "device_value", "equalize_value", "fix_budget_value", "fraction", "globs",
           "layer_format_pairs", "mapping", "positive_integer", "severity_pairs", "text", "tolerance_pairs"]

PLACES = ("qmodel", "ini", "cli")
SEVERITIES = ("fail", "warn", "off")

# a parser takes the raw value and the names of the registered checks; it raises ValueError naming the problem
Parser = Callable[[Any, Sequence[str]], Any]


def closest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass(frozen=True)
class Setting:
    """One setting: its name, how its values parse, its default, its help, and where it may be given.

    scope "model" settings resolve per model (command line, then qmodel(...), then ini, then the default);
    "session" settings are read once for the whole run. `merge` settings are dicts merged key by key across
    the sources (default, ini, qmodel, command line). `shown_default` is how the README shows the default.
    """

    name: str
    parse: Parser
    default: Any
    help: str
    places: frozenset[str] = frozenset(PLACES)
    scope: str = "model"
    merge: bool = False
    metavar: str = "VALUE"
    shown_default: str = ""
    flag_action: str = ""  # "store_true" for command-line flags that take no value

    def __post_init__(self) -> None:
        unknown = set(self.places) - set(PLACES)
        if unknown or self.scope not in ("model", "session"):
            raise ValueError(f"setting {self.name!r}: places must be within {PLACES} and scope model or session")
        if self.scope == "session" and "qmodel" in self.places:
            raise ValueError(f"setting {self.name!r}: a session setting cannot be a qmodel() keyword")

    @property
    def flag(self) -> str | None:
        """The command-line flag (`--qreport-<name with dashes>`), or None."""
        return f"--qreport-{self.name.replace('_', '-')}" if "cli" in self.places else None

    @property
    def dest(self) -> str:
        """Where pytest keeps the command-line value: config.getoption('qreport_<name>')."""
        return f"qreport_{self.name}"

    @property
    def ini(self) -> str | None:
        """The ini key (`qreport_<name>`), or None."""
        return f"qreport_{self.name}" if "ini" in self.places else None

    def value(self, raw: Any, checks: Sequence[str] = ()) -> Any:
        """`raw` parsed (None stays None: not given)."""
        return None if raw is None else self.parse(raw, checks)


# -- parsers -----------------------------------------------------------------------------------------------------
def number(unit: str, non_negative: bool = False) -> Parser:
    """A number of `unit` (not NaN; optionally not negative)."""
    def parse(value: Any, checks: Sequence[str]) -> float:
        try:
            parsed = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number of {unit}, got {value!r}") from None
        if math.isnan(parsed) or (non_negative and parsed < 0):
            raise ValueError(f"must be a {'non-negative ' if non_negative else ''}number of {unit}, got {value!r}")
        return parsed
    return parse


def decibels(non_negative: bool = False) -> Parser:
    """A number of dB (not NaN; optionally not negative)."""
    return number("dB", non_negative)


def fraction() -> Parser:
    """A number in [0, 1]."""
    def parse(value: Any, checks: Sequence[str]) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number in [0, 1], got {value!r}") from None
        if not 0.0 <= number <= 1.0:
            raise ValueError(f"must be a number in [0, 1], got {value!r}")
        return number
    return parse


def function(value: Any, checks: Sequence[str]) -> Any:
    """A callable (in qmodel), or 'module:attribute' naming one."""
    if isinstance(value, str) and ":" in value:
        from .quantizers import import_attribute

        value = import_attribute(value)
    if not callable(value):
        raise ValueError(f"must be a function fn(model, batches) -> float, or 'module:attribute' naming one; got "
                         f"{value!r}")
    return value


def globs(value: Any, checks: Sequence[str]) -> list[str]:
    """A list of globs: a list, or one string separated by commas or newlines."""
    if isinstance(value, str):
        return [part.strip() for part in value.replace("\n", ",").split(",") if part.strip()]
    return [str(v) for v in value]


def check_names(value: Any, checks: Sequence[str]) -> list[str]:
    """A list of registered check names."""
    names = globs(value, checks)
    for name in names:
        if checks and name not in checks:
            raise ValueError(f"unknown qreport check {name!r}{closest(name, checks)}; known checks: "
                             f"{', '.join(checks)}")
    return names


def text(value: Any, checks: Sequence[str]) -> Any:
    """Any value, kept as given (a fixture name, a callable, an object)."""
    return value


def mapping(value: Any, checks: Sequence[str]) -> dict[str, dict]:
    """{check: {option: value}} for registered checks."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a dict of {{check: {{option: value}}}}, got {value!r}")
    for name in value:
        if checks and name not in checks:
            raise ValueError(f"options for unknown check {name!r}{closest(name, checks)}; known checks: "
                             f"{', '.join(checks)}")
    return {str(name): dict(options) for name, options in value.items()}


OVERRIDE_KEYS = ("per_channel", "is_dynamic", "skip", "activation_observer")


def layer_override_pairs(value: Any, checks: Sequence[str]) -> dict[str, dict]:
    """{layer glob: {per_channel, is_dynamic, skip, activation_observer}}: qcore.Int8StaticQuantizer overrides."""
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(f"must be a dict of {{layer glob: {{option: value}}}}, got {value!r}")
    for glob, override in value.items():
        unknown = sorted(set(override) - set(OVERRIDE_KEYS))
        if unknown:
            raise ValueError(f"{glob!r}: unknown override(s) {unknown}{closest(str(unknown[0]), OVERRIDE_KEYS)}; "
                             f"known: {', '.join(OVERRIDE_KEYS)}")
    return {str(glob): dict(override) for glob, override in value.items()}


def choice(*choices: str) -> Parser:
    """One of `choices`."""
    def parse(value: Any, checks: Sequence[str]) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, not {value!r}{closest(str(value), choices)}")
        return str(value)
    return parse


def boolean(value: Any, checks: Sequence[str]) -> bool:
    """true/false, yes/no, 1/0, or a bool."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be true or false, not {value!r}")


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def byte_size(value: Any, checks: Sequence[str]) -> int | None:
    """A size in bytes ("16GiB", "512 MB", 1000000), or None for "auto"."""
    import re

    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _BYTE_UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"must be a size such as 16GiB, 512MB or a number of bytes, or auto; got {value!r}")
    return int(float(found.group(1)) * _BYTE_UNITS[unit])


UNLIMITED_FIX_BUDGET = "unlimited"


def fix_budget_value(value: Any, checks: Sequence[str]) -> float | None:
    """A fix budget: a non-negative multiple of the verdict pass (0: verdicts only), or "unlimited" (inf)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in (UNLIMITED_FIX_BUDGET, "inf"):
        return math.inf
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be a multiple of the verdict pass such as 1 or 0.5, 0 for verdicts only, or "
                         f"'{UNLIMITED_FIX_BUDGET}'; got {value!r}") from None
    if math.isnan(number) or number < 0:
        raise ValueError(f"must be a multiple of the verdict pass such as 1 or 0.5, 0 for verdicts only, or "
                         f"'{UNLIMITED_FIX_BUDGET}'; got {value!r}")
    return number


def positive_integer(value: Any, checks: Sequence[str]) -> int:
    """A positive integer."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return number


def severity_pairs(value: Any, checks: Sequence[str]) -> dict[str, str]:
    """{check: level} from a dict or 'check=level' pairs separated by commas, spaces or newlines."""
    pairs = value.items() if isinstance(value, dict) else (
        part.split("=", 1) if "=" in part else (part, "") for part in str(value).replace(",", " ").split())
    result = {}
    for check, level in pairs:
        check, level = str(check).strip(), str(level).strip()
        if check not in checks:
            raise ValueError(f"severity for unknown check {check!r}{closest(check, checks)}; known checks: "
                             f"{', '.join(checks)}")
        if level not in SEVERITIES:
            raise ValueError(f"severity of {check} must be one of {', '.join(SEVERITIES)}, not {level!r}"
                             f"{closest(level, SEVERITIES)}")
        result[check] = level
    return result


def tolerance_pairs(value: Any, checks: Sequence[str]) -> dict[str, float]:
    """{check or '*': tolerance} from a number, a dict, or 'check=number' pairs."""
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
        if check != "*" and check not in checks:
            raise ValueError(f"baseline tolerance for unknown check {check!r}{closest(check, checks)}")
        try:
            number = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"baseline tolerance of {check} must be a number, got {raw!r}") from None
        if math.isnan(number) or number < 0:
            raise ValueError(f"baseline tolerance of {check} must be a non-negative number, got {raw!r}")
        result[check] = number
    return result


def layer_format_pairs(value: Any, checks: Sequence[str]) -> dict[str, str]:
    """{layer glob: format name or "float"} from a dict or 'glob=FORMAT' pairs separated by commas or spaces; an
    unknown format name is an error naming the closest one."""
    from .quantizers import FORMAT_NAMES

    pairs = value.items() if isinstance(value, dict) else (
        part.split("=", 1) if "=" in part else (part, "") for part in str(value).replace(",", " ").split())
    result = {}
    for glob, name in pairs:
        glob, name = str(glob).strip(), str(name).strip()
        if name not in (*FORMAT_NAMES, "float"):
            raise ValueError(f"layer_formats: unknown format {name!r} for {glob!r}"
                             f"{closest(name, (*FORMAT_NAMES, 'float'))}; formats: {', '.join(FORMAT_NAMES)}, float")
        result[glob] = name
    return result


def blockwise_value(value: Any, checks: Sequence[str]) -> bool | str:
    """"auto" (block-wise only when the whole model's analysis would exceed the memory budget), True, False, or the
    module path of the stack of blocks to analyse one at a time ("model.layers")."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip()
        if word.lower() in ("auto", ""):
            return "auto"
        if word.lower() in ("1", "true", "yes", "on"):
            return True
        if word.lower() in ("0", "false", "no", "off"):
            return False
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", word):
            return word
    raise ValueError(f"blockwise must be true, false, auto or the module path of a stack of blocks (such as "
                     f"'model.layers'), not {value!r}")


def device_value(value: Any, checks: Sequence[str]) -> str | None:
    """A torch device to analyse on ("cuda", "cuda:1", "cpu", or a torch.device), or None for wherever the model's
    parameters are."""
    import torch

    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "model")):
        return None
    try:
        return str(torch.device(value.strip() if isinstance(value, str) else value))
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device must be a torch device such as cuda, cuda:1 or cpu, or auto (where the model is), "
                         f"not {value!r}: {error}") from None


def equalize_value(value: Any, checks: Sequence[str]) -> Any:
    """None (off), True (input-weight on every eligible layer), "cross_layer", "smooth", "smooth:search" or
    "smooth:<alpha>" (SmoothQuant-style smoothing), or a list of layer names."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("", "0", "false", "no", "off", "none"):
            return None
        if word in ("1", "true", "yes", "on", "input_weight"):
            return True
        if word == "cross_layer":
            return "cross_layer"
        if word == "smooth" or word.startswith("smooth:"):
            from qcore.analysis import smoothing_alpha

            smoothing_alpha(word)
            return word
        raise ValueError(f"equalize must be true, false, input_weight, cross_layer, smooth, smooth:search or "
                         f"smooth:<alpha>, not {value!r}")
    if value is False:
        return None
    if value is True or isinstance(value, (list, tuple)):
        return value if value is True else list(value)
    raise ValueError(f"equalize must be True, False, 'cross_layer' or a list of layer names, not {value!r}")
