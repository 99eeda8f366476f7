"""The analysis on a GPU: its time against the plain forward on the same GPU, its host traffic per batch, its GPU
memory, and how close its numbers are to the CPU's.

For each case (bench_analysis.py's, on the GPU, plus bigger batches and a bfloat16 Llama):
- the plain eager forward over the calibration batches (batches already on the GPU; best of 5, synchronized);
- the full default analysis behind `pytest --qreport` (every built-in check): the first in the process (capture
  and first calls included), then the best of 2 more;
- host traffic: device-to-host copies (torch's profiler) and synchronizing calls (torch.cuda's sync debug mode)
  of one analysis on 4 batches and on the same 4 batches twice over (the same statistics and findings, so the
  same trials): per batch = (second - first) / 4;
- the analysis's peak GPU memory above what the model and batches hold, against the parameter bytes;
- per-layer shadow SQNR and output SQNR on the GPU against the same measurement on the CPU.

    python benchmarks/bench_cuda.py [--cases cnn,resnet18,minilm,...] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback
import warnings

DEVICE = "cuda"
PROFILE_DIR: pathlib.Path | None = None
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples")]

CASES = {
    "cnn": "examples' TinyResNet, 8 x 8x3x32x32",
    "resnet18": "ResNet-18, 8 x 4x3x128x128",
    "resnet18_b64": "ResNet-18, 8 x 64x3x224x224",
    "minilm": "BERT-sized encoder (MiniLM-L6-H384 shape), 8 x 4x64 tokens",
    "minilm_b32": "BERT-sized encoder, 8 x 32x128 tokens",
    "llama_bf16": "Llama 0.5B config (bench_memory's), bfloat16, 3 x 2x64 tokens",
    "llama_bf16_512": "Llama 0.5B config, bfloat16, 8 x 4x512 tokens",
}


def _case(name: str):
    import bench_analysis
    import torch

    if name == "resnet18_b64":
        from models import seeded, settle_batchnorm

        g = torch.Generator().manual_seed(0)
        batches = [torch.randn(64, 3, 224, 224, generator=g) for _ in range(8)]
        return settle_batchnorm(seeded(bench_analysis._resnet18), batches[:1], steps=1), batches
    if name == "minilm_b32":
        model, _ = bench_analysis._case("minilm")
        g = torch.Generator().manual_seed(0)
        return model, [{"input_ids": torch.randint(0, 30522, (32, 128), generator=g),
                        "attention_mask": torch.ones(32, 128, dtype=torch.long)} for _ in range(8)]
    if name in ("llama_bf16", "llama_bf16_512"):
        import transformers
        from bench_memory import SIZES

        hidden, intermediate, layers, heads, kv_heads, vocabulary = SIZES["0.5b"]
        config = transformers.LlamaConfig(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=512, use_cache=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        count, shape = (8, (4, 512)) if name == "llama_bf16_512" else (3, (2, 64))
        return model, [{"input_ids": torch.randint(0, vocabulary, shape, generator=g)} for _ in range(count)]
    return bench_analysis._case(name)


def _synchronize() -> None:
    """Wait for the GPU's queued work (nothing on the CPU)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _synchronized(function) -> float:
    """Seconds `function` takes, the GPU's queued work included."""
    _synchronize()
    start = time.perf_counter()
    function()
    _synchronize()
    return time.perf_counter() - start


def _forward(model, batches) -> None:
    import torch

    from qcore.graph.inputs import call_model

    with torch.no_grad():
        for batch in batches:
            call_model(model, batch)


def _collected(model, batches):
    """The plugin's pipeline of `model` with every built-in check, collected (captured), not analysed."""
    from pytest_qreport.checks import BUILTIN_CHECKS
    from tests.gpu.test_cuda import collected

    return collected(model, batches, [check.name for check in BUILTIN_CHECKS])


def _analyzed(pipeline, batches):
    pipeline.analyze(lambda: batches, lambda found: None)
    if pipeline.failed:
        raise RuntimeError(pipeline.error)
    return pipeline


def _analysis(model, batches):
    """The plugin's analysis of `model` (collection, then every built-in check)."""
    return _analyzed(_collected(model, batches), batches)


