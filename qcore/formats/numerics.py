"""The number formats people deploy, as vectorized quantize / dequantize primitives with torchao 0.18's numerics
(see DESIGN.md, "Deployed formats"): integers with a scale (and zero point) per tensor, channel, group or block;
FP8 (e4m3) with an fp32 scale; MX (OCP v1.0) elements with an e8m0 scale per 32 along the last dimension; and
NVFP4, e2m1 elements with an e4m3 scale per 16 and an fp32 global scale.

Blocks: `block_size` has one entry per dimension, as in torchao: `(1, K)` is one scale per output row of a
`[out, K]` weight, `(1, 128)` one per group of 128, `x.shape` one per tensor. Every function works on whole
tensors (no Python loop over blocks or elements) on the tensor's own device.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from qcore.runtime import native

__all__ = ["E2M1_MAX", "E4M3_MAX", "E8M0_BIAS", "MX_BLOCK", "NVFP4_BLOCK", "choose_qparams_affine",
           "choose_scale_float8", "dequantize_affine", "dequantize_float8", "e2m1_decode", "e2m1_encode",
           "fake_quantize_mx", "fake_quantize_nvfp4", "from_mx", "nvfp4_dequantize", "nvfp4_global_scale",
           "nvfp4_quantize", "quantize_affine", "quantize_float8", "reduction_layout", "to_mx"]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
MX_BLOCK = 32
NVFP4_BLOCK = 16
_E8M0_NAN = 255
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX = {torch.float8_e4m3fn: 8, "e2m1": 2}  # the largest power of two of each element type: 448 = 1.75 * 2^8


def reduction_layout(shape: Sequence[int], block_size: Sequence[int]) -> tuple[list[int], list[int]]:
    """(the shape that splits each blocked dimension into (blocks, block), the dimensions one block spans), for
    viewing a tensor of `shape` so that one reduction gives every block's statistic. ValueError when a dimension
    is not a multiple of its block."""
    if len(block_size) != len(shape):
        raise ValueError(f"block_size {tuple(block_size)} needs one entry per dimension of shape {tuple(shape)}")
    split: list[int] = []
    reduced: list[int] = []
    for size, block in zip(shape, block_size):
        if block != size and block > 1:
            if size % block:
                raise ValueError(f"a dimension of size {size} is not a multiple of its block of {block}")
            split += [size // block, block]
            reduced.append(len(split) - 1)
        else:
            split.append(size)
            if block != 1:
                reduced.append(len(split) - 1)
    return split, reduced


def _per_block(x: torch.Tensor, block_size: Sequence[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    split, reduced = reduction_layout(x.shape, block_size)
    kept = [1 if index in reduced else size for index, size in enumerate(split)]
    return x.reshape(split), reduced, kept


def _block_max(blocks: torch.Tensor, reduced: list[int]) -> torch.Tensor:
    """Each block's maximum; blocks of one element are their own (torch.amax over no dimension reduces all)."""
    return torch.amax(blocks, dim=reduced, keepdim=True) if reduced else blocks


def _block_min(blocks: torch.Tensor, reduced: list[int]) -> torch.Tensor:
    """Each block's minimum; blocks of one element are their own."""
    return torch.amin(blocks, dim=reduced, keepdim=True) if reduced else blocks


