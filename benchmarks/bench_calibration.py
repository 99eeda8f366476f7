"""Calibration cost of ModelReport with all four detectors: plain forward vs qcore vs torch.ao, one process.

ResNet-style CNN on 16x3x64x64 (20 batches) and an MLP of 6 x Linear(256) on 256 rows (50 batches).
Times calibration passes (observers running on every batch). This machine's timings swing by up to 2x
from minute to minute, so the contenders take turns, round after round; it prints each one's best pass and
the median of the per-round ratios to the plain pass. Report generation is timed apart. Prints whether our
observers ran the native kernel (qcore.runtime.native),
and times qcore a second time with every observer on its torch path (what QCORE_NATIVE=0 runs), in the same rounds.

    python benchmarks/bench_calibration.py
"""
from __future__ import annotations

import copy
import pathlib
import statistics
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from models import TinyResNet, settle_batchnorm  # noqa: E402

warnings.filterwarnings("ignore")
ROUNDS, AO_ROUNDS = 15, 2


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(256, 256)] + ([nn.ReLU()] if i < 5 else [])
    return nn.Sequential(*layers).eval()


def _batches(shape, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


def _pass(model, batches) -> float:
    """Seconds for one calibration pass over the batches."""
    start = time.perf_counter()
    for batch in batches:
        model(batch)
    return time.perf_counter() - start


def ours(model, batches):
    """qcore's ModelReport with all four detectors: (observed model, report-generation callable)."""
    from qcore.report import (
        DynamicStaticDetector,
        InputWeightEqualizationDetector,
        ModelReport,
        OutlierDetector,
        PerChannelDetector,
    )

    report = ModelReport(copy.deepcopy(model), [PerChannelDetector(), DynamicStaticDetector(),
                                                InputWeightEqualizationDetector(0.5), OutlierDetector()],
                         example_inputs=batches[0])
    return report.prepare_detailed_calibration(), lambda: report.generate_model_report(False)


def ours_torch_path(model, batches):
    """The same as `ours`, with every observer kept on its torch path (what QCORE_NATIVE=0 runs)."""
    from qcore.report.observer import ReportObserver

    observed, generate = ours(model, batches)
    for module in observed.modules():
        if isinstance(module, ReportObserver):
            module._observe_native = lambda values: False  # instance attribute: this observer never plans a kernel
    return observed, generate


def torch_ao(model, batches):
    """torch.ao's ModelReport with all four detectors on a prepare_fx model."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx._model_report import detector as d
    from torch.ao.quantization.fx._model_report.model_report import ModelReport
    from torch.ao.quantization.quantize_fx import prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    report = ModelReport(prepared, {d.PerChannelDetector(), d.DynamicStaticDetector(),
                                    d.InputWeightEqualizationDetector(0.5), d.OutlierDetector()})
    return report.prepare_detailed_calibration(), lambda: report.generate_model_report(False)


def measure(model, batches) -> dict[str, float]:
    """Interleaved rounds: plain, the captured graph without observers, qcore, then (in the first AO_ROUNDS
    rounds) torch.ao, back to back.

    Returns each contender's best pass, the median over rounds of each round's ratio to that round's plain
    pass (a slow spell of this machine hits both halves of a ratio alike), and report-generation times."""
    from qcore.graph.capture import capture

    contenders = {"plain": (model, None), "qcore graph": (capture(copy.deepcopy(model), batches[0]), None),
                  "qcore": ours(model, batches), "qcore torch path": ours_torch_path(model, batches),
                  "torch.ao": torch_ao(model, batches)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.no_grad():
        for observed, _ in contenders.values():
            observed(batches[0])  # warm-up (observers plan their kernels here)
        for round_index in range(ROUNDS):
            for name, (observed, _) in contenders.items():
                if name != "torch.ao" or round_index < AO_ROUNDS:
                    times[name].append(_pass(observed, batches))
    result = {name: min(values) for name, values in times.items()}
    for name in ("qcore graph", "qcore", "qcore torch path", "torch.ao"):
        result[f"{name} median ratio"] = statistics.median(t / p for t, p in zip(times[name], times["plain"]))
    for name, (_, generate) in contenders.items():
        if generate is None:
            continue
        start = time.perf_counter()
        try:
            generate()
        except Exception as error:  # noqa: BLE001 - torch.ao's own failures are part of the picture
            print(f"    {name} report generation failed: {type(error).__name__}: {error}")
        result[f"{name} report"] = time.perf_counter() - start
    return result


def main() -> None:
    torch.manual_seed(0)
    cnn = settle_batchnorm(TinyResNet().eval(), _batches((16, 3, 64, 64), 4, seed=9))
    cases = [("ResNet-style CNN 16x3x64x64, 20 batches", cnn, _batches((16, 3, 64, 64), 20)),
             ("MLP 6 x Linear(256), 256 rows, 50 batches", mlp(), _batches((256, 256), 50))]
    from qcore.runtime import native

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; qcore observers: {native.status()}")
    print(f"{ROUNDS} interleaved rounds ({AO_ROUNDS} with torch.ao): best pass, and the median of per-round "
          "ratios to the plain pass")
    for title, model, batches in cases:
        result = measure(model, batches)
        plain = result["plain"]
        print(title)
        print(f"  plain forward         {plain * 1e3:9.1f} ms")
        print(f"  (captured graph, no observers: {result['qcore graph'] / plain:.2f}x; median ratio "
              f"{result['qcore graph median ratio']:.2f}x)")
        for name in ("qcore", "qcore torch path", "torch.ao"):
            print(f"  {name + ' ModelReport':32s} {result[name] * 1e3:9.1f} ms  = {result[name] / plain:5.2f}x forward"
                  f" (median ratio {result[name + ' median ratio']:5.2f}x; "
                  f"report {result[name + ' report'] * 1e3:.0f} ms)")
        print(f"  native kernel vs torch path: {result['qcore torch path'] / result['qcore']:.2f}x faster "
              "(best passes)")
        print(f"  qcore is {result['torch.ao'] / result['qcore']:.1f}x faster than torch.ao (best passes; "
              f"{result['torch.ao median ratio'] / result['qcore median ratio']:.1f}x by median ratios)")


if __name__ == "__main__":
    main()
