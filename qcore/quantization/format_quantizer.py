"""A quantizer for the deployed formats (qcore.formats.presets): it annotates each weighted layer (linear, conv,
addmm) with its preset's weight format and, unless the preset is weight-only, its activation format on the layer's
input. Layer outputs stay in float: the next layer quantizes its own input, as deployed kernels do.

Prepare gives each annotated tensor a FormatObserver: a static activation scale (FP8 per tensor, NVFP4's global
scale) needs the calibration amax, which it keeps as it streams; dynamic formats and weights need nothing (their
scales come from the tensor itself). Convert replaces weights by their fake-quantized values and puts a
FormatFakeQuantize on each quantized activation.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx, nn

from qcore.formats.presets import Preset, TensorFormat, preset
from qcore.graph.grouped import GroupedOp, find_grouped_ops
from qcore.graph.ops import find_quantizable_ops, layer_patterns
from qcore.observe.observers import ObserverBase
from qcore.observe.segmented import observe_runs
from qcore.quantization.quantizer import ANNOTATION_KEY, QuantizationAnnotation, QuantizationSpec, Quantizer

__all__ = ["FORMAT_KINDS", "FORMAT_REFUSAL_KEY", "FormatFakeQuantize", "FormatObserver", "FormatQuantizer",
           "PerExpertFormatObservers", "fake_quantize_format", "fake_quantize_format_per_expert",
           "fake_quantize_weight", "follows_rows", "format_spec", "layer_shapes", "preset_refusal"]

FORMAT_REFUSAL_KEY = "qcore_format_refusal"  # on a layer's node: why its shapes cannot take its format
# addmm(bias, x, W) is a linear whose weight W is stored [in, out] (transformers' Conv1D: GPT-2's layers)
FORMAT_KINDS = ("linear", "conv", "addmm")


def format_spec(tensor_format: TensorFormat, *, weight: bool = False, transposed: bool = False,
                experts: bool = False) -> QuantizationSpec:
    """The QuantizationSpec of a tensor in a deployed format (its observer is a FormatObserver; a weight's keeps
    nothing, since convert takes its scales from the weight itself). `transposed`: a weight stored [in, out];
    `experts`: an [E, out, in] grouped projection's weight."""
    observer = functools.partial(FormatObserver, keep_amax=False, transposed=transposed, grouped_weight=experts) \
        if weight else FormatObserver
    return QuantizationSpec(torch.int8, observer, is_dynamic=tensor_format.dynamic, format=tensor_format)


def fake_quantize_weight(tensor_format: TensorFormat, weight: torch.Tensor, transposed: bool = False,
                         experts: bool = False) -> torch.Tensor:
    """A weight quantized to its format and back, its blocks along the input dimension: the rows of an [out, in]
    weight, or the columns of one stored [in, out] (`transposed`); with `experts`, an [E, out, in] grouped
    projection's weight, each expert's [out, in] as its Linear's."""
    if experts and follows_rows(tensor_format, weight=True):  # one pass over every expert's rows
        return tensor_format.fake_quantize(weight.reshape(-1, weight.shape[-1]), weight=True).reshape(weight.shape)
    if experts:  # a scale over each expert's whole weight, or blocks across its rows: expert by expert
        return torch.stack([tensor_format.fake_quantize(expert, weight=True) for expert in weight.unbind(0)])
    if transposed:
        return tensor_format.fake_quantize(weight.t(), weight=True).t()
    return tensor_format.fake_quantize(weight, weight=True)


class FormatObserver(ObserverBase):
    """Keeps the running amax of a tensor whose format has a static scale; passes everything else through."""

    def __init__(self, tensor_format: TensorFormat, keep_amax: bool = True, transposed: bool = False,
                 grouped_weight: bool = False) -> None:
        super().__init__(is_dynamic=tensor_format.dynamic)
        self.format = tensor_format
        self.transposed = transposed  # a weight stored [in, out]
        self.grouped_weight = grouped_weight  # an [E, out, in] grouped projection's: quantized by its experts' rows
        # static scales: NVFP4's global scale (its block scales are dynamic) and FP8 per tensor, unless dynamic
        self.static = keep_amax and (tensor_format.scale_format == "e4m3" or (
            not tensor_format.dynamic and tensor_format.element == "float8_e4m3fn"
            and tensor_format.granularity == "tensor"))
        self.amax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        if self.static and not self.frozen:
            low, high = torch.aminmax(x.detach())  # no |x| copy of the activation, on every calibration batch
            seen = torch.maximum(-low, high).to(torch.float32)
            if self.amax is None:
                self.amax = seen
            else:
                torch.maximum(self.amax, seen, out=self.amax)
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A format's scales are not one scale and zero point: see FormatFakeQuantize."""
        raise RuntimeError("a deployed format has no single (scale, zero_point); FormatFakeQuantize applies it")


