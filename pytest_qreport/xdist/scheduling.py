"""`--dist load` and `loadgroup` for qreport items: all items of one model form one work unit, so one worker
analyses each model, and a model that kills its worker is not retried on the next one. A worker is given the
models it captured at collection first (see capture_share), then other work, and another worker's models last.

xdist groups by an "@group" suffix that it appends to node ids at collection. pytest 9.2 no longer lets it
change node ids (pytest-xdist issue 1386), so the groups silently vanish; this scheduler groups qreport items
by the model named in their node id instead, and leaves every other test to xdist's loadgroup rules.
"""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

from ..core.nodeids import parse_item_nodeid
from .rendezvous import captured_by

__all__ = ["ModelGroupScheduling"]


class ModelGroupScheduling(LoadGroupScheduling):
    """LoadGroupScheduling where a qreport item's group is its conftest and model."""

    def __init__(self, config, log=None, capture_dir: str | None = None) -> None:
        super().__init__(config, log)
        self.capture_dir = capture_dir
        self._captured: dict[str, str] | None = None

    def _assign_work_unit(self, node) -> None:
        """Assign the node a model it captured, else a unit nobody alive captured, else the next unit."""
        if self._captured is None:  # complete once every worker has collected, which precedes scheduling
            self._captured = captured_by(self.capture_dir) if self.capture_dir else {}
        if self._captured:
            alive = {other.gateway.id for other in self.nodes}
            mine = next((scope for scope in self.workqueue if self._captured.get(scope) == node.gateway.id), None)
            free = mine or next((scope for scope in self.workqueue if self._captured.get(scope) not in alive), None)
            if free is not None:
                self.workqueue.move_to_end(free, last=False)
        super()._assign_work_unit(node)

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
