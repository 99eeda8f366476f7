"""The xdist work units: claims on captures at collection, and the longest-first queue from recorded durations."""
import threading

from pytest_qreport.xdist.durations import CACHE_KEY, UnitDurations, estimated_seconds
from pytest_qreport.xdist.rendezvous import CaptureRendezvous
from pytest_qreport.xdist.scheduling import ModelGroupScheduling


def test_the_first_worker_to_claim_a_model_owns_it_and_the_other_waits_for_its_entry(tmp_path):
    first, second = CaptureRendezvous(str(tmp_path), "gw0"), CaptureRendezvous(str(tmp_path), "gw1")
    first.register()
    assert first.claim(3) and not second.claim(3) and first.claim(3)  # a claim holds for its owner only
    assert first.owner(3) == second.owner(3) == "gw0" and first.owner(4) is None


    entry = {"key": "key", "items": {"sqnr": ["fc"]}, "capture": {"method": "export"}, "parameter_bytes": 1024}
    store = threading.Timer(0.1, lambda: first.mark_done(3, entry))
    store.start()
    assert second.wait(3) == entry
    assert second.claim(5)
    second.mark_done(5, None)  # claimed, build or capture failed, nothing stored: the waiter stops waiting
    assert first.wait(5) is None


def test_a_claim_by_a_dead_worker_stops_the_wait(tmp_path):
    dead = CaptureRendezvous(str(tmp_path), "gw0")
    assert dead.claim(0)
    (tmp_path / "worker-gw0").touch()  # registered once, no process holds its lock any more
    assert CaptureRendezvous(str(tmp_path), "gw1").wait(0) is None


def test_units_without_a_recorded_duration_are_estimated_from_the_recorded_seconds_per_item():
    seconds = estimated_seconds({"a": 10, "b": 100, "c": 50}, {"a": 20.0, "stale": 3.0})
    assert seconds == {"a": 20.0, "b": 200.0, "c": 100.0}
    assert estimated_seconds({"a": 10, "b": 100}, {}) == {"a": 10.0, "b": 100.0}


class _Node:
    def __init__(self, name):
        self.gateway, self.shutting_down, self.sent = type("G", (), {"id": name})(), False, []

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


class _Cache(dict):
    def get(self, key, default):
        return super().get(key, default)

    def set(self, key, value):
        self[key] = value


class _Config:
    def __init__(self, cache):
        self.cache = cache

    def getvalue(self, name):
        return ["2*popen"] if name == "tx" else None


def test_the_longest_recorded_model_is_queued_first_and_durations_are_merged_into_the_cache():
    ids = [f"c.py::qreport/many/sqnr/fc{i}" for i in range(6)] + ["c.py::qreport/wide/sqnr/conv",
                                                                    "c.py::qreport/small/sqnr/fc"]
    cache = _Cache({CACHE_KEY: {"c.py::qreport/wide": 30.0, "c.py::qreport/many": 6.0}})
    scheduler = ModelGroupScheduling(_Config(cache))
    assert list(scheduler.workqueue) == []
    first, second = _Node("gw0"), _Node("gw1")
    for node in (first, second):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, ids)
    scheduler.schedule()
    # wide (30 s recorded) first, then many (6 s), then small (1 item at 1 s per item)
    assert first.sent[0] == [6] and second.sent[0] == [0, 1, 2, 3, 4, 5]
    durations = UnitDurations()
    durations.add("c.py::qreport/small", 0.5)
    durations.add("c.py::qreport/small", 0.25)
    durations.save(_Config(cache))
    assert cache[CACHE_KEY] == {"c.py::qreport/wide": 30.0, "c.py::qreport/many": 6.0, "c.py::qreport/small": 0.75}
