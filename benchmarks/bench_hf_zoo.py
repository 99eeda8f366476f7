"""The transformers zoo: 46 architectures as users declare them, under int8 and four deployed formats.

Each architecture of `hf_zoo/architectures.py` (decoders, mixture-of-experts decoders, encoders, sequence to
sequence, vision and audio models; default configs made tiny, seeded random weights, `{"input_ids": ...}`-style
calibration batches) is a @qmodel of `hf_zoo/conftest.py`. For each quantizer this runs `pytest --qreport` on
that folder in a fresh process, reads its JSON report and prints, per architecture, the items and the error
items, the error items that are not shape refusals naming their fix, and the wall time of each run. It exits 1
when an error item other than a shape refusal is left. Run:

    python benchmarks/bench_hf_zoo.py [--quantizers int8,NVFP4,W4A16,FP8_DYNAMIC,MXFP4] [--zoo gpt2,llama] [-n 2]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
QUANTIZERS = ("int8", "NVFP4", "W4A16", "FP8_DYNAMIC", "MXFP4")


def is_shape_refusal(row: dict) -> bool:
    """An error item that refuses a layer's shape for a format, naming the layer_formats fix."""
    return "cannot be quantized as" in row["message"] and "layer_formats=" in row["message"]


def run_zoo(quantizer: str, zoo: str, workers: int) -> tuple[list[dict], float]:
    """The rows of one `pytest --qreport` run of the zoo under `quantizer`, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "zoo.json")
        command = [sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                   f"--qreport-quantizer={quantizer}", f"--qreport-json={report}", str(HERE / "hf_zoo")]
        if workers:
            command += ["-n", str(workers)]
        env = dict(os.environ, QREPORT_ZOO=zoo)
        start = time.perf_counter()
        subprocess.run(command, cwd=HERE / "hf_zoo", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elapsed = time.perf_counter() - start
        with open(report) as file:
            return json.load(file)["rows"], elapsed


def main() -> int:
    """Run the zoo under each quantizer and print the error items per architecture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantizers", default=",".join(QUANTIZERS))
    parser.add_argument("--zoo", default="", help="comma-separated architectures (default: all)")
    parser.add_argument("-n", dest="workers", type=int, default=0, help="pytest-xdist workers (default: serial)")
    parser.add_argument("--show", type=int, default=1, help="error messages to print per architecture")
    options = parser.parse_args()
    sys.path.insert(0, str(HERE / "hf_zoo"))
    from architectures import ARCHITECTURES

    names = [n for n in options.zoo.split(",") if n] or list(ARCHITECTURES)
    left = 0
    total = 0.0
    for quantizer in options.quantizers.split(","):
        rows, elapsed = run_zoo(quantizer, ",".join(names), options.workers)
        total += elapsed
        items = collections.Counter(row["model"] for row in rows)
        errors = collections.defaultdict(list)
        for row in rows:
            if row["verdict"] == "error":
                errors[row["model"]].append(row)
        print(f"\n## {quantizer}: {len(rows)} items, {sum(map(len, errors.values()))} errors, {elapsed:.1f} s")
        print(f"{'architecture':<14} {'family':<8} {'items':>6} {'errors':>6} {'other than refusals':>20}")
        for name in names:
            other = [row for row in errors[name] if not is_shape_refusal(row)]
            left += len(other)
            print(f"{name:<14} {ARCHITECTURES[name][0]:<8} {items[name]:>6} {len(errors[name]):>6} {len(other):>20}")
            for row in other[:options.show]:
                print("    " + row["message"].splitlines()[0][:300])
    print(f"\nwhole zoo: {total:.1f} s; error items other than shape refusals: {left}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
