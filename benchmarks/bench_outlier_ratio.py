"""How often torch.ao's outlier heuristic names a channel without outliers, by the values a batch gives it.

The heuristic (qcore.report.OutlierDetector, torch.ao's) takes, per input channel and batch, the ratio of the
maximum to the 97.5th percentile (torch.quantile's "lower" interpolation), its magnitude either way, and names the
channel when the ratio averaged over the batches exceeds 3.5. An MoE expert's batch is the tokens its router sent it,
often a few. This prints, for one batch of n values per channel: the share of seeded draws whose ratio exceeds the
threshold, for standard normal values (no outliers) and for SwiGLU products silu(g) * u of two normals (a gated
MLP's down projection input, heavy-tailed), and the share of layers of 2048 such normal channels that one batch
names (1 - (1 - rate) ^ 2048). The outlier check's default expert_min_batch_tokens (percentile_estimate_tokens) is
where the normal rate vanishes.

    python benchmarks/bench_outlier_ratio.py [--draws 200000]
"""
from __future__ import annotations

import argparse

import torch

from qcore.report import percentile_estimate_tokens

THRESHOLD, PERCENTILE, CHANNELS = 3.5, 0.975, 2048
SIZES = (2, 4, 8, 16, 32, 40, 48, 64, 80, 96, 120, 128, 256, 512)
CHUNK = 20_000


def exceeding(n: int, draws: int, swiglu: bool, generator: torch.Generator) -> float:
    """The share of `draws` batches of n values whose q100 / q97.5 ratio exceeds the threshold."""
    hits = 0
    for start in range(0, draws, CHUNK):
        rows = min(CHUNK, draws - start)
        values = torch.randn(rows, n, generator=generator)
        if swiglu:
            values = torch.nn.functional.silu(torch.randn(rows, n, generator=generator)) * values
        reference = torch.quantile(values, PERCENTILE, dim=1, interpolation="lower")
        ratio = (values.amax(dim=1) / reference).abs()
        ratio = torch.where(ratio < 1, 1 / ratio, ratio)  # the detector's magnitude either way
        hits += int((ratio > THRESHOLD).sum())
    return hits / draws


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200_000)
    draws = parser.parse_args().draws
    generator = torch.Generator().manual_seed(0)
    print(f"q100 / q97.5 > {THRESHOLD} in one batch of n values, {draws:,} seeded draws each; "
          f"default expert_min_batch_tokens {percentile_estimate_tokens(PERCENTILE)}")
    print(f"{'n':>5} {'normal':>10} {'layer of ' + str(CHANNELS):>16} {'SwiGLU':>10}")
    for n in SIZES:
        normal = exceeding(n, draws, False, generator)
        swiglu = exceeding(n, draws, True, generator)
        print(f"{n:>5} {normal:>10.2e} {1 - (1 - normal) ** CHANNELS:>16.3f} {swiglu:>10.3f}")


if __name__ == "__main__":
    main()
