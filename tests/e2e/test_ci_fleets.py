"""CI fleets: whole models sharded over runners (--qreport-shard=I/N), their reports merged (python -m
pytest_qreport.merge), and GitHub Actions' step summary and annotations."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import TINY_SOURCE

ROOT = pathlib.Path(__file__).resolve().parents[2]

THREE_MODELS = TINY_SOURCE + '''

@pytest.fixture
def batches():
    torch.manual_seed(0)
    return [torch.randn(4, 8) for _ in range(2)]


def _tiny(seed):
    torch.manual_seed(seed)
    return Tiny().eval()


@qmodel(calibration="batches", checks=["sqnr", "model_sqnr"])
def alpha():
    return _tiny(0)


@qmodel(calibration="batches", checks=["sqnr", "model_sqnr"], sqnr_min_db={threshold})
def beta():
    return _tiny(1)


@qmodel(calibration="batches", checks=["sqnr", "model_sqnr"])
def gamma():
    return _tiny(2)
'''


def _merge(*args):
    return subprocess.run([sys.executable, "-m", "pytest_qreport.merge", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "GITHUB_ACTIONS": "", "GITHUB_STEP_SUMMARY": ""})


def test_shard_values_out_of_range_are_usage_errors(pytester):
    pytester.makeconftest(THREE_MODELS.format(threshold=20))
    for bad, why in (("4/3", "shard index 4 is out of range"), ("1/0", "N >= 1"), ("two", "must be I/N")):
        result = pytester.runpytest("--qreport", f"--qreport-shard={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR and why in result.stderr.str(), bad


def test_four_shards_of_three_models_one_empty_merge_into_one_run_and_bad_inputs_are_named(pytester, tmp_path):
    pytester.makeconftest(THREE_MODELS.format(threshold=20))
    reports, outcomes = [], []
    for index in range(1, 5):  # the layer cache (pytester's own) spares the later shards the captures
        result = pytester.runpytest("--qreport", f"--qreport-shard={index}/4", f"--qreport-json={index}.json")
        outcomes.append((result.ret, result.stdout.str()))
        reports.append(pytester.path / f"{index}.json")
    assert all(ret == 0 for ret, _ in outcomes)
    assert sum("no model in this shard" in text for _, text in outcomes) == 1
    assert sum(json.loads(report.read_text())["rows"] == [] for report in reports) == 1
    merged = _merge(*reports, "--json", tmp_path / "merged.json")
    assert merged.returncode == 0 and "9 pass" in merged.stdout  # 3 models' sqnr fc1, fc2 and model_sqnr
    assert [row["model"] for row in json.loads((tmp_path / "merged.json").read_text())["rows"]] == \
        ["alpha"] * 3 + ["beta"] * 3 + ["gamma"] * 3  # the collection order of an unsharded run
    missing = _merge(*reports[:3])
    assert missing.returncode == 2 and "missing shard(s) 4/4" in missing.stderr
    twice = _merge(reports[0], *reports[:3])
    assert twice.returncode == 2 and "shard 1/4 is given twice" in twice.stderr
    busy = next(report for report in reports if json.loads(report.read_text())["rows"])
    other = json.loads(busy.read_text())
    other["shard"]["run"] = other["shard"]["units"]  # claims every model
    (tmp_path / "greedy.json").write_text(json.dumps(other))
    doubled = _merge(*[tmp_path / "greedy.json" if report == busy else report for report in reports])
    assert doubled.returncode == 2 and re.search(r"model \S+::qreport/\w+ is in two shards", doubled.stderr)
    other = json.loads(busy.read_text())
    other["versions"]["pytest_qreport"] = "0.0.1"
    (tmp_path / "old.json").write_text(json.dumps(other))
    versions = _merge(*[tmp_path / "old.json" if report == busy else report for report in reports])
    assert versions.returncode == 2 and "different plugin versions" in versions.stderr and "0.0.1" in versions.stderr
    (tmp_path / "cut.json").write_text(busy.read_text()[:200])
    truncated = _merge(*[tmp_path / "cut.json" if report == busy else report for report in reports])
    assert truncated.returncode == 2 and f"{tmp_path / 'cut.json'}: not a JSON report" in truncated.stderr
    failing = json.loads(busy.read_text())
    failing["rows"][0]["verdict"] = "fail"
    (tmp_path / "failing.json").write_text(json.dumps(failing))
    fails = _merge(*[tmp_path / "failing.json" if report == busy else report for report in reports],
                   "--junitxml", tmp_path / "failing.xml")
    assert fails.returncode == 1 and "FAIL" in fails.stdout and (tmp_path / "failing.xml").exists()


def test_models_are_spread_by_their_stored_durations_also_under_xdist(pytester):
    pytester.makeconftest(THREE_MODELS.format(threshold=20))
    pytester.runpytest("--qreport", "--qreport-store-durations")
    durations = json.loads((pytester.path / ".qreport_durations").read_text())
    assert sorted(unit.split("/")[-1] for unit in durations) == ["alpha", "beta", "gamma"]
    # alpha, say, takes as long as the two others together: it gets a shard of its own
    durations = {unit: 100.0 if unit.endswith("/alpha") else 1.0 for unit in durations}
    (pytester.path / ".qreport_durations").write_text(json.dumps(durations))
    runs = {}
    for index, workers in ((1, ["-n", "2"]), (2, [])):  # under xdist the workers tell the controller their shard
        pytester.runpytest("--qreport", *workers, f"--qreport-shard={index}/2", f"--qreport-json={index}.json")
        runs[index] = json.loads((pytester.path / f"{index}.json").read_text())
    assert [unit.split("/")[-1] for unit in runs[1]["shard"]["run"]] == ["alpha"]
    assert sorted({row["model"] for row in runs[2]["rows"]}) == ["beta", "gamma"]


def test_github_actions_gets_a_step_summary_and_an_annotation_per_failing_row(pytester, monkeypatch):
    pytester.makeconftest(THREE_MODELS.format(threshold=200))
    summary = pytester.path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider")
    text = summary.read_text()
    assert text.startswith("### qreport\n") and "| model | check | layer | value | threshold | verdict |" in text
    assert re.search(r"\| beta \| sqnr \| fc1 \| [\d.]+ dB \| 200.0 dB \| FAIL \|", text)
    line = next(n for n, source in enumerate((pytester.path / "conftest.py").read_text().splitlines(), 1)
                if source.startswith("def beta"))
    annotations = [text for text in result.stdout.lines if text.startswith("::error ")]
    assert len(annotations) == 2  # fc1 and fc2 of beta
    declared = line - 1  # the line of its @qmodel decorator
    assert annotations[0].startswith(f"::error file=conftest.py,line={declared},title=qreport beta sqnr fc1::"
                                     "layer fc1: SQNR")
