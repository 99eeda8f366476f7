"""The quantization tools that make artifacts, recognised by the marks each leaves on the modules of the model it
returns: which modules it quantized (and in what format, in its own config's words), which modules it added for its
own bookkeeping, how it dequantizes a weight, and how its user keeps a layer out of quantization.

No tool is imported to recognise its model. Where a tool's weight can only be dequantized by its own function
(bitsandbytes' 4-bit blocks), that function is imported from the tool the model was made with, when it is asked for.
"""
from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qcore.graph.experts import PER_EXPERT_QUANTIZERS

__all__ = ["RECIPE_KEYS", "TOOL_NAMES", "artifact_tool", "bookkeeping_module", "dequantized_weight",
           "quanto_quantize_weights", "skipped_modules", "tool_dequantized_weight", "tool_layer_format",
           "tool_of_module", "tool_recipes", "unwrapped_artifact"]

RECIPE_KEYS = {"compressed-tensors": "llm-compressor"}  # a tool's line in the recipe: by the tool its users run
TOOL_NAMES = {"compressed-tensors": "llm-compressor", "modelopt": "ModelOpt", "bitsandbytes": "bitsandbytes",
              "quanto": "optimum-quanto", "hqq": "HQQ", "gptqmodel": "GPTQModel", "torchao": "torchao"}


def _class_module(module: Any) -> str:
    return type(module).__module__ or ""


def _is_modelopt_quantizer(module: Any) -> bool:
    return _class_module(module).startswith("modelopt.") and hasattr(module, "is_enabled")


def _quantizer_enabled(quantizer: Any) -> bool:
    """Whether a ModelOpt TensorQuantizer (or a SequentialQuantizer of them) quantizes."""
    parts = list(quantizer) if isinstance(quantizer, nn.Sequential) else [quantizer]
    return any(bool(getattr(part, "is_enabled", False)) for part in parts)


def _modelopt_quantizers(module: nn.Module) -> dict[str, Any]:
    """The module's own ModelOpt quantizers (children), by name."""
    found = {}
    for name, child in module.named_children():
        if _is_modelopt_quantizer(child) or (isinstance(child, nn.Sequential) and len(child)
                                              and all(_is_modelopt_quantizer(part) for part in child)):
            found[name] = child
    return found


def tool_of_module(module: nn.Module) -> str | None:
    """The tool whose quantization `module` holds itself (its own weight or quantizers), or None."""
    if getattr(module, "quantization_scheme", None) is not None:
        return "compressed-tensors"
    if _modelopt_quantizers(module):
        return "modelopt"
    weight = getattr(module, "weight", None)
    weight_class = _class_module(weight) if weight is not None else ""
    if weight_class.startswith("bitsandbytes.") or _class_module(module).startswith("bitsandbytes."):
        return "bitsandbytes"
    if _class_module(module).startswith("optimum.quanto.") or weight_class.startswith("optimum.quanto."):
        return "quanto"
    if _class_module(module).startswith("hqq."):
        return "hqq"
    if _class_module(module).startswith("gptqmodel."):
        return "gptqmodel"
    if weight_class.startswith("torchao."):
        return "torchao"
    return None


def unwrapped_artifact(model: nn.Module) -> nn.Module:
    """The model inside a tool's wrapper (GPTQModel.load returns a BaseQModel holding the transformers model as
    `.model`), or `model` itself."""
    inner = getattr(model, "model", None)
    if _class_module(model).startswith("gptqmodel.") and isinstance(inner, nn.Module):
        return inner
    return model


def artifact_tool(model: nn.Module) -> str | None:
    """The tool that made the artifact, from its modules' marks (the first quantized module's tool), or None."""
    for module in model.modules():
        tool = tool_of_module(module)
        if tool is not None:
            return tool
    return None


def bookkeeping_module(module: nn.Module) -> bool:
    """Whether a module the reference does not have was added by a tool for its own state, not by the architecture:
    ModelOpt's quantizers, and its modules that hold quantizer state shared between layers (the
    SharedWeightGlobalAmaxState under `_shared_quant_states` in 0.47)."""
    if _is_modelopt_quantizer(module):
        return True
    return _class_module(module).startswith("modelopt.") and not any(True for _ in module.parameters(recurse=False))


