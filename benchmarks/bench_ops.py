"""How many aten ops an analysis dispatches against the plain forward over the same batches: the launch count a GPU
pays, measured on the CPU (QCORE_NATIVE=0: qcore's C kernels off, the path a GPU takes), with its host reads (each a
wait for a GPU); and, in the same run, what the analysis costs on this CPU against the forward (qcore's C kernels
on).

    python benchmarks/bench_ops.py                 # the examples' TinyResNet ("cnn"), a MiniLM-shaped BERT, ResNet-18,
                                                   # and the 0.5B Llama config (op counts only: minutes a run)
    python benchmarks/bench_ops.py --quick         # the examples' TinyResNet only
    python benchmarks/bench_ops.py --no-time       # the op counts alone
    python benchmarks/bench_ops.py --llama1b       # also the 1B Llama config's CPU time (about 10-30 minutes)

The cases are bench_analysis.py's and a 0.5B Llama config, 8 batches each.

Each case runs in subprocesses of its own: every default check (as `pytest --qreport` runs them), and
`sqnr,model_sqnr` alone, each counted with a TorchDispatchMode from capture to the last finding, against the eager
forward; then bench_analysis.py's steady-state time of every default check against the forward (best of three
rounds after a first analysis in the process, the capture apart). With --llama1b, the 1B Llama config in float32
(hidden 2048, 16 layers, 32,000-token vocabulary, seeded weights; bench_memory.py's 3 batches of 2 x 64 tokens) is
analysed once with every default check, native kernels on, against its forward over the same batches: the
collection (capture) and the analysis proper apart, as a session pays them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

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


def analysis_ops(model, batches, checks=None) -> tuple[int, int]:
    """(aten ops, host reads) of one model's analysis, capture included, with the plugin's checks (every default one,
    or `checks`). A host read is a scalar read of a tensor (`.item()`, `float(t)`, `bool(t)`: aten._local_scalar_dense),
    which on a GPU waits for the device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pytest_qreport.checks import BUILTIN_CHECKS
    from tests.helpers import analyze_with_checks

    class Counter(TorchDispatchMode):
        ops = reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            Counter.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    chosen = checks or [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    with torch.no_grad(), Counter():
        analyze_with_checks(lambda: model, batches, checks=chosen)
    return Counter.ops, Counter.reads


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
    every, reads = analysis_ops(model, batches)
    return {"case": name, "forward": forward, "all": every, "reads": reads,
            "sqnr": analysis_ops(model, batches, ["sqnr", "model_sqnr"])[0]}


def main() -> None:
    """Each case in a subprocess with the native kernels off; the table of counts and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-time", action="store_true", help="count the ops only")
    parser.add_argument("--llama1b", action="store_true", help="also time the 1B Llama config on this CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--time-llama1b", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    if args.time_llama1b:
        print(json.dumps(time_llama1b()))
        return
    cases = ["cnn"] if args.quick else ["cnn", "minilm", "resnet18", "llama0.5b"]
    print(f"{'case':12} {'forward ops':>12} {'every default check':>28} {'host reads':>11} {'sqnr,model_sqnr':>24} "
          f"{'CPU time':>22}")
    for name in cases:
        output = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT,
                                env={**os.environ, "QCORE_NATIVE": "0"}, timeout=3000)
        if output.returncode:
            print(f"{name}: failed: {output.stderr[-500:]}")
            continue
        row = json.loads(output.stdout.strip().splitlines()[-1])
        timed = "" if args.no_time or name == "llama0.5b" else _cpu_time(name)
        print(f"{name:12} {row['forward']:>12,} {row['all']:>16,} ({row['all'] / row['forward']:>6.1f}x) "
              f"{row['reads']:>11,} {row['sqnr']:>12,} ({row['sqnr'] / row['forward']:>6.1f}x) {timed:>22}")
    if args.llama1b:
        environment = {key: value for key, value in os.environ.items() if key != "QCORE_NATIVE"}
        output = subprocess.run([sys.executable, __file__, "--time-llama1b"], capture_output=True, text=True,
                                cwd=ROOT, env=environment, timeout=7200)
        if output.returncode:
            print(f"llama1b: failed: {output.stderr[-500:]}")
            return
        row = json.loads(output.stdout.strip().splitlines()[-1])
        print(f"llama1b, every default check, CPU: forward {row['forward']:.2f} s; "
              f"collection {row['collection']:.1f} s; analysis {row['analysis']:.1f} s "
              f"({row['analysis'] / row['forward']:.0f}x the forward)")


def time_llama1b() -> dict[str, float]:
    """The 1B Llama config's forward, collection (capture) and analysis seconds on this CPU (native kernels on, 2
    threads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_analysis import _analyse, _forward_seconds  # noqa: E402 - the benchmarks are scripts

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 32000, (2, 64), generator=generator)} for _ in range(3)]
    forward = _forward_seconds(model, batches)
    collection, analysis = _analyse(model, batches, None)
    return {"forward": forward, "collection": collection, "analysis": analysis}


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
