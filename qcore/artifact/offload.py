"""Models as a small machine loads them: parameters on the meta device behind accelerate's offloading hooks
(`from_pretrained(..., device_map="auto", max_memory=..., offload_folder=...)`), and compressed-tensors layers that
decompress on a model's first forward.

A module is onloaded through its own hooks (the AlignDevicesHook's pre_forward reads its weights from the offload
folder or the checkpoint), kept onloaded while every batch runs through it, and offloaded again with the hook's
post_forward: each weight is read once per pass instead of once per call. A compressed-tensors layer is decompressed
with compressed-tensors' own `decompress_module` while its block is onloaded, and its compressed state is put back
after, so the decompressed weights of one block at a time exist. No tool is imported unless its marks are found.
"""
from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qcore.graph.experts import ExpertProjection

__all__ = ["compressed_layers_decompressed", "decompress_pending", "first_forward_decompression_held", "is_offloaded",
           "module_tensor", "offloaded_bytes", "onloaded", "parameter_bytes"]


def _offloading_hooks(module: nn.Module) -> list[Any]:
    """The AlignDevicesHook(s) that offload `module`'s own tensors (inside a SequentialHook too)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    hooks = list(getattr(hook, "hooks", None) or [hook])
    return [h for h in hooks if hasattr(h, "offload") and hasattr(h, "weights_map") and h.weights_map is not None]


def is_offloaded(model: nn.Module) -> bool:
    """Whether some of the model's parameters wait on the meta device behind an offloading hook."""
    return any(hook.offload for module in model.modules() for hook in _offloading_hooks(module))


def _is_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


def _placing_hooks(module: nn.Module) -> list[Any]:
    """Every hook of accelerate's on `module` that places inputs on an execution device (offloading or not)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return [h for h in list(getattr(hook, "hooks", None) or [hook]) if hasattr(h, "execution_device")]


@contextlib.contextmanager
def onloaded(module: nn.Module, device: torch.device | str | None = None, recurse: bool = True) -> Iterator[None]:
    """`module` and its submodules with their weights onloaded for the duration (read once), through their offloading
    hooks. With `device`: the hooks' execution device is set to it, and the tensors the module holds are moved there
    too, the originals put back after. `recurse=False`: the module's own tensors only (not a hook that places its
    submodules)."""
    modules = list(module.modules()) if recurse else [module]
    opened: list[tuple[nn.Module, Any]] = []
    placed: list[tuple[Any, Any]] = []
    moved: list[tuple[dict, str, torch.Tensor]] = []
    target = torch.device(device) if device is not None else None
    try:
        if target is not None:
            for sub in modules:
                for hook in _placing_hooks(sub):
                    placed.append((hook, hook.execution_device))
                    hook.execution_device = target
        for sub in modules:
            for hook in _offloading_hooks(sub):
                if not hook.offload or (not recurse and getattr(hook, "place_submodules", False)):
                    continue  # onloaded already (an enclosing context), never offloaded, or placing the children
                hook.pre_forward(sub)
                hook.offload = False
                opened.append((sub, hook))
        if target is not None:
            for sub in modules:
                for table in (sub._parameters, sub._buffers):
                    for name, value in list(table.items()):
                        if value is None or _is_meta(value) or value.device == target:
                            continue
                        moved.append((table, name, value))
                        table[name] = (nn.Parameter(value.to(target), requires_grad=value.requires_grad)
                                       if isinstance(value, nn.Parameter) else value.to(target))
        yield
    finally:
        for table, name, value in reversed(moved):
            table[name] = value
        for sub, hook in reversed(opened):
            hook.offload = True
            hook.post_forward(sub, None)
        for hook, before in reversed(placed):
            hook.execution_device = before


def module_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor `name` ('model.layers.0.mlp.up_proj.weight') of `model`, read from its offload (the folder, or the
    checkpoint's file) when the model holds it on the meta device: one tensor at a time, never the whole model."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    tensor = getattr(module, attribute)
    if not isinstance(tensor, torch.Tensor) or not _is_meta(tensor):
        return tensor
    if isinstance(module, ExpertProjection) and attribute == "weight":  # a view of its experts' fused parameter
        experts_path = module_name.rsplit(".", 2)[0]
        return module.sliced(module_tensor(model, f"{experts_path}.{module.fused}"))
    path = module_name.split(".") if module_name else []
    for depth in range(len(path), -1, -1):  # the nearest hooked module whose weights map holds it
        owner = model.get_submodule(".".join(path[:depth]))
        relative = ".".join([*path[depth:], attribute])
        for hook in _offloading_hooks(owner):
            with contextlib.suppress(KeyError):
                return hook.weights_map[relative]
    raise ValueError(f"{name} is on the meta device and no offloading hook holds its value: the model was not "
                     "loaded whole or through accelerate's offload (device_map=..., offload_folder=...)")


@contextlib.contextmanager
def read_from_offload(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """The submodule `name` with each of its own tensors that waits on the meta device read from the offload
    (module_tensor) for the duration, put back after: its weights, where no hook of its own onloads them (a model
    offloaded whole to disk behind one hook at its root)."""
    module = model.get_submodule(name)
    prefix = f"{name}." if name else ""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for table in (module._parameters, module._buffers):
            for key, value in list(table.items()):
                if value is None or not _is_meta(value):
                    continue
                read = module_tensor(model, prefix + key)
                if _is_meta(read):
                    continue
                swapped.append((table, key, value))
                table[key] = nn.Parameter(read, requires_grad=False) if isinstance(value, nn.Parameter) else read
        yield module
    finally:
        for table, key, value in reversed(swapped):
            table[key] = value


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers as declared (those on the meta device counted by shape)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def offloaded_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters that wait on the meta device."""
    return sum(t.numel() * t.element_size() for t in model.parameters() if _is_meta(t))


