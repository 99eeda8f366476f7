"""The fused experts of a mixture-of-experts checkpoint, expert by expert against the reference's.

transformers 5 loads an MoE checkpoint with its experts fused again (`mlp.experts.gate_up_proj` [E, 2I, H]) and,
for compressed-tensors checkpoints, dequantized to float at load time, so the quantized model holds plain float
parameters that differ from the reference's; the analysis reads them through views that hold each expert's
projections as modules. Each expert's slice is compared with the reference's (qcore.artifact.weights): its weight
SQNR, and whether the checkpoint holds it as zeros (GPTQ's expert that no calibration token reached) or as NaN or
infinite values. A checkpoint that holds its experts as modules (llm-compressor's linearized model, quantized) is
read expert by expert the same way, from each layer's dequantized weight; those layers are also measured as layers
(qcore.artifact.measure compares each on the reference's tokens).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from qcore.artifact.offload import module_tensor
from qcore.artifact.tools import dequantized_weight
from qcore.artifact.weights import WeightFit, weight_fit
from qcore.graph.experts import ExpertLayer, expert_linears, fused_experts_modules, module_list_experts

__all__ = ["CheckpointExperts", "checkpoint_experts", "checkpoint_experts_from_fits", "paired_expert_blocks"]


@dataclass(frozen=True)
class CheckpointExperts:
    """One MoE block of a checkpoint: per projection (per fused parameter where a tool quantizes the fused experts
    in place), each expert's weight SQNR against the reference's, and the experts the checkpoint holds as zeros or
    with values that are not finite."""

    block: str
    experts: int
    weight_sqnr_db: dict[str, list[float]] = field(default_factory=dict)  # {projection: [per expert]}
    zeros: tuple[int, ...] = ()
    non_finite: tuple[int, ...] = ()
    # {parameter: [per expert (s, SQNR of the reference against the checkpoint's weight divided by s)]}: s the least
    # squares factor of the checkpoint's weight on the reference's (1 for a sound one; a loader that applies a scale
    # the wrong way gives every expert one far from 1, with a high SQNR once divided out)
    scale_fit: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """Whether any expert's weights differ from the reference's."""
        return any(not math.isinf(value) for values in self.weight_sqnr_db.values() for value in values)


def _assembled(path: str, count: int, fits: Iterable[tuple[int, str, WeightFit]]) -> CheckpointExperts | None:
    """One block's CheckpointExperts from (expert position, projection or parameter, its WeightFit) triples; None
    when there are none."""
    sqnr: dict[str, list[float]] = {}
    scale_fit: dict[str, list[tuple[float, float]]] = {}
    zeros: set[int] = set()
    non_finite: set[int] = set()
    for position, name, fit in fits:
        sqnr.setdefault(name, [math.nan] * count)[position] = fit.sqnr_db
        scale_fit.setdefault(name, [(math.nan, math.nan)] * count)[position] = (fit.factor, fit.fitted_db)
        if fit.zeros:
            zeros.add(position)
        if not fit.finite:
            non_finite.add(position)
    if not sqnr:
        return None
    return CheckpointExperts(path, count, sqnr, tuple(sorted(zeros)), tuple(sorted(non_finite)), scale_fit)


def _reference_weights(reference: nn.Module, path: str, fused: nn.Module | None, held: dict[int, nn.Module],
                       expert: int) -> dict[str, torch.Tensor]:
    """{projection: [out, in] weight} of the reference's expert `expert`, held as modules or fused (read from
    the offload where the reference is offloaded)."""
    if expert in held:
        return {name: module_tensor(reference, f"{path}.{expert}.{name}.weight")
                for name, module in held[expert].named_modules()
                if isinstance(getattr(module, "weight", None), torch.Tensor)}
    if fused is not None:
        return {name: module.weight for name, module in expert_linears(fused, expert).named_children()}
    return {}


def _held_block(reference: nn.Module, path: str, experts: dict[int, nn.Module], fused: nn.Module | None,
                held: dict[int, nn.Module]) -> CheckpointExperts | None:
    """One block whose checkpoint holds its experts as modules (a tool's quantized layers), against the
    reference's experts (held as modules or fused); None when none pairs."""
    fits = []
    for position, (expert, module) in enumerate(experts.items()):
        ours = _reference_weights(reference, path, fused, held, expert)
        for name, layer in module.named_modules():
            theirs = dequantized_weight(layer) if name in ours else None
            if theirs is not None and theirs.numel() == ours[name].numel():
                fits.append((position, name, weight_fit(ours[name], theirs.detach().reshape(ours[name].shape))))
    return _assembled(path, len(experts), fits)


def paired_expert_blocks(reference: nn.Module, quantized: nn.Module) -> list[str]:
    """The experts modules checkpoint_experts compares, found by the models' structure alone (no weight is read)."""
    references = {**fused_experts_modules(reference), **module_list_experts(reference)}
    held = [path for path in module_list_experts(quantized) if path in references]
    return held + [path for path in fused_experts_modules(quantized) if path in references and path not in held]


def checkpoint_experts_from_fits(fits: Mapping[str, WeightFit], experts: Mapping[str, ExpertLayer]
                                 ) -> dict[str, CheckpointExperts]:
    """{experts module path: CheckpointExperts} from each expert layer's weight fit, measured while its block was
    onloaded (a block-wise pass): the numbers _held_block reads from the models, without reading them again."""
    counts: dict[str, int] = {}
    for entry in experts.values():
        counts[entry.block] = max(counts.get(entry.block, 0), entry.expert + 1)
    by_block: dict[str, list[tuple[int, str, WeightFit]]] = {}
    for layer, fit in fits.items():
        if layer in experts:
            entry = experts[layer]
            by_block.setdefault(entry.block, []).append((entry.expert, layer.rsplit(".", 1)[1], fit))
    found = {path: _assembled(path, counts[path], block) for path, block in by_block.items()}
    return {path: block for path, block in found.items() if block is not None}


def _as_computed(module: nn.Module, name: str, weight: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert `expert`'s slice of fused parameter `name` as it computes with it: through its own weight quantizer
    where a tool keeps one per expert beside the float parameter (ModelOpt's `<name>_weight_quantizers`), else as
    stored."""
    quantizers = getattr(module, f"{name}_weight_quantizers", None)
    if not isinstance(quantizers, nn.ModuleList) or len(quantizers) != getattr(module, name).shape[0]:
        return weight
    with torch.no_grad():
        return quantizers[expert](weight)


def checkpoint_experts(reference: nn.Module, quantized: nn.Module) -> dict[str, CheckpointExperts]:
    """{experts module path: CheckpointExperts} of the experts modules the two models share: fused on both sides,
    or held as modules by the checkpoint (against the reference's, held as modules or fused)."""
    found = {}
    references = fused_experts_modules(reference)
    held_references = module_list_experts(reference)
    for path, experts in module_list_experts(quantized).items():
        if path in references or path in held_references:
            block = _held_block(reference, path, experts, references.get(path), held_references.get(path, {}))
            if block is not None:
                found[path] = block
    for path, module in fused_experts_modules(quantized).items():
        if path not in references or path in found:
            continue
        block = _fused_block(path, module, module_tensor(reference, f"{path}.down_proj"), reference, quantized)
        if block is not None:
            found[path] = block
    return found


def _fused_block(path: str, module: nn.Module, down: torch.Tensor, reference: nn.Module,
                 quantized: nn.Module) -> CheckpointExperts | None:
    """One block whose two models hold their experts fused, compared expert by expert (each fused parameter read
    from its offload once, where the models are offloaded)."""
    fits = []
    for name, parameter in module.named_parameters(recurse=False):
        if parameter.dim() != 3:
            continue
        theirs, ours = module_tensor(quantized, f"{path}.{name}"), module_tensor(reference, f"{path}.{name}")
        if theirs.shape != ours.shape:
            continue
        for expert in range(theirs.shape[0]):
            fits.append((expert, name, weight_fit(ours[expert], _as_computed(module, name, theirs[expert], expert))))
    return _assembled(path, int(down.shape[0]), fits)
