"""Per-layer SQNR before and after input-weight (and cross-layer) equalization, and the gain in dB.

The models' input channels span four orders of magnitude (a sensor-style MLP and a small CNN whose input
channels are scaled alike), with the default quantizer (int8, per-channel weights, min/max activations); a
third case has unbalanced conv output channels and per-tensor weights, where cross-layer equalization helps.

Smoothing (qcore.rewrites.equalize.smooth) on the BERT-style example (examples/models.py TinyEncoder: pre-norm, HF-style
input_ids/attention_mask), made realistic by giving a few hidden channels of every LayerNorm large gains, as
trained BERTs have: per-layer shadow SQNR before and after sqrt equalization, smoothing with alpha 0.5 and with
a searched alpha; the median gain on the smoothed layers; each group's searched alpha against 0.5; the float
equivalence error; the search time against one plain analysis. Then transformers' BertModel (post-norm), where
LayerNorm outputs also feed residual adds, so only the attention output projections can be smoothed.

    python benchmarks/bench_equalization.py
"""
from __future__ import annotations

import torch
from torch import nn

import qcore
from qcore.analysis import measure_sqnr
from qcore.rewrites.equalize import cross_layer_equalize, equalize


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


def _encoder():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    from models import TinyEncoder, seeded

    model = seeded(lambda: TinyEncoder(dim=128, heads=4, layers=4))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight[[3, 17, 90]] *= 30.0
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(8):
        mask = torch.ones(8, 48, dtype=torch.long)
        mask[:, 40:] = 0
        batches.append({"input_ids": torch.randint(0, 1000, (8, 48), generator=g), "attention_mask": mask})
    return model.eval(), batches


def _relative_error(reference, candidate, batches) -> float:
    with torch.no_grad():
        return max(float((candidate(**b) - reference(**b)).abs().max() / reference(**b).abs().max()) for b in batches)


def smoothing_on_the_encoder() -> None:
    import statistics
    import time

    from qcore.analysis import ModelAnalysis
    from qcore.rewrites.smoothing import smooth

    torch.set_num_threads(2)
    model, batches = _encoder()
    gm = qcore.capture(model, batches[0])
    start = time.perf_counter()
    ModelAnalysis(gm, batches=batches).sqnr  # noqa: B018 - one plain analysis, for scale
    analysis_seconds = time.perf_counter() - start
    before = measure_sqnr(gm, batches).layers
    linear = [op.layer for op in qcore.find_quantizable_ops(gm) if op.kind == "linear"]
    sqrt_equalized = measure_sqnr(equalize(gm, linear, batches), batches).layers
    half = smooth(gm, batches, 0.5)
    start = time.perf_counter()
    searched = smooth(gm, batches, "search")
    search_seconds = time.perf_counter() - start
    after_half, after_search = measure_sqnr(half, batches).layers, measure_sqnr(searched, batches).layers
    smoothed = [layer for group in searched.meta["qcore_smoothing"] for layer in group["layers"]]
    print("BERT-style encoder (TinyEncoder 4 x 128, LayerNorm gains x30 on 3 channels): shadow SQNR (dB)")
    print(f"  {'layer':22} {'before':>7} {'sqrt eq.':>9} {'smooth 0.5':>11} {'smooth search':>14}")
    for layer in before:
        if layer in smoothed or layer in sqrt_equalized:
            print(f"  {layer:22} {before[layer].shadow_sqnr_db:7.1f} {sqrt_equalized[layer].shadow_sqnr_db:9.1f} "
                  f"{after_half[layer].shadow_sqnr_db:11.1f} {after_search[layer].shadow_sqnr_db:14.1f}")
    gains = {layer: after_search[layer].shadow_sqnr_db - before[layer].shadow_sqnr_db for layer in smoothed}
    half = statistics.median(after_half[k].shadow_sqnr_db - before[k].shadow_sqnr_db for k in smoothed)
    print(f"  median gain on the {len(smoothed)} smoothed layers: search {statistics.median(gains.values()):+.1f} dB, "
          f"alpha 0.5 {half:+.1f} dB")
    for group in searched.meta["qcore_smoothing"]:
        layers = group["layers"]
        search_db = sum(after_search[k].shadow_sqnr_db for k in layers) / len(layers)
        half_db = sum(after_half[k].shadow_sqnr_db for k in layers) / len(layers)
        print(f"  group {','.join(layers):48} <- {group['producer']:16} alpha {group['alpha']:.1f}: "
              f"{search_db:5.1f} dB vs {half_db:5.1f} dB at 0.5 ({search_db - half_db:+.2f})")
    print(f"  float equivalence: {_relative_error(gm, searched, batches):.2e} relative (alpha 0.5: "
          f"{_relative_error(gm, half, batches):.2e}); refused: {searched.meta['qcore_smoothing_refused']}")
    print(f"  search time {search_seconds:.2f} s = {search_seconds / analysis_seconds:.2f}x one plain analysis "
          f"({analysis_seconds:.2f} s)")


def smoothing_on_hf_bert() -> None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipping BertModel")
        return
    from qcore.rewrites.smoothing import smooth

    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=512, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 1000, (4, 48), generator=g),
                "attention_mask": torch.ones(4, 48, dtype=torch.long)} for _ in range(4)]
    gm = qcore.capture(model, batches[0])
    searched = smooth(gm, batches, "search")
    groups = searched.meta["qcore_smoothing"]
    reasons = sorted({reason.split(",")[0] for reason in searched.meta["qcore_smoothing_refused"].values()})
    print(f"transformers BertModel (post-norm, 4 layers): {len(groups)} groups smoothed "
          f"({', '.join(sorted({g['producer'] for g in groups}))}); "
          f"{len(searched.meta['qcore_smoothing_refused'])} layers refused: {reasons}")


if __name__ == "__main__":
    main()
    smoothing_on_the_encoder()
    smoothing_on_hf_bert()
