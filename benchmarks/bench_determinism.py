"""Determinism of the gate's numbers: run to run, serial vs `-n 2`, and what a thread count change does.

Runs `pytest --qreport --qreport-json` on examples/ and on a ResNet-50-shaped CNN (53 conv layers, seeded
random weights, BatchNorm settled, built in code: the PyPI torchvision wheel needs a CUDA torch), then compares
every (model, check, layer) value between runs:

- run to run: two serial runs with the default analysis thread count (qreport_threads = 1);
- serial vs xdist: a serial run against `-n 2`, both with the default;
- the old behaviour, for scale: 2 analysis threads serially (torch's default on this machine) against `-n 2`
  with 1 thread per worker, which is what the plugin used to do.

    python benchmarks/bench_determinism.py
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

RESNET = '''
import torch
from torch import nn
from pytest_qreport import qmodel


class Bottleneck(nn.Module):
    def __init__(self, inputs, width, stride):
        super().__init__()
        out = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or inputs != out:
            self.down = nn.Sequential(nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet50Like(nn.Module):
    """ResNet-50's layout ([3, 4, 6, 3] bottlenecks, 53 convs) at a quarter of its width."""

    def __init__(self, classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, inputs = [], 16
        for width, count, stride in ((16, 3, 1), (32, 4, 2), (64, 6, 2), (128, 3, 2)):
            for index in range(count):
                blocks.append(Bottleneck(inputs, width, stride if index == 0 else 1))
                inputs = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def images(seed, count):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 64, 64, generator=g) for _ in range(count)]


@qmodel(calibration=lambda: images(0, 4), checks="sqnr,weight_sqnr,model_sqnr,equalization")
def resnet50_like():
    torch.manual_seed(0)
    model = ResNet50Like().train()
    with torch.no_grad():
        for batch in images(9, 4):
            model(batch)
    return model.eval()
'''


def run(directory: pathlib.Path, report: pathlib.Path, *args: str) -> dict[tuple[str, str, str], float]:
    """{(model, check, layer): value} of one pytest --qreport run in `directory`."""
    command = [sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider",
               f"--qreport-json={report}", *args]
    subprocess.run(command, cwd=directory, capture_output=True, text=True, check=False)
    rows = json.loads(report.read_text())["rows"]
    return {(r["model"], r["check"], r["layer"]): r["value"] for r in rows}


def difference(a: dict, b: dict) -> tuple[int, int, float]:
    """(values compared, values that differ, largest absolute difference of finite values)."""
    keys = sorted(set(a) & set(b))
    changed = [k for k in keys if a[k] != b[k]]
    finite = [abs(a[k] - b[k]) for k in changed if isinstance(a[k], float) and isinstance(b[k], float)
              and math.isfinite(a[k]) and math.isfinite(b[k])]
    return len(keys), len(changed), max(finite, default=0.0)


def main() -> None:
    with tempfile.TemporaryDirectory() as temporary:
        scratch = pathlib.Path(temporary)
        zoo = scratch / "zoo"
        zoo.mkdir()
        (zoo / "conftest.py").write_text(RESNET)
        for title, directory in (("examples/", ROOT / "examples"), ("ResNet-50-like, 53 convs", zoo)):
            def measured(name: str, *args: str, directory=directory) -> dict:
                return run(directory, scratch / f"{name}.json", str(directory), *args)

            first, second, parallel = measured("serial-1"), measured("serial-2"), measured("xdist", "-n", "2")
            old_serial = measured("old-serial", "--qreport-threads", "2")
            old_parallel = measured("old-xdist", "-n", "2", "--qreport-threads", "1")
            print(title)
            for label, a, b in (("run to run (serial, default threads)", first, second),
                                ("serial vs -n 2 (default threads)", first, parallel),
                                ("old: 2 threads serial vs 1 per worker", old_serial, old_parallel)):
                compared, changed, worst = difference(a, b)
                print(f"  {label:40s} {changed:5d} of {compared} values differ, largest difference {worst:.3g}",
                      flush=True)


if __name__ == "__main__":
    main()
