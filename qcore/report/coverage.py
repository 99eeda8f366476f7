"""Expert coverage: how many calibration tokens each expert of a mixture-of-experts block received.

An expert no calibration token reaches gets no activation range (its static scales stay at their initial values)
and, in GPTQ, an empty Hessian: llm-compressor then writes its weights as zeros. The detector counts the rows
that reach each expert's first projection during the shared calibration pass; in a grouped capture
(qcore.graph.grouped), where a block's experts are one op a projection, it adds up the block's counts of each batch.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qcore.graph.experts import moe_blocks
from qcore.graph.grouped import GroupedOp, find_grouped_ops
from qcore.graph.ops import QuantizableOp, find_quantizable_ops
from qcore.report.detectors import DetectorBase, observer_name

__all__ = ["ExpertCoverageDetector", "ExpertTokenCounts", "TokenCounter"]


class TokenCounter(nn.Module):
    """Counts the tokens (rows of the last axis) it sees; a shape read, no device sync."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tokens += x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        self.batches += 1
        return x


class ExpertTokenCounts(nn.Module):
    """Adds up a grouped block's counts of the tokens each expert received ([E] a batch), on the device."""

    tokens: torch.Tensor

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.register_buffer("tokens", torch.zeros(experts, dtype=torch.long))
        self.batches = 0

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        """Add one batch's counts; returns them."""
        self.tokens += counts.to(self.tokens.device)
        self.batches += 1
        return counts


class ExpertCoverageDetector(DetectorBase):
    """Calibration tokens per expert of each MoE block: {block: {"tokens": [per expert], "experts": E, ...}}."""

    def get_detector_name(self) -> str:
        return "expert_coverage_detector"

    def layers(self, model: fx.GraphModule) -> list[QuantizableOp]:
        """Each expert's first projection (gate_proj, or up_proj for experts without a gate)."""
        firsts = {f"{block.path}.{expert}.{block.first_projection}"
                  for block in moe_blocks(model).values() for expert in range(block.experts)}
        return [op for op in find_quantizable_ops(model) if op.layer in firsts and op.activation_inputs]

    def grouped_firsts(self, model: fx.GraphModule) -> list[GroupedOp]:
        """A grouped capture's first projection of each block, whose counts are the block's."""
        blocks = moe_blocks(model)
        return [op for op in find_grouped_ops(model)
                if op.block in blocks and op.name == blocks[op.block].first_projection]

    def determine_observer_insert_points(self, model: fx.GraphModule) -> dict[str, dict[str, Any]]:
        points = {observer_name(op.layer, self.get_detector_name(), "pre"): self._point(
            op.node, op.activation_inputs[0], TokenCounter(), post=False) for op in self.layers(model)}
        points.update({observer_name(f"{op.block}.{op.name}", self.get_detector_name(), "pre"): self._point(
            op.node, op.counts, ExpertTokenCounts(op.experts), post=False) for op in self.grouped_firsts(model)})
        return points

    def generate_detector_report(self, model: fx.GraphModule) -> tuple[str, dict[str, Any]]:
        found: dict[str, Any] = {}
        for path, block in moe_blocks(model).items():
            grouped = self._observer(model, f"{path}.{block.first_projection}", "pre")
            if isinstance(grouped, ExpertTokenCounts):
                found[path] = {"tokens": grouped.tokens.tolist(), "experts": block.experts,
                               "batches": grouped.batches, "first_projection": block.first_projection}
                continue
            tokens = []
            for expert in range(block.experts):
                counter = self._observer(model, f"{path}.{expert}.{block.first_projection}", "pre")
                tokens.append(int(counter.tokens) if counter is not None else -1)
            batches = max((self._observer(model, f"{path}.{e}.{block.first_projection}", "pre") or TokenCounter()
                           ).batches for e in range(block.experts))
            found[path] = {"tokens": tokens, "experts": block.experts, "batches": batches,
                           "first_projection": block.first_projection}
        lines = [f"{path}: fewest tokens {min(entry['tokens'])} (expert {entry['tokens'].index(min(entry['tokens']))})"
                 for path, entry in found.items()]
        return "\n".join(lines), found
