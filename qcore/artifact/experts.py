"""The fused experts of a mixture-of-experts checkpoint, expert by expert against the reference's.

transformers 5 loads an MoE checkpoint with its experts fused again (`mlp.experts.gate_up_proj` [E, 2I, H]) and,
for compressed-tensors checkpoints, dequantized to float at load time, so the quantized model holds plain float
parameters that differ from the reference's. Each expert's slice is compared with the reference's: its weight SQNR,
and whether the checkpoint holds it as zeros (GPTQ's expert that no calibration token reached) or as NaN or
infinite values. The experts' outputs are not compared layer by layer in artifact mode (the model outputs are).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from qcore.artifact.offload import module_tensor
from qcore.graph.experts import fused_experts_modules

__all__ = ["CheckpointExperts", "checkpoint_experts"]


@dataclass(frozen=True)
class CheckpointExperts:
    """One MoE block of a checkpoint: per fused parameter, each expert's weight SQNR against the reference's, and
    the experts the checkpoint holds as zeros or with values that are not finite."""

    block: str
    experts: int
    weight_sqnr_db: dict[str, list[float]] = field(default_factory=dict)  # {parameter: [per expert]}
    zeros: tuple[int, ...] = ()
    non_finite: tuple[int, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether any expert's weights differ from the reference's."""
        return any(not math.isinf(value) for values in self.weight_sqnr_db.values() for value in values)


def _sqnr_per_expert(reference: torch.Tensor, quantized: torch.Tensor) -> list[float]:
    """10 log10(|w|^2 / |w - q|^2) of each expert's slice (dim 0), in float64."""
    ref, act = reference.detach().double().flatten(1), quantized.detach().double().flatten(1)
    signal, noise = ref.pow(2).sum(1), (ref - act).pow(2).sum(1)
    values = torch.where(noise == 0, torch.full_like(noise, math.inf), 10 * torch.log10(signal / noise))
    return [float(v) for v in values.tolist()]


def checkpoint_experts(reference: nn.Module, quantized: nn.Module) -> dict[str, CheckpointExperts]:
    """{experts module path: CheckpointExperts} of the fused experts modules the two models share."""
    found = {}
    references = fused_experts_modules(reference)
    for path, module in fused_experts_modules(quantized).items():
        if path not in references:
            continue
        sqnr: dict[str, list[float]] = {}
        zeros: set[int] = set()
        non_finite: set[int] = set()
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() != 3:
                continue
            theirs = module_tensor(quantized, f"{path}.{name}")
            ours = module_tensor(reference, f"{path}.{name}")
            if theirs.shape != ours.shape:
                continue
            sqnr[name] = _sqnr_per_expert(ours, theirs)
            flat = theirs.detach().flatten(1)
            zeros.update(int(e) for e in (flat == 0).all(1).nonzero().flatten().tolist())
            non_finite.update(int(e) for e in (~torch.isfinite(flat)).any(1).nonzero().flatten().tolist())
        if sqnr:
            found[path] = CheckpointExperts(path, int(module_tensor(quantized, f"{path}.down_proj").shape[0]), sqnr,
                                            tuple(sorted(zeros)), tuple(sorted(non_finite)))
    return found
