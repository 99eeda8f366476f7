"""The launch count a GPU pays, held on the CPU: the aten ops an analysis dispatches against the plain forward's,
with qcore's native kernels off (the path a GPU takes). benchmarks/bench_ops.py measures the larger models."""
import pathlib
import sys

import torch

from pytest_qreport.checks import BUILTIN_CHECKS
from qcore.runtime import native
from tests.helpers import analyze_with_checks, count_aten_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a little above what the examples' TinyResNet dispatches today (24.7x: its outlier screen observes each flagged
# layer's input with a histogram, 11 observers), so that a regression in launches fails here
CEILING = 26.0


def test_the_analysis_dispatches_at_most_the_ceiling_of_aten_ops_against_the_forward(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)  # the torch path, as on a GPU
    sys.path.insert(0, str(ROOT / "examples"))
    from models import TinyResNet, seeded, settle_batchnorm

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, 32, 32, generator=generator) for _ in range(8)]
    model = settle_batchnorm(seeded(TinyResNet), batches)
    with torch.no_grad():
        forward, _ = count_aten_ops(lambda: [model(batch) for batch in batches])
    checks = [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    with torch.no_grad():
        analysis, (found, _) = count_aten_ops(lambda: analyze_with_checks(lambda: model, batches, checks=checks))
    assert not [finding for finding in found.values() if finding.verdict == "error"]
    assert analysis / forward <= CEILING, f"{analysis:,} aten ops against the forward's {forward:,}"


def test_the_passes_floor_counts_a_graphs_own_ops_and_each_fake_quantization_once(monkeypatch):
    monkeypatch.setitem(native._state, "library", None)  # the torch path: observers and fake quantizations are ops
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ops
    from torch import fx, nn

    from qcore.graph.inputs import call_model
    from qcore.observe.observers import MinMaxObserver
    from qcore.observe.qparams import fake_quantize_per_tensor

    x = torch.randn(2, 4)
    plain = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    observed = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    observed.add_submodule("observer", MinMaxObserver())  # called from the graph, as prepare inserts observers
    output = next(node for node in observed.graph.nodes if node.op == "output")
    with observed.graph.inserting_before(output):
        output.replace_input_with(output.args[0], observed.graph.call_module("observer", (output.args[0],)))
    observed.recompile()
    counts = []
    for run in (lambda: call_model(plain, x), lambda: call_model(observed, x),
                lambda: fake_quantize_per_tensor(x, 0.1, 0, -128, 127)):
        counter = bench_ops.op_counter()
        with torch.no_grad(), counter:
            run()
        counts.append(counter.counts)
    graph_ops = counts[0]["graph"]
    assert graph_ops == counts[0]["ops"] > 0 and counts[0]["fq"] == 0
    assert counts[1]["graph"] == graph_ops < counts[1]["ops"]  # the observer's aminmax and updates are not the graph's
    assert counts[2]["fq"] == 1 < counts[2]["ops"] and counts[2]["graph"] == 0  # NaN put back: an op of its own
    assert all(count["trial_graph"] == count["trial_fq"] == 0 for count in counts)
