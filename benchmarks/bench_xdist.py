"""A model zoo under pytest-xdist: serial against `-n 2`, from a cold and from a warm cache.

Writes a throwaway repository whose conftest.py declares 19 classification models built in code with the
architectures of torchvision's (ResNet-18/34/50/101/152 and narrow or wide variants, MobileNetV2 at three widths,
EfficientNet- and MnasNet-like inverted residuals with squeeze-excitation, VGG-11/13/16 with BatchNorm; seeded
weights, settled BatchNorm statistics, 4 calibration batches of 4 32x32 images): 82 to 1,100 items per model,
7,067 in all. It then times `pytest --qreport` on it in fresh processes:

- serial, cold cache (`--cache-clear`), then warm;
- `-n 2`, cold, then warm;

and prints each wall time, the CPU seconds of all its processes (the controller and the workers), the items, and
the ratios serial / `-n 2`. CPU sets a ceiling on the ratio, since a `-n 2` run takes at least its CPU spread
over the cores: the serial wall time times the cores, over the `-n 2` run's CPU (which adds the workers' start-up,
the reports sent and received, and the controller). The ceiling is printed beside each ratio. Run:

    python benchmarks/bench_xdist.py [--models 19] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

CONFTEST = '''
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


def conv_bn(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act else nn.Sequential(*layers)


class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(conv_bn(cin, width, 3, stride), conv_bn(width, cout, 3, act=None))
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None

    def forward(self, x):
        return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))


class Bottleneck(Basic):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__(cin, width, stride)
        self.body = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3, stride),
                                  conv_bn(width, width * 4, 1, act=None))


class ResNet(nn.Module):
    def __init__(self, block, depths, base=64, classes=100):
        super().__init__()
        self.stem = conv_bn(3, base, 3)
        stages, cin = [], base
        for index, depth in enumerate(depths):
            width = base * 2 ** index
            for position in range(depth):
                stages.append(block(cin, width, 2 if position == 0 and index else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class Inverted(nn.Module):
    def __init__(self, cin, cout, stride, expand, se=False, act=nn.ReLU6):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn(cin, hidden, 1, act=act)] if expand != 1 else []
        layers.append(conv_bn(hidden, hidden, 3, stride, groups=hidden, act=act))
        self.expand = nn.Sequential(*layers)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, max(8, hidden // 4), 1), nn.SiLU(),
                                nn.Conv2d(max(8, hidden // 4), hidden, 1), nn.Sigmoid()) if se else None
        self.project = conv_bn(hidden, cout, 1, act=None)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.expand(x)
        if self.se is not None:
            y = y * self.se(y)
        y = self.project(y)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    SETTING = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
               (6, 320, 1, 1)]

    def __init__(self, width=1.0, se=False, act=nn.ReLU6, classes=100):
        super().__init__()
        cin = int(32 * width)
        blocks = [conv_bn(3, cin, 3, act=act)]
        for expand, channels, repeats, stride in self.SETTING:
            cout = max(8, int(channels * width))
            for position in range(repeats):
                blocks.append(Inverted(cin, cout, stride if position == 0 else 1, expand, se, act))
                cin = cout
        blocks.append(conv_bn(cin, 1280, 1, act=act))
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(1280, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class VGG(nn.Module):
    def __init__(self, plan, classes=100):
        super().__init__()
        layers, cin = [], 3
        for entry in plan:
            if entry == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers.append(conv_bn(cin, entry))
                cin = entry
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(cin, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, classes))

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512]
VGG13 = [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512]
VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
ZOO = {
    "vgg13_bn": lambda: VGG(VGG13),
    "resnet18": lambda: ResNet(Basic, [2, 2, 2, 2]),
    "resnet34": lambda: ResNet(Basic, [3, 4, 6, 3]),
    "resnet50": lambda: ResNet(Bottleneck, [3, 4, 6, 3]),
    "resnet101": lambda: ResNet(Bottleneck, [3, 4, 23, 3], base=32),
    "resnet26_narrow": lambda: ResNet(Bottleneck, [2, 2, 2, 2], base=32),
    "wide_resnet18": lambda: ResNet(Basic, [2, 2, 2, 2], base=96),
    "mobilenet_v2": lambda: MobileNet(1.0),
    "mobilenet_v2_075": lambda: MobileNet(0.75),
    "mobilenet_v2_050": lambda: MobileNet(0.5),
    "efficientnet_like": lambda: MobileNet(1.0, se=True, act=nn.SiLU),
    "efficientnet_like_075": lambda: MobileNet(0.75, se=True, act=nn.SiLU),
    "mnasnet_like": lambda: MobileNet(0.5, se=True),
    "vgg11_bn": lambda: VGG(VGG11),
    "resnet152_narrow": lambda: ResNet(Bottleneck, [3, 8, 36, 3], base=16),
    "vgg16_bn": lambda: VGG(VGG16),
    "resnet18_c10": lambda: ResNet(Basic, [2, 2, 2, 2], classes=10),
    "resnet34_narrow": lambda: ResNet(Basic, [3, 4, 6, 3], base=32),
    "resnet50_narrow": lambda: ResNet(Bottleneck, [3, 4, 6, 3], base=32),
}


@pytest.fixture
def images():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 32, 32, generator=g) for _ in range(4)]


def _declare(index, name, build):
    def factory():
        torch.manual_seed(index)
        model = build().eval()
        for module in model.modules():  # settled BatchNorm statistics, as a trained model has
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
        return model
    factory.__name__ = name
    globals()[name] = qmodel(calibration="images")(factory)


for _index, (_name, _build) in enumerate(list(ZOO.items())[:MODELS]):
    _declare(_index, _name, _build)
'''


def _children_cpu() -> float:
    """User and system seconds of every waited-for child process so far (a child's own waited-for children,
    such as xdist's workers, included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(project: pathlib.Path, *args: str) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds of all its processes, items run, and the summary line of one pytest run in a
    fresh process."""
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:randomly", *args],
                          cwd=project, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    summary = lines[-1].strip("= ") if lines else done.stdout[-2000:] + done.stderr[-2000:]
    items = sum(int(n) for n in re.findall(r"(\d+) (?:passed|failed|skipped|error)", summary))
    return wall, cpu, items, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=19)
    parser.add_argument("--keep", help="write the repository here and keep it")
    options = parser.parse_args()
    root = pathlib.Path(options.keep or tempfile.mkdtemp(prefix="qreport-zoo-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "conftest.py").write_text(CONFTEST.replace("MODELS", str(options.models)))
    (root / "pytest.ini").write_text("[pytest]\n")
    walls, cpus = {}, {}
    for label, args in (("serial, cold", ["--cache-clear"]), ("serial, warm", []),
                        ("-n 2, cold", ["-n", "2", "--cache-clear"]), ("-n 2, warm", ["-n", "2"])):
        walls[label], cpus[label], items, summary = run(root, *args)
        print(f"{label:14s} {walls[label]:7.1f} s  CPU {cpus[label]:6.1f} s  {items} items  ({summary})", flush=True)
    cores = min(2, os.cpu_count() or 1)
    for cache in ("cold", "warm"):
        serial, parallel = f"serial, {cache}", f"-n 2, {cache}"
        print(f"serial / -n 2, {cache} cache: {walls[serial] / walls[parallel]:.2f}x "
              f"(CPU ceiling on {cores} cores: {cores * walls[serial] / cpus[parallel]:.2f}x)")


if __name__ == "__main__":
    main()
