"""The layer cache: a warm collection captures nothing; the worker that analyses a model captures it once."""
import json

import torch
from torch import nn

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.layer_cache import LayerCache, model_cache_key
from pytest_qreport.core.settings import ModelSettings
from tests.helpers import PLUGIN_CONFTEST, SQNR_ONLY

COUNT_CAPTURES = """

import os
import time

import qcore
import qcore.graph.capture
import pytest_qreport.core.pipeline

_real_capture = qcore.capture


def _counting_capture(*args, **kwargs):
    with open(os.path.join(os.path.dirname(__file__), "captures.txt"), "a") as log:
        log.write(kwargs.get("name") or "?")
        log.write("\\n")
    time.sleep(float(os.environ.get("SLOW_CAPTURE_SECONDS", "0")))
    return _real_capture(*args, **kwargs)


qcore.capture = _counting_capture

@qmodel(calibration="batches")
def other():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
"""


def _project(pytester, model_width=16):
    source = PLUGIN_CONFTEST.replace("{options}", "").replace("{extra}", COUNT_CAPTURES)
    pytester.makeconftest(source.replace("nn.Linear(8, 16)", f"nn.Linear(8, {model_width})")
                          .replace("nn.Linear(16, 4)", f"nn.Linear({model_width}, 4)"))
    pytester.makeini("[pytest]\n" + SQNR_ONLY)


def _captures(pytester):
    path = pytester.path / "captures.txt"
    captured = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return sorted(captured)


def _ids(result):
    return [line for line in result.outlines if "::qreport/" in line]


def test_a_warm_collection_captures_nothing_and_the_run_captures_each_model_once(pytester):
    _project(pytester)
    cold = pytester.runpytest("--qreport", "--collect-only", "-q")
    assert _captures(pytester) == ["other", "tiny"]
    warm = pytester.runpytest("--qreport", "--collect-only", "-q")
    assert _captures(pytester) == []
    assert _ids(warm) == _ids(cold) and len(_ids(cold)) == 10
    pytester.runpytest("--qreport").assert_outcomes(passed=10)
    assert _captures(pytester) == ["other", "tiny"]  # at the analysis: once per model


def test_k_on_a_warm_cache_captures_only_the_selected_model(pytester):
    _project(pytester)
    pytester.runpytest("--qreport", "--collect-only", "-q")
    _captures(pytester)
    pytester.runpytest("--qreport", "-k", "other").assert_outcomes(passed=5)
    assert _captures(pytester) == ["other"]


