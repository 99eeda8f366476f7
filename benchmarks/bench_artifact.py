"""What gating an artifact costs (qcore.artifact): the analysis of a quantized Llama against its float reference,
in time against the quantized model's own forward over the same batches, and in memory against both models'
weights plus one batch's activations.

Each configuration runs in a subprocess of its own, so that its peak resident memory is its own:

    python benchmarks/bench_artifact.py            # a Llama of 4 layers, hidden 512; torchao int8 and W8A8
    python benchmarks/bench_artifact.py --quick    # a smaller one, for a smoke run

It prints, per artifact: the quantized and the float forward over the batches, the analysis, its ratio to the
quantized forward (the ceiling: 3.5x) and the floor of that ratio (one float pass and two quantized passes: the
model and its shadow layers), then the resident memory the analysis adds over the two loaded models, against one
batch's activations (what one forward of both models holds at its peak, and the reference's layer inputs and
outputs that wait for the quantized pass) plus the stated allowance, for 4 and 16 batches.

Then what the verified fixes cost: `pytest --qreport` on a tiny 4-layer Llama's NVFP4 and W4A16 compressed-tensors
checkpoints (4 batches of 32 tokens) and on this benchmark's Llama's W4A16 one, with the default thresholds (the
per-layer and output gates fail, fixes are searched) and with every gate open (nothing searched): the analysis
seconds of each (the model's stages in the JSON report, the fastest of 3 runs) and their ratio (the ceiling: 3x).
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time

ALLOWANCE_BYTES = 64 << 20  # the allocator's pools, the hooks' bookkeeping, one layer's float64 comparison chunk
TIME_CEILING = 3.5
GATES_CEILING = 3.0
OPEN_GATES = ("sqnr_min_db=-1000, weight_sqnr_min_db=-1000, model_sqnr_min_db=-1000, kl_max_nats=1e9, "
              "top1_agreement_min=0, perplexity_max_increase_pct=1e9")
GATES_CONFTEST = """
import sys

sys.path.insert(0, {root!r})

import pytest
import torch

from pytest_qreport import qmodel
from tests.helpers import compressed_tensors_checkpoint


def reference():
    sys.path.insert(0, {benchmarks!r})
    from bench_artifact import _gates_model

    return _gates_model({size!r})


@pytest.fixture(scope="session")
def batches():
    generator = torch.Generator().manual_seed(1)
    return [{{"input_ids": torch.randint(0, reference().config.vocab_size, (1, 32), generator=generator)}}
            for _ in range(4)]


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    return compressed_tensors_checkpoint(reference(), tmp_path_factory.mktemp("checkpoint"), {preset!r},
                                         **({extra}))


@qmodel(calibration="batches", quantized="artifact"{gates})
def llama():
    return reference()
"""


def _model(quick: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = 128 if quick else 512
    config = LlamaConfig(vocab_size=2048 if quick else 8192, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=4)
    return LlamaForCausalLM(config).eval()


def _artifact(reference, kind: str):
    if kind == "torchao-int8-dynamic":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        model = copy.deepcopy(reference)
        quantize_(model, Int8DynamicActivationInt8WeightConfig())
        return model
    sys.path.insert(0, ".")
    from tests.helpers import compressed_tensors_checkpoint

    return compressed_tensors_checkpoint(reference, tempfile.mkdtemp(), "W8A8")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Start the peak resident memory (VmHWM) over from the current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def measure(kind: str, batch_count: int, quick: bool) -> dict:
    """One configuration, in this process: times, and the memory the analysis adds."""
    import torch

    from qcore.artifact import ArtifactAnalysis
    from qcore.artifact.measure import _output_tensor

    torch.set_num_threads(2)
    reference = _model(quick)
    quantized = _artifact(reference, kind)
    generator = torch.Generator().manual_seed(1)
    tokens = 64 if quick else 128
    batches = [{"input_ids": torch.randint(0, reference.config.vocab_size, (4, tokens), generator=generator)}
               for _ in range(batch_count)]
    with torch.no_grad():  # warm both models (compressed-tensors decompresses its weights on the first forward)
        reference(**batches[0], use_cache=False)
        quantized(**batches[0], use_cache=False)
    analysis = ArtifactAnalysis(reference, quantized, logits=True)
    names = [layer.name for layer in analysis.layers]
    held = 0  # one batch's reference layer inputs and outputs, as the pass keeps them

    def count(module, args, output):
        nonlocal held
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [_output_tensor(output)]
        held += sum(t.numel() * t.element_size() for t in tensors if t is not None)

    handles = [reference.get_submodule(name).register_forward_hook(count) for name in names]
    with torch.no_grad():
        reference(**batches[0], use_cache=False)
    for handle in handles:
        handle.remove()
    _reset_peak()
    before = _status("VmRSS")
    with torch.no_grad():
        reference(**batches[0], use_cache=False)
        quantized(**batches[0], use_cache=False)
    forward_peak = max(0, _status("VmHWM") - before)  # what one batch's forward holds at its peak
    forward, float_forward = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            start = time.perf_counter()
            quantized(**batch, use_cache=False)
            middle = time.perf_counter()
            reference(**batch, use_cache=False)
            forward, float_forward = forward + middle - start, float_forward + time.perf_counter() - middle
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    analysis.attach_batches(batches)
    analysis.measurement  # noqa: B018
    seconds = time.perf_counter() - start
    added = max(0, _status("VmHWM") - before)
    return {"kind": kind, "batches": batch_count, "layers": len(names), "forward_s": forward,
            "float_forward_s": float_forward, "analysis_s": seconds, "ratio": seconds / forward,
            "floor_ratio": (float_forward + 2 * forward) / forward, "added_bytes": added,
            "one_batch_activations": held + forward_peak, "kept_layer_values": held,
            "weights": sum(t.numel() * t.element_size() for t in reference.parameters())}


def _gates_model(size: str):
    """The tiny 4-layer Llama of the artifact tests, or this benchmark's."""
    if size == "tiny":
        sys.path.insert(0, ".")
        from tests.helpers import tiny_llama

        return tiny_llama(layers=4)
    return _model(size == "quick")


