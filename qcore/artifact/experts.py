"""The fused experts of a mixture-of-experts checkpoint, expert by expert against the reference's.

transformers 5 loads an MoE checkpoint with its experts fused again (`mlp.experts.gate_up_proj` [E, 2I, H]) and,
for compressed-tensors checkpoints, dequantized to float at load time, so the quantized model holds plain float
parameters that differ from the reference's. Each expert's slice is compared with the reference's: its weight SQNR,
and whether the checkpoint holds it as zeros (GPTQ's expert that no calibration token reached) or as NaN or
infinite values. A checkpoint that holds its experts as modules (llm-compressor's linearized model, quantized) is
read expert by expert the same way, from each layer's dequantized weight; those layers are also measured as layers
(qcore.artifact.measure compares each on the reference's tokens).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qcore.artifact.offload import module_tensor
from qcore.artifact.tools import dequantized_weight
from qcore.artifact.weights import WeightFit, weight_fit
from qcore.graph.experts import ExpertLayer, expert_linears, fused_experts_modules, module_list_experts

__all__ = ["CheckpointExperts", "checkpoint_experts", "checkpoint_experts_from_fits", "paired_expert_blocks"]


@dataclass(frozen=True)
class CheckpointExperts:
    """One MoE block of a checkpoint: per fused parameter, each expert's weight SQNR against the reference's, and
    the experts the checkpoint holds as zeros or with values that are not finite."""

    block: str
    experts: int
    weight_sqnr_db: dict[str, list[float]] = field(default_factory=dict)  # {parameter: [per expert]}
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


def _sqnr_per_expert(reference: torch.Tensor, quantized: torch.Tensor) -> list[float]:
    """10 log10(|w|^2 / |w - q|^2) of each expert's slice (dim 0), in float64."""
    ref, act = reference.detach().double().flatten(1), quantized.detach().double().flatten(1)
    signal, noise = ref.pow(2).sum(1), (ref - act).pow(2).sum(1)
    values = torch.where(noise == 0, torch.full_like(noise, math.inf), 10 * torch.log10(signal / noise))
    return [float(v) for v in values.tolist()]


def _scale_fit_per_expert(reference: torch.Tensor, quantized: torch.Tensor) -> list[tuple[float, float]]:
    """Per expert slice (dim 0): the factor s that best maps the reference's weight onto the checkpoint's (least
    squares), and the reference's SQNR against the checkpoint's weight divided by s, in float64."""
    ref, act = reference.detach().double().flatten(1), quantized.detach().double().flatten(1)
    signal = ref.pow(2).sum(1)
    factor = (ref * act).sum(1) / signal.clamp_min(torch.finfo(torch.float64).tiny)
    safe = torch.where(factor == 0, torch.ones_like(factor), factor)
    noise = (ref - act / safe.unsqueeze(1)).pow(2).sum(1)
    fitted = torch.where(noise == 0, torch.full_like(noise, math.inf), 10 * torch.log10(signal / noise))
    return [(float(f), float(d)) for f, d in zip(factor.tolist(), fitted.tolist(), strict=True)]


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
    sqnr: dict[str, list[float]] = {}
    fits: dict[str, list[tuple[float, float]]] = {}
    zeros: set[int] = set()
    non_finite: set[int] = set()
    for expert, module in experts.items():
        ours = _reference_weights(reference, path, fused, held, expert)
        for name, layer in module.named_modules():
            theirs = dequantized_weight(layer) if name in ours else None
            if theirs is None or theirs.numel() != ours[name].numel():
                continue
            fit = weight_fit(ours[name], theirs.detach().reshape(ours[name].shape))
            position = list(experts).index(expert)
            sqnr.setdefault(name, [math.nan] * len(experts))[position] = fit.sqnr_db
            fits.setdefault(name, [(math.nan, math.nan)] * len(experts))[position] = (fit.factor, fit.fitted_db)
            if fit.zeros:
                zeros.add(expert)
            if not fit.finite:
                non_finite.add(expert)
    if not sqnr:
        return None
    return CheckpointExperts(path, len(experts), sqnr, tuple(sorted(zeros)), tuple(sorted(non_finite)), fits)


