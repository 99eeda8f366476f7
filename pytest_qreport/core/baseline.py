"""Committed baselines: one JSON file per model, compared item by item with a tolerance.

File format (schema 1), written with sorted keys and one (check, layer) entry per line so that a PR diff reads
well; values are rounded to 0.01 (below 1 in magnitude, to 4 significant digits, so that a KL divergence of
7e-06 nats survives), non-finite values are the strings "inf", "-inf" and "nan"::

    {
      "entries": {
        "model_sqnr/output": {"value": 39.61, "verdict": "pass"},
        "sqnr/fc1": {"value": 41.12, "verdict": "pass"}
      },
      "fingerprint": {"calibration": "sha256:...", "equalize": null, "qcore": "0.1.0", ...},
      "model": "tiny",
      "schema": 1
    }

Baselines are JSON and are never unpickled.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .files import write_atomically
from .findings import Finding
from .numbers import format_bound, format_delta, format_value

__all__ = ["COMPARED_FINGERPRINT_FIELDS", "SCHEMA", "Baseline", "BaselineError", "baseline_path", "compare_findings",
           "dumps_baseline", "fingerprint_differences", "join_messages", "load_baseline", "write_baseline"]

SCHEMA = 1
BASELINE_DIR = "__qreport__"
# what the numbers depend on; versions compare by major.minor
COMPARED_FINGERPRINT_FIELDS = ("torch", "qcore", "quantizer", "calibration", "equalize", "threads", "device")
_RECORDED_BEFORE = {"device": "cpu"}  # fields that baselines written before them lack, with the value they had
_VERSIONED = ("torch", "qcore")
_VERDICTS = ("pass", "fail", "warn", "waived")


class BaselineError(ValueError):
    """A baseline file that cannot be used: the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Baseline:
    """A loaded baseline file: the model, its fingerprint and {(check, layer): (value, verdict)}."""

    path: str
    model: str
    fingerprint: Mapping[str, Any]
    entries: Mapping[tuple[str, str], tuple[float, str]]


def baseline_path(declaring_dir: str | os.PathLike, model: str, override_dir: str | None = None) -> pathlib.Path:
    """`__qreport__/<model>.json` beside the declaring file, or `<override_dir>/<model>.json`; ValueError when the
    name would put the file anywhere else (model names are checked before, this is the second lock)."""
    directory = pathlib.Path(override_dir) if override_dir else pathlib.Path(declaring_dir) / BASELINE_DIR
    path = directory / f"{model}.json"
    if path.resolve().parent != directory.resolve() or path.name != f"{model}.json":
        raise ValueError(f"model {model!r}: its baseline file {path} would lie outside the baseline directory "
                         f"{directory}; give the model a plain name (letters, digits, '_', '-', '.')")
    return path


def _normalized(value: float) -> float:
    """Values of 1e30 or more are infinities that nan_to_num turned into FLT_MAX: compare them as such."""
    return math.copysign(math.inf, value) if abs(value) >= 1e30 else value


