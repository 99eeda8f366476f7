"""Speed work must not move the numbers: every examples/ row stays at its recorded value.

"At" allows for the float rounding that differs between CPUs: AVX2 and AVX-512 kernels sum in different orders,
which can move a value across one quantization step. benchmarks/bench_cpu_drift.py measures it: ATen's AVX2
kernels with qcore's C kernels built without AVX-512 move a value by at most 0.0018 (dB, or a gain in dB), and an
AMD EPYC (AVX2) moved three by 0.0041 dB; 0.01 holds both with room. Unvectorized kernels (a CPU without AVX2) move
values by up to 0.08 dB and are not covered. A changed computation moves values by far more than 0.01.
"""
import json
import math
import pathlib
import subprocess
import sys

from tests.helpers import run_examples

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_example_value_is_unchanged_and_three_shards_merge_into_the_same_run(pytester, monkeypatch):
    tmp_path = pytester.path

    def _examples(*args):
        """pytest --qreport examples/ (its layer lists cached under tmp_path for the runs after the first)."""
        return run_examples(pytester, monkeypatch, *args, cache_dir=tmp_path / "cache")

    report = tmp_path / "report.json"
    _examples(f"--qreport-json={report}")
    recorded = json.loads((ROOT / "tests" / "data" / "examples_values.json").read_text())["values"]
    whole = json.loads(report.read_text())["rows"]
    measured = {f'{r["model"]}/{r["check"]}/{r["layer"]}': r["value"] for r in whole}
    assert set(measured) == set(recorded)
    moved = {}
    for key, old in recorded.items():
        new = measured[key]
        if isinstance(old, str) or isinstance(new, str) or old is None or new is None:
            same = old == new
        else:
            same = (math.isnan(old) and math.isnan(new)) or math.isclose(new, old, rel_tol=1e-4, abs_tol=1e-2)
        if not same:
            moved[key] = (old, new)
    assert not moved, moved
    # the same examples as 3 CI shards (--qreport-shard) merged (python -m pytest_qreport.merge): the same run
    shards = [tmp_path / f"shard{index}.json" for index in (1, 2, 3)]
    for index, shard in enumerate(shards, 1):
        result = _examples(f"--qreport-shard={index}/3", f"--qreport-json={shard}")
        assert result.ret == 0 and f"qreport shard {index}/3: " in result.stdout.str(), result.stdout.str()
    ran = [unit for shard in shards for unit in json.loads(shard.read_text())["shard"]["run"]]
    assert len(ran) == len(set(ran)) == 5  # every model on exactly one shard
    merged = subprocess.run([sys.executable, "-m", "pytest_qreport.merge", *map(str, shards), "--json",
                             str(tmp_path / "merged.json"), "--junitxml", str(tmp_path / "merged.xml"), "--html",
                             str(tmp_path / "merged.html")], capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0 and "232 pass, 8 skip" in merged.stdout, merged.stderr

    def row(entry):
        return entry["model"], entry["check"], entry["layer"], entry["value"], entry["verdict"]

    assert [row(entry) for entry in json.loads((tmp_path / "merged.json").read_text())["rows"]] == \
        [row(entry) for entry in whole]
    assert (tmp_path / "merged.xml").read_text().count("<testsuite ") == 5
    assert "tiny_resnet" in (tmp_path / "merged.html").read_text()
