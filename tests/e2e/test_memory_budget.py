"""The memory budget: a model estimated not to fit errors before its analysis starts; concurrent analyses of the
-n workers hold reservations against one budget, so a second one waits instead of running out of memory."""
import threading
import time

import pytest
from torch import nn

from pytest_qreport.core.memory import ANALYSIS_FACTOR, MemoryLedger, estimated_analysis_bytes
from pytest_qreport.core.schema import byte_size
from tests.helpers import BUDGET_CONFTEST, BUDGET_EVENTS


def test_sizes_parse_with_decimal_and_binary_units_and_auto():
    assert byte_size("16GiB", ()) == 16 * 2**30 and byte_size("512 MB", ()) == 512 * 10**6
    assert byte_size(1000, ()) == 1000 and byte_size("1.5kib", ()) == 1536 and byte_size("auto", ()) is None
    for bad in ("lots", "-1GB", "0", "12 parsecs"):
        with pytest.raises(ValueError, match="must be a size such as 16GiB"):
            byte_size(bad, ())


def test_the_estimate_counts_shared_storages_once():
    layer = nn.Linear(16, 16)
    tied = nn.Sequential(layer, layer)
    weights, estimate = estimated_analysis_bytes(tied)
    assert weights == (16 * 16 + 16) * 4 and estimate == int(weights * ANALYSIS_FACTOR)


def test_a_second_reservation_waits_until_the_first_is_released(tmp_path):
    ledger, events = MemoryLedger(str(tmp_path), poll=0.01), []

    def second():
        with ledger.reserved("b", 60, budget=100):
            events.append("b in")

    with ledger.reserved("a", 60, budget=100):
        waiting = threading.Thread(target=second)
        waiting.start()
        time.sleep(0.2)
        assert events == [] and list(ledger.held()) == ["a"]  # 60 + 60 > 100: b waits
        events.append("a out")
    waiting.join(5)
    assert events == ["a out", "b in"] and ledger.held() == {}
    with ledger.reserved("alone", 500, budget=100):  # larger than the budget but alone: it runs (it was checked)
        assert list(ledger.held()) == ["alone"]


def test_the_reservation_of_a_dead_process_is_dropped(tmp_path):
    (tmp_path / "memory.json").write_text('{"gone": [999999999, 90]}')
    ledger = MemoryLedger(str(tmp_path), poll=0.01)
    with ledger.reserved("mine", 60, budget=100):
        assert list(ledger.held()) == ["mine"]


@pytest.mark.parametrize("workers", [[], ["-n", "2", "-p", "xdist"]], ids=["serial", "xdist"])
def test_a_model_over_the_budget_errors_with_its_estimate_and_the_others_run(pytester, workers):
    pytester.makeconftest(BUDGET_CONFTEST)
    run = pytester.runpytest
    result = run("--qreport", "-p", "no:randomly", "--qreport-memory-budget=1MiB", *workers)
    result.assert_outcomes(passed=2, errors=2)  # narrow's 2 layers pass; wide's 2 items error
    text = result.stdout.str()
    # a Sequential is a stack of blocks: blockwise='auto' tried one layer at a time too
    assert ("model 'wide': its analysis, even one block at a time (blockwise), is estimated to need 1.3 MiB on top "
            "of the model (5x its biggest block's 257.0 KiB of parameters and buffers)") in text
    assert "more than the memory budget of 1.0 MiB (--qreport-memory-budget / qreport_memory_budget)" in text
    # the hint works: the budget it names lets the model run
    run("--qreport", "-p", "no:randomly", "--qreport-memory-budget=32GiB", *workers).assert_outcomes(passed=4)


def test_two_models_that_fit_the_budget_only_one_at_a_time_both_run_under_xdist(pytester):
    pytester.makeconftest(BUDGET_CONFTEST.replace("nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 4)",
                                           "nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)"))
    # each estimate is 2.5 MiB: both fit 3 MiB alone, not together, so one worker waits for the other
    result = pytester.runpytest("--qreport", "-p", "no:randomly", "-p", "xdist", "-n", "2",
                                "--qreport-memory-budget=3MiB")
    result.assert_outcomes(passed=4)




def test_a_worker_that_waits_for_memory_has_not_built_its_model_yet(pytester):
    # two models of 514 KiB: each analysis (6x with the model) fits 3.5 MiB alone, not two at once; and each model is
    # past the eighth of the budget that captures may hold from collection to analysis, so both are built again
    source = BUDGET_CONFTEST.replace("nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 4)",
                              "nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)")
    source = source.replace("    torch.manual_seed(0)\n", "    log('build wide')\n    torch.manual_seed(0)\n")
    source = source.replace("    torch.manual_seed(1)\n", "    log('build narrow')\n    torch.manual_seed(1)\n")
    pytester.makeconftest(source + BUDGET_EVENTS)
    result = pytester.runpytest("--qreport", "-p", "no:randomly", "-p", "xdist", "-n", "2",
                                "--qreport-memory-budget=3.5MiB")
    result.assert_outcomes(passed=4)
    events = (pytester.path / "events.txt").read_text().split("\n")[:-1]
    collection, analysis = events[:-4], events[-4:]
    assert set(collection) == {"build narrow", "build wide"}  # each worker collects (and builds) both
    first, second = analysis[0].split()[1], analysis[2].split()[1]
    assert {first, second} == {"narrow", "wide"}
    # the second model is built only once the first one's analysis is over and its memory is given back
    assert analysis == [f"build {first}", f"analysed {first}", f"build {second}", f"analysed {second}"], events


FREED = """

import gc
import weakref

BUILT = []


class Cyclic(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        self.__dict__["me"] = self  # a reference cycle, as transformers models have: only the collector frees it

    def forward(self, x):
        return self.layers(x)


@qmodel(calibration="batches", checks=["sqnr"])
def cyclic():
    model = Cyclic().eval()
    BUILT.append(weakref.ref(model))
    return model


def pytest_collection_finish(session):
    gc.disable()  # no collection of our own from here: what is alive now was left alive by collection
    alive = [ref for ref in BUILT if ref() is not None]
    print(f"models built: {len(BUILT)}, alive after collection: {len(alive)}")
    gc.enable()
"""


def test_a_model_built_at_collection_is_freed_before_the_next_one_is_built(pytester):
    pytester.makeconftest(BUDGET_CONFTEST + FREED)
    result = pytester.runpytest("--qreport", "-p", "no:randomly", "-s")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["models built: 1, alive after collection: 0"])