# -- integers ------------------------------------------------------------------------------------------------------
def choose_qparams_affine(x: torch.Tensor, block_size: Sequence[int], quant_min: int, quant_max: int, *,
                          symmetric: bool, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point), one per block, each of shape `[size // block for each dimension]`.

    Symmetric: scale = amax / ((quant_max - quant_min) / 2), zero point (quant_max + quant_min + 1) // 2.
    Asymmetric: the range always includes 0; zero_point = quant_min - round(min / scale), clamped, as int32.
    Scales are at least `eps` (default: the smallest normal number of x's dtype)."""
    blocks, reduced, _kept = _per_block(x, block_size)
    low = torch.clamp(_block_min(blocks, reduced), max=0.0)
    high = torch.clamp(_block_max(blocks, reduced), min=0.0)
    floor = torch.finfo(x.dtype).smallest_normal if eps is None else eps
    if symmetric:
        scale = torch.clamp(torch.maximum(-low, high) / (float(quant_max - quant_min) / 2), min=floor)
        zero_point = torch.full_like(scale, int((quant_max + quant_min + 1) / 2))
    else:
        scale = torch.clamp((high - low) / float(quant_max - quant_min), min=floor)
        zero_point = torch.clamp(quant_min - torch.round(low / scale), quant_min, quant_max).to(torch.int32)
    shape = [size // block for size, block in zip(x.shape, block_size)]
    return scale.reshape(shape), zero_point.reshape(shape)


def quantize_affine(x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, zero_point: torch.Tensor,
                    quant_min: int, quant_max: int) -> torch.Tensor:
    """The integer codes (as x's float dtype): clamp(round(x * (1 / scale)) + zero_point), rounding half to even."""
    blocks, _reduced, kept = _per_block(x, block_size)
    codes = torch.round(blocks * (1.0 / scale.reshape(kept))) + zero_point.reshape(kept)
    return torch.clamp(codes, quant_min, quant_max).reshape(x.shape)


def dequantize_affine(codes: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor,
                      zero_point: torch.Tensor, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes - zero_point) * scale, in `output_dtype`."""
    blocks, _reduced, kept = _per_block(codes.to(output_dtype), block_size)
    values = (blocks - zero_point.reshape(kept).to(output_dtype)) * scale.reshape(kept)
    return values.reshape(codes.shape).to(output_dtype)


# -- FP8 -----------------------------------------------------------------------------------------------------------
def choose_scale_float8(x: torch.Tensor, block_size: Sequence[int],
                        dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """One fp32 scale per block: amax / the format's largest value (448 for e4m3, 57344 for e5m2). An all-zero
    block gets scale 0, as in torchao, and its values become NaN."""
    blocks, reduced, _kept = _per_block(x, block_size)
    scale = _block_max(blocks.abs(), reduced) / torch.finfo(dtype).max
    return scale.reshape([size // block for size, block in zip(x.shape, block_size)]).to(torch.float32)


def quantize_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x / scale, saturated to the format's range, then cast (round to nearest even) to `dtype`."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) / _broadcast(scale, x.shape)).clamp(-limit, limit).to(dtype)


def dequantize_float8(q: torch.Tensor, scale: torch.Tensor, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale."""
    return (q.to(torch.float32) * _broadcast(scale, q.shape)).to(output_dtype)


def _broadcast(scale: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A per-block scale spread over the tensor it scales (blocks of size shape[i] // scale.shape[i])."""
    if scale.numel() == 1 or all(s in (1, n) for s, n in zip(scale.shape, shape)):
        return scale
    block = [n // s for s, n in zip(scale.shape, shape)]
    for dim, size in enumerate(block):
        if size > 1:
            scale = scale.repeat_interleave(size, dim=dim)
    return scale


# -- e2m1 (FP4) elements -------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign in bit 3) of float32 values, rounded to the nearest even and saturated at 6. There is
    no NaN or infinity in e2m1: as in torchao, a NaN input gets whatever code its bits round to."""
    bits = x.to(torch.float32).view(torch.int32)
    sign = bits & -0x80000000
    magnitude = (bits ^ sign).view(torch.float32)
    # below 1, e2m1 is subnormal (steps of 0.5): adding 2^22 puts the value where float32's last bit is worth 0.5,
    # so the float addition itself rounds to the nearest even step, and the low bits are the code
    subnormal = ((magnitude + 2.0**22).view(torch.int32) - (149 << 23)).to(torch.uint8)
    # from 1 on: rebias the exponent (127 -> 1), round the mantissa's first bit to nearest even, keep 3 bits
    normal_bits = magnitude.view(torch.int32)
    odd = (normal_bits >> 22) & 1
    normal = ((normal_bits + ((1 - 127) << 23) + (2**21 - 1) + odd) >> 22).to(torch.uint8)
    codes = torch.where(magnitude < 1.0, subnormal, normal)
    codes = torch.where(magnitude >= E2M1_MAX, torch.full_like(codes, 7), codes)
    return codes | ((sign >> 28).to(torch.uint8) & 8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes (-0.0 for the negative zero)."""
    table = torch.tensor([*_E2M1_VALUES, *(-v for v in _E2M1_VALUES)], dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.long)]


# -- MX ------------------------------------------------------------------------------------------------------------
def to_mx(x: torch.Tensor, elem_dtype: torch.dtype | str,
          block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased e8m0 exponents as uint8, one per `block` along the last dimension; elements) with the OCP shared
    exponent floor(log2 amax) - emax(element), clamped to e8m0 (FLOOR mode). Elements are float8_e4m3fn values,
    or e2m1 codes for elem_dtype "e2m1". A block holding NaN gets exponent 255."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the MX block of {block}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block).to(torch.float32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - _EMAX[elem_dtype]
    biased = (torch.clamp(exponent, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS).to(torch.uint8)
    biased = torch.where(torch.isnan(amax), torch.full_like(biased, _E8M0_NAN), biased)
    divisor = torch.clamp((biased.to(torch.int32) << 23).view(torch.float32), min=torch.finfo(torch.float32).tiny)
    scaled = blocks / divisor
    if elem_dtype == "e2m1":
        elements = e2m1_encode(scaled)
    else:
        limit = torch.finfo(elem_dtype).max
        elements = scaled.clamp(-limit, limit).to(elem_dtype)
    return biased.squeeze(-1), elements.reshape(x.shape)


def from_mx(exponents: torch.Tensor, elements: torch.Tensor, elem_dtype: torch.dtype | str,
            block: int = MX_BLOCK, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of MX data: element * 2^(exponent - 127), NaN where the exponent is 255."""
    values = e2m1_decode(elements) if elem_dtype == "e2m1" else elements.to(torch.float32)
    scale = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.to(torch.int32) - E8M0_BIAS)
    scale = torch.where(exponents == _E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // block, block) * scale.unsqueeze(-1)
    return blocks.reshape(values.shape).to(output_dtype)


# -- NVFP4 ---------------------------------------------------------------------------------------------------------
def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 per-tensor scale of NVFP4 from the tensor's amax: amax / (448 * 6), so that block scales use the
    whole e4m3 range."""
    return amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor,
                   block: int = NVFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 block scales, one per `block` along the last dimension; e2m1 codes): each block's amax / 6, divided
    by the global scale and rounded to e4m3; the elements x * (1 / global) / block scale, saturated at 6."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the NVFP4 block of {block}")
    blocks = x.to(torch.float32).reshape(x.shape[0] if x.dim() > 1 else 1, -1, block)
    relative = blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale
    scales = torch.clamp(relative, min=torch.finfo(torch.float8_e4m3fn).tiny, max=E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / global_scale) / scales.to(torch.float32)
    scaled = torch.clamp(blocks * reciprocal.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    return scales.reshape(*x.shape[:-1], x.shape[-1] // block), e2m1_encode(scaled).reshape(x.shape)


def nvfp4_dequantize(scales: torch.Tensor, codes: torch.Tensor, global_scale: torch.Tensor,
                     block: int = NVFP4_BLOCK, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 value * (global scale * block scale)."""
    values = e2m1_decode(codes)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // block, block)
    return (blocks * (global_scale * scales.to(torch.float32)).unsqueeze(-1)).reshape(values.shape).to(output_dtype)


# -- fake quantization (quantized and back), fused where the native kernels run -----------------------------------
def _native_input(x: torch.Tensor) -> bool:
    return (x.__class__ is torch.Tensor and x.dtype == torch.float32 and x.is_cpu
            and not (x.requires_grad and torch.is_grad_enabled()) and native.kernel() is not None)


def fake_quantize_mx(x: torch.Tensor, elem_dtype: torch.dtype | str, block: int = MX_BLOCK) -> torch.Tensor:
    """from_mx(to_mx(x)) as float32: one fused pass per block where the native kernels run."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the MX block of {block}")
    if _native_input(x):
        x = x.contiguous()
        out = torch.empty_like(x)
        native.kernel().qcore_fake_quantize_mx(x.data_ptr(), out.data_ptr(), x.numel() // block, block,
                                               4 if elem_dtype == "e2m1" else 8, native.threads(x.numel()))
        return out
    exponents, elements = to_mx(x.contiguous(), elem_dtype, block)
    return from_mx(exponents, elements, elem_dtype, block)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_dequantize(nvfp4_quantize(x)) as float32: one fused pass per block where the native kernels run."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the NVFP4 block of {NVFP4_BLOCK}")
    if _native_input(x) and global_scale.numel() == 1:
        x = x.contiguous()
        out = torch.empty_like(x)
        native.kernel().qcore_fake_quantize_nvfp4(x.data_ptr(), out.data_ptr(), x.numel() // NVFP4_BLOCK,
                                                  float(global_scale), native.threads(x.numel()))
        return out
    rows = x.reshape(-1, x.shape[-1])
    scales, codes = nvfp4_quantize(rows, global_scale)
    return nvfp4_dequantize(scales, codes, global_scale).reshape(x.shape)
