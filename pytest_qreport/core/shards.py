"""Sharding whole models over CI runners (--qreport-shard=I/N): which models shard I of N runs, and the durations
file the assignment reads (written by --qreport-store-durations, committed like pytest-split's .test_durations).

A model is a work unit (`<conftest>::qreport/<model>`, see core.nodeids.model_scope): its items always land on one
shard, so that it is analysed once. Units are spread longest first, each to the shard with the least time so far
(ties: the lowest index), by their recorded seconds, else by item counts at the recorded seconds per item. The
assignment depends on the units, their items and the durations only: every runner computes the same one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .files import write_atomically

__all__ = ["Shard", "assign_shards", "estimated_seconds", "read_durations", "shard_value", "write_durations"]


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def to_dict(self) -> dict[str, int]:
        """{"index": I, "count": N}."""
        return {"index": self.index, "count": self.count}


def shard_value(value: Any, checks: Any = ()) -> Shard:
    """'I/N' with 1 <= I <= N (or a Shard); ValueError naming what is wrong."""
    if isinstance(value, Shard):
        return value
    text = str(value).strip()
    index, slash, count = text.partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        raise ValueError(f"must be I/N (shard I of N, e.g. 2/4), got {text!r}") from None
    if not slash or shard.count < 1:
        raise ValueError(f"must be I/N with N >= 1 shards, got {text!r}")
    if not 1 <= shard.index <= shard.count:
        raise ValueError(f"shard index {shard.index} is out of range: shards are numbered 1 to {shard.count}")
    return shard


def estimated_seconds(units: Mapping[str, int], known: Mapping[str, float]) -> dict[str, float]:
    """Seconds for each unit of {unit: items}: the recorded ones, and for the rest their items at the recorded
    units' seconds per item (1 s per item when nothing is recorded, which spreads them by items)."""
    recorded = {unit: float(known[unit]) for unit in units if isinstance(known.get(unit), (int, float))}
    recorded_items = sum(units[unit] for unit in recorded)
    per_item = sum(recorded.values()) / recorded_items if recorded_items and sum(recorded.values()) > 0 else 1.0
    return {unit: recorded.get(unit, items * per_item) for unit, items in units.items()}


def assign_shards(units: Mapping[str, int], count: int, known: Mapping[str, float]) -> dict[str, int]:
    """{unit: shard index (1-based)} for units of {unit: items}, longest first to the least loaded shard."""
    seconds = estimated_seconds(units, known)
    loads = [0.0] * count
    assigned = {}
    for unit in sorted(units, key=lambda name: (-seconds[name], name)):
        shard = min(range(count), key=lambda index: (loads[index], index))
        assigned[unit] = shard + 1
        loads[shard] += seconds[unit]
    return assigned


def read_durations(path: str) -> dict[str, float]:
    """{unit: seconds} from a durations file ({} when there is none); ValueError naming a file that is not one."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"the durations file {path} cannot be read ({error}); delete it or write it again with "
                         "--qreport-store-durations") from None
    if not isinstance(data, dict):
        raise ValueError(f"the durations file {path} is not a JSON object of {{model unit: seconds}}")
    return {str(unit): float(seconds) for unit, seconds in data.items() if isinstance(seconds, (int, float))}


def write_durations(path: str, seconds: Mapping[str, float]) -> None:
    """Merge `seconds` into the durations file (units this run did not see keep theirs), atomically."""
    merged = {**read_durations(path), **{unit: round(float(value), 3) for unit, value in seconds.items()}}
    write_atomically(path, json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