def paired_expert_blocks(reference: nn.Module, quantized: nn.Module) -> list[str]:
    """The experts modules checkpoint_experts compares, found by the models' structure alone (no weight is read)."""
    references = {**fused_experts_modules(reference), **module_list_experts(reference)}
    held = [path for path in module_list_experts(quantized) if path in references]
    return held + [path for path in fused_experts_modules(quantized) if path in references and path not in held]


def checkpoint_experts_from_fits(fits: Mapping[str, WeightFit], experts: Mapping[str, ExpertLayer]
                                 ) -> dict[str, CheckpointExperts]:
    """{experts module path: CheckpointExperts} from each expert layer's weight fit, measured while its block was
    onloaded (a block-wise pass): the numbers _held_block reads from the models, without reading them again."""
    blocks: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    for entry in experts.values():
        counts[entry.block] = max(counts.get(entry.block, 0), entry.expert + 1)
    for layer, fit in fits.items():
        found = experts.get(layer)
        if found is None:
            continue
        entry = found
        count, name = counts[entry.block], layer.rsplit(".", 1)[1]
        block = blocks.setdefault(entry.block, {"sqnr": {}, "fits": {}, "zeros": set(), "non_finite": set()})
        block["sqnr"].setdefault(name, [math.nan] * count)[entry.expert] = fit.sqnr_db
        block["fits"].setdefault(name, [(math.nan, math.nan)] * count)[entry.expert] = (fit.factor, fit.fitted_db)
        if fit.zeros:
            block["zeros"].add(entry.expert)
        if not fit.finite:
            block["non_finite"].add(entry.expert)
    return {path: CheckpointExperts(path, counts[path], block["sqnr"], tuple(sorted(block["zeros"])),
                                    tuple(sorted(block["non_finite"])), block["fits"])
            for path, block in blocks.items()}


def _with_expert_quantizers(module: nn.Module, name: str, weights: torch.Tensor, experts: slice) -> torch.Tensor:
    """Experts `experts` of a fused parameter as they compute with it: through each expert's own weight quantizer
    where a tool keeps one per expert beside the float parameter (ModelOpt's `<name>_weight_quantizers`), else as
    stored."""
    quantizers = getattr(module, f"{name}_weight_quantizers", None)
    if not isinstance(quantizers, nn.ModuleList) or len(quantizers) != getattr(module, name).shape[0]:
        return weights
    with torch.no_grad():
        return torch.stack([quantizer(weight) for quantizer, weight
                            in zip(list(quantizers)[experts], weights, strict=True)])


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


CHUNK_ELEMENTS = 1 << 23  # a chunk of experts compared at once (float64): its memory, not the block's


def _fused_block(path: str, module: nn.Module, down: torch.Tensor, reference: nn.Module,
                 quantized: nn.Module) -> CheckpointExperts | None:
    """One block whose two models hold their experts fused, compared a chunk of experts at a time (each fused
    parameter read from its offload once, where the models are offloaded)."""
    sqnr: dict[str, list[float]] = {}
    fits: dict[str, list[tuple[float, float]]] = {}
    zeros: set[int] = set()
    non_finite: set[int] = set()
    for name, parameter in module.named_parameters(recurse=False):
        if parameter.dim() != 3:
            continue
        theirs_all, ours_all = module_tensor(quantized, f"{path}.{name}"), module_tensor(reference, f"{path}.{name}")
        if theirs_all.shape != ours_all.shape:
            continue
        count = theirs_all.shape[0]
        step = max(1, CHUNK_ELEMENTS // max(1, theirs_all[0].numel()))
        sqnr[name], fits[name] = [], []
        for start in range(0, count, step):
            chunk = slice(start, min(count, start + step))
            theirs = _with_expert_quantizers(module, name, theirs_all[chunk], chunk)
            ours = ours_all[chunk]
            sqnr[name] += _sqnr_per_expert(ours, theirs)
            fits[name] += _scale_fit_per_expert(ours, theirs)
            flat = theirs.detach().flatten(1)
            zeros.update(start + int(e) for e in (flat == 0).all(1).nonzero().flatten().tolist())
            non_finite.update(start + int(e) for e in (~torch.isfinite(flat)).any(1).nonzero().flatten().tolist())
    if not sqnr:
        return None
    return CheckpointExperts(path, int(down.shape[0]), sqnr, tuple(sorted(zeros)), tuple(sorted(non_finite)), fits)
