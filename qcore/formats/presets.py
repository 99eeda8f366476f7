"""The deployed quantization presets, by the compressed-tensors names vLLM users know (W8A8, W4A16, FP8, NVFP4, ...),
each a weight format and an activation format (None: the activation stays in float), with fake quantization in
that format (qcore.formats.numerics' numerics, torchao's).

Weights are `[out, in]` (a conv weight is read as `[out, in * kernel]`); groups and blocks run along `in`, the last
dimension. "token" means each row of an activation's last dimension, with its scale computed per batch (dynamic).
A static activation scale (FP8, NVFP4's global scale) comes from the calibration amax.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from qcore.formats import numerics as formats

__all__ = ["ELEMENTS", "GRANULARITIES", "PRESETS", "Preset", "TensorFormat", "preset"]

ELEMENTS = ("int8", "int4", "float8_e4m3fn", "float4_e2m1")
GRANULARITIES = ("tensor", "axis", "group", "block", "token")
_INT_RANGES = {"int8": (-128, 127), "int4": (-8, 7)}


@dataclass(frozen=True)
class TensorFormat:
    """How one tensor is quantized: its element type, the granularity of its scales (with the group size, or the
    block shape), whether the scales are computed per batch (dynamic) or from calibration (static), whether an
    integer format is symmetric, and the scales' own format: "fp32", "e8m0" (MX, per 32) or "e4m3" (NVFP4, per
    16, under an fp32 global scale)."""

    element: str
    granularity: str
    group: int | tuple[int, int] | None = None
    dynamic: bool = False
    symmetric: bool = True
    scale_format: str = "fp32"

    def __post_init__(self) -> None:
        if self.element not in ELEMENTS:
            raise ValueError(f"element must be one of {', '.join(ELEMENTS)}, not {self.element!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, not {self.granularity!r}")
        if self.scale_format not in ("fp32", "e8m0", "e4m3"):
            raise ValueError(f"scale_format must be fp32, e8m0 or e4m3, not {self.scale_format!r}")
        if self.granularity in ("group", "block") and self.group is None:
            raise ValueError(f"a {self.granularity} granularity needs its size")

    @property
    def block(self) -> int:
        """How many consecutive values of the last dimension share a scale (0: the whole dimension or more)."""
        if self.scale_format == "e8m0":
            return formats.MX_BLOCK
        if self.scale_format == "e4m3":
            return formats.NVFP4_BLOCK
        if self.granularity in ("group", "token") and self.group is not None:
            return int(self.group)  # type: ignore[arg-type]
        if self.granularity == "block":
            return int(self.group[1])  # type: ignore[index]
        return 0

    def refusal(self, shape: tuple[int, ...], *, weight: bool = False) -> str:
        """Why a tensor of `shape` (a weight, read as [out, in]) cannot take this format ("" when it can)."""
        block = self.block
        columns = int(torch.Size(shape[1:]).numel()) if weight and len(shape) > 2 else shape[-1]
        if block and columns % block:
            return f"its last dimension ({columns}) is not a multiple of the format's block of {block}"
        if self.granularity == "block" and len(shape) >= 2 and shape[0] % int(self.group[0]):  # type: ignore[index]
            return f"its first dimension ({shape[0]}) is not a multiple of the format's block of {self.group[0]}"  # type: ignore[index]
        return ""

    def fake_quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, *, weight: bool = False) -> torch.Tensor:
        """x quantized to this format and back, in x's dtype. `amax`: the calibration amax of a static activation
        (the per-tensor scale of FP8, the global scale of NVFP4). `weight`: x is a weight, read as `[out, in]`."""
        problem = self.refusal(tuple(x.shape), weight=weight)
        if problem:
            raise ValueError(f"a tensor of shape {tuple(x.shape)} cannot take this format: {problem}")
        view = x.reshape(x.shape[0], -1) if weight and x.dim() > 2 else x
        return self._fake_quantize(view, amax, weight).reshape(x.shape).to(x.dtype)

    def _fake_quantize(self, x: torch.Tensor, amax: torch.Tensor | None, weight: bool) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to in this batch
            return x
        if self.scale_format == "e8m0":
            return formats.fake_quantize_mx(x, "e2m1" if self.element == "float4_e2m1" else torch.float8_e4m3fn)
        if self.scale_format == "e4m3":
            return formats.fake_quantize_nvfp4(x, formats.nvfp4_global_scale(
                x.abs().amax() if weight or amax is None else amax))
        block = self._block_size(tuple(x.shape))
        if self.element == "float8_e4m3fn":
            if self.dynamic or amax is None:
                scale = formats.choose_scale_float8(x, block)
            else:
                scale = (amax.to(torch.float32) / formats.E4M3_MAX).reshape([1] * x.dim())
            return formats.dequantize_float8(formats.quantize_float8(x, scale), scale)
        quant_min, quant_max = _INT_RANGES[self.element]
        scale, zero_point = formats.choose_qparams_affine(x, block, quant_min, quant_max, symmetric=self.symmetric)
        codes = formats.quantize_affine(x, block, scale, zero_point, quant_min, quant_max)
        return formats.dequantize_affine(codes, block, scale, zero_point)

    def _block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """torchao's block_size for a tensor of `shape` (one entry per dimension)."""
        if self.granularity == "tensor":
            return shape
        if self.granularity == "axis":  # one scale per output row of an [out, in] weight
            return (1, *shape[1:])
        if self.granularity == "token":  # one per row of the last dimension, or per group of it
            return (*[1] * (len(shape) - 1), self.block or shape[-1])
        if self.granularity == "group":
            return (*[1] * (len(shape) - 1), self.block)
        rows, columns = self.group  # type: ignore[misc]
        return (*[1] * (len(shape) - 2), rows, columns)


