"""What one model's analysis costs: time against the plain eager forward, peak memory against the parameters.

For each case, in a fresh subprocess (so that peak RSS is the analysis's own), on 2 torch threads:
- the plain eager forward over the calibration batches (best of 3);
- the full default analysis behind `pytest --qreport` (every built-in check, as the plugin runs them:
  pytest_qreport.runner.collect_model + analyze), and `sqnr,model_sqnr` alone;
- torch.ao's nearest equivalent of the SQNR part, for scale: prepare_fx, calibrate, convert_fx, then the FX
  numeric suite's add_loggers/extract_logger_info over the same batches (CNN only: HF models do not
  symbolic_trace);
- peak RSS above the process's RSS before the analysis, against the model's parameter bytes.

Cases: the BERT-style encoder (transformers.BertModel, 6 layers, hidden 256, 8 batches of 4x64 tokens), a
ResNet-style CNN (examples' TinyResNet, 8 batches of 8x3x32x32), and 8 x Linear(4096) with 200 batches of 64 rows
(memory).

    python benchmarks/bench_analysis.py
"""
from __future__ import annotations

import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _case(name: str):
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    if name == "bert":
        import transformers

        config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=6,
                                         num_attention_heads=4, intermediate_size=1024, max_position_embeddings=64)
        torch.manual_seed(0)
        model = transformers.BertModel(config).eval()
        g = torch.Generator().manual_seed(0)
        batches = [{"input_ids": torch.randint(0, 1000, (4, 64), generator=g),
                    "attention_mask": torch.ones(4, 64, dtype=torch.long)} for _ in range(8)]
        return model, batches
    if name == "cnn":
        from models import TinyResNet, seeded, settle_batchnorm

        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(8, 3, 32, 32, generator=g) for _ in range(8)]
        return settle_batchnorm(seeded(TinyResNet), batches), batches
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    g = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(*layers).eval(), [torch.randn(64, 4096, generator=g) for _ in range(200)]


def _settings(checks, batches):
    from pytest_qreport.options import ModelSettings

    return ModelSettings(20.0, 20.0, 30.0, layers=None, skip_layers=None, float_layers=None, checks=checks,
                         calibration=batches, example_inputs=None, quantizer="int8", equalize=None,
                         equalization_min_gain_db=1.0, severity={}, check_options={})


def _analyse(model, batches, checks):
    import qcore
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.registry import CheckRegistry
    from pytest_qreport.runner import analyze, collect_model

    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    state = collect_model("model", _settings(checks or registry.names(), batches), registry,
                          qcore.Int8StaticQuantizer(), model, batches[0])
    analyze(state, lambda: batches, lambda found: None, threads=2)
    assert state.analysis_error is None, state.analysis_error
    return state


def _forward_seconds(model, batches) -> float:
    import torch

    from qcore.inputs import call_model

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
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    _analyse(model, batches, None if mode == "full" else ["sqnr", "model_sqnr"])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_above_bytes": peak - before, "params": params}


def _run(name: str, mode: str) -> dict:
    output = subprocess.run([sys.executable, __file__, name, mode], capture_output=True, text=True, cwd=ROOT,
                            timeout=3000)
    if output.returncode:
        raise RuntimeError(output.stderr[-2000:])
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    for name, title in (("bert", "BERT-style encoder (6 x 256)"), ("cnn", "ResNet-style CNN (TinyResNet)")):
        forward = _run(name, "forward")
        full, sqnr = _run(name, "full"), _run(name, "sqnr")
        line = (f"{title}: forward {forward['seconds']:.3f} s; full analysis {full['seconds']:.2f} s = "
                f"{full['seconds'] / forward['seconds']:.1f}x; sqnr,model_sqnr {sqnr['seconds']:.2f} s = "
                f"{sqnr['seconds'] / forward['seconds']:.1f}x; peak RSS +{full['peak_above_bytes'] / 2**20:.0f} MiB "
                f"= {full['peak_above_bytes'] / full['params']:.1f}x the parameters")
        if name == "cnn":
            reference = _run(name, "torch_ao")
            line += (f"; torch.ao prepare/convert + numeric suite {reference['seconds']:.2f} s = "
                     f"{reference['seconds'] / forward['seconds']:.1f}x")
        print(line)
    forward, sqnr = _run("linear4096", "forward"), _run("linear4096", "sqnr")
    print(f"8 x Linear(4096), 200 batches of 64: forward {forward['seconds']:.2f} s; sqnr,model_sqnr "
          f"{sqnr['seconds']:.2f} s = {sqnr['seconds'] / forward['seconds']:.1f}x; peak RSS "
          f"+{sqnr['peak_above_bytes'] / 2**20:.0f} MiB = {sqnr['peak_above_bytes'] / sqnr['params']:.1f}x the "
          f"parameters ({sqnr['params'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
    else:
        main()
