"""What one model's analysis costs: time against the plain eager forward, peak memory against the parameters.

For each case, in a fresh subprocess (so that peak RSS is the analysis's own), on 2 torch threads:
- the plain eager forward over the calibration batches (best of 3);
- the full default analysis behind `pytest --qreport` (every built-in check, as the plugin runs them), in two
  parts: collection (pytest_qreport.core.pipeline.collect_model: capture with torch.export, list each check's
  layers; once per model and session, or none on a warm capture cache) and the analysis proper
  (ModelPipeline.analyze: the first item's setup, as the issue measures it); and `sqnr,model_sqnr` alone;
- the steady state: three more rounds of (forward, analysis of the same model), best of each. The first
  analysis in a process also pays the process's one-time costs (imports, first calls of each op), which a
  session pays once, not once per model;
- torch.ao's nearest equivalent of the SQNR part, for scale: prepare_fx, calibrate, convert_fx, then the FX
  numeric suite's add_loggers/extract_logger_info over the same batches (TinyResNet only: HF models do not
  symbolic_trace);
- the first analysis's peak RSS above the RSS it started from (after the capture; Linux's clear_refs resets
  the peak), against the model's parameter bytes, with and without one batch's activations (the bytes of every
  op output of one forward, views excluded: the goal is 3x the parameters plus those); the capture's peak is
  printed apart.

Each full case runs in three fresh processes; the median ratio is quoted, with the range, because this
machine's speed drifts from second to second.

Cases: the issue's BERT-sized encoder (transformers.BertModel shaped like MiniLM-L6-H384: 6 layers, hidden 384,
vocabulary 30522, 22.7M parameters, seeded random weights; 8 batches of 4x64 tokens), a smaller BERT-style
encoder (6 layers, hidden 256, vocabulary 1000), a ResNet-18 (torchvision's architecture, seeded weights,
8 batches of 4x3x128x128), examples' TinyResNet (8 batches of 8x3x32x32, about 1-2 ms a batch: fixed costs
show), and 8 x Linear(4096) with 200 batches of 64 rows (memory).

With `--capture [--cases ...]`: each case's capture alone, in alternating rounds in one process, as qcore makes
it (no Python stack trace recorded per node) and with the stack traces torch.export records by default: the
median seconds of each and their ratio.

    python benchmarks/bench_analysis.py [--cases minilm,resnet18] [--capture]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
REPEATS = 3
STEADY_ROUNDS = 3


def _case(name: str):
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    if name in ("minilm", "bert"):
        import transformers

        vocabulary, hidden, heads = (30522, 384, 12) if name == "minilm" else (1000, 256, 4)
        config = transformers.BertConfig(vocab_size=vocabulary, hidden_size=hidden, num_hidden_layers=6,
                                         num_attention_heads=heads, intermediate_size=4 * hidden,
                                         max_position_embeddings=512 if name == "minilm" else 64)
        torch.manual_seed(0)
        model = transformers.BertModel(config).eval()
        g = torch.Generator().manual_seed(0)
        batches = [{"input_ids": torch.randint(0, vocabulary, (4, 64), generator=g),
                    "attention_mask": torch.ones(4, 64, dtype=torch.long)} for _ in range(8)]
        return model, batches
    if name == "cnn":
        from models import TinyResNet, seeded, settle_batchnorm

        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(8, 3, 32, 32, generator=g) for _ in range(8)]
        return settle_batchnorm(seeded(TinyResNet), batches), batches
    if name == "resnet18":
        from models import seeded, settle_batchnorm

        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(4, 3, 128, 128, generator=g) for _ in range(8)]
        return settle_batchnorm(seeded(_resnet18), batches, steps=2), batches
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    g = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(*layers).eval(), [torch.randn(64, 4096, generator=g) for _ in range(200)]


def _resnet18():
    """torchvision's resnet18 architecture (11.7M parameters), built here: torchvision is not a dependency."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.relu = nn.ReLU()
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                            nn.BatchNorm2d(outputs)) if stride != 1 or inputs != outputs else None

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + identity)

    stages, width = [], 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Block(width, outputs, stride), Block(outputs, outputs, 1)]
        width = outputs
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def _settings(checks, batches, **settings):
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import ModelSettings

    return ModelSettings.defaults(BUILTIN_CHECKS, checks=checks, calibration=batches, **settings)