def _modelopt_quantizer_format(quantizer: Any) -> str:
    """A ModelOpt quantizer's format in its config's words: 'int8 per-channel', 'fp8 e4m3 per-tensor',
    'int4 block 128'."""
    parts = list(quantizer) if isinstance(quantizer, nn.Sequential) else [quantizer]
    texts = []
    for part in parts:
        if not getattr(part, "is_enabled", False):
            continue
        bits = getattr(part, "num_bits", None)
        if isinstance(bits, (tuple, list)) and len(bits) == 2:
            kind = f"fp{1 + bits[0] + bits[1]} e{bits[0]}m{bits[1]}"
        else:
            kind = f"int{bits}"
        blocks = getattr(part, "block_sizes", None)
        axis = getattr(part, "axis", None)
        if blocks:
            sizes = [size for key, size in blocks.items() if isinstance(key, int)]
            granularity = f"block {sizes[0]}" if sizes else "block"
        elif axis is None:
            granularity = "per-tensor"
        else:
            granularity = "per-channel"
        dynamic = " dynamic" if (blocks or {}).get("type") == "dynamic" else ""
        scale_bits = tuple((blocks or {}).get("scale_bits") or ())
        if scale_bits == (4, 3) and kind.startswith("fp4"):
            kind = "nvfp4"  # e2m1 values, e4m3 block scales
        elif scale_bits == (8, 0):
            kind, dynamic = f"mx{kind}", ""  # e8m0 block scales, always computed from the block
        texts.append(f"{kind} {granularity}{dynamic}")
    return ", then ".join(texts)


def _modelopt_format(module: nn.Module) -> str:
    quantizers = {name: q for name, q in _modelopt_quantizers(module).items() if _quantizer_enabled(q)}
    if not quantizers:
        return ""
    words = {"weight_quantizer": "weights", "input_quantizer": "inputs", "output_quantizer": "outputs"}
    parts = []
    for name, quantizer in quantizers.items():
        what = words.get(name, name.removesuffix("_quantizer").replace("_", " "))
        parts.append(f"{what} {_modelopt_quantizer_format(quantizer)}")
    scale = getattr(module, "input_quantizer", None)
    if scale is not None and getattr(scale, "pre_quant_scale", None) is not None:
        parts.append("inputs pre-scaled (pre_quant_scale)")
    return "ModelOpt " + ", ".join(parts)


def _bitsandbytes_format(module: nn.Module) -> str:
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None:
        kind = getattr(state, "quant_type", "4-bit")
        # the CPU kernel's packing (packing_format_for_cpu) undoes the double quantization it keeps as original_nested
        double = getattr(state, "original_nested", False) if getattr(state, "packing_format_for_cpu", False) else \
            getattr(state, "nested", False)
        nested = " double-quantized" if double else ""
        return f"bitsandbytes {kind} block {getattr(state, 'blocksize', '?')}{nested}"
    threshold = getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0
    outliers = f", inputs over {threshold:g} in 16-bit (LLM.int8)" if threshold > 0 else ""
    return f"bitsandbytes int8 per-channel{outliers}"


