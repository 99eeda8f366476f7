"""The arithmetic of one analysis against the forward's: the matmul and convolution FLOPs (torch's FlopCounterMode
registry) every default check runs, per stage (calibration, comparison, trials, outside the stages) and, for the
trials, per advice that runs them, against the eager forward's over the same batches.

    python benchmarks/bench_flops.py                 # TinyResNet, the MiniLM-shaped BERT, ResNet-18, a 4-layer Llama
    python benchmarks/bench_flops.py minilm resnet18
    python benchmarks/bench_flops.py --fix-budget 0 minilm llama1b   # the verdict pass alone (no fix search)

On the CPU an analysis is bound by these FLOPs (matmuls and convolutions are about four fifths of its time), so their
ratio is the floor of its CPU ratio; the op count (bench_ops.py) is the GPU's. Each case also prints the share of the
forward's op time its matmuls and convolutions take on this CPU (torch's profiler, 2 threads, the median of 3
forwards) and the floor that gives: the analysis's matmuls and convolutions alone, run as fast as the forward runs
its own, against the whole forward (the FLOPs' ratio times that share), before any observer, comparator, fake
quantization or other op. The cases are bench_analysis.py's, and
"llama4": a transformers Llama of 4 layers (hidden 512, vocabulary 8192) with 8 batches of 2 x 256 tokens;
"llama1b": bench_ops.py's 1B Llama config in float32 with its 3 batches of 2 x 64 tokens (minutes; not a default).
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

ADVICE = ("input_weight_advice", "equalize_all_advice", "smoothing_advice", "equalization_advice", "advise",
          "findings")  # the functions of pytest_qreport.checks whose trials are told apart, innermost last


def _case(name: str):
    """(model, batches) of a case."""
    import torch

    if name == "llama1b":
        import transformers

        config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                          use_cache=False)
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        return (transformers.LlamaForCausalLM(config).eval(),
                [{"input_ids": torch.randint(0, 32000, (2, 64), generator=generator)} for _ in range(3)])
    if name == "llama4":
        import transformers

        config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=512, use_cache=False)
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        return (transformers.LlamaForCausalLM(config).eval(),
                [{"input_ids": torch.randint(0, 8192, (2, 256), generator=generator)} for _ in range(8)])
    from bench_analysis import _case as analysis_case

    return analysis_case(name)


def _advice() -> str:
    """The check function running the current trial (the innermost of ADVICE on the stack)."""
    found = "?"
    for frame in traceback.extract_stack(limit=60):
        if frame.name in ADVICE and "pytest_qreport" in frame.filename:
            found = f"{Path(frame.filename).stem}.{frame.name}"
    return found


PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
                      "aten::_convolution", "aten::mkldnn_convolution", "aten::_slow_conv2d_forward"})


def product_share(model, batches, rounds: int = 3) -> float:
    """The share of the eager forward's op time (self CPU time, torch's profiler, 2 threads, after one warm-up pass)
    that its matmuls and convolutions take: the median of `rounds` forwards over the batches."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    from qcore.graph.inputs import call_model

    torch.set_num_threads(2)
    shares = []
    with torch.no_grad():
        for batch in batches:
            call_model(model, batch)
        for _ in range(rounds):
            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                for batch in batches:
                    call_model(model, batch)
            events = profiled.key_averages()
            total = sum(event.self_cpu_time_total for event in events)
            shares.append(sum(event.self_cpu_time_total for event in events if event.key in PRODUCTS) / total)
    return statistics.median(shares)


def measure(name: str, fix_budget: float = 1.0) -> tuple[int, dict[tuple[str, ...], int], float]:
    """(the forward's FLOPs over the batches, {stage path: the analysis's FLOPs there}, product_share), every default
    check under `fix_budget` (0: the verdicts alone)."""
    import torch
    from bench_analysis import _settings
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.registry import CheckRegistry
    from qcore.graph.inputs import call_model
    from qcore.runtime import progress

    model, batches = _case(name)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        for batch in batches:
            call_model(model, batch)
    forward = counter.get_total_flops()
    share = product_share(model, batches)
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    pipeline = collect_model("model", _settings(registry.names(), batches, fix_budget=fix_budget), registry,
                             qcore.Int8StaticQuantizer(), model, batches[0])
    by_stage: dict[tuple[str, ...], int] = {}

    class Flops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                times = progress._CURRENT.get()  # the stages open now (qcore.runtime.progress)
                stage = tuple(times.open) if times is not None else ()
                if stage[:1] == ("trials",):
                    stage = (stage[0], _advice(), *stage[1:])
                by_stage[stage] = by_stage.get(stage, 0) + count(*args, **(kwargs or {}), out_val=out)
            return out

    with Flops():
        pipeline.analyze(lambda: batches, lambda found: None)
    if pipeline.failed:
        raise RuntimeError(pipeline.error)
    return forward, by_stage, share


def main() -> None:
    """Each case's FLOPs against the forward's, in all and per stage."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["cnn", "minilm", "resnet18", "llama4"])
    parser.add_argument("--fix-budget", type=float, default=1.0,
                        help="the checks' fix budget (default 1, the plugin's; 0 measures the verdict pass alone)")
    args = parser.parse_args()
    print(f"fix_budget={args.fix_budget:g}", flush=True)
    for name in args.cases:
        forward, by_stage, share = measure(name, args.fix_budget)
        total = sum(by_stage.values())
        print(f"{name}: forward {forward / 1e9:.2f} GFLOP, analysis {total / 1e9:.2f} GFLOP = {total / forward:.2f}x; "
              f"matmuls and convolutions {share:.1%} of the forward's op time on this CPU, so the analysis's alone "
              f"take at least {total / forward * share:.1f}x the forward", flush=True)
        for stage, flops in sorted(by_stage.items(), key=lambda item: -item[1]):
            print(f"    {'/'.join(stage) or 'outside the stages':<70} {flops / forward:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
