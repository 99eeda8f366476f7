"""The arithmetic of one analysis against the forward's: the matmul and convolution FLOPs (torch's FlopCounterMode
registry) every default check runs, per stage (calibration, comparison, trials, outside the stages) and, for the
trials, per advice that runs them, against the eager forward's over the same batches.

    python benchmarks/bench_flops.py                 # TinyResNet, the MiniLM-shaped BERT, ResNet-18, a 4-layer Llama
    python benchmarks/bench_flops.py minilm resnet18

On the CPU an analysis is bound by these FLOPs (matmuls and convolutions are about four fifths of its time), so their
ratio is the floor of its CPU ratio; the op count (bench_ops.py) is the GPU's. The cases are bench_analysis.py's, and
"llama4": a transformers Llama of 4 layers (hidden 512, vocabulary 8192) with 8 batches of 2 x 256 tokens.
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


def measure(name: str) -> tuple[int, dict[tuple[str, ...], int]]:
    """(the forward's FLOPs over the batches, {stage path: the analysis's FLOPs there})."""
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
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    pipeline = collect_model("model", _settings(registry.names(), batches), registry, qcore.Int8StaticQuantizer(),
                             model, batches[0])
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
    return forward, by_stage


def main() -> None:
    """Each case's FLOPs against the forward's, in all and per stage."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["cnn", "minilm", "resnet18", "llama4"])
    args = parser.parse_args()
    for name in args.cases:
        forward, by_stage = measure(name)
        total = sum(by_stage.values())
        print(f"{name}: forward {forward / 1e9:.2f} GFLOP, analysis {total / 1e9:.2f} GFLOP = {total / forward:.2f}x",
              flush=True)
        for stage, flops in sorted(by_stage.items(), key=lambda item: -item[1]):
            print(f"    {'/'.join(stage) or 'outside the stages':<70} {flops / forward:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
