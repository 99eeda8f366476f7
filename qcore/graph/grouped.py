"""One projection of every expert of an MoE block as one op, over the routed tokens sorted by expert.

A block's routed tokens arrive sorted by expert, each expert's run in token order, with the count of each run
(what `qcore.graph.experts` computes once per block). `grouped_linear` gives each run its expert's Linear: the
weight is the block's [E, out, in] parameter (or a view of it: a gate or up half, a transposed layout), the bias
[E, out]. It computes each run with its expert's `F.linear`, so that a graph holding a
projection as one node gives the values a graph holding one node per expert gives. `rows_of_experts` spreads a
per-expert tensor (an expert's qparams, its scales) over the rows of its run, for per-row computations on them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

__all__ = ["GROUPED_PREFIX", "GroupedOp", "find_grouped_ops", "grouped_linear", "linear_by_expert", "rows_of_experts"]

GROUPED_PREFIX = "grouped_"  # of the [E, out, in] views of the fused parameters a grouped capture reads


def _check(routed: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError for arguments that are not routed rows, one count per expert and one weight per expert."""
    if routed.dim() != 2 or weight.dim() != 3 or counts.dim() != 1:
        raise ValueError(f"grouped_linear takes routed rows [N, in], counts [E] and weights [E, out, in]; got "
                         f"{tuple(routed.shape)}, {tuple(counts.shape)} and {tuple(weight.shape)}")
    if counts.shape[0] != weight.shape[0] or routed.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_linear: {counts.shape[0]} counts and routed rows of {routed.shape[1]} features do "
                         f"not fit weights {tuple(weight.shape)} ([experts, out, in])")
    if counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_linear: the counts are {counts.dtype}, not an integer dtype")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:2]):
        raise ValueError(f"grouped_linear: a bias {tuple(bias.shape)} does not fit weights {tuple(weight.shape)}")


@torch.library.custom_op("qcore::grouped_linear", mutates_args=())
def _grouped_linear(routed: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    _check(routed, counts, weight, bias)
    return linear_by_expert(routed, counts, weight.__getitem__, weight.shape[1], bias)


def linear_by_expert(routed: torch.Tensor, counts: torch.Tensor, weight_of: Callable[[int], torch.Tensor],
                     out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's run of `routed` through F.linear with `weight_of(expert)` (asked only for an expert whose run
    has rows), concatenated: grouped_linear's values."""
    # one F.linear per expert, not torch's grouped product: F.linear picks its kernel by shape (a matrix-vector
    # product for one row or one output), and the grouped product's values differ from it there
    outputs = [F.linear(run, weight_of(expert), None if bias is None else bias[expert]) if run.shape[0]
               else run.new_empty((0, out_features)) for expert, run in enumerate(routed.split(counts.tolist()))]
    if not outputs:
        return routed.new_empty((0, out_features))
    return torch.cat(outputs)


@_grouped_linear.register_fake
def _(routed: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(routed, counts, weight, bias)
    return routed.new_empty((routed.shape[0], weight.shape[1]))


def grouped_linear(routed: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's Linear on its run of `routed` ([N, in], sorted by expert; `counts` [E] rows each): weight
    [E, out, in], bias [E, out] or None; [N, out], as one F.linear per expert gives it, bit for bit."""
    return torch.ops.qcore.grouped_linear(routed, counts, weight, bias)


def rows_of_experts(values: torch.Tensor, counts: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """`values` [E, ...] with each expert's entry repeated over the rows of its run ([N, ...]): an expert's
    qparams or scales per routed row. `rows`, the total of `counts` where known, spares a read of it."""
    return values.repeat_interleave(counts, dim=0, output_size=rows)


def scale_rows_by_expert(x: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`x`'s rows by expert ([N, in]) each multiplied by its expert's per-channel `scale` ([E, in]): input-weight
    equalization's mul before a grouped projection, one node that reads the counts."""
    return x * rows_of_experts(scale, counts, x.shape[0])


@dataclass(frozen=True)
class GroupedOp:
    """One grouped_linear node of a captured graph: which block and projection it is, and what it reads."""

    node: fx.Node
    block: str  # the experts module's path
    name: str  # the projection of each expert: "gate_proj", "up_proj" or "down_proj"
    routed: fx.Node
    counts: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    experts: int
    fused: str  # the fused parameter it reads: "gate_up_proj", "up_proj" or "down_proj"

    @property
    def item(self) -> str:
        """The name its items go by: the fused parameter's path (`block.gate_up_proj` for a gate or up half)."""
        return f"{self.block}.{self.fused}"

    @property
    def layer(self) -> str:
        """The projection's own name, the common path of its experts' layers (`block.down_proj`)."""
        return f"{self.block}.{self.name}"

    @property
    def layers(self) -> tuple[str, ...]:
        """Each expert's layer name, as the per-expert capture names it (`block.3.down_proj`)."""
        return tuple(f"{self.block}.{expert}.{self.name}" for expert in range(self.experts))


def find_grouped_ops(gm: fx.GraphModule) -> list[GroupedOp]:
    """The grouped_linear nodes of a graph captured with qcore.graph.experts.grouped_experts, in graph order, each
    named by the view of the fused parameters it reads (`block.grouped_down_proj`: block `block`, `down_proj`).
    ValueError for one whose weight is not such a view."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.qcore.grouped_linear.default:
            continue
        routed, counts, weight = node.args[:3]
        bias = node.args[3] if len(node.args) > 3 else None
        while weight.meta.get("qcore_inserted") == "observer" and weight.args:  # a prepared graph's weight observer
            weight = weight.args[0]
        # a converted graph's weight is its quantized copy, or its quantization where read, which names the float one
        float_weight = weight.meta.get("qcore_float_weight")
        target = str(float_weight if float_weight is not None else weight.target)
        block, _, attribute = target.rpartition(".") if weight.op == "get_attr" or float_weight is not None else (
            "", "", "")
        value = weight.meta.get("val")
        if not attribute.startswith(GROUPED_PREFIX) or value is None:
            raise ValueError(f"{node.name} reads {weight.name}, not a grouped projection's weight of the capture")
        found.append((node, block, attribute[len(GROUPED_PREFIX):], routed, counts, weight, bias, int(value.shape[0])))
    gated = {entry[1] for entry in found if entry[2] == "gate_proj"}
    return [GroupedOp(*entry, fused="down_proj" if entry[2] == "down_proj" else
                      "gate_up_proj" if entry[1] in gated else entry[2]) for entry in found]
