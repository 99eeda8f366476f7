"""A model zoo under pytest-xdist: serial against `-n 2`, from a cold and from a warm cache.

Writes a throwaway repository whose conftest.py declares 18 small models built in code (residual MLPs and CNNs
of 12 to 60 layers, seeded weights, 4 calibration batches each: the shape of a zoo of classification models,
150 to 850 items per model, about 7,000 in all), then times `pytest --qreport` on it in fresh processes:

- serial, cold cache (`--cache-clear`), then warm;
- `-n 2`, cold, then warm;

and prints each wall time, the items, and the ratios serial / `-n 2`. Run:

    python benchmarks/bench_xdist.py [--models 18] [--keep DIR]
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import time

CONFTEST = '''
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class DeepMLP(nn.Module):
    def __init__(self, blocks, width=32, classes=10):
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))))


class ConvBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class DeepCNN(nn.Module):
    def __init__(self, blocks, channels=8, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.pool(self.blocks(torch.relu(self.stem(x)))).flatten(1))


@pytest.fixture
def vectors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, generator=g) for _ in range(4)]


@pytest.fixture
def images():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 12, 12, generator=g) for _ in range(4)]


def _declare(index):
    blocks = 10 + (index * 7) % 36
    if index % 3 == 2:
        def factory():
            torch.manual_seed(index)
            return DeepCNN(blocks).eval()
        source = "images"
    else:
        def factory():
            torch.manual_seed(index)
            return DeepMLP(blocks).eval()
        source = "vectors"
    factory.__name__ = f"zoo_{index:02d}"
    globals()[factory.__name__] = qmodel(calibration=source)(factory)


for _index in range(MODELS):
    _declare(_index)
'''


def run(project: pathlib.Path, *args: str) -> tuple[float, int, str]:
    """Wall seconds, items run, and the summary line of one pytest run in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:randomly", *args],
                          cwd=project, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    summary = lines[-1].strip("= ") if lines else done.stdout[-2000:] + done.stderr[-2000:]
    items = sum(int(n) for n in re.findall(r"(\d+) (?:passed|failed|skipped|error)", summary))
    return wall, items, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=18)
    parser.add_argument("--keep", help="write the repository here and keep it")
    options = parser.parse_args()
    root = pathlib.Path(options.keep or tempfile.mkdtemp(prefix="qreport-zoo-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "conftest.py").write_text(CONFTEST.replace("MODELS", str(options.models)))
    (root / "pytest.ini").write_text("[pytest]\n")
    results = {}
    for label, args in (("serial, cold", ["--cache-clear"]), ("serial, warm", []),
                        ("-n 2, cold", ["-n", "2", "--cache-clear"]), ("-n 2, warm", ["-n", "2"])):
        wall, items, summary = run(root, *args)
        results[label] = wall
        print(f"{label:14s} {wall:7.1f} s  {items} items  ({summary})", flush=True)
    for cache in ("cold", "warm"):
        print(f"serial / -n 2, {cache} cache: {results[f'serial, {cache}'] / results[f'-n 2, {cache}']:.2f}x")


if __name__ == "__main__":
    main()
