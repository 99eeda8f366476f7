"""`--dist load` and `loadgroup` for qreport items: all items of one model form one work unit, so one worker
analyses each model, and a model that kills its worker is not retried on the next one.

xdist groups by an "@group" suffix that it appends to node ids at collection. pytest 9.2 no longer lets it
change node ids (pytest-xdist issue 1386), so the groups silently vanish; this scheduler groups qreport items
by the model named in their node id instead, and leaves every other test to xdist's loadgroup rules.
"""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

from .items import parse_item_nodeid

__all__ = ["ModelGroupScheduling"]


class ModelGroupScheduling(LoadGroupScheduling):
    """LoadGroupScheduling where a qreport item's group is its conftest and model."""

    def _split_scope(self, nodeid: str) -> str:
        parsed = parse_item_nodeid(nodeid)
        if parsed is not None:
            return f"{parsed[0]}::qreport/{parsed[1]}"
        return super()._split_scope(nodeid)

    def remove_node(self, node) -> str | None:
        """Requeue a dead worker's unfinished work, except the item it crashed on (xdist reports that one)."""
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]
        workload[self._split_scope(crashed)][crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        # a restarted worker joins before it has collected; xdist would look up its collection and raise
        # KeyError when another worker's collection arrives first (two workers restarted at once)
        if node not in self.registered_collections:
            return
        super()._reschedule(node)
