"""How long each work unit (a model's items, see scheduling) took in earlier runs, kept in pytest's cache so that
ModelGroupScheduling can queue the longest first. An item count says little of a model's cost (a wide ResNet-18
has few items and a slow analysis), so measured seconds are used where there are any."""
from __future__ import annotations

from typing import Any

from ..core.declare import model_group
from ..core.nodeids import model_scope, parse_item_nodeid
from ..core.shards import estimated_seconds

__all__ = ["CACHE_KEY", "UnitDurations", "estimated_seconds", "work_unit"]

CACHE_KEY = "qreport/unit-durations"


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to: its model for a qreport item (its declaration, for one of several artifacts gated
    against one reference), its `@group` for a grouped test, else itself."""
    parsed = parse_item_nodeid(nodeid)
    if parsed is not None:
        return model_scope(parsed[0], model_group(parsed[1]))
    if "@" in nodeid:
        return "@" + nodeid.rsplit("@", 1)[1]
    return nodeid


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
