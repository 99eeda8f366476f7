"""--qreport-update-baseline: the controller writes each model's baseline file from the rows that came back."""
from __future__ import annotations

from collections.abc import Mapping

from ..core.baseline import BaselineError, load_baseline, write_baseline
from ..core.findings import Finding
from ..core.results import ModelFacts

__all__ = ["update_baselines"]

_NOT_ENTRIES = ("baseline", "capture")


def update_baselines(rows: list[Finding], models: Mapping[str, ModelFacts]) -> tuple[list[str], bool]:
    """Write the baseline of every model that ran without error: (one line of news per model, whether a
    write failed).

    Entries of this run replace the file's; entries for items that were collected but not run (under -k)
    are kept, and entries for layers that no longer exist are dropped.
    """
    by_model: dict[str, list[Finding]] = {}
    for row in rows:
        by_model.setdefault(row.model, []).append(row)
    news, failed = [], False
    for model, found in by_model.items():
        facts = models.get(model)
        if facts is None or facts.baseline_path is None:
            continue
        path, fingerprint = facts.baseline_path, facts.fingerprint
        errored = [f"{row.check}/{row.layer}".rstrip("/") for row in found if row.verdict == "error"]
        if errored or fingerprint is None:
            reason = ", ".join(errored) or "no analysis"
            news.append(f"qreport: baseline of {model!r} not updated: the model errored ({reason})")
            continue
        entries = _kept_entries(path, found)
        entries.update({(row.check, row.layer): (row.value, row.verdict) for row in found
                        if row.check not in _NOT_ENTRIES and row.verdict != "skip"})
        try:
            write_baseline(path, facts.name, fingerprint, entries)
        except OSError as error:
            news.append(f"qreport: could not write the baseline of {model!r} to {path}: {error}")
            failed = True
            continue
        news.append(f"qreport: baseline of {model!r} written to {path} ({len(entries)} entries)")
    return news, failed


def _kept_entries(path: str, found: list[Finding]) -> dict[tuple[str, str], tuple[float, str]]:
    """The old file's entries that are still collected (all of them when the baseline item did not run)."""
    try:
        old = load_baseline(path)
    except BaselineError:
        return {}  # a corrupt file is rewritten from this run alone
    if old is None:
        return {}
    collected = next((row.details.get("collected") for row in found if row.check == "baseline"), None)
    if collected is None:
        return dict(old.entries)
    still = set(collected)
    return {key: value for key, value in old.entries.items() if f"{key[0]}/{key[1]}" in still}
