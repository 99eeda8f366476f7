"""The fix budget (issue 86): verdicts that do not depend on it, fixes searched within it, and what a search it
stopped says."""
import ast
import json
import re

import pytest

from pytest_qreport.core.schema import fix_budget_value
from qcore.runtime.progress import (
    StageTimes,
    fix_budget_use,
    graph_run,
    stage,
    tracked,
    trial_step,
    trials_allowed,
)
from tests.helpers import FRAGILE_SOURCE

DECLARATION = '''

@qmodel(calibration=batches, checks="sqnr,weight_sqnr,model_sqnr,sensitivity,per_channel,outlier"{extra})
def fragile():
    return MLP().eval()
'''


def _run(pytester, *args, extra=""):
    pytester.makeconftest(FRAGILE_SOURCE + DECLARATION.format(extra=extra))
    result = pytester.runpytest("--qreport", "--qreport-json=report.json", "--qreport-table=all", *args)
    report = json.loads((pytester.path / "report.json").read_text())
    return result, {(row["check"], row["layer"]): row for row in report["rows"]}, report["models"]["fragile"]


def test_graph_runs_count_towards_the_outermost_stage_and_the_budget_is_a_multiple_of_the_verdict_pass():
    with tracked(times=StageTimes(fix_budget=0.5)) as times:
        assert not trials_allowed(refuse=False)  # before the verdict pass, its multiples are nothing
        with stage("calibration"):
            for _ in range(3):
                graph_run()
        with stage("comparison"):
            graph_run(2)
        with stage("trials"), stage("calibration"):  # a trial's own passes are the trial's
            graph_run()
            graph_run(0.5)  # a run resumed half way through the graph
        assert times.runs == {"calibration": 3, "comparison": 2, "trials": 1.5}
        assert trials_allowed()  # 1.5 of 0.5 x 5 runs
        with stage("trials"):
            graph_run()
        assert not trials_allowed()  # 2.5 of 2.5
        use = fix_budget_use()
    assert use.verdict_runs == 5 and use.trial_runs == 2.5 and use.share == pytest.approx(1.0)
    assert use.refusals == 1
    assert trials_allowed() and fix_budget_use() is None  # untracked: no budget


def test_a_whole_model_trial_waits_for_a_budget_that_holds_the_costliest_one_so_far():
    with tracked(times=StageTimes(fix_budget=1.0)) as times:
        with stage("calibration"):
            graph_run(2)  # two batches: until one is measured, a whole-model trial calibrates and runs its quantized
        with stage("comparison"):  # copy on both
            graph_run(8)
        assert times.whole_trial_runs() == 4 and trials_allowed(whole=True)
        with stage("trials"), trial_step():
            graph_run(7)
        assert times.whole_trial_runs() == 7  # the costliest measured
        assert trials_allowed() and not trials_allowed(whole=True)  # 3 left: a search's screen, not a trial of 7
        with stage("trials"), trial_step():
            graph_run(1)
        use = fix_budget_use()
    assert use.refusals == 1 and use.trial_runs == 8


@pytest.mark.parametrize(("given", "parsed"), [("1", 1.0), (0, 0.0), ("0.25", 0.25), ("unlimited", float("inf")),
                                               ("inf", float("inf")), (float("inf"), float("inf"))])
def test_the_fix_budget_setting_parses(given, parsed):
    assert fix_budget_value(given, []) == parsed


@pytest.mark.parametrize("bad", ["-1", "lots", float("nan")])
def test_a_bad_fix_budget_says_what_it_takes(bad):
    with pytest.raises(ValueError, match="0 for verdicts only, or 'unlimited'"):
        fix_budget_value(bad, [])


def test_verdicts_and_values_are_the_same_under_every_budget(pytester):
    runs = {budget: _run(pytester, f"--qreport-fix-budget={budget}")[1] for budget in ("0", "1", "unlimited")}
    # every item but the sensitivity ranking's, whose value is its search's (the largest gain it measured)
    judged = {budget: {key: (row["verdict"], row["value"]) for key, row in rows.items() if key[0] != "sensitivity"}
              for budget, rows in runs.items()}
    assert judged["0"] == judged["1"] == judged["unlimited"]
    assert judged["0"][("model_sqnr", "output")][0] == "fail"
    # verdicts only: every search is said not to have run, and how to run it
    assert "No fix was searched: fix_budget is 0 (verdicts only)" in runs["0"][("model_sqnr", "output")]["message"]
    assert "qmodel(fix_budget=1)" in runs["0"][("sqnr", "layers.4")]["message"]


def test_a_search_stopped_by_its_budget_prints_only_fixes_measured_on_every_batch(pytester):
    result, rows, facts = _run(pytester, extra=", fix_budget=0.75")
    result.stdout.fnmatch_lines(["fix budget used: fragile *% of fix_budget=0.75 (* of * graph runs; * search "
                                 "step(s) stopped by it)"])
    assert facts["fix_budget"]["fix_budget"] == 0.75 and facts["fix_budget"]["stopped_searches"] > 0
    message = rows[("model_sqnr", "output")]["message"]
    found = re.search(r"was measured to reach ([\d.]+) dB: float_layers=(\[.*\])$", message)
    assert found, message
    announced, pasted = float(found.group(1)), ast.literal_eval(found.group(2))
    ranking = rows[("sensitivity", "model")]["message"]
    assert "were not measured: the model's fix budget was spent" in ranking
    further = re.search(r"search further with qmodel\((fix_budget=[\d.]+)\)", ranking)
    assert further, ranking
    # the printed set, pasted: the item measures what the message announced, on every batch it is judged on
    result, rows, _ = _run(pytester, extra=f", fix_budget=0.75, float_layers={pasted!r}")
    assert rows[("model_sqnr", "output")]["verdict"] == "pass"
    assert rows[("model_sqnr", "output")]["value"] == pytest.approx(announced, abs=0.05)
    # the settings the stopped search names: a larger budget searches further, 'unlimited' to the end
    _, rows, further_facts = _run(pytester, extra=f", {further.group(1)}")
    assert further_facts["fix_budget"]["trial_runs"] > facts["fix_budget"]["trial_runs"]
    _, rows, end_facts = _run(pytester, extra=", fix_budget='unlimited'")
    ranking = rows[("sensitivity", "model")]
    assert "not measured" not in ranking["message"], ranking
    assert "ranking" in ranking["details"], (ranking["message"], ranking["details"])
    assert len(ranking["details"]["ranking"]) == 4, ranking
    assert end_facts["fix_budget"]["stopped_searches"] == 0 and end_facts["fix_budget"]["fix_budget"] is None