@dataclass(frozen=True)
class Preset:
    """A deployed format: how weights and activations are quantized (activation None: it stays in float)."""

    name: str
    weight: TensorFormat
    activation: TensorFormat | None
    description: str


def _mx(element: str, dynamic: bool = False) -> TensorFormat:
    return TensorFormat(element, "group", formats.MX_BLOCK, dynamic=dynamic, scale_format="e8m0")


def _nvfp4(dynamic: bool = False) -> TensorFormat:
    return TensorFormat("float4_e2m1", "group", formats.NVFP4_BLOCK, dynamic=dynamic, scale_format="e4m3")


PRESETS: dict[str, Preset] = {preset.name: preset for preset in (
    Preset("W8A8", TensorFormat("int8", "axis"), TensorFormat("int8", "token", dynamic=True),
           "int8 weights per output channel, int8 activations per token (dynamic), symmetric"),
    Preset("W8A16", TensorFormat("int8", "axis"), None, "int8 weights per output channel, float activations"),
    Preset("W4A16", TensorFormat("int4", "group", 128), None, "int4 weights in groups of 128, symmetric"),
    Preset("W4A16_ASYM", TensorFormat("int4", "group", 128, symmetric=False), None,
           "int4 weights in groups of 128, asymmetric (integer zero point)"),
    Preset("FP8", TensorFormat("float8_e4m3fn", "tensor"), TensorFormat("float8_e4m3fn", "tensor"),
           "e4m3 weights per tensor, e4m3 activations per tensor (static)"),
    Preset("FP8_DYNAMIC", TensorFormat("float8_e4m3fn", "axis"), TensorFormat("float8_e4m3fn", "token", dynamic=True),
           "e4m3 weights per output channel, e4m3 activations per token (dynamic)"),
    Preset("FP8_BLOCK", TensorFormat("float8_e4m3fn", "block", (128, 128)),
           TensorFormat("float8_e4m3fn", "token", 128, dynamic=True),
           "e4m3 weights per 128x128 block, e4m3 activations per token and group of 128 (dynamic)"),
    Preset("MXFP8", _mx("float8_e4m3fn"), _mx("float8_e4m3fn", dynamic=True),
           "e4m3 elements with an e8m0 scale per 32, weights and activations (dynamic)"),
    Preset("MXFP4", _mx("float4_e2m1"), _mx("float4_e2m1", dynamic=True),
           "e2m1 elements with an e8m0 scale per 32, weights and activations (dynamic)"),
    Preset("NVFP4", _nvfp4(), _nvfp4(dynamic=True),
           "e2m1 elements, e4m3 scale per 16 under an fp32 global scale; activations' global scale static "
           "(calibration amax), block scales dynamic"),
    Preset("NVFP4A16", _nvfp4(), None, "NVFP4 weights, float activations"),
)}


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError with the closest name otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    match = difflib.get_close_matches(name, list(PRESETS), n=1) or difflib.get_close_matches(
        name.upper(), list(PRESETS), n=1)
    hint = f" (did you mean {match[0]!r}?)" if match else ""
    raise ValueError(f"unknown format {name!r}{hint}; formats: {', '.join(PRESETS)}")