def test_under_xdist_workers_agree_on_item_ids_and_only_the_analysing_worker_captures(pytester):
    _project(pytester)
    pytester.runpytest("--qreport", "--collect-only", "-q")
    _captures(pytester)
    result = pytester.runpytest("--qreport", "-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=10)  # xdist refuses a run whose workers collected different ids
    assert _captures(pytester) == ["other", "tiny"]


def test_a_model_past_the_share_of_the_budget_for_held_captures_is_captured_again_at_its_analysis(pytester):
    # tiny is 8 -> 2000 -> 4: 104 kB of weights, past an eighth of the 600 KiB budget (the share that captures
    # kept from collection to analysis may hold), though its analysis (5x) fits the budget: it is not held while
    # the other models are collected and analysed, but captured again by its analysis
    _project(pytester, model_width=2000)
    pytester.runpytest("--qreport", "--qreport-memory-budget=600KiB").assert_outcomes(passed=10)
    assert _captures(pytester) == ["other", "tiny", "tiny"]
    pytester.runpytest("--qreport", "--cache-clear").assert_outcomes(passed=10)
    assert _captures(pytester) == ["other", "tiny"]  # with the machine's memory as the budget, it is held


def test_under_xdist_each_model_is_built_once_at_collection_cold_warm_and_without_a_cache(pytester):
    from tests.helpers import BUDGET_CONFTEST as TWO_MODELS
    from tests.helpers import BUDGET_EVENTS as EVENTS

    source = TWO_MODELS.replace("    torch.manual_seed(0)\n", "    log('build wide')\n    torch.manual_seed(0)\n")
    source = source.replace("    torch.manual_seed(1)\n", "    log('build narrow')\n    torch.manual_seed(1)\n")
    pytester.makeconftest(source + EVENTS)
    events = pytester.path / "events.txt"
    for cache in ("cold", "warm", "none"):
        options = ["-p", "no:cacheprovider"] if cache == "none" else []
        result = pytester.runpytest("--qreport", "--collect-only", "-q", "-p", "xdist", "-n", "2", *options)
        assert result.ret == 0, cache
        # the worker that claims a model builds it; the other takes its items from the claimant's entry
        assert sorted(events.read_text().split("\n")[:-1]) == ["build narrow", "build wide"], cache
        events.unlink()


BROKEN = """

class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("this forward always fails")


@qmodel(calibration="batches")
def broken():
    return Broken()
"""


def test_on_a_cold_cache_under_xdist_each_model_is_captured_once_by_the_worker_that_analyses_it(pytester,
                                                                                                monkeypatch):
    # each capture takes a second: a worker claims the next model while the other captures one, however far apart
    # (within that second) the two start, so each captures one of the two models that capture
    monkeypatch.setenv("SLOW_CAPTURE_SECONDS", "1")
    _project(pytester)
    conftest = pytester.path / "conftest.py"
    conftest.write_text(conftest.read_text() + BROKEN)
    result = pytester.runpytest("--qreport", "-n", "2", "-p", "xdist", "-v")
    result.assert_outcomes(passed=10, errors=1)  # the workers agree on every item id, the failed capture's too
    # tiny and other at collection by the worker that claimed each, which then analyses it; broken's claimant
    # could not capture it, so the other worker tried too, to report the same error
    assert _captures(pytester) == ["broken", "broken", "other", "tiny"]
    assert "this forward always fails" in result.stdout.str()
    workers = {line.split("]")[0] for line in result.outlines if "PASSED" in line and "::qreport/" in line}
    assert len(workers) == 2  # the claims and the scheduler spread the models over the workers


def test_a_changed_model_is_captured_again_and_its_new_layers_are_items(pytester):
    _project(pytester)
    pytester.runpytest("--qreport", "--collect-only", "-q")
    _captures(pytester)
    _project(pytester, model_width=12)  # the conftest's source and the parameters' shapes change
    pytester.runpytest("--qreport", "--collect-only", "-q")
    assert _captures(pytester) == ["other", "tiny"]


def _settings():
    return ModelSettings.defaults(BUILTIN_CHECKS, checks=["sqnr"])


def test_the_key_covers_shapes_dtypes_settings_and_versions(monkeypatch, tmp_path):
    import qcore

    model, inputs, settings = nn.Linear(4, 2), torch.randn(3, 4), _settings()
    quantizer = qcore.Int8StaticQuantizer()

    def key(**changes):
        return model_cache_key(changes.get("model", model), changes.get("inputs", inputs), __file__,
                               changes.get("settings", settings), [], quantizer)

    base = key()
    assert key() == base
    assert key(inputs=torch.randn(5, 4)) != base
    assert key(inputs=torch.randn(3, 4, dtype=torch.float64)) != base
    assert key(model=nn.Linear(4, 3)) != base
    changed = _settings().replace(skip_layers=["x"])
    assert key(settings=changed) != base
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert key() != base
    cache = LayerCache(str(tmp_path))
    assert cache.load(base) is None
    cache.store(base, {"sqnr": ["fc"]}, {"method": "export"})
    assert cache.load(base)["items"] == {"sqnr": ["fc"]}
    assert [p.name for p in tmp_path.iterdir()] == [f"{base}.json"]  # written atomically: no temporary left
    (tmp_path / f"{base}.json").write_text(json.dumps({"format": 0}))
    assert cache.load(base) is None  # another format is a miss, not an error