def _rss_bytes(field: str) -> int | None:
    """VmRSS or VmHWM (the peak) of this process, from /proc (Linux), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def _reset_peak() -> int | None:
    """Reset the peak RSS to the current RSS (Linux 4.0+) and return it; None where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return None
    return _rss_bytes("VmRSS")


def _analyse(model, batches, checks, between=None, kept=None, **settings) -> tuple[float, float]:
    """(collection seconds, analysis seconds) of one model, as the plugin runs them, with `settings` over the
    defaults; `between` is called between the two, untimed; `kept`, a list, gets the model's pipeline."""
    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.registry import CheckRegistry

    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    start = time.perf_counter()
    state = collect_model("model", _settings(checks or registry.names(), batches, **settings), registry,
                          qcore.Int8StaticQuantizer(), model, batches[0])
    collected = time.perf_counter()
    if between is not None:
        between()
        collected = time.perf_counter()
    state.analyze(lambda: batches, lambda found: None, threads=2)
    assert not state.failed, state.error
    if kept is not None:
        kept.append(state)
    return collected - start, time.perf_counter() - collected


def _forward_seconds(model, batches) -> float:
    import torch

    from qcore.graph.inputs import call_model

    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            for batch in batches:
                call_model(model, batch)
            best = min(best, time.perf_counter() - start)
    return best


def _torch_ao_seconds(model, batches) -> float:
    import copy
    import warnings

    import torch
    import torch.ao.ns._numeric_suite_fx as ns
    from torch.ao.ns.fx.utils import compute_sqnr
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
        quantized = convert_fx(copy.deepcopy(prepared))
        a, b = ns.add_loggers("fp32", prepared, "int8", quantized, ns.OutputLogger)
        for batch in batches:
            a(batch)
            b(batch)
    results = ns.extract_logger_info(a, b, ns.OutputLogger, "int8")
    ns.extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
    return time.perf_counter() - start


