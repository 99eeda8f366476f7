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

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_example_value_is_unchanged(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--qreport-json={report}", "examples/"], cwd=ROOT, capture_output=True, timeout=600)
    recorded = json.loads((ROOT / "tests" / "data" / "examples_values.json").read_text())["values"]
    measured = {f'{r["model"]}/{r["check"]}/{r["layer"]}': r["value"]
                for r in json.loads(report.read_text())["rows"]}
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
