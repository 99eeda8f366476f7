"""Per-layer SQNR before and after input-weight (and cross-layer) equalization, and the gain in dB.

The models' input channels span four orders of magnitude (a sensor-style MLP and a small CNN whose input
channels are scaled alike), with the default quantizer (int8, per-channel weights, min/max activations); a
third case has unbalanced conv output channels and per-tensor weights, where cross-layer equalization helps.

    python benchmarks/bench_equalization.py
"""
from __future__ import annotations

import torch
from torch import nn

import qcore
from qcore.equalize import cross_layer_equalize, equalize
from qcore.analysis import measure_sqnr


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4),
                         nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).eval()


def _batches(shape, axis, count=8):
    g = torch.Generator().manual_seed(1)
    view = [1] * len(shape)
    view[axis] = -1
    spread = torch.logspace(-2, 2, shape[axis]).view(view)
    return [torch.randn(shape, generator=g) * spread for _ in range(count)]


def _unbalanced_cnn() -> nn.Module:
    model = _cnn()
    with torch.no_grad():  # output channels of the first conv with very different weight ranges
        scale = torch.logspace(-1.5, 1.5, 16)
        model[0].weight.mul_(scale.view(-1, 1, 1, 1))
        model[0].bias.mul_(scale)
    return model


def main() -> None:
    per_tensor = qcore.Int8StaticQuantizer(per_channel=False)
    cases = (("MLP 32-64-64-8, inputs spanning 1e-2..1e2", _mlp(), _batches((64, 32), 1), None),
             ("CNN (grouped + depthwise), input channels spanning 1e-2..1e2", _cnn(), _batches((8, 8, 16, 16), 1),
              None),
             ("CNN with unbalanced conv output channels, per-tensor weights", _unbalanced_cnn(),
              _batches((8, 8, 16, 16), 1), per_tensor))
    for title, model, data, quantizer in cases:
        gm = qcore.capture(model, data[0])
        layers = [op.layer for op in qcore.find_quantizable_ops(gm)]
        before = measure_sqnr(gm, data, quantizer).layers
        after = measure_sqnr(equalize(gm, layers, data), data, quantizer).layers
        crossed = measure_sqnr(cross_layer_equalize(gm), data, quantizer).layers
        print(title)
        print(f"  {'layer':8} {'before':>9} {'input-weight':>13} {'gain':>8} {'cross-layer':>12} {'gain':>8}")
        for layer in layers:
            b, a, c = before[layer].sqnr_db, after[layer].sqnr_db, crossed[layer].sqnr_db
            print(f"  {layer:8} {b:7.1f} dB {a:10.1f} dB {a - b:+6.1f} dB {c:9.1f} dB {c - b:+6.1f} dB")


if __name__ == "__main__":
    main()
