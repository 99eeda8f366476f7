"""Where one model's analysis spends its time: each stage (calibration, comparison, trials, the rest) against the
plain eager forward over the same batches, every default check, as the plugin runs them.

    python benchmarks/bench_stages.py                      # the MiniLM-shaped BERT and ResNet-18, 3 processes each
    python benchmarks/bench_stages.py resnet18 --rounds 5

The cases are bench_analysis.py's. Each round is a fresh process on 2 threads: a first analysis pays the process's
one-time costs, then the forward (best of 3) and two more analyses (the faster kept) are timed, the capture apart;
the stage seconds are the ones the plugin prints under its summary (`qcore.runtime.progress`; "other" is the time
outside the named stages). To compare two
commits, run it from a checkout of each, one round at a time, alternating: this machine's speed drifts by a tenth
from minute to minute.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(name: str) -> dict:
    """One round in this process: {"forward": s, "analysis": s, stage: s, ...}."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analysis import _case, _forward_seconds, _settings  # noqa: E402 - the benchmarks are scripts

    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.registry import CheckRegistry

    torch.set_num_threads(2)
    model, batches = _case(name)
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)

    def analysis() -> tuple[float, dict[str, float]]:
        state = collect_model("model", _settings(registry.names(), batches), registry, qcore.Int8StaticQuantizer(),
                              model, batches[0])
        start = time.perf_counter()
        state.analyze(lambda: batches, lambda found: None, threads=2)
        assert not state.failed, state.error
        return time.perf_counter() - start, {k: v for k, v in state.seconds.items() if k != "capture"}

    analysis()
    forward = min(_forward_seconds(model, batches) for _ in range(3))
    seconds, stages = min((analysis() for _ in range(2)), key=lambda found: found[0])
    return {"forward": forward, "analysis": seconds, **stages}


def main() -> None:
    """Each round of each case in a fresh process; one line per round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["minilm", "resnet18"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    for name in args.cases:
        for _ in range(args.rounds):
            output = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                    cwd=ROOT, timeout=3000)
            if output.returncode:
                print(f"{name}: failed: {output.stderr[-500:]}")
                continue
            row = json.loads(output.stdout.strip().splitlines()[-1])
            forward, analysis = row.pop("forward"), row.pop("analysis")
            stages = ", ".join(f"{stage} {seconds / forward:.2f}x" for stage, seconds in row.items())
            print(f"{name}: forward {forward:.3f} s, analysis {analysis:.2f} s = {analysis / forward:.1f}x "
                  f"({stages})", flush=True)


if __name__ == "__main__":
    main()
