"""A pytest-xdist scheduler for qreport runs, written against xdist's documented `Scheduling` protocol
(xdist.scheduler.protocol) and handed to xdist through its `pytest_xdist_make_scheduler` hook; it overrides no
private xdist method.

Work units: all items of one model form one unit, so one worker analyses each model and a model that kills its
worker is not retried on the next one. Other tests keep xdist's rules: those with an `@group` suffix (--dist
loadgroup) form one unit per group, and every other test is a unit of its own (--dist load). Units are queued
longest first (the seconds the last run took, see durations; else by items), so that the last unit to finish is
a short one and no worker waits long on another at the end. A worker is given its longest model captured at
collection first (see rendezvous), then the longest unit nobody alive captured, then the longest of the rest.

Node ids come from the workers' collections; xdist_group marks do not reach them under pytest 9.2 (pytest-xdist
issue 1386), which is why qreport items are grouped by the model their node id names.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from xdist.workermanage import parse_tx_spec_config

from .durations import UnitDurations, estimated_seconds, work_unit
from .rendezvous import captured_by

__all__ = ["ModelGroupScheduling", "work_unit"]

_REFILL_AT = 2  # a worker with at most this many pending items gets its next unit (xdist's loadscope heuristic)


class ModelGroupScheduling:
    """Schedules one unit at a time per worker; see the module docstring."""

    def __init__(self, config: Any, log: Any = None, capture_dir: str | None = None) -> None:
        self.config, self.capture_dir = config, capture_dir
        self.log = log.modelgroupsched if log is not None else (lambda *args: None)
        self.numnodes = len(parse_tx_spec_config(config))
        self.collection: list[str] | None = None
        self.workqueue: OrderedDict[str, dict[str, bool]] = OrderedDict()  # unit -> {nodeid: done}
        self.assigned_work: dict[Any, dict[str, dict[str, bool]]] = {}  # worker -> its units
        self.registered_collections: dict[Any, list[str]] = {}
        self._positions: dict[str, int] = {}  # nodeid -> index in the collection
        self._captured: dict[str, str] | None = None
        self._pending: dict[Any, int] = {}  # worker -> its items not done yet (kept, not recounted per report)

    # -- the Scheduling protocol --------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Any]:
        """The workers this scheduler feeds."""
        return list(self.assigned_work)

    @property
    def collection_is_completed(self) -> bool:
        """True once every initial worker has sent its collection."""
        return len(self.registered_collections) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        """True when nothing is queued and no worker has more than its last item left."""
        if not self.collection_is_completed or self.workqueue:
            return False
        return all(self._pending.get(node, 0) < 2 for node in self.assigned_work)

    @property
    def has_pending(self) -> bool:
        """True while any item is queued or running."""
        return bool(self.workqueue) or any(self._pending.get(node, 0) for node in self.assigned_work)

    def add_node(self, node: Any) -> None:
        """A worker is ready: it will be given units."""
        assert node not in self.assigned_work
        self.assigned_work[node] = {}
        self._pending[node] = 0

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        """A worker's collection; a restarted worker's must match the first one's."""
        assert node in self.assigned_work
        if self.collection_is_completed and self.collection is not None and list(collection) != self.collection:
            self.log(f"worker {node.gateway.id} collected other tests; it gets no work")
            return
        self.registered_collections[node] = list(collection)

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        """A worker finished one item: mark it, and give the worker its next unit when it runs low."""
        nodeid = self.registered_collections[node][item_index]
        unit = self.assigned_work[node][work_unit(nodeid)]
        if not unit[nodeid]:
            unit[nodeid] = True
            self._pending[node] -= 1
        self._refill(node)

    def mark_test_pending(self, item: str) -> None:
        """Queue one item again, first (a pytest_handlecrashitem hook that re-runs a crashed test asks for it)."""
        unit = work_unit(item)
        self.workqueue.setdefault(unit, {})[item] = False
        self.workqueue.move_to_end(unit, last=False)
        for node in self.nodes:
            if node in self.registered_collections:
                self._refill(node)

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        """xdist calls this only after a 'steal' command, which this scheduler never sends."""
        raise RuntimeError("qreport's scheduler sends no 'steal' command, so no worker can answer one")

    def remove_node(self, node: Any) -> str | None:
        """A worker went away. If it died mid-run, requeue its unfinished units, except the item it crashed on
        (xdist reports that one), and return that item."""
        units = self.assigned_work.pop(node)
        self._pending.pop(node, None)
        pending = [nodeid for unit in units.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]
        units[work_unit(crashed)][crashed] = True
        self.workqueue.update({name: unit for name, unit in units.items() if not all(unit.values())})
        for other in self.assigned_work:
            if other in self.registered_collections:  # a restarted worker has not collected yet
                self._refill(other)
        return crashed

    def schedule(self) -> None:
        """Split the collection into units and give every worker its first ones (again later: refill all)."""
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self._refill(node)
            return
        collections = list(self.registered_collections.values())
        if any(collection != collections[0] for collection in collections[1:]):
            self.log("workers collected different tests: no tests are scheduled")
            return
        self.collection = list(collections[0])
        self._positions = {nodeid: index for index, nodeid in enumerate(self.collection)}
        units: dict[str, dict[str, bool]] = {}
        for nodeid in self.collection:
            units.setdefault(work_unit(nodeid), {})[nodeid] = False
        recorded = UnitDurations.recorded(self.config)
        seconds = estimated_seconds({name: len(unit) for name, unit in units.items()}, recorded)
        self.workqueue.update(sorted(units.items(), key=lambda unit: -seconds[unit[0]]))  # stable: ties keep order
        for unused in self.nodes[len(self.workqueue):]:  # more workers than units
            self.assigned_work.pop(unused)
            self._pending.pop(unused, None)
            unused.shutdown()
        for node in self.nodes:
            self._assign(node)
        for node in self.nodes:
            self._refill(node)

    # -- assignment ----------------------------------------------------------------------------------------------
    def _refill(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending.get(node, 0) <= _REFILL_AT:
            self._assign(node)

    def _assign(self, node: Any) -> None:
        """Give the worker its next unit: one it captured, else one nobody alive captured, else the first."""
        if not self.workqueue:
            return
        name = self._next_unit(node)
        unit = self.workqueue.pop(name)
        self.assigned_work[node][name] = unit
        self._pending[node] = self._pending.get(node, 0) + sum(1 for done in unit.values() if not done)
        positions = self._positions if self.registered_collections[node] == self.collection else {
            nodeid: index for index, nodeid in enumerate(self.registered_collections[node])}
        node.send_runtest_some([positions[nodeid] for nodeid, done in unit.items() if not done])

    def _next_unit(self, node: Any) -> str:
        if self._captured is None:  # complete once every worker has collected, which precedes scheduling
            self._captured = captured_by(self.capture_dir) if self.capture_dir else {}
        if self._captured:
            alive = {other.gateway.id for other in self.nodes}
            mine = next((name for name in self.workqueue if self._captured.get(name) == node.gateway.id), None)
            if mine is not None:
                return mine
            free = next((name for name in self.workqueue if self._captured.get(name) not in alive), None)
            if free is not None:
                return free
        return next(iter(self.workqueue))