def measure(name: str, mode: str) -> dict:
    """One measurement in this process (called in a subprocess)."""
    import torch

    torch.set_num_threads(2)
    model, batches = _case(name)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "forward":
        return {"seconds": _forward_seconds(model, batches), "params": params}
    if mode == "torch_ao":
        return {"seconds": _torch_ao_seconds(model, batches)}
    forward = _forward_seconds(model, batches) if mode == "full" else math.nan  # the same process's forward
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    marks: dict[str, int | None] = {}

    def after_collection() -> None:
        marks["capture_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        marks["analysis_start"] = _reset_peak()

    collection, analysis = _analyse(model, batches, None if mode == "full" else ["sqnr", "model_sqnr"],
                                    after_collection)
    start = marks["analysis_start"]
    peak = _rss_bytes("VmHWM") if start is not None else None
    # the analysis's own peak above the RSS it started from; without /proc, the peak since before the capture
    above = peak - start if peak is not None and start is not None else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    batch_bytes = sum(t.numel() * t.element_size() for t in _tensors(batches[0]))
    result = {"collection": collection, "analysis": analysis, "peak_above_bytes": above, "params": params,
              "batch_bytes": batch_bytes, "activation_bytes": _activation_bytes(model, batches[0]), "forward": forward,
              "capture_above_bytes": marks["capture_peak"] - before,
              "analysis_only": start is not None}
    if mode == "full":
        # the steady state: each later model of a session pays neither the imports nor the first calls of ops;
        # rounds alternate forward and analysis, and each side's best is kept (the same estimator for both)
        forwards, analyses, verdicts, kept = [forward], [], [], []
        for _ in range(STEADY_ROUNDS):
            forwards.append(_forward_seconds(model, batches))
            analyses.append(_analyse(model, batches, None, kept=kept)[1])
            verdicts.append(_analyse(model, batches, None, fix_budget=0)[1])  # the verdicts alone
        best = kept[analyses.index(min(analyses))]
        result.update(steady_forward=min(forwards), steady_analysis=min(analyses), steady_verdicts=min(verdicts),
                      stages=dict(best.seconds), fix_budget=best.fix_budget,
                      failing=sum(f.verdict == "fail" for f in (best.findings or {}).values()))
    return result


def _activation_bytes(model, batch) -> int:
    """Bytes of the tensors one eager forward of `batch` computes: every aten op's output, views and aliases (which
    share their input's memory) left out. The memory goal allows one batch's activations."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from qcore.graph.inputs import call_model

    class Counter(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if all(r.alias_info is None for r in func._schema.returns):
                Counter.total += sum(v.numel() * v.element_size() for v in pytree.tree_leaves(result)
                                     if isinstance(v, torch.Tensor))
            return result

    with torch.no_grad(), Counter():
        call_model(model, batch)
    return Counter.total


def _tensors(batch) -> list:
    return list(batch.values()) if isinstance(batch, dict) else [batch]


def _run(name: str, mode: str) -> dict:
    output = subprocess.run([sys.executable, __file__, name, mode], capture_output=True, text=True, cwd=ROOT,
                            timeout=3000)
    if output.returncode:
        raise RuntimeError(output.stderr[-2000:])
    return json.loads(output.stdout.strip().splitlines()[-1])


CAPTURE_ROUNDS = 7


def capture_cost(names: list[str]) -> None:
    """--capture: each case's capture as qcore makes it (no Python stack trace recorded per node) against the same
    capture with the stack traces torch.export records by default, in alternating rounds in this process (the
    machine's drift falls on both alike): the median of each, their ratio, and the process's peak RSS."""
    import contextlib

    import qcore.graph.capture as capturing
    from qcore.graph.capture import capture

    without_traces = capturing._without_stack_traces
    print(f"{'case':>9} {'no traces s':>11} {'traces s':>9} {'ratio':>6} {'nodes':>6}")
    for name in names:
        model, batches = _case(name)
        example = batches[0]
        capture(model, example)  # the first capture in a process pays its one-time costs: not measured
        seconds: dict[bool, list[float]] = {False: [], True: []}
        nodes = 0
        for _ in range(CAPTURE_ROUNDS):
            for traces in (False, True):
                capturing._without_stack_traces = contextlib.nullcontext if traces else without_traces
                try:
                    start = time.perf_counter()
                    graph = capture(model, example)
                    seconds[traces].append(time.perf_counter() - start)
                finally:
                    capturing._without_stack_traces = without_traces
                nodes = len(graph.graph.nodes)
        quick, slow = statistics.median(seconds[False]), statistics.median(seconds[True])
        print(f"{name:>9} {quick:>11.3f} {slow:>9.3f} {quick / slow:>6.2f} {nodes:>6}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated cases to run (default: all, and the 8 x Linear(4096) one)")
    parser.add_argument("--capture", action="store_true", help="the capture alone, without and with the stack "
                        "traces torch.export records by default (default cases: minilm,resnet18,cnn)")
    args = parser.parse_args()
    if args.capture:
        capture_cost(args.cases.split(",") if args.cases else ["minilm", "resnet18", "cnn"])
        return
    cases = (("minilm", "BERT-sized encoder (MiniLM-L6-H384 shape, 22.7M parameters)"),
             ("bert", "BERT-style encoder (6 x 256)"), ("resnet18", "ResNet-18 CNN (11.7M parameters, 4x3x128x128)"),
             ("cnn", "examples' TinyResNet CNN (8x3x32x32)"))
    chosen = args.cases.split(",") if args.cases else [name for name, _ in cases]
    for name, title in cases:
        if name not in chosen:
            continue
        # three fresh processes, each timing its own forwards and analyses: this machine's speed drifts by
        # +-20% over seconds, so one ratio is noisy; the median of three and their range are printed
        runs = [_run(name, "full") for _ in range(REPEATS)]
        first = sorted(run["analysis"] / run["forward"] for run in runs)
        steady = sorted(run["steady_analysis"] / run["steady_forward"] for run in runs)
        middle = sorted(runs, key=lambda run: run["steady_analysis"] / run["steady_forward"])[REPEATS // 2]
        sqnr = _run(name, "sqnr")
        print(f"{title}: forward {middle['steady_forward']:.3f} s over {8} batches")
        print(f"  full default analysis {middle['steady_analysis']:.2f} s = {statistics.median(steady):.1f}x the "
              f"forward (best of {STEADY_ROUNDS} after a first analysis in the process; median of {REPEATS} "
              f"processes, {steady[0]:.1f}x-{steady[-1]:.1f}x)")
        stages, budget = middle["stages"], middle["fix_budget"] or {}
        print(f"  verdicts only (fix_budget=0) {middle['steady_verdicts']:.2f} s = "
              f"{middle['steady_verdicts'] / middle['steady_forward']:.1f}x; the default run's stages: " + ", ".join(
                  f"{stage} {seconds:.2f}" for stage, seconds in stages.items()) +
              f" s; {middle['failing']} failing item(s); fix searches {budget.get('trial_runs', 0):.3g} graph runs of "
              f"the verdict pass's {budget.get('verdict_runs', 0):.3g}")
        print(f"  first analysis in a fresh process {statistics.median(first):.1f}x ({first[0]:.1f}x-{first[-1]:.1f}x;"
              f" imports and first calls of ops included); collection with capture {middle['collection']:.2f} s")
        print(f"  sqnr,model_sqnr alone (first in a process) {sqnr['analysis']:.2f} s = "
              f"{sqnr['analysis'] / middle['steady_forward']:.1f}x")
        peak, params = middle["peak_above_bytes"], middle["params"]
        what = "the analysis's peak RSS above its start" if middle["analysis_only"] else "peak RSS (capture included)"
        activations = middle["activation_bytes"]
        print(f"  {what} +{peak / 2**20:.0f} MiB = {peak / params:.1f}x the parameters ({params / 2**20:.0f} MiB; one "
              f"batch's input {middle['batch_bytes'] / 2**20:.1f} MiB); the capture's +"
              f"{middle['capture_above_bytes'] / 2**20:.0f} MiB")
        print(f"  less one batch's activations ({activations / 2**20:.0f} MiB, the goal's allowance): "
              f"{(peak - activations) / params:.1f}x the parameters")
        if name == "cnn":
            reference = _run(name, "torch_ao")["seconds"]
            print(f"  torch.ao prepare/convert + numeric suite (SQNR only, first in a process) {reference:.2f} s = "
                  f"{reference / middle['steady_forward']:.1f}x")
    if args.cases:
        return
    forward, sqnr = _run("linear4096", "forward")["seconds"], _run("linear4096", "sqnr")
    print(f"8 x Linear(4096), 200 batches of 64: forward {forward:.2f} s; sqnr,model_sqnr {sqnr['analysis']:.2f} s = "
          f"{sqnr['analysis'] / forward:.1f}x; the analysis's peak RSS +{sqnr['peak_above_bytes'] / 2**20:.0f} MiB = "
          f"{sqnr['peak_above_bytes'] / sqnr['params']:.1f}x the parameters ({sqnr['params'] / 2**20:.0f} MiB; "
          f"one batch {sqnr['batch_bytes'] / 2**20:.1f} MiB, its activations "
          f"{sqnr['activation_bytes'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):  # one measurement, in a subprocess of main()
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
    else:
        main()
