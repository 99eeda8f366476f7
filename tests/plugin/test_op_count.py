"""The launch count a GPU pays, held on the CPU: the aten ops an analysis dispatches against the plain forward's,
with qcore's native kernels off (the path a GPU takes). benchmarks/bench_ops.py measures the larger models."""
import pathlib
import sys

import torch

from pytest_qreport.checks import BUILTIN_CHECKS
from qcore.runtime import native
from tests.helpers import analyze_with_checks, count_aten_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a little above what the examples' TinyResNet dispatches today (17.9x), so that a regression in launches fails here
CEILING = 19.5


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
