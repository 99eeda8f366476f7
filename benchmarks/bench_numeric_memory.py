"""Peak-RSS growth of qcore's streaming comparison vs torch.ao's add_loggers + OutputLogger.

100 batches of 256x512 through 8 x Linear(512). Each side runs in a fresh subprocess of this script, so
the two peaks do not mix; the parent prints both and the ratio.

    python benchmarks/bench_numeric_memory.py
"""
from __future__ import annotations

import copy
import json
import resource
import subprocess
import sys
import warnings

import torch
from torch import nn

BATCHES, ROWS, WIDTH, LAYERS = 100, 256, 512, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).eval()


def _batches(n: int = BATCHES):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.randn(ROWS, WIDTH, generator=g)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours() -> dict:
    import qcore
    from qcore.numeric import compare

    model = _model()
    float_gm, quant_gm = qcore.quantize(model, next(_batches(1)), list(_batches(4)))
    compare(float_gm, quant_gm, _batches(2))  # warm up: instrumentation and allocator
    before = _peak_mb()
    records = compare(float_gm, quant_gm, _batches())
    return {"growth_mb": _peak_mb() - before, "layers": len(records) - 1,
            "min_sqnr_db": min(r["sqnr_db"] for r in records)}


def run_torch_ao() -> dict:
    warnings.filterwarnings("ignore")
    from torch.ao.ns import _numeric_suite_fx as ns
    from torch.ao.ns.fx.utils import compute_sqnr
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    model = _model()
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("fbgemm"), (next(_batches(1)),))
    for batch in _batches(4):
        prepared(batch)
    quantized = convert_fx(copy.deepcopy(prepared))
    logged_a, logged_b = ns.add_loggers("fp32", prepared, "int8", quantized, ns.OutputLogger)
    with torch.no_grad():
        for batch in _batches(2):  # warm up, then drop what was logged
            logged_a(batch)
            logged_b(batch)
    for module in list(logged_a.modules()) + list(logged_b.modules()):
        if isinstance(module, ns.OutputLogger):
            module.stats.clear()
    before = _peak_mb()
    with torch.no_grad():
        for batch in _batches():
            logged_a(batch)
            logged_b(batch)
    results = ns.extract_logger_info(logged_a, logged_b, ns.OutputLogger, "int8")
    ns.extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
    return {"growth_mb": _peak_mb() - before, "layers": len(results)}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps({"ours": run_ours, "torch_ao": run_torch_ao}[sys.argv[1]]()))
        return
    results = {}
    for side in ("ours", "torch_ao"):
        out = subprocess.run([sys.executable, __file__, side], capture_output=True, text=True, check=True)
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, ao = results["ours"]["growth_mb"], results["torch_ao"]["growth_mb"]
    print(f"{BATCHES} batches of {ROWS}x{WIDTH} through {LAYERS} x Linear({WIDTH})")
    print(f"peak RSS growth, qcore streaming compare : {ours:8.1f} MB  ({results['ours']['layers']} layers)")
    print(f"peak RSS growth, torch.ao add_loggers    : {ao:8.1f} MB  ({results['torch_ao']['layers']} layers)")
    print(f"torch.ao / qcore: {ao / max(ours, 1.0):.1f}x (qcore growth floored at 1 MB for the ratio)")


if __name__ == "__main__":
    main()