def _timed_analysis(model, batches) -> tuple[float, dict[str, float], dict[str, float]]:
    """One analysis after its collection: its seconds (synchronized), the seconds of its stages (the plugin's:
    calibration, comparison, trials, other) and of each check (a check that first reads a measurement pays for it,
    so the trials show under the checks that run them)."""
    from pytest_qreport.core.pipeline import ModelPipeline

    pipeline, checks = _collected(model, batches), {}
    before = dict(pipeline.seconds)
    per_check = ModelPipeline._check_findings

    def timed(self, check_name, layers):
        _synchronize()
        start = time.perf_counter()
        try:
            return per_check(self, check_name, layers)
        finally:
            _synchronize()
            checks[check_name] = checks.get(check_name, 0.0) + time.perf_counter() - start

    ModelPipeline._check_findings = timed
    try:
        seconds = _synchronized(lambda: _analyzed(pipeline, batches))
    finally:
        ModelPipeline._check_findings = per_check
    stages = {stage: value - before.get(stage, 0.0) for stage, value in pipeline.seconds.items()
              if value - before.get(stage, 0.0) > 0}
    return seconds, stages, checks


def _op_count(function) -> int:
    """How many aten ops `function` dispatches (each one kernel launch, or more, on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        function()
    return Count.ops


def _profile(model, batches, path: pathlib.Path) -> float:
    """One analysis (after its collection) under torch's profiler: the top ops by host time and by device time
    written to `path`; returns the device's busy share of the analysis's wall time."""
    import torch

    pipeline = _collected(model, batches)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        wall = _synchronized(lambda: _analyzed(pipeline, batches))
    averages = profiler.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            tables.append(averages.table(sort_by=key, row_limit=30))
            break
        except Exception:  # noqa: BLE001 - the key's name depends on torch's version
            continue
    path.write_text("\n\n".join(tables))
    busy_us = sum(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
                  for event in averages)
    return busy_us / 1e6 / wall


def _traffic(model, batches):
    from contextlib import nullcontext

    from tests.gpu.test_cuda import HostTraffic

    with HostTraffic() if DEVICE == "cuda" else nullcontext(HostTraffic()) as traffic:
        _analysis(model, batches)
    return traffic


def _sqnrs(model, batches):
    import qcore
    from qcore.measure.passes import measure_model

    measured = measure_model(qcore.capture(model, batches[0]), batches, qcore.Int8StaticQuantizer())
    return ({layer: value.shadow_sqnr_db for layer, value in measured.sqnr.layers.items()},
            {name: value.sqnr_db for name, value in measured.sqnr.outputs.items()})


def run_case(name: str, compare_with_cpu: bool, light: bool = False, profile_light: bool = False) -> dict:
    """Every figure of one case (`light`: the forward, two analyses and the GPU memory only, and with
    `profile_light` a third analysis under the profiler)."""
    import copy

    import torch

    from qcore.graph.inputs import move_to

    model, cpu_batches = _case(name)
    cpu_model = copy.deepcopy(model) if compare_with_cpu else None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    model = model.to(DEVICE)
    batches = [move_to(batch, DEVICE) for batch in cpu_batches]
    for _ in range(2):
        _forward(model, batches)
    forward = min(_synchronized(lambda: _forward(model, batches)) for _ in range(5))
    on_gpu = DEVICE == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if on_gpu else 0
    first = _synchronized(lambda: _analysis(model, batches))
    peak = torch.cuda.max_memory_allocated() - held if on_gpu else 0
    steady, stages, checks = min((_timed_analysis(model, batches) for _ in range(1 if light else 2)),
                                 key=lambda timed: timed[0])
    result = {"case": name, "params": params, "forward_s": forward, "first_s": first, "steady_s": steady,
              "ratio": steady / forward, "first_ratio": first / forward, "gpu_peak_above_bytes": peak,
              "batches": len(batches), "stages_s": stages, "checks_s": checks}
    if light:
        if PROFILE_DIR and profile_light:
            result["device_busy"] = _profile(model, batches, PROFILE_DIR / f"profile_{name}.txt")
        return result
    four = batches[:4]
    once, twice = _traffic(model, four), _traffic(model, four + [move_to(b, DEVICE) for b in cpu_batches[:4]])
    pipeline = _collected(model, batches)
    analysis_ops = _op_count(lambda: _analyzed(pipeline, batches))
    forward_ops = _op_count(lambda: _forward(model, batches))
    busy = _profile(model, batches, PROFILE_DIR / f"profile_{name}.txt") if PROFILE_DIR else None
    result.update(analysis_ops=analysis_ops, forward_ops=forward_ops, device_busy=busy,
                  copies_to_host=[once.copies_to_host, twice.copies_to_host], syncs=[once.syncs, twice.syncs],
                  copies_to_device=[once.copies_to_device, twice.copies_to_device], traffic_batches=len(four))
    if cpu_model is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(8)
        cpu_layers, cpu_outputs = _sqnrs(cpu_model, cpu_batches)
        torch.set_num_threads(threads)
        gpu_layers, gpu_outputs = _sqnrs(model, batches)
        differences = [abs(gpu_layers[layer] - value) for layer, value in cpu_layers.items()
                       if layer in gpu_layers and abs(value) != float("inf")]
        result.update(layers_compared=len(differences), layers_missing=len(set(cpu_layers) ^ set(gpu_layers)),
                      layer_diff_median_db=statistics.median(differences) if differences else None,
                      layer_diff_max_db=max(differences, default=None),
                      output_diff_db={k: gpu_outputs.get(k, float("nan")) - v for k, v in cpu_outputs.items()})
    return result


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--light", default="llama_bf16,llama_bf16_512",
                        help="cases timed without traffic, op counts or profile")
    parser.add_argument("--profile-dir", default=None, help="write each case's profiler tables there")
    parser.add_argument("--profile-light", action="store_true", help="profile the light cases too")
    parser.add_argument("--device", default="cuda", help="cpu runs every step but the GPU's own (a dry run)")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="start no case after this many seconds")
    options = parser.parse_args()
    global DEVICE, PROFILE_DIR
    DEVICE = options.device
    PROFILE_DIR = pathlib.Path(options.profile_dir) if options.profile_dir and DEVICE == "cuda" else None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA device (or --device cpu, a dry run)")
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}", flush=True)
    started, results = time.perf_counter(), []
    for name in options.cases.split(","):
        if time.perf_counter() - started > options.deadline_s:
            print(f"{name}: skipped (past the deadline)", flush=True)
            continue
        try:
            result = run_case(name, compare_with_cpu=name in ("cnn", "resnet18", "minilm"),
                              light=name in options.light.split(","), profile_light=options.profile_light)
        except Exception:  # noqa: BLE001 - one case's failure is printed, the others still run
            print(f"{name}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
            continue
        results.append(result)
        print(json.dumps(result), flush=True)
        if options.json:
            pathlib.Path(options.json).write_text(json.dumps(results, indent=1))
    print(f"\n{'case':<55} {'forward':>9} {'analysis':>9} {'ratio':>6} {'first':>6} {'DtoH/batch':>10} "
          f"{'syncs/batch':>11} {'GPU peak':>9}")
    for r in results:
        per_batch = [(b - a) / r["traffic_batches"] for a, b in (r["copies_to_host"], r["syncs"])] \
            if "syncs" in r else ["-", "-"]
        print(f"{CASES[r['case']]:<55} {r['forward_s'] * 1e3:>7.1f}ms {r['steady_s']:>8.2f}s {r['ratio']:>5.1f}x "
              f"{r['first_ratio']:>5.1f}x {per_batch[0]:>10} {per_batch[1]:>11} "
              f"{r['gpu_peak_above_bytes'] / r['params']:>8.2f}x")
        forward = r["forward_s"]
        print("    stages: " + ", ".join(f"{k} {v / forward:.1f}x" for k, v in r["stages_s"].items()))
        slowest = sorted(r["checks_s"].items(), key=lambda item: -item[1])[:6]
        print("    checks: " + ", ".join(f"{k} {v / forward:.1f}x" for k, v in slowest))
        if "syncs" not in r:
            if r.get("device_busy") is not None:
                print(f"    the GPU busy {r['device_busy']:.0%} of the analysis")
            continue
        busy = f"; the GPU busy {r['device_busy']:.0%} of the analysis" if r["device_busy"] is not None else ""
        print(f"    aten ops: analysis {r['analysis_ops']}, forward {r['forward_ops']} "
              f"({r['analysis_ops'] / r['forward_ops']:.0f}x){busy}")
        if "layer_diff_max_db" in r:
            print(f"    GPU vs CPU: {r['layers_compared']} layers, |shadow SQNR difference| median "
                  f"{r['layer_diff_median_db']:.3f} dB, max {r['layer_diff_max_db']:.3f} dB; outputs "
                  f"{ {k: round(v, 3) for k, v in r['output_diff_db'].items()} }")


if __name__ == "__main__":
    main()
