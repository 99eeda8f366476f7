"""Fake-quantization throughput of each deployed preset (qcore.formats.presets) against the same format computed with
torchao 0.18's reference functions, in the same run: a 4096 x 4096 weight and a [8, 512, 4096] activation.

    python benchmarks/bench_formats.py [--device cuda] [--repeats 5]

Prints, per preset and tensor, our time, torchao's, their ratio, and our throughput in GB/s of float32 input; then
the plugin's default analysis of one MLP under int8 and under NVFP4, MXFP4 and FP8_DYNAMIC, as ratios to int8.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_presets import ACTIVATION_REFERENCES, CALIBRATION_AMAX, WEIGHT_REFERENCES  # noqa: E402

from qcore.formats.presets import PRESETS  # noqa: E402


def _best(function, repeats: int, device: str) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(4096, 4096, generator=g) * 0.02).to(args.device)
    activation = torch.randn(8, 512, 4096, generator=g).to(args.device)
    amax = CALIBRATION_AMAX.to(args.device)
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'preset':12} {'tensor':10} {'qcore ms':>9} {'torchao ms':>11} {'ratio':>6} {'qcore GB/s':>11}")
    for name, chosen in PRESETS.items():
        cases = [("weight", weight, lambda t=weight, c=chosen: c.weight.fake_quantize(t, weight=True),
                  WEIGHT_REFERENCES[name])]
        if chosen.activation is not None:
            cases.append(("activation", activation, lambda t=activation, c=chosen: c.activation.fake_quantize(t, amax),
                          ACTIVATION_REFERENCES[name]))
        for label, tensor, ours, reference in cases:
            ours_s = _best(ours, args.repeats, args.device)
            theirs_s = _best(lambda r=reference, t=tensor: r(t), args.repeats, args.device)
            print(f"{name:12} {label:10} {ours_s * 1e3:9.1f} {theirs_s * 1e3:11.1f} {ours_s / theirs_s:6.2f} "
                  f"{tensor.numel() * 4 / ours_s / 1e9:11.2f}")
    analysis_ratios(args.repeats)



def analysis_ratios(repeats: int = 3) -> None:
    """The default analysis (sqnr, weight_sqnr, model_sqnr) of one model under int8 and under each 4-bit format,
    as the plugin runs it; prints each format's time over int8's."""
    from torch import nn

    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.registry import CheckRegistry
    from pytest_qreport.core.settings import ModelSettings

    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(1024, 1024), nn.GELU())]).eval()
    batches = [torch.randn(64, 1024) for _ in range(8)]
    settings = ModelSettings.defaults(registry.checks(), checks=["sqnr", "weight_sqnr", "model_sqnr"],
                                      model_sqnr_min_db=-100.0)
    timings = {}
    for name, quantizer in [("int8", qcore.Int8StaticQuantizer()), ("NVFP4", qcore.FormatQuantizer("NVFP4")),
                            ("MXFP4", qcore.FormatQuantizer("MXFP4")), ("FP8_DYNAMIC",
                                                                        qcore.FormatQuantizer("FP8_DYNAMIC"))]:
        best = math.inf
        for _ in range(repeats):
            pipeline = collect_model(name, settings, registry, quantizer, model, batches[0])
            start = time.perf_counter()
            pipeline.analyze(lambda: batches, lambda found: None, threads=torch.get_num_threads())
            best = min(best, time.perf_counter() - start)
            assert not pipeline.failed, pipeline.error
        timings[name] = best
    print(f"\nanalysis of a 6 x Linear(1024) MLP, 8 batches of 64 (sqnr, weight_sqnr, model_sqnr), best of {repeats}:")
    for name, seconds in timings.items():
        print(f"  {name:12} {seconds:6.2f} s  {seconds / timings['int8']:5.2f}x int8")


if __name__ == "__main__":
    main()