def gates(size: str, preset: str, open_gates: bool) -> dict:
    """`pytest --qreport` on one checkpoint, in a subprocess: the model's analysis seconds per stage."""
    import os
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    extra = "{'group_size': 32}" if preset == "W4A16" and size == "tiny" else "{}"
    with tempfile.TemporaryDirectory() as directory:
        conftest = GATES_CONFTEST.format(root=root, benchmarks=str(pathlib.Path(__file__).parent), size=size,
                                         preset=preset, extra=extra,
                                         gates=(", " + OPEN_GATES) if open_gates else "")
        pathlib.Path(directory, "conftest.py").write_text(conftest)
        report = pathlib.Path(directory, "r.json")
        subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-p", "no:cacheprovider", "-q",
                        f"--qreport-json={report}", "--rootdir", directory, directory],
                       capture_output=True, text=True, cwd=directory, env={**os.environ, "PYTHONPATH": root})
        data = json.loads(report.read_text())
    model = data["models"]["llama"]
    failing = sum(row["verdict"] == "fail" for row in data["rows"])
    seconds = {stage: value for stage, value in model["seconds"].items() if stage != "capture"}
    return {"seconds": sum(seconds.values()), "trials": seconds.get("trials", 0.0), "failing": failing}


def print_gates(quick: bool, repeats: int = 3) -> None:
    """The table of analyses with fixes searched against every gate open (each the fastest of `repeats` runs:
    sub-second analyses of the tiny checkpoints vary by tens of percent between runs on a shared machine)."""
    print(f"\n{'checkpoint':28} {'default':>9} {'fails':>6} {'trials':>8} {'open':>7} {'ratio':>6}")
    cases = [("tiny", "NVFP4"), ("tiny", "W4A16")] + ([] if quick else [("bench", "W4A16")])
    for size, preset in cases:
        default = min((gates(size, preset, False) for _ in range(repeats)), key=lambda run: run["seconds"])
        open_ = min((gates(size, preset, True) for _ in range(repeats)), key=lambda run: run["seconds"])
        ratio = default["seconds"] / open_["seconds"]
        verdict = "ok" if ratio <= GATES_CEILING else "OVER"
        print(f"{size + ' ' + preset:28} {default['seconds']:>8.2f}s {default['failing']:>6} "
              f"{default['trials']:>7.2f}s {open_['seconds']:>6.2f}s {ratio:>5.2f}x  {verdict}")


def main() -> None:
    """Run each configuration in a subprocess and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "BATCHES"), help=argparse.SUPPRESS)
    parser.add_argument("--gates-only", action="store_true", help="only the fixes' table")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.quick)))
        return
    if args.gates_only:
        print_gates(args.quick)
        return
    print(f"{'artifact':24} {'batches':>7} {'forward':>9} {'float':>7} {'analysis':>9} {'ratio':>6} {'floor':>6} "
          f"{'/floor':>6} {'added MiB':>10} {'1 batch MiB':>12} {'limit MiB':>10}")
    for kind in ("torchao-int8-dynamic", "compressed-tensors-W8A8"):
        for batches in (4, 16):
            command = [sys.executable, __file__, "--one", kind, str(batches)] + (["--quick"] if args.quick else [])
            line = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(line)
            limit = row["one_batch_activations"] + ALLOWANCE_BYTES
            print(f"{kind:24} {batches:>7} {row['forward_s']:>8.2f}s {row['float_forward_s']:>6.2f}s "
                  f"{row['analysis_s']:>8.2f}s {row['ratio']:>5.2f}x {row['floor_ratio']:>5.2f}x "
                  f"{row['ratio'] / row['floor_ratio']:>5.2f}x {row['added_bytes'] / 2**20:>10.1f} "
                  f"{row['one_batch_activations'] / 2**20:>12.1f} {limit / 2**20:>10.1f}  {_verdict(row, limit)}")
    print_gates(args.quick)


def _verdict(row: dict, limit: float) -> str:
    """'ok', or what is over: the time (and whether its floor is over the ceiling already: where the float reference
    runs slower than the quantized model, one float and two quantized passes alone exceed it), the memory, or both."""
    over = []
    if row["ratio"] > TIME_CEILING:
        floor = " (its floor too: the float forward is the slower here)" if row["floor_ratio"] > TIME_CEILING else ""
        over.append(f"time OVER{floor}")
    if row["added_bytes"] > limit:
        over.append("memory OVER")
    return "; ".join(over) or "ok"


if __name__ == "__main__":
    main()
