"""Judging a model against its committed baseline: each finding with its baseline value, plus the model's own
`baseline` finding (missing file, fingerprint mismatch, stale entries)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .baseline import BaselineError, compare_findings, fingerprint_differences, join_messages, load_baseline
from .findings import Finding

if TYPE_CHECKING:
    from .pipeline import ModelPipeline

__all__ = ["compare_with_baseline"]


def compare_with_baseline(state: ModelPipeline, found: list[Finding], options: dict[str, Any]) -> list[Finding]:
    """The findings compared with the model's baseline file, plus the model's `baseline` finding.

    options: {"update": bool, "strict": bool}. With update, nothing fails for baseline reasons: the file is
    about to be rewritten; deltas are still shown when the fingerprint matches.
    """
    assert state.settings is not None and state.context is not None and state.baseline_path is not None
    path, enforce, strict = state.baseline_path, not options["update"], bool(options["strict"])
    collected = sorted(f"{check}/{layer}" for check, layer in state.checks_and_layers())
    still_collected = set(collected)
    details: dict[str, Any] = {"path": path, "collected": collected, "stale": []}
    update_hint = f"Run pytest --qreport --qreport-update-baseline to {'write' if enforce else 'rewrite'} {path}."

    def model_finding(passed: bool, message: str, stale: int | None = None, error: bool = False) -> Finding:
        """The model's `baseline` row: its value is the count of stale entries, when the entries could be
        compared at all (nothing to show for a missing, unreadable or incomparable file)."""
        verdict = "error" if error and enforce else "pass" if passed or not enforce else "fail"
        value, threshold = (math.nan, math.nan) if stale is None else (stale, 0)
        return Finding(model=state.name, check="baseline", layer="", metric="stale_entries", value=value,
                       threshold=threshold, verdict=verdict, message=message, details=details)

    try:
        recorded = load_baseline(path)
    except BaselineError as error:
        return found + [model_finding(False, f"model {state.name!r}: {error}", error=True)]
    if recorded is None:
        why = " (--qreport-baseline-strict)" if strict else ""
        return found + [model_finding(not strict, f"model {state.name!r}: no baseline file {path}{why}. {update_hint}")]
    differences = fingerprint_differences(recorded.fingerprint, state.fingerprint or {})
    if differences:
        return found + [model_finding(False, (
            f"model {state.name!r}: the baseline {path} was recorded under other conditions, so its values "
            f"cannot be compared: {'; '.join(differences)}. If the change is intended, {update_hint[0].lower()}"
            f"{update_hint[1:]}"))]
    checks = state.context.checks
    settings = state.settings
    given = settings.baseline_tolerance_db or {}

    def tolerance(check: str) -> float:
        """The check's tolerance: set for it, else its own default (a fraction's is not 0.5), else '*'."""
        own = getattr(checks.get(check), "baseline_tolerance", None)
        return settings.tolerance(check) if check in given or own is None else float(own)

    compared = compare_findings(found, recorded, tolerance,
                                lambda check: checks[check].higher_is_better if check in checks else True,
                                strict, enforce, lambda check: _threshold_setting(checks.get(check)))
    changed = _artifact_change(recorded.fingerprint, state.fingerprint or {})
    if changed:  # the artifact changing is what the baseline gates: its values are compared, and it is said
        details["artifact_changed"] = changed
        note = f"The artifact changed since the baseline ({changed})."
        compared = [f.replace(message=join_messages(f.message, note)) if f.baseline_status == "regressed" else f
                    for f in compared]
    stale = sorted(f"{check}/{layer}" for check, layer in recorded.entries if f"{check}/{layer}" not in still_collected)
    details["stale"] = stale
    message = (f"model {state.name!r}: the baseline {path} has entries for layers that no longer exist: "
               f"{', '.join(stale)}. {update_hint}") if stale else ""
    if changed:
        message = join_messages(message, f"model {state.name!r}: artifact changed since the baseline ({changed}).")
    return compared + [model_finding(not (stale and strict), message, stale=len(stale))]




def _artifact_change(recorded: dict[str, Any] | Any, current: dict[str, Any]) -> str:
    """'sha256:1234abcd… -> sha256:5678ef01…' when the quantized model a baseline was recorded with is not the one
    measured now (artifact mode); "" otherwise."""
    old, new = recorded.get("artifact"), current.get("artifact")
    if not old or not new or old == new:
        return ""
    return f"{str(old)[:15]}… -> {str(new)[:15]}…"


def _threshold_setting(check: Any) -> str | None:
    """The setting that holds a check's threshold (its first declared setting), as a user would set it; None for a
    check that declares none (its verdict is not a value against a threshold)."""
    settings = getattr(check, "settings", ())
    if not settings or not getattr(check, "threshold_is_setting", True):
        return None
    return f"{settings[0].name} / {settings[0].flag}" if settings[0].flag else settings[0].name