def _quanto_format(module: nn.Module) -> str:
    weights = getattr(module, "weight_qtype", None)
    inputs = getattr(module, "activation_qtype", None)
    text = f"quanto weights {getattr(weights, 'name', weights)}"
    weight = getattr(module, "weight", None)
    scale = getattr(weight, "_scale", None)
    if isinstance(scale, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2 and scale.numel():
        group = weight.numel() // scale.numel()
        text += " per-channel" if group == weight.shape[1] else f" group {group}"
    if getattr(weight, "_shift", None) is not None:
        text += " with zero point"
    return text + (f", activations {getattr(inputs, 'name', inputs)}" if inputs is not None else "")


def _hqq_format(module: nn.Module) -> str:
    meta = getattr(module, "meta", None) or {}
    bits, group = meta.get("nbits", "?"), meta.get("group_size")
    axis = meta.get("axis")
    return f"hqq int{bits}" + (f" group {group}" if group else "") + (f" axis {axis}" if axis is not None else "")


def _gptq_format(module: nn.Module) -> str:
    bits, group = getattr(module, "bits", "?"), getattr(module, "group_size", None)
    act_order = " act-order" if getattr(module, "desc_act", False) else ""
    return f"gptq int{bits}" + (f" group {group}" if group and group > 0 else " per-channel") + act_order


def tool_layer_format(module: nn.Module) -> str | None:
    """The format of the quantization a tool holds in `module` itself, in the tool's words; "" for a tool's module
    that quantizes nothing (every quantizer off); None for a module no tool marked."""
    tool = tool_of_module(module)
    if tool == "modelopt":
        return _modelopt_format(module)
    if tool == "bitsandbytes":
        return _bitsandbytes_format(module)
    if tool == "quanto":
        return _quanto_format(module)
    if tool == "hqq":
        return _hqq_format(module)
    if tool == "gptqmodel":
        return _gptq_format(module) if hasattr(module, "qweight") else ""
    return None


_BNB_CPU_BLOCK_N = 32  # the rows bitsandbytes' CPU layout interleaves (block_n of _convert_weight_packed_for_cpu)


def _bitsandbytes_cpu_packed_weight(packed: torch.Tensor, state: Any) -> torch.Tensor:
    """The 4-bit weight bitsandbytes' CPU kernel computes with once its first forward on a CPU with AVX512-BF16 has
    repacked it (`packing_format_for_cpu`): [N, K/2] bytes holding 32 rows' codes interleaved, and each row's block
    absmax in bfloat16, laid [K / blocksize, N]. Read without undoing the packing: the layer stays as the tool left
    it."""
    rows, half = packed.shape
    # the codes in [N / 32, K / 2, 32, 2] order, 64 at a time: a byte's low and high halves hold codes 32 apart
    pairs = packed.reshape(-1, _BNB_CPU_BLOCK_N)
    codes = torch.cat([pairs & 0xF, (pairs >> 4) & 0xF], dim=-1)
    codes = codes.reshape(rows // _BNB_CPU_BLOCK_N, half, _BNB_CPU_BLOCK_N, 2).transpose(1, 2).reshape(rows, 2 * half)
    scales = state.absmax.t().float().repeat_interleave(state.blocksize, dim=1)
    return (state.code.float()[codes.long()] * scales).to(state.dtype)


def _bitsandbytes_weight(module: nn.Module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None and isinstance(weight, torch.Tensor):
        if getattr(state, "packing_format_for_cpu", False):
            return _bitsandbytes_cpu_packed_weight(weight.data, state)
        from bitsandbytes.functional import dequantize_4bit  # the tool's own: its 4-bit codes and blocks

        return dequantize_4bit(weight.data, state).reshape(state.shape)
    # LLM.int8: int8 codes and a per-row absmax; the first forward moves both from the weight to the layer's state
    layer_state = getattr(module, "state", None)
    codes = _first_tensor(getattr(weight, "CB", None), getattr(layer_state, "CB", None))
    scales = _first_tensor(getattr(weight, "SCB", None), getattr(layer_state, "SCB", None))
    if codes is None and isinstance(weight, torch.Tensor) and weight.dtype == torch.int8:
        codes = weight.data
    if codes is None or scales is None:
        return None
    return codes.float() * (scales.float().reshape(-1, 1) / 127.0)


def _first_tensor(*values: Any) -> torch.Tensor | None:
    return next((value for value in values if isinstance(value, torch.Tensor)), None)


_PROBE_ROWS = 1024  # identity rows run through a layer at a time to read the weight it computes with


def _probed_weight(module: nn.Module, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight a linear layer computes with, read from its own forward on the identity (the bias taken off), a
    bounded number of rows at a time: for a layer whose kernel repacked its weight into a format only it reads."""
    bias = getattr(module, "bias", None)
    columns = []
    for start in range(0, in_features, _PROBE_ROWS):
        count = min(_PROBE_ROWS, in_features - start)
        rows = torch.zeros(count, in_features, dtype=dtype)
        rows[torch.arange(count), torch.arange(start, start + count)] = 1  # these rows of the identity only
        out = module(rows)
        columns.append(out - bias.to(out.dtype) if isinstance(bias, torch.Tensor) else out)
    return torch.cat(columns).t()


def _gptq_weight(module: nn.Module) -> torch.Tensor | None:
    if getattr(module, "linear_mode", None) == "inference":
        # GPTQModel's CPU kernel repacked the weight for its fused int4 matmul on the first forward: read it through
        # that matmul
        scales = getattr(module, "scales", None)
        return _probed_weight(module, int(module.in_features),
                              scales.dtype if isinstance(scales, torch.Tensor) else torch.float32)
    dequantize = getattr(module, "dequantize_weight", None)
    if not callable(dequantize):
        return None
    return dequantize().t()  # GPTQ's packing keeps input channels first: (in_features, out_features)


def _modelopt_weight(module: nn.Module) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    quantizer = getattr(module, "weight_quantizer", None)
    if not isinstance(weight, torch.Tensor):
        return None
    ours = quantizer(weight.detach()) if quantizer is not None and _quantizer_enabled(quantizer) else weight.detach()
    scale = getattr(getattr(module, "input_quantizer", None), "pre_quant_scale", None)
    if isinstance(scale, torch.Tensor) and ours.dim() == 2:
        # SmoothQuant and AWQ in ModelOpt: the layer computes (x * pre_quant_scale) @ weight.T, so the weight the
        # reference's is comparable with is the quantized weight scaled back per input channel
        ours = ours * scale.reshape(1, -1).to(ours.dtype)
    return ours


def tool_dequantized_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight `module` computes with, dequantized as the tool that quantized it does (bitsandbytes' CB * SCB /
    127 and 4-bit blocks, HQQ's and GPTQModel's own dequantize, ModelOpt's weight quantizer and pre_quant_scale);
    None where no tool holds the module's weight."""
    tool = tool_of_module(module)
    with torch.no_grad():
        if tool == "modelopt":
            return _modelopt_weight(module)
        if tool == "bitsandbytes":
            return _bitsandbytes_weight(module)
        if tool == "quanto":
            quantized = getattr(module, "qweight", None)
            return quantized.dequantize() if quantized is not None and hasattr(quantized, "dequantize") else None
        if tool == "hqq":
            return module.dequantize() if callable(getattr(module, "dequantize", None)) else None
        if tool == "gptqmodel":
            return _gptq_weight(module)
    return None


def _version(package: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _modelopt_line(names: list[str], per_expert_blocks: Iterable[str] = ()) -> str:
    wildcards = [_modelopt_wildcard(name, tuple(per_expert_blocks)) for name in names]
    version = _version("nvidia-modelopt")
    if version is None or version >= (0, 47):  # quant_cfg is a list of entries from 0.47 on
        entries = ", ".join(f"{{'quantizer_name': {wildcard!r}, 'enable': False}}" for wildcard in wildcards)
        return f"config['quant_cfg'].extend([{entries}])"
    entries = ", ".join(f"{wildcard!r}: {{'enable': False}}" for wildcard in wildcards)
    return f"config['quant_cfg'].update({{{entries}}})"


def _modelopt_wildcard(name: str, per_expert_blocks: tuple[str, ...]) -> str:
    """ModelOpt's wildcard over the quantizers that keep layer (or glob) `name` in float. Under a block whose fused
    experts ModelOpt quantizes in place (`per_expert_blocks`), an expert's projection (`block.3.down_proj`, all of
    them `block.*.down_proj`, the whole block `block`) is its weight quantizers (`block.down_proj_weight_quantizers.3`):
    ModelOpt keeps one input quantizer for all the experts of a projection, which stays (as the measured trial kept
    it); the wildcard ends at the expert's index, so that expert 3's does not match expert 30's."""
    for block in per_expert_blocks:
        if name == block:
            return f"*{block}.*{PER_EXPERT_QUANTIZERS}.*"
        expert, _, projection = name[len(block) + 1:].partition(".") if name.startswith(block + ".") else ("", "", "")
        if projection and "." not in projection and (expert == "*" or expert.isdigit()):
            return f"*{block}.{projection}{PER_EXPERT_QUANTIZERS}.{expert}"
    return f"*{name}*"


def quanto_quantize_weights(model: nn.Module) -> str | None:
    """The weights qtype ('qint8') of a model quantized by quanto's own quantize(), not loaded through transformers'
    QuantoConfig (which leaves a quantization_config on the model's config); None for any other model."""
    if getattr(getattr(model, "config", None), "quantization_config", None) is not None:
        return None
    for module in model.modules():
        qtype = getattr(module, "weight_qtype", None)
        if qtype is not None and tool_of_module(module) == "quanto":
            return str(getattr(qtype, "name", qtype))
    return None


def skipped_modules(model: nn.Module) -> list[str]:
    """The modules the artifact's quantization setting keeps out of quantization: its transformers config's own
    list (modules_to_not_convert, llm_int8_skip_modules), or transformers' default when it has none (the output
    embedding, `lm_head`); for quanto's own quantize(), the linear and convolution modules it left in float (its
    exclude); for torchao's quantize_, the linear modules it left in float (its filter_fn). A fix's list must
    repeat them: the setting replaces the default."""
    if quanto_quantize_weights(model) is not None:
        return [name for name, module in model.named_modules()
                if type(module) in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)]
    if artifact_tool(model) == "torchao":
        return [name for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and tool_of_module(module) is None]
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    for key in ("llm_int8_skip_modules", "modules_to_not_convert", "skip_modules"):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value:
            return list(value)
    return ["lm_head"] if isinstance(getattr(model, "lm_head", None), nn.Module) else []


def _regex(pattern: str) -> str:
    """A float_layers glob as a regular expression over module names: `*` one name part, a module's name also its
    submodules'."""
    return re.escape(pattern).replace(r"\*", r"[^.]+") + r"(\..+)?$"


def tool_recipes(float_layers: Iterable[str], skipped: Iterable[str] = ("lm_head",),
                 quanto_weights: str | None = None, patterns: Iterable[str] | None = None,
                 per_expert_blocks: Iterable[str] = ()) -> dict[str, str]:
    """The line that keeps `float_layers` unquantized in each tool that makes artifacts, by tool (and qmodel's
    float_layers); `skipped`: what the tool's setting already held (skipped_modules); `quanto_weights`: the
    weights qtype of a model made by quanto's own quantize() (quanto_quantize_weights), whose line is then that
    call's exclude, else transformers' QuantoConfig. `patterns`: the same layers written with globs (a block's
    experts as `block.*.down_proj`), for the tools that take patterns (qmodel, llm-compressor's `re:`, ModelOpt,
    GPTQModel); the others list every name. `per_expert_blocks`: the MoE blocks whose fused experts ModelOpt
    quantized in place, a weight quantizer per expert (their experts' layers are those quantizers there)."""
    names = list(float_layers)
    globs = list(patterns) if patterns is not None else names
    listed = ", ".join(repr(name) if "*" not in name and name in names else repr("re:" + _regex(name))
                       for name in globs)
    in_float = [*skipped, *(name for name in names if name not in skipped)]
    kept = ", ".join(repr(name) for name in in_float)
    pattern = "|".join(name.replace(".", r"\.") if name in names else _regex(name) for name in globs)
    return {
        "float_layers": f"float_layers={globs!r}",
        "llm-compressor": f"ignore=[..., {listed}]",
        "modelopt": _modelopt_line(globs, per_expert_blocks),
        "bitsandbytes": f"BitsAndBytesConfig(..., llm_int8_skip_modules=[{kept}])",
        "quanto": f"quantize(model, weights={quanto_weights}, exclude=[{kept}])" if quanto_weights else
                  f"QuantoConfig(..., modules_to_not_convert=[{kept}])",
        # AutoHQQHFModel.quantize_model skips by linear tag (every block's), so one layer goes back after it
        "hqq": f"for name in {names!r}: model.set_submodule(name, float_model.get_submodule(name))  # after "
               "AutoHQQHFModel.quantize_model(model, ...), float_model a copy of the model before it",
        "gptqmodel": f"QuantizeConfig(..., dynamic={{{'-:' + pattern!r}: {{}}}})",
        "torchao": f"quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear) "
                   f"and fqn not in {sorted(in_float)!r})",
    }


def dequantized_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight the module computes with, dequantized as the tool that made it does (tool_dequantized_weight);
    None when it has none (a compressed-tensors module before its first forward keeps only its packed weight)."""
    by_tool = tool_dequantized_weight(module)
    if by_tool is not None:
        return by_tool
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    with torch.no_grad():
        if type(weight) not in (torch.Tensor, nn.Parameter) and type(weight).dequantize is not torch.Tensor.dequantize:
            return weight.dequantize()
        return weight.detach()
