"""How many aten ops an analysis dispatches against the plain forward over the same batches: the launch count a GPU
pays, measured on the CPU (QCORE_NATIVE=0: qcore's C kernels off, the path a GPU takes), with its host reads (each a
wait for a GPU); and, in the same run, what the analysis costs on this CPU against the forward (qcore's C kernels
on).

    python benchmarks/bench_ops.py                 # the examples' TinyResNet ("cnn"), a MiniLM-shaped BERT, ResNet-18,
                                                   # and the 0.5B Llama config (op counts only: minutes a run)
    python benchmarks/bench_ops.py --quick         # the examples' TinyResNet only
    python benchmarks/bench_ops.py --no-time       # the op counts alone
    python benchmarks/bench_ops.py --llama1b       # also the 1B Llama config's CPU time, verdicts only and the
                                                   # default run (fix budgets 0 and 1; about 5 minutes)
    python benchmarks/bench_ops.py --quick --no-time --llama1b --fix-budget unlimited   # the 1B config alone,
                                                   # its fix searches run to their ends

The cases are bench_analysis.py's and a 0.5B Llama config, 8 batches each.

Each case runs in subprocesses of its own: every default check (as `pytest --qreport` runs them), and
`sqnr,model_sqnr` alone, each counted with a TorchDispatchMode from capture to the last finding, against the eager
forward, with the floor of the passes the checks run (the ops the model graphs' own code dispatches in every
calibration, float, quantized, shadow and trial run, plus one per fake quantization: what the analysis would
dispatch if every observer, comparator and statistic cost nothing) and the part of that floor verified advice runs
(its trials and searches); then bench_analysis.py's steady-state time of every default check against the forward
(best of three rounds after a first analysis in the process, the capture apart). With --llama1b, the 1B Llama config
in float32 (hidden 2048, 16 layers, 32,000-token vocabulary, seeded weights; bench_memory.py's 3 batches of 2 x 64
tokens) is analysed once with every default check, native kernels on, against its forward over the same batches: the
collection (capture) and the analysis proper apart, as a session pays them, and the analysis's seconds per check.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the plugin's analysis as the tests run it


def _case(name: str):
    """(model, batches) of a case: bench_analysis.py's, so that the two benchmarks' figures concern one model; or
    "llama0.5b", the issue's 0.5B Llama config in bfloat16 with 8 batches of 1 x 32 tokens (an op count does not
    depend on the tokens per batch, and short batches keep the count quick on a CPU)."""
    if name == "llama0.5b":
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=14, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=32000, use_cache=False)
        generator = torch.Generator().manual_seed(1)
        return (LlamaForCausalLM(config).to(torch.bfloat16).eval(),
                [{"input_ids": torch.randint(0, 32000, (1, 32), generator=generator)} for _ in range(8)])
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analysis import _case as analysis_case  # noqa: E402 - the benchmarks are scripts, not a package

    return analysis_case(name)


FAKE_QUANTIZATIONS = frozenset({"fake_quantize_per_tensor_affine", "fake_quantize_per_tensor_affine_cachemask",
                                "fake_quantize_per_channel_affine", "fake_quantize_per_channel_affine_cachemask"})
TRIALS = frozenset({("advice.py", "try_fix"), ("analysis.py", "sensitivity"), ("analysis.py", "float_layers_fix"),
                    ("analysis.py", "format_fix")})  # the functions verified advice runs its trials and searches in


def _op_origin(frame, packages: tuple[str, ...], inputs: str) -> tuple[bool, bool]:
    """(whether the op dispatched under `frame` is a model graph's own: the innermost frame of qcore or the plugin
    is call_model, so no observer, comparator or fake quantization of qcore's dispatched it; whether verified
    advice dispatched it, in a trial or a search)."""
    graph = trial = False
    innermost = True
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(packages):
            if innermost:
                graph, innermost = path == inputs and frame.f_code.co_name == "call_model", False
            if (os.path.basename(path), frame.f_code.co_name) in TRIALS:
                trial = True
                break
        frame = frame.f_back
    return graph, trial


def op_counter():
    """A TorchDispatchMode counting, in its `counts`, every aten op ("ops"), host reads ("reads"), the ops of model
    graphs' own code ("graph"), fake quantizations ("fq"), and of these two those verified advice dispatched
    ("trial_graph", "trial_fq"). A host read is a scalar read of a tensor (`.item()`, `float(t)`, `bool(t)`:
    aten._local_scalar_dense), which on a GPU waits for the device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import pytest_qreport
    import qcore

    packages = tuple(os.path.dirname(module.__file__) + os.sep for module in (qcore, pytest_qreport))
    inputs = os.path.join(os.path.dirname(qcore.__file__), "graph", "inputs.py")

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts = dict.fromkeys(("ops", "reads", "graph", "fq", "trial_graph", "trial_fq"), 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts = self.counts
            counts["ops"] += 1
            counts["reads"] += func is torch.ops.aten._local_scalar_dense.default
            graph, trial = _op_origin(sys._getframe(1), packages, inputs)
            kind = "fq" if func._overloadpacket.__name__ in FAKE_QUANTIZATIONS else "graph" if graph else None
            if kind is not None:
                counts[kind] += 1
                counts["trial_" + kind] += trial
            return func(*args, **(kwargs or {}))

    return Counter()


def analysis_ops(model, batches, checks=None) -> dict[str, int]:
    """op_counter()'s counts of one model's analysis, capture included, with the plugin's checks (every default one,
    or `checks`). "graph" and "fq" together are what the passes cost with no observer, comparator or statistic and
    one op per fake quantization: the floor of the passes the checks run."""
    import torch

    from pytest_qreport.checks import BUILTIN_CHECKS
    from tests.helpers import analyze_with_checks

    chosen = checks or [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    counter = op_counter()
    with torch.no_grad(), counter:
        analyze_with_checks(lambda: model, batches, checks=chosen)
    return counter.counts


def forward_ops(model, batches) -> int:
    """Aten ops of the eager forward over the batches."""
    import torch

    from qcore.graph.inputs import call_model
    from tests.helpers import count_aten_ops

    with torch.no_grad():
        return count_aten_ops(lambda: [call_model(model, batch) for batch in batches])[0]


def measure(name: str) -> dict:
    """One case, in this process."""
    model, batches = _case(name)
    forward = forward_ops(model, batches)
    every = analysis_ops(model, batches)
    return {"case": name, "forward": forward, "all": every["ops"], "reads": every["reads"],
            "floor": every["graph"] + every["fq"], "trials_floor": every["trial_graph"] + every["trial_fq"],
            "sqnr": analysis_ops(model, batches, ["sqnr", "model_sqnr"])["ops"]}


def main() -> None:
    """Each case in a subprocess with the native kernels off; the table of counts and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-time", action="store_true", help="count the ops only")
    parser.add_argument("--llama1b", action="store_true", help="also time the 1B Llama config on this CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--fix-budget", default="0,1",
                        help="the 1B runs' fix budgets, comma-separated, one process each (default '0,1': verdicts "
                             "only and the default run; 'unlimited' searches to the end)")
    parser.add_argument("--time-llama1b", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    if args.time_llama1b:
        print(json.dumps(time_llama1b(math.inf if args.fix_budget == "unlimited" else float(args.fix_budget))))
        return
    cases = ["cnn"] if args.quick else ["cnn", "minilm", "resnet18", "llama0.5b"]
    print(f"{'case':12} {'forward ops':>12} {'every default check':>28} {'host reads':>11} {'passes floor':>15} "
          f"{'of it, advice':>14} {'sqnr,model_sqnr':>24} {'CPU time':>22}")
    for name in cases:
        output = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT,
                                env={**os.environ, "QCORE_NATIVE": "0"}, timeout=3000)
        if output.returncode:
            print(f"{name}: failed: {output.stderr[-500:]}")
            continue
        row = json.loads(output.stdout.strip().splitlines()[-1])
        timed = "" if args.no_time or name == "llama0.5b" else _cpu_time(name)
        print(f"{name:12} {row['forward']:>12,} {row['all']:>16,} ({row['all'] / row['forward']:>6.1f}x) "
              f"{row['reads']:>11,} {row['floor'] / row['forward']:>14.1f}x "
              f"{row['trials_floor'] / row['forward']:>13.1f}x "
              f"{row['sqnr']:>12,} ({row['sqnr'] / row['forward']:>6.1f}x) {timed:>22}")
    if args.llama1b:
        ratios = {}
        for budget in args.fix_budget.split(","):
            row = _llama1b_run(budget)
            if row is not None:
                ratios[budget] = row["analysis"] / row["forward"]
        if len(ratios) > 1:
            print("llama1b, against the forward of the same process: " + "; ".join(
                f"fix_budget={budget} {ratio:.1f}x" for budget, ratio in ratios.items()))


def _llama1b_run(budget: str) -> dict[str, Any] | None:
    """time_llama1b under `budget` in a subprocess, its lines printed; its row (None if it failed)."""
    environment = {key: value for key, value in os.environ.items() if key != "QCORE_NATIVE"}
    output = subprocess.run([sys.executable, __file__, "--time-llama1b", "--fix-budget", budget],
                            capture_output=True, text=True, cwd=ROOT, env=environment, timeout=7200)
    if output.returncode:
        print(f"llama1b, fix_budget={budget}: failed: {output.stderr[-500:]}")
        return None
    row = json.loads(output.stdout.strip().splitlines()[-1])
    print(f"llama1b, fix_budget={budget}, every default check, CPU: forward {row['forward']:.2f} s; "
          f"collection {row['collection']:.1f} s; analysis {row['analysis']:.1f} s "
          f"({row['analysis'] / row['forward']:.1f}x the forward)")
    print("  seconds per check (its items' findings, the model's measurement in the first): " + ", ".join(
        f"{name} {seconds:.1f}" for name, seconds in row["checks"].items() if seconds >= 0.05))
    spent = row["fix_budget"]
    print(f"  verdict pass (calibration, comparison) {row['verdict']:.1f} s = {row['verdict'] / row['forward']:.1f}x "
          f"the forward; {row['failing']} failing item(s); per stage: "
          + ", ".join(f"{name} {seconds:.1f}" for name, seconds in row["stages"].items()) +
          f"; fix searches {spent.get('trial_runs', 0):.3g} graph runs of the verdict pass's "
          f"{spent.get('verdict_runs', 0):.3g} ({spent.get('stopped_searches', 0)} search step(s) stopped)")
    if row["peak_above_bytes"] is not None:
        print(f"  the analysis's peak RSS above its start: +{row['peak_above_bytes'] / 2**30:.2f} GiB = "
              f"{row['peak_above_bytes'] / row['weights_bytes']:.2f}x its float32 weights "
              f"({row['weights_bytes'] / 2**30:.2f} GiB)")
    return row


def time_llama1b(fix_budget: float = 1.0) -> dict[str, Any]:
    """The 1B Llama config's forward, collection (capture) and analysis seconds on this CPU (native kernels on, 2
    threads) under `fix_budget`, the analysis's seconds per check and per stage (its verdict pass: calibration and
    comparison), what its fix searches spent, and its peak RSS above the RSS it started from (after the capture)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analysis import _analyse, _forward_seconds, _reset_peak, _rss_bytes  # noqa: E402 - scripts

    from pytest_qreport.core.pipeline import ModelPipeline

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 32000, (2, 64), generator=generator)} for _ in range(3)]
    forward = _forward_seconds(model, batches)
    checks: dict[str, float] = {}
    timed = ModelPipeline._check_findings

    def check_findings(pipeline: ModelPipeline, name: str, layers: list[str]) -> Any:
        start = time.perf_counter()
        try:
            return timed(pipeline, name, layers)
        finally:
            checks[name] = checks.get(name, 0.0) + time.perf_counter() - start

    ModelPipeline._check_findings = check_findings  # type: ignore[method-assign]
    kept: list[Any] = []
    try:
        marks: dict[str, int | None] = {}
        collection, analysis = _analyse(model, batches, None, kept=kept, fix_budget=fix_budget,
                                        between=lambda: marks.update(start=_reset_peak()))
        peak = _rss_bytes("VmHWM")
    finally:
        ModelPipeline._check_findings = timed  # type: ignore[method-assign]
    seconds = dict(kept[0].seconds)
    start = marks.get("start")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"forward": forward, "collection": collection, "analysis": analysis, "checks": checks,
            "stages": seconds, "verdict": seconds.get("calibration", 0.0) + seconds.get("comparison", 0.0),
            "fix_budget": kept[0].fix_budget, "weights_bytes": weights,
            "peak_above_bytes": None if peak is None or start is None else peak - start,
            "failing": sum(f.verdict == "fail" for f in (kept[0].findings or {}).values())}


def _cpu_time(name: str) -> str:
    """bench_analysis.py's steady state of every default check on this CPU, native kernels on: 'analysis (ratio)'."""
    environment = {key: value for key, value in os.environ.items() if key != "QCORE_NATIVE"}
    output = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_analysis.py"), name, "full"],
                            capture_output=True, text=True, cwd=ROOT, env=environment, timeout=3000)
    if output.returncode:
        return "failed"
    row = json.loads(output.stdout.strip().splitlines()[-1])
    return f"{row['steady_analysis']:.2f} s ({row['steady_analysis'] / row['steady_forward']:.1f}x)"


if __name__ == "__main__":
    main()
