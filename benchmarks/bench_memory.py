"""Peak RSS of `pytest --qreport` on one Llama (transformers.LlamaConfig, random seeded weights) against the bytes
of its parameters.

Writes a throwaway repository whose conftest.py declares the model with 3 calibration batches of 2 x 64 tokens,
runs `pytest --qreport` on it in a fresh process, and prints the parameter bytes, the run's peak RSS and wall
time, and the peak over the parameter bytes. The allowance (what a run holds besides the model: torch,
transformers, pytest, torch.export's machinery) is the peak of the same run on the "micro" config (0.3 MB of
weights). With `--models N --workers W` the repository declares N such models (seeded apart) and runs
`pytest --qreport -n W`: the peak is then the system's (MemTotal - MemAvailable, sampled every 0.1 s, above
what it was before the run), since the workers are separate processes. Run:

    python benchmarks/bench_memory.py [--size 0.5b|1b|3b|tiny|micro] [--dtype float32|bfloat16]
        [--checks sqnr,model_sqnr] [--blockwise auto|true|false] [--models 2 --workers 2]
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "micro": (64, 128, 2, 4, 2, 256),  # weights of 0.3 MB: its run's peak is the allowance
    "tiny": (256, 688, 4, 8, 8, 4096),
    "0.5b": (1024, 2816, 14, 16, 16, 32000),
    "1b": (2048, 5632, 16, 32, 8, 32000),
    "3b": (3072, 8192, 28, 24, 8, 128256),  # Llama-3.2-3B's shapes, embeddings tied: 3.2B parameters
}

MODEL = '''
import torch
import transformers

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCABULARY = {size}


def build(seed=0):
    config = transformers.LlamaConfig(vocab_size=VOCABULARY, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=128, use_cache=False,
                                      tie_word_embeddings=VOCABULARY > 100000)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.{dtype})  # built in its dtype: no float32 copy of a bfloat16 model on the way
    try:
        return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def batches():
    g = torch.Generator().manual_seed(0)
    return [{{"input_ids": torch.randint(0, VOCABULARY, (2, 64), generator=g)}} for _ in range(3)]
'''

CONFTEST = '''
import pytest
from pytest_qreport import qmodel
from llama_model import batches as make_batches, build


@pytest.fixture
def batches():
    return make_batches()


@qmodel(calibration="batches", checks={checks}, blockwise={blockwise})
def llama():
    return build()
'''

MORE_MODELS = '''

@qmodel(calibration="batches", checks={checks}, blockwise={blockwise})
def llama_{index}():
    return build({index})
'''

WEIGHTS = '''
from llama_model import build
print(sum(p.numel() * p.element_size() for p in build().parameters()))
'''


def child_peak(command: list[str], cwd: pathlib.Path) -> tuple[float, float, str]:
    """Peak RSS in bytes and wall seconds of one child process, and its output."""
    start = time.perf_counter()
    wrapper = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
               "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", wrapper, *command], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = float(re.findall(r"PEAK (\d+)", done.stdout)[-1])
    return peak, wall, done.stdout + done.stderr


def _system_used() -> int:
    """MemTotal - MemAvailable, in bytes (Linux)."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    return fields["MemTotal"] - fields["MemAvailable"]


def system_peak(command: list[str], cwd: pathlib.Path) -> tuple[float, float, str]:
    """The system's peak memory use above its use before the run (all processes: xdist's workers), wall seconds
    and output of one child process."""
    before, peak, done = _system_used(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _system_used() - before)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    finished = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    return float(peak[0]), wall, finished.stdout + finished.stderr


def measure(root: pathlib.Path, size: str, dtype: str, checks: str, blockwise: str, models: int = 1,
            workers: int = 0) -> tuple[float, float, float, str]:
    """Parameter bytes (of one model), peak RSS (the system's, with workers), wall seconds and summary line of
    one `pytest --qreport` run on `models` Llamas."""
    (root / "llama_model.py").write_text(MODEL.format(size=SIZES[size], dtype=dtype))
    options = {"checks": repr(checks.split(",")) if checks else "None", "blockwise": repr(blockwise)}
    (root / "conftest.py").write_text(CONFTEST.format(**options) + "".join(
        MORE_MODELS.format(index=index, **options) for index in range(1, models)))
    (root / "pytest.ini").write_text("[pytest]\n")
    weights = float(subprocess.run([sys.executable, "-c", WEIGHTS], cwd=root, capture_output=True, text=True,
                                   check=True).stdout)
    command = [sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
               *(["-n", str(workers)] if workers else ["-p", "no:xdist"])]
    peak, wall, output = system_peak(command, root) if workers else child_peak(command, root)
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return weights, peak, wall, summary[-1] if summary else output[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--checks", default="", help="comma-separated checks (default: all of the defaults)")
    parser.add_argument("--blockwise", default="auto", help="the model's blockwise setting (auto, True, False)")
    parser.add_argument("--models", type=int, default=1, help="how many such models the repository declares")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (-n); 0: one process")
    parser.add_argument("--keep", help="write the repository here and keep it")
    options = parser.parse_args()
    root = pathlib.Path(options.keep or tempfile.mkdtemp(prefix="qreport-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    blockwise = {"true": True, "false": False}.get(options.blockwise.lower(), options.blockwise)
    shape = (options.models, options.workers)
    _, allowance, _, _ = measure(root, "micro", options.dtype, options.checks, blockwise, *shape)
    weights, peak, wall, summary = measure(root, options.size, options.dtype, options.checks, blockwise, *shape)
    weights *= options.models
    how = f"-n {options.workers}, the system's peak" if options.workers else "peak RSS"
    print(f"allowance (the same run on 0.3 MB models, {how}): {allowance / 1e9:.2f} GB")
    print(f"{options.models} x Llama {options.size} in {options.dtype}, blockwise={blockwise!r}: parameters "
          f"{weights / 1e9:.2f} GB in all; pytest --qreport: {how} {peak / 1e9:.2f} GB in {wall:.1f} s ({summary})")
    print(f"peak / parameter bytes: {peak / weights:.2f}x; (peak - allowance) / parameter bytes: "
          f"{(peak - allowance) / weights:.2f}x")


if __name__ == "__main__":
    main()