def _compressed(module: nn.Module) -> bool:
    status = getattr(module, "quantization_status", None)
    return getattr(status, "value", status) == "compressed" and hasattr(module, "quantization_scheme")


@contextlib.contextmanager
def first_forward_decompression_held(model: nn.Module) -> Iterator[None]:
    """compressed-tensors decompresses every layer of a compressed model on its first forward (a forward pre-hook,
    `ct_decompress_hook`, that also trades accelerate's offload for its own): held off for the duration, so that
    layers are decompressed one block at a time instead."""
    handle = getattr(model, "ct_decompress_hook", None)
    hooks = model._forward_pre_hooks
    held = hooks.pop(handle.id, None) if handle is not None else None
    try:
        yield
    finally:
        if handle is not None and held is not None:
            hooks[handle.id] = held


def decompress_pending(model: nn.Module) -> None:
    """Run compressed-tensors' first-forward decompression now, if it is still pending, its progress bar kept out of
    the output: a whole pass swaps reference modules in for some layers, and a layer swapped out while the first
    forward decompresses the others would stay compressed after."""
    handle = getattr(model, "ct_decompress_hook", None)
    decompress = model._forward_pre_hooks.get(handle.id) if handle is not None else None
    if decompress is not None:
        # its "Decompressing model" progress bar would land in a failing item's captured output
        with contextlib.redirect_stderr(io.StringIO()):
            decompress(model, ())


@contextlib.contextmanager
def compressed_layers_decompressed(module: nn.Module) -> Iterator[list[str]]:
    """The compressed-tensors layers under `module` decompressed with compressed-tensors' own decompress_module for
    the duration (their names), their compressed parameters put back after: one block's decompressed weights at a
    time. A module with nothing compressed is left as it is."""
    layers = [(name, sub) for name, sub in module.named_modules() if _compressed(sub)]
    if not layers:
        yield []
        return
    from compressed_tensors.compressors.base import decompress_module

    kept = []
    try:
        for _, sub in layers:
            # the module's own tensors as they were, in their order (a state digest reads them in it)
            kept.append((sub, dict(sub._parameters), dict(sub._buffers), set(sub._non_persistent_buffers_set),
                         sub.quantization_status))
            decompress_module(sub)
        yield [name for name, _ in layers]
    finally:
        for sub, parameters, buffers, non_persistent, status in reversed(kept):
            sub._parameters.clear()
            sub._parameters.update(parameters)
            sub._buffers.clear()
            sub._buffers.update(buffers)
            sub._non_persistent_buffers_set.clear()
            sub._non_persistent_buffers_set.update(non_persistent)
            sub.quantization_status = status