class FormatFakeQuantize(nn.Module):
    """An activation quantized to its format and back, with the calibration amax of a static scale."""

    def __init__(self, tensor_format: TensorFormat, amax: torch.Tensor | None) -> None:
        super().__init__()
        self.format = tensor_format
        self.register_buffer("amax", None if amax is None else amax.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch: nothing to see
            return x
        return self.format.fake_quantize(x, self.amax)


def fake_quantize_format(x: torch.Tensor, quantize: FormatFakeQuantize) -> torch.Tensor:
    """The graph's call for a quantized activation (a function, so that sensitivity can switch it off)."""
    return quantize(x)


class PerExpertFormatObservers(ObserverBase):
    """The input observers of a grouped projection's experts in a format with a static activation scale (FP8's per
    tensor, NVFP4's global one): one FormatObserver per expert, each called on its expert's rows alone, as the
    per-expert graph observes each expert's input. It reads the counts to the host once a batch."""

    def __init__(self, tensor_format: TensorFormat, experts: int) -> None:
        super().__init__(is_dynamic=True)  # no qparams for convert to read: each expert's amax, as its format's
        self.format = tensor_format
        self.per_expert = nn.ModuleList([FormatObserver(tensor_format) for _ in range(experts)])

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Give each expert's observer its run of `x`'s rows (`counts` rows each); returns x."""
        observe_runs(dict(enumerate(self.per_expert)), x, counts)
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A format's scales are not one scale and zero point: see FormatFakeQuantize."""
        raise RuntimeError("a deployed format has no single (scale, zero_point); FormatFakeQuantize applies it")

    def fake_quantizers(self) -> nn.ModuleList:
        """Each expert's FormatFakeQuantize, with the amax its observer saw (None where no batch reached it)."""
        return nn.ModuleList([FormatFakeQuantize(observer.format, observer.amax) for observer in self.per_expert])


def fake_quantize_format_per_expert(x: torch.Tensor, counts: torch.Tensor, quantizers: nn.ModuleList) -> torch.Tensor:
    """Each expert's run of `x`'s rows quantized to its format with its expert's own static scale."""
    runs = x.split(counts.tolist())
    return torch.cat([quantize(run) for quantize, run in zip(quantizers, runs, strict=True)])


class FormatQuantizer(Quantizer):
    """Annotates linear, conv and addmm layers with a preset's formats.

    `layer_overrides` maps layer or FQN globs to {"format": preset name} or {"skip": True} (stay in float); later
    entries win. A layer whose weight or input cannot take its format (a dimension that is not a multiple of the
    format's block) stays in float, with the reason under FORMAT_REFUSAL_KEY in its node's meta.
    """

    def __init__(self, default: str | Preset = "W8A8", layer_overrides: dict[str, dict] | None = None) -> None:
        self.preset = default if isinstance(default, Preset) else preset(default)
        self.layer_overrides = dict(layer_overrides or {})
        for override in self.layer_overrides.values():
            if "format" in override:
                preset(override["format"])  # an unknown name fails here, with the closest one

    def __repr__(self) -> str:
        return f"FormatQuantizer({self.preset.name!r}, layer_overrides={self.layer_overrides!r})"

    def layer_preset(self, fqn: str, layer: str, item: str = "") -> Preset | None:
        """The preset of one layer (None: kept in float); `item`, the name of the item it is measured under (an MoE
        expert's projection path), which a layer_overrides glob may name too."""
        chosen: Preset | None = self.preset
        for pattern in layer_patterns(tuple(self.layer_overrides)).matching(layer, fqn, item):
            override = self.layer_overrides[pattern]
            if override.get("skip"):
                chosen = None
            elif "format" in override:
                chosen = preset(override["format"])
        return chosen

    def annotate(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Annotate every weighted linear, conv and addmm layer with its preset's weight and input formats, and each
        grouped projection of a grouped capture (_annotate_grouped)."""
        for grouped in find_grouped_ops(gm):
            self._annotate_grouped(grouped)
        for op in find_quantizable_ops(gm):
            if op.kind not in FORMAT_KINDS or op.weight is None:
                continue
            chosen = self.layer_preset(op.fqn, op.layer, op.item)
            if chosen is None:
                continue
            refusal = preset_refusal(chosen, *layer_shapes(op))
            if refusal:
                op.node.meta[FORMAT_REFUSAL_KEY] = f"{chosen.name}: {refusal}"
                continue
            inputs: dict = {op.weight: format_spec(chosen.weight, weight=True, transposed=op.kind == "addmm")}
            if chosen.activation is not None:
                inputs.update({a: format_spec(chosen.activation) for a in op.activation_inputs})
            # no implicit sharing: two layers reading one tensor may quantize it to different formats
            op.node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=None,
                                                                  allow_implicit_sharing=False, _annotated=True)
        return gm


    def _annotate_grouped(self, op: GroupedOp) -> None:
        """A grouped projection in its experts' preset, each expert's weight and routed rows as its Linear's would
        be (an activation scale over a whole tensor, FP8's or NVFP4's global one, observed and applied expert by
        expert). ValueError, naming the projection, for experts given different presets or shapes the preset
        refuses: left in float, the experts would pass for quantized."""
        chosen = {self.layer_preset(op.block, layer, op.item) for layer in op.layers}
        if chosen == {None}:
            return
        if len(chosen) > 1:
            raise ValueError(f"{op.item}: its experts are given different formats, which a grouped capture does not "
                             "take yet; capture the model with one layer per expert")
        found = chosen.pop()
        assert found is not None
        weight = op.weight.meta["val"]
        refusal = preset_refusal(found, tuple(weight.shape[1:]), [(-1, int(weight.shape[2]))])
        if refusal:
            raise ValueError(f"{op.item}: {found.name}: {refusal}")
        inputs: dict = {op.weight: format_spec(found.weight, weight=True, experts=True)}
        if found.activation is not None and follows_rows(found.activation, weight=False):
            inputs[op.routed] = format_spec(found.activation)  # every expert's rows at once give each its own
        elif found.activation is not None:  # a scale over each expert's whole input: one observer per expert
            inputs[op.routed] = QuantizationSpec(
                torch.int8, functools.partial(PerExpertFormatObservers, experts=op.experts),
                is_dynamic=found.activation.dynamic, format=found.activation, experts=op.counts)
        op.node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=None,
                                                              allow_implicit_sharing=False, _annotated=True)


def follows_rows(tensor_format: TensorFormat, weight: bool) -> bool:
    """Whether a format's scales follow the rows of what it quantizes (per output row or group of a row of a
    weight; per token or group of a row of an activation): the rows of every expert of a grouped projection, taken
    together, then give each expert's values."""
    if FormatObserver(tensor_format).static:  # a scale over the whole tensor (FP8's, NVFP4's global one)
        return False
    return tensor_format.granularity in (("axis", "group") if weight else ("token", "group"))


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if value is None:
        value = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    shape = getattr(value, "shape", None)
    return tuple(_size(size) for size in shape) if shape is not None else None


def _size(size: Any) -> int:
    """A dimension's size, or -1 where only the data decides it (the tokens routed to one expert)."""
    try:
        return int(size)
    except Exception:  # noqa: BLE001 - torch's data-dependent-size errors have no common public base
        return -1


def layer_shapes(op: Any) -> tuple[tuple[int, ...] | None, list[tuple[int, ...]]]:
    """(the layer's weight shape, its inputs' shapes), as far as the graph knows them."""
    return _weight_shape(op), [shape for node in op.activation_inputs if (shape := _shape(node))]


def preset_refusal(chosen: Preset, weight: tuple[int, ...] | None, inputs: list[tuple[int, ...]]) -> str:
    """Why a layer with these weight and input shapes cannot take the preset's formats ("" when it can)."""
    problem = chosen.weight.refusal(weight, weight=True) if weight is not None else ""
    if problem:
        return f"its weight {list(weight)}: {problem}"  # type: ignore[arg-type]
    for shape in inputs if chosen.activation is not None else ():
        problem = chosen.activation.refusal(shape)  # type: ignore[union-attr]
        if problem:
            return f"its input {list(shape)}: {problem}"
    return ""


def _weight_shape(op: Any) -> tuple[int, ...] | None:
    shape = _shape(op.weight)
    if shape is None and op.weight.op == "get_attr":
        root = op.weight.graph.owning_module
        value: Any = root
        for part in str(op.weight.target).split("."):
            value = getattr(value, part, None)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    if shape is not None and op.kind == "addmm":  # stored [in, out]: read as [out, in]
        shape = shape[::-1]
    return shape