def _encode(value: float) -> float | str:
    value = _normalized(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    rounded = round(value, 2) if abs(value) >= 1 else float(f"{value:.4g}")
    return rounded + 0.0  # + 0.0: no -0.0 in files


def _decode(value: Any) -> float:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a value must be a number or 'nan'/'inf'/'-inf', not {value!r}")
    return float(value)


def dumps_baseline(model: str, fingerprint: Mapping[str, Any],
                   entries: Mapping[tuple[str, str], tuple[float, str]]) -> str:
    """The file text: sorted keys, one entry per line, values rounded (0.01, or 4 significant digits below 1)."""
    lines = ["{", '  "entries": {']
    rows = sorted((f"{check}/{layer}", value, verdict) for (check, layer), (value, verdict) in entries.items())
    for index, (key, value, verdict) in enumerate(rows):
        entry = json.dumps({"value": _encode(value), "verdict": verdict}, sort_keys=True)
        lines.append(f"    {json.dumps(key)}: {entry}" + ("," if index < len(rows) - 1 else ""))
    fingerprint_text = json.dumps(dict(fingerprint), sort_keys=True, indent=2).replace("\n", "\n  ")
    lines += ["  },", f'  "fingerprint": {fingerprint_text},', f'  "model": {json.dumps(model)},',
              f'  "schema": {SCHEMA}', "}"]
    return "\n".join(lines) + "\n"


def write_baseline(path: str | os.PathLike, model: str, fingerprint: Mapping[str, Any],
                   entries: Mapping[tuple[str, str], tuple[float, str]]) -> None:
    """Write a baseline file atomically (temp file, then rename)."""
    write_atomically(os.fspath(path), dumps_baseline(model, fingerprint, entries))


def _line_of(text: str, needle: str) -> int:
    """The 1-based line of the first occurrence of `needle` (1 if absent)."""
    index = text.find(needle)
    return text.count("\n", 0, index) + 1 if index >= 0 else 1


def load_baseline(path: str | os.PathLike) -> Baseline | None:
    """The baseline at `path`, None if there is none; BaselineError naming the file and line if it is bad."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    fix = "fix it by hand, or rewrite it with --qreport-update-baseline"
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError) as error:
        raise BaselineError(f"baseline {path}: cannot be read ({error}); {fix}") from error
    except json.JSONDecodeError as error:
        raise BaselineError(f"baseline {path}, line {error.lineno}: invalid JSON ({error.msg}); {fix}") from error
    if not isinstance(data, dict):
        raise BaselineError(f"baseline {path}, line 1: the file must hold a JSON object; {fix}")
    if data.get("schema") != SCHEMA:
        line = _line_of(text, '"schema"')
        raise BaselineError(f"baseline {path}, line {line}: unknown schema version "
                            f"{data.get('schema')!r} (this pytest-qreport reads schema {SCHEMA}); {fix}")
    model, fingerprint, raw = data.get("model"), data.get("fingerprint"), data.get("entries")
    for key, value, kind in (("model", model, str), ("fingerprint", fingerprint, dict), ("entries", raw, dict)):
        if not isinstance(value, kind):
            raise BaselineError(f"baseline {path}, line {_line_of(text, json.dumps(key))}: {key!r} must be a "
                                f"{'string' if kind is str else 'JSON object'}; {fix}")
    entries: dict[tuple[str, str], tuple[float, str]] = {}
    assert isinstance(raw, dict)
    for key, entry in raw.items():
        line = _line_of(text, json.dumps(key))
        check, slash, layer = key.partition("/")
        try:
            if not slash or not check:
                raise TypeError("an entry key is 'check/layer'")
            if not isinstance(entry, dict) or set(entry) != {"value", "verdict"}:
                raise TypeError('an entry is {"value": number, "verdict": "pass" | "fail" | "warn" | "waived"}')
            if entry["verdict"] not in _VERDICTS:
                raise TypeError(f"verdict must be one of {', '.join(_VERDICTS)}, not {entry['verdict']!r}")
            entries[(check, layer)] = (_decode(entry["value"]), entry["verdict"])
        except TypeError as error:
            raise BaselineError(f"baseline {path}, line {line}: entry {key!r}: {error}; {fix}") from error
    return Baseline(str(path), str(model), dict(fingerprint or {}), entries)


def _major_minor(version: Any) -> str:
    return ".".join(str(version).split("+")[0].split(".")[:2])


def fingerprint_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'field: recorded -> current' for each compared field that differs (versions by major.minor)."""
    differences = []
    for name in COMPARED_FINGERPRINT_FIELDS:
        old, new = recorded.get(name, _RECORDED_BEFORE.get(name)), current.get(name, _RECORDED_BEFORE.get(name))
        same = _major_minor(old) == _major_minor(new) if name in _VERSIONED else old == new
        if not same:
            differences.append(f"{name}: {old!r} -> {new!r}")
    return differences


def compare_findings(findings: list[Finding], baseline: Baseline, tolerance: Callable[[str], float],
                     higher_is_better: Callable[[str], bool], strict: bool, enforce: bool,
                     threshold_setting: Callable[[str], str | None] = lambda check: None) -> list[Finding]:
    """Each finding with its baseline value, delta and status; regressions fail when `enforce` is on.

    Rules: a value worse than the baseline by more than the check's tolerance fails; so does a pass in the
    baseline that fails now, unless the check judges by a threshold setting (`threshold_setting` names it; None
    for checks that judge otherwise) and the baseline's value fails the current threshold too: then the threshold
    changed, and the finding fails below its threshold, which updating the baseline cannot fix; no entry is 'new'
    (fails with `strict`); better by more than the tolerance is 'improved'. Absolute thresholds are already in
    each finding's verdict.
    """
    compared = []
    for finding in findings:
        if finding.verdict == "skip":  # nothing was measured: nothing to record or compare
            compared.append(finding)
            continue
        entry = baseline.entries.get((finding.check, finding.layer))
        if entry is None:
            failed = strict and enforce and finding.verdict != "error"
            message = (f"{finding.check}/{finding.layer}: no entry in the baseline {baseline.path} "
                       "(--qreport-baseline-strict). Add it with --qreport-update-baseline.")
            joined = join_messages(finding.message, message) if failed else finding.message
            compared.append(finding.replace(baseline_status="new", verdict="fail" if failed else finding.verdict,
                                            message=joined))
            continue
        value, verdict = _normalized(entry[0]), entry[1]
        current = _normalized(finding.value)
        delta = 0.0 if current == value else current - value  # inf == inf: no change
        worse = -delta if higher_is_better(finding.check) else delta
        limit = tolerance(finding.check)
        status, rule = "ok", ""
        if worse > limit or (math.isnan(worse) and not math.isnan(value)):
            status = "regressed"
            rule = (f"{finding.check}/{finding.layer} regressed against the baseline: "
                    f"{format_value(current, finding.metric)} now, {format_value(value, finding.metric)} in "
                    f"{baseline.path} (delta {format_delta(delta, finding.metric)}, tolerance {limit:g}).")
        elif verdict == "pass" and finding.verdict in ("fail", "warn") and finding.check != "baseline":
            setting = threshold_setting(finding.check)
            if setting is not None and _fails(value, finding.threshold, higher_is_better(finding.check)):
                why = _threshold_not_model(finding, value, baseline.path, setting, higher_is_better(finding.check))
                compared.append(finding.replace(baseline=value, delta=delta, baseline_status="ok",
                                                message=join_messages(finding.message, why)))
                continue
            status = "regressed"
            rule = (f"{finding.check}/{finding.layer} passed in the baseline {baseline.path} and is {finding.verdict} "
                    f"now (delta {format_delta(delta, finding.metric)}, within the tolerance {limit:g}).")
        elif -worse > limit:
            status = "improved"
        changed = finding.replace(baseline=value, delta=delta, baseline_status=status)
        if status == "regressed" and enforce and finding.verdict not in ("error", "waived"):
            hint = " Fix the regression, or accept it with pytest --qreport --qreport-update-baseline."
            changed = changed.replace(verdict="fail", message=join_messages(finding.message, rule + hint))
        compared.append(changed)
    return compared


def _threshold_not_model(finding: Finding, value: float, path: str, setting: str, higher: bool) -> str:
    """Why an item whose value stayed within tolerance of a passing baseline entry fails now: its baseline value
    fails the current threshold too, so the threshold, or how the check judges against it, changed."""
    side, move = ("below", "lower") if higher else ("above", "raise")
    shown, now = format_value(value, finding.metric), format_bound(finding.value, finding.metric, up=not higher)
    return (f"{finding.check}/{finding.layer} is {side} its threshold {format_value(finding.threshold, finding.metric)}"
            f" ({setting}), and so was its baseline value {shown} in {path}, which passed: the model did not change "
            f"beyond the tolerance, the threshold or the check's rule did, so updating the baseline would not fix "
            f"this. Fix the layer, or {move} {setting} {side} {now} to pass it.")


def _fails(value: float, threshold: float, higher_is_better: bool) -> bool:
    """Whether `value` fails `threshold` in the check's direction (not when either is nan: nothing to say)."""
    if math.isnan(value) or math.isnan(threshold):
        return False
    return value < threshold if higher_is_better else value > threshold


def join_messages(first: str, second: str) -> str:
    """Two messages, one per line (the first may be empty)."""
    return f"{first}\n{second}" if first else second
