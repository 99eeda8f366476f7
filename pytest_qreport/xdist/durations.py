"""How long each work unit (a model's items, see scheduling) took in earlier runs, kept in pytest's cache so that
ModelGroupScheduling can queue the longest first. An item count says little of a model's cost (a wide ResNet-18
has few items and a slow analysis), so measured seconds are used where there are any."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.nodeids import model_scope, parse_item_nodeid

__all__ = ["CACHE_KEY", "UnitDurations", "estimated_seconds", "work_unit"]

CACHE_KEY = "qreport/unit-durations"


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to: its model for a qreport item, its `@group` for a grouped test, else itself."""
    parsed = parse_item_nodeid(nodeid)
    if parsed is not None:
        return model_scope(parsed[0], parsed[1])
    if "@" in nodeid:
        return "@" + nodeid.rsplit("@", 1)[1]
    return nodeid


def estimated_seconds(units: Mapping[str, int], known: Mapping[str, float]) -> dict[str, float]:
    """Seconds for each unit of {unit: items}: the recorded ones, and for the rest their items at the recorded
    units' seconds per item (1 s per item when nothing is recorded, which orders them by items)."""
    recorded = {unit: float(known[unit]) for unit in units if isinstance(known.get(unit), (int, float))}
    recorded_items = sum(units[unit] for unit in recorded)
    per_item = sum(recorded.values()) / recorded_items if recorded_items and sum(recorded.values()) > 0 else 1.0
    return {unit: recorded.get(unit, items * per_item) for unit, items in units.items()}


class UnitDurations:
    """Controller-side: sums each unit's report durations (setup, call, teardown) during a run, then merges them
    into the cache (units this run did not see keep their earlier figure)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, unit: str, seconds: float) -> None:
        """One report's duration, for its unit."""
        self.seconds[unit] = self.seconds.get(unit, 0.0) + float(seconds)

    @staticmethod
    def recorded(config: Any) -> dict[str, float]:
        """The durations earlier runs left in the cache ({} without a cache, or with an unreadable entry)."""
        cache = getattr(config, "cache", None)
        found = cache.get(CACHE_KEY, {}) if cache is not None else {}
        if not isinstance(found, dict):
            return {}
        return {str(k): float(v) for k, v in found.items() if isinstance(v, (int, float))}

    def save(self, config: Any) -> None:
        """Merge this run's durations into the cache."""
        cache = getattr(config, "cache", None)
        if cache is not None and self.seconds:
            cache.set(CACHE_KEY, {**self.recorded(config), **{k: round(v, 3) for k, v in self.seconds.items()}})
