"""A model's pipeline moves through explicit stages, and the xdist scheduler keeps a model's items together."""
import importlib

import torch

from tests.helpers import builtin_registry, tiny_sequential


def test_a_pipeline_moves_through_explicit_stages(monkeypatch):
    import qcore
    from pytest_qreport.core import pipeline as pipelines
    from pytest_qreport.core import runtime
    from pytest_qreport.core.pipeline import ModelPipeline, Stage, collect_model
    from pytest_qreport.core.settings import ModelSettings

    mapped: list[int] = []
    monkeypatch.setattr(runtime, "_set_mmap_threshold", mapped.append)
    trims: list[str] = []  # the heap's free pages given back between one model's checks
    monkeypatch.setattr(pipelines, "trim_heap", lambda: trims.append("trimmed"))
    where_read: list[bool] = []
    converting = importlib.import_module("qcore.analysis")  # where the plugin reads it
    original = converting.quantize_weights_where_read

    def recorded_where_read(enabled=True):
        where_read.append(enabled)
        return original(enabled)

    monkeypatch.setattr(converting, "quantize_weights_where_read", recorded_where_read)

    registry = builtin_registry()
    batches = [torch.randn(4, 8) for _ in range(2)]
    settings = ModelSettings.defaults(registry.checks(), checks=["sqnr", "model_sqnr"])
    pipeline = collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), tiny_sequential(), batches[0])
    assert pipeline.stage is Stage.COLLECTED and not pipeline.needs_capture
    assert pipeline.checks_and_layers() == [("sqnr", "0"), ("sqnr", "2"), ("model_sqnr", "output")]
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.stage is Stage.ANALYSED and pipeline.facts().fingerprint["threads"] == 1
    assert pipeline.finding("model_sqnr", "output").value > 20 and pipeline.facts().error == ""
    assert mapped == []  # a small model's analysis allocates from the heap: no page faults per activation
    assert where_read == [False]  # and keeps its quantized weights as tensors: no dequantization per forward
    assert trims == []  # nor gives the heap's pages back after each check, to fault them in again

    broken = collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), tiny_sequential(), batches[0])
    broken.analyze(lambda: [torch.randn(4, 3)], lambda found: None)
    assert broken.stage is Stage.ANALYSIS_FAILED and broken.failed and "model 'tiny'" in broken.error
    assert broken.facts().error == broken.error
    assert mapped == []
    monkeypatch.setattr(pipelines, "LARGE_MODEL_BYTES", 0)  # as if the model were big: its peak matters more
    collect_model("tiny", settings, registry, qcore.Int8StaticQuantizer(), tiny_sequential(), batches[0]).analyze(
        lambda: batches, lambda found: None)
    assert mapped == [1 << 20, 32 << 20]
    assert trims == ["trimmed", "trimmed"]  # after each of its two checks: what one freed is not resident in the next
    # a big model's weights are quantized where read (tests/qcore/test_weights_where_read.py)
    assert where_read[-1] is True
    broken.analyze(lambda: batches, lambda found: None)  # a failed stage is final
    assert broken.stage is Stage.ANALYSIS_FAILED
    assert ModelPipeline("m").collection_failed("why").stage is Stage.COLLECTION_FAILED


def test_the_scheduler_keeps_a_models_items_together_and_can_queue_a_crashed_item_again():
    from pytest_qreport.xdist.scheduling import ModelGroupScheduling, work_unit

    class Node:
        def __init__(self, name):
            self.gateway, self.shutting_down, self.sent = type("G", (), {"id": name})(), False, []

        def send_runtest_some(self, indices):
            self.sent += indices

        def shutdown(self):
            self.shutting_down = True

    class Config:  # what xdist's parse_tx_spec_config reads: two local workers
        def getvalue(self, name):
            return ["2*popen"] if name == "tx" else None

    ids = ["c.py::qreport/a/sqnr/fc1", "c.py::qreport/a/sqnr/fc2", "c.py::qreport/b/sqnr/fc1", "t.py::test_x"]
    assert work_unit(ids[0]) == work_unit(ids[1]) == "c.py::qreport/a" and work_unit(ids[3]) == "t.py::test_x"
    scheduler = ModelGroupScheduling(Config())
    assert scheduler.numnodes == 2
    first, second = Node("gw0"), Node("gw1")
    for node in (first, second):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, ids)
    scheduler.schedule()
    assert sorted(first.sent + second.sent) == [0, 1, 2, 3]
    holder = first if 0 in first.sent else second
    assert 1 in holder.sent  # both of model a's items went to the same worker
    crashed = scheduler.remove_node(holder)
    assert crashed == ids[0] and ids[1] in scheduler.workqueue.get("c.py::qreport/a", {})
    scheduler.mark_test_pending(crashed)
    assert scheduler.workqueue["c.py::qreport/a"][crashed] is False