def test_the_budget_stops_a_search_at_the_same_step_serially_and_under_xdist(pytester):
    _, serial, serial_facts = _run(pytester, extra=", fix_budget=0.75")
    _, parallel, parallel_facts = _run(pytester, "-n", "2", extra=", fix_budget=0.75")
    assert {key: (row["verdict"], row["value"], row["message"]) for key, row in serial.items()} == \
        {key: (row["verdict"], row["value"], row["message"]) for key, row in parallel.items()}
    assert serial_facts["fix_budget"]["trial_runs"] == parallel_facts["fix_budget"]["trial_runs"]


def test_the_fix_budget_is_read_from_the_ini_file(pytester):
    pytester.makeini("[pytest]\nqreport_fix_budget = 0\n")
    _, rows, facts = _run(pytester)
    assert facts["fix_budget"]["fix_budget"] == 0 and facts["fix_budget"]["trial_runs"] == 0
    assert "fix_budget is 0" in rows[("model_sqnr", "output")]["message"]


SENSOR_SOURCE = '''
import torch
from torch import nn
from pytest_qreport import qmodel


def sensor_batches():
    g = torch.Generator().manual_seed(4)
    spread = torch.logspace(-2, 2, 32)  # input channels span four orders of magnitude
    return [torch.randn(64, 32, generator=g) * spread for _ in range(8)]


@qmodel(calibration=sensor_batches, quantizer="int8_histogram", checks="model_sqnr,equalization"{extra})
def sensor():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
'''


def _run_sensor(pytester, extra=""):
    pytester.makeconftest(SENSOR_SOURCE.format(extra=extra))
    pytester.runpytest("--qreport", "--qreport-json=report.json")
    report = json.loads((pytester.path / "report.json").read_text())
    return {row["layer"]: row for row in report["rows"] if row["check"] == "equalization"}, report["models"]["sensor"]


def test_an_equalization_verdict_comes_from_the_comparison_pass_and_its_fix_from_the_budget(pytester):
    verdicts = {budget: _run_sensor(pytester, f", fix_budget={budget!r}") for budget in (0, 0.5, "unlimited")}
    judged = {budget: {layer: (row["verdict"], row["value"]) for layer, row in rows.items()}
              for budget, (rows, _) in verdicts.items()}
    assert judged[0] == judged[0.5] == judged["unlimited"]
    failing = [layer for layer, (verdict, _) in judged[0].items() if verdict == "fail"]
    assert failing and all(judged[0][layer][1] >= 1.0 for layer in failing)
    assert verdicts[0][1]["fix_budget"]["trial_runs"] == 0  # no verdict waited for a trial
    first = verdicts[0][0][failing[0]]["message"]
    assert "effect on the model output was not measured: the model's fix budget was spent" in first, first
    pasted = re.search(r"The setting that applies it: qmodel\(\.\.\., (equalize=\[.*?\])\)", first)
    assert pasted, first
    # the setting it names applies the fix: equalized so, the layer's item passes
    rows, _ = _run_sensor(pytester, f", {pasted.group(1)}")
    assert rows[failing[0]]["verdict"] == "pass" and rows[failing[0]]["details"]["applied"]
    # the smaller budget prints a measured fix and says how to search further; that setting measures more fixes
    half = verdicts[0.5][0][failing[0]]["message"]
    assert "Fix: qmodel(..., equalize=" in half and "Other fixes of this search were not measured" in half, half
    further = re.search(r"search further with qmodel\((fix_budget=[\d.]+)\)", half)
    assert further, half
    _, facts = _run_sensor(pytester, f", {further.group(1)}")
    assert facts["fix_budget"]["trial_runs"] > verdicts[0.5][1]["fix_budget"]["trial_runs"]
    assert "Fix: qmodel(..., equalize=" in verdicts["unlimited"][0][failing[0]]["message"]


def test_the_fix_budget_line_lists_models_by_name_however_their_times_fell():
    from pytest_qreport.core.results import ModelFacts
    from pytest_qreport.reports.terminal import timing_lines

    use = {"fix_budget": 1.0, "verdict_runs": 16.0, "trial_runs": 8.0, "share": 0.5, "stopped_searches": 1}
    lines = {}
    for fast, slow in (("alpha", "beta"), ("beta", "alpha")):  # a serial run, then one under xdist
        models = {name: ModelFacts(name=name, seconds={"comparison": seconds}, fix_budget=use)
                  for name, seconds in ((fast, 1.0), (slow, 2.0))}
        lines[fast] = timing_lines(models)[-1]
    assert lines["alpha"] == lines["beta"]
    assert lines["alpha"].startswith("fix budget used: alpha 50% of fix_budget=1 (8 of 16 graph runs; 1 search")
