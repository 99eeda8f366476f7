"""How far the examples' values move between CPU kernels: the tolerance of tests/e2e/test_examples_values.py.

Runs `pytest --qreport examples/` once per kernel set and prints, for each, the largest absolute and relative
change of any row's value against tests/data/examples_values.json:

- `native`: this CPU's kernels (ATen's best capability, qcore's C kernels built with -march=native);
- `avx2`: ATen's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) and qcore's C kernels built without AVX-512;
- `scalar`: ATen's unvectorized kernels and qcore's torch paths (QCORE_NATIVE=0), a CPU without AVX2.

oneDNN, MKL and FBGEMM pick their kernels from the CPU itself, so another vendor's CPU can move values further
than this machine shows. Run:

    python benchmarks/bench_cpu_drift.py
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import stat
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
AVX2_CC = '#!/bin/sh\nexec cc "$@" -mno-avx512f -mno-avx512bw -mno-avx512dq -mno-avx512vl -mno-avx512cd\n'


def run_examples(env: dict[str, str], report: pathlib.Path) -> dict[str, object]:
    """Every examples/ row's value, keyed model/check/layer, from one run under `env`."""
    subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--qreport-json={report}", "examples/"], cwd=ROOT, env={**os.environ, **env},
                   capture_output=True, timeout=900)
    rows = json.loads(report.read_text())["rows"]
    return {f'{r["model"]}/{r["check"]}/{r["layer"]}': r["value"] for r in rows}


def largest_changes(recorded: dict[str, object], measured: dict[str, object]) -> tuple[float, float, str]:
    """(largest absolute change, largest relative change, the row of the absolute one) over the finite values."""
    largest, relative, where = 0.0, 0.0, ""
    for key, old in recorded.items():
        new = measured.get(key)
        if not isinstance(old, (int, float)) or not isinstance(new, (int, float)):
            continue
        if not (math.isfinite(old) and math.isfinite(new)):
            continue
        change = abs(new - old)
        if change > largest:
            largest, where = change, key
        relative = max(relative, change / max(abs(old), 1e-12))
    return largest, relative, where


def main() -> int:
    """Print the largest change per kernel set."""
    recorded = json.loads((ROOT / "tests" / "data" / "examples_values.json").read_text())["values"]
    with tempfile.TemporaryDirectory() as tmp:
        compiler = pathlib.Path(tmp) / "cc-avx2"
        compiler.write_text(AVX2_CC)
        compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
        kernel_sets = {
            "native": {},
            "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "CC": str(compiler), "QCORE_CACHE_DIR": f"{tmp}/cache"},
            "scalar": {"ATEN_CPU_CAPABILITY": "default", "QCORE_NATIVE": "0"},
        }
        print(f"{'kernels':<8} {'largest change':>15} {'relative':>10}  row")
        for name, env in kernel_sets.items():
            measured = run_examples(env, pathlib.Path(tmp) / f"{name}.json")
            largest, relative, where = largest_changes(recorded, measured)
            print(f"{name:<8} {largest:>15.5f} {relative:>10.2e}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
