"""Calibration cost of ModelReport with all four detectors: plain forward vs qcore vs torch.ao, one process.

ResNet-style CNN on 16x3x64x64 (20 batches) and an MLP of 6 x Linear(256) on 256 rows (50 batches).
Times the calibration loop (observers running on every batch); report generation is timed apart.

    python benchmarks/bench_calibration.py
"""
from __future__ import annotations

import copy
import pathlib
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from models import TinyResNet, settle_batchnorm  # noqa: E402

warnings.filterwarnings("ignore")


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(256, 256)] + ([nn.ReLU()] if i < 5 else [])
    return nn.Sequential(*layers).eval()


def _batches(shape, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


def _loop(model, batches, repeats=3) -> float:
    best = float("inf")
    with torch.no_grad():
        model(batches[0])
        for _ in range(repeats):
            start = time.perf_counter()
            for batch in batches:
                model(batch)
            best = min(best, time.perf_counter() - start)
    return best


def ours(model, batches):
    from qcore.report import (DynamicStaticDetector, InputWeightEqualizationDetector, ModelReport, OutlierDetector,
                              PerChannelDetector)

    report = ModelReport(copy.deepcopy(model), [PerChannelDetector(), DynamicStaticDetector(),
                                                InputWeightEqualizationDetector(0.5), OutlierDetector()],
                         example_inputs=batches[0])
    observed = report.prepare_detailed_calibration()
    seconds = _loop(observed, batches, repeats=1)  # one pass: observers accumulate, like a real calibration
    start = time.perf_counter()
    report.generate_model_report(remove_inserted_observers=False)
    return seconds, time.perf_counter() - start


def torch_ao(model, batches):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report import detector as d
    from torch.ao.quantization.fx._model_report.model_report import ModelReport
    from torch.ao.quantization.quantize_fx import prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    report = ModelReport(prepared, {d.PerChannelDetector(), d.DynamicStaticDetector(),
                                    d.InputWeightEqualizationDetector(0.5), d.OutlierDetector()})
    observed = report.prepare_detailed_calibration()
    seconds = _loop(observed, batches, repeats=1)
    start = time.perf_counter()
    try:
        report.generate_model_report(remove_inserted_observers=False)
    except Exception as error:  # noqa: BLE001 - torch.ao's own failures are part of the picture
        print(f"    torch.ao report generation failed: {type(error).__name__}: {error}")
    return seconds, time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.manual_seed(0)
    cnn = settle_batchnorm(TinyResNet().eval(), _batches((16, 3, 64, 64), 4, seed=9))
    cases = [("ResNet-style CNN 16x3x64x64, 20 batches", cnn, _batches((16, 3, 64, 64), 20)),
             ("MLP 6 x Linear(256), 256 rows, 50 batches", mlp(), _batches((256, 256), 50))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for title, model, batches in cases:
        plain = _loop(model, batches)
        our_time, our_report = ours(model, batches)
        ao_time, ao_report = torch_ao(model, batches)
        print(title)
        print(f"  plain forward         {plain * 1e3:9.1f} ms")
        print(f"  qcore ModelReport     {our_time * 1e3:9.1f} ms  = {our_time / plain:5.2f}x forward "
              f"(report {our_report * 1e3:.0f} ms)")
        print(f"  torch.ao ModelReport  {ao_time * 1e3:9.1f} ms  = {ao_time / plain:5.2f}x forward "
              f"(report {ao_report * 1e3:.0f} ms)")
        print(f"  qcore is {ao_time / our_time:.1f}x faster than torch.ao")


if __name__ == "__main__":
    main()
