"""Which modules of a user's quantized model (the artifact it ships) are quantized layers, matched by module name with
its float reference, and what their weights are once dequantized.

A module is a quantized layer when the tool that made the artifact quantized it (qcore.artifact.tools reads each
tool's marks: an enabled quantizer, a quantized weight, quantization parameters), when it holds a quantized weight
of another kind (a tensor subclass with its own `dequantize()`, as torchao's `quantize_` leaves), parameters the
reference's module does not have, a replaced forward, or weights that differ from the reference's; at the finest
module where that holds. No tool is imported to find them: each leaves these marks on the modules of the model it
returns.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qcore.artifact.experts import checkpoint_experts
from qcore.artifact.offload import module_tensor
from qcore.artifact.tools import bookkeeping_module, dequantized_weight, tool_layer_format, tool_of_module
from qcore.graph.experts import ExpertProjection, QuantizedExpertProjection

__all__ = ["ArtifactLayer", "ArtifactMismatchError", "StateDigest", "artifact_layers", "changed_modules",
           "dequantized_weight", "state_digest"]

_LISTED = 8  # names listed in a mismatch error


class ArtifactMismatchError(ValueError):
    """The quantized model does not match its float reference (names, outputs, shapes)."""


@dataclass(frozen=True)
class ArtifactLayer:
    """A quantized layer of the artifact: its module name (the same in both models), the reference module's class,
    and what holds its quantization, in words."""

    name: str
    kind: str
    format: str
    weighted: bool
    # read as a QuantizedLayer is: an artifact's layer is quantized already, no quantizer setting applies to it
    per_channel: bool = True
    dynamic: bool = False
    clipping: bool = True
    equalizable: bool = False
    equalization_refusal: str = ""
    format_refusal: str = ""

    @property
    def layer(self) -> str:
        """The layer's name (its module name)."""
        return self.name

    @property
    def fqn(self) -> str:
        """Its module name."""
        return self.name

    @property
    def op(self) -> str:
        """The reference module's class."""
        return self.kind


def _plain(tensor: Any) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(module, ExpertProjection):  # its weight is a view of the fused experts' parameter
        return {"weight": module.weight, **({"bias": module.bias} if module.bias is not None else {})}
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _stateless(module: nn.Module) -> bool:
    """Whether a module holds nothing (an activation function, a dropout): where it sits does not pair layers
    (llm-compressor's linearized experts keep one activation per expert where fused experts keep one)."""
    return not _own_tensors(module) and not any(True for _ in module.children())


def _args_text(args: Any) -> str:
    if args is None:
        return "-"
    kind = f"{getattr(args, 'type', '')}{getattr(args, 'num_bits', '')}"
    strategy = str(getattr(args, "strategy", "") or "")
    strategy = strategy.split(".")[-1].lower()
    group = getattr(args, "group_size", None)
    text = f"{kind} {strategy}" + (f" {group}" if strategy == "group" and group else "")
    return text + (" dynamic" if getattr(args, "dynamic", False) is True else "")


def _same_class(a: type, b: type) -> bool:
    """Whether two classes are one by their module and name: a module imported again (pytester's in-process runs,
    an autoreload, transformers' remote code) makes the same class a new object."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _placement_forward(module: nn.Module) -> bool:
    """Whether the module's replaced forward places its tensors rather than quantizing: accelerate's hook wrapper, or
    compressed-tensors' offload wrapper (which a model loaded from its checkpoint gets at its first forward, every
    module of it, quantized or not)."""
    if "_old_forward" in vars(module) and getattr(module, "_hf_hook", None) is not None:
        return True
    return "_original_forward_func" in vars(module) and \
        type(module._parameters).__module__.startswith("compressed_tensors.offload.")


def _format(module: nn.Module, reference: nn.Module | None, weights: Any = None) -> str:
    """What holds the module's quantization, in words, from its own marks (not its class); "" for a module that is
    not quantized. `weights()`: the two weights' values, read from the offload where a model holds them on the meta
    device (module_tensor)."""
    tool_format = tool_layer_format(module)
    if tool_format is not None:
        return tool_format  # "" where the tool's quantizers are all off
    weight = getattr(module, "weight", None)
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is not None:  # compressed-tensors
        weights, inputs = getattr(scheme, "weights", None), getattr(scheme, "input_activations", None)
        return f"compressed-tensors weights {_args_text(weights)}, activations {_args_text(inputs)}"
    if isinstance(weight, torch.Tensor) and not _plain(weight):
        return type(weight).__name__
    if reference is None:
        return ""
    reference_own, own = _own_tensors(reference), _own_tensors(module)
    ref_weight = reference_own.get("weight")
    if not (isinstance(ref_weight, torch.Tensor) and ref_weight.dim() >= 2):
        return ""  # a norm's or a bias-only module's parameters may change (SmoothQuant folds scales into norms)
    extra = sorted(set(own) - set(reference_own))
    if extra:
        return f"{type(module).__name__} with {', '.join(extra)}"
    if "forward" in vars(module) and not _placement_forward(module):
        return f"{type(module).__name__} with a replaced forward"
    if isinstance(weight, torch.Tensor) and weight.shape != ref_weight.shape:
        return f"{type(module).__name__} with a weight of shape {tuple(weight.shape)}"
    if isinstance(weight, torch.Tensor):
        ours, theirs = weights() if weights is not None else (weight, ref_weight)
        if ours.device.type == "meta" or theirs.device.type == "meta":
            return ""  # nothing to compare: its weights are not held and no offload gives them
        with torch.no_grad():
            if not torch.equal(ours.detach(), theirs.detach().to(ours.dtype)):
                return f"{type(module).__name__} with changed weights"
    return ""


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def artifact_layers(reference: nn.Module, quantized: nn.Module) -> list[ArtifactLayer]:
    """The quantized layers of `quantized`, in module order: each module the tool quantized (an enabled quantizer, a
    quantized weight, quantization parameters, a replaced forward or changed weights), at the finest module where
    that holds; a module whose only mark is a changed class is a layer when nothing under it is (a container of
    quantized layers is not). Modules a tool adds for its own state are not the architecture's.
    ArtifactMismatchError listing the names that match nothing on either side (a model of another architecture,
    or modules renamed)."""
    references = dict(reference.named_modules())
    modules = [(name, module) for name, module in quantized.named_modules() if name]
    bookkeeping = [name for name, module in modules if name not in references and bookkeeping_module(module)]
    # a container the tool added around its own state only (ModelOpt's `_shared_quant_states` list) is its too
    bookkeeping += [name for name, module in modules if name not in references and not _under(name, bookkeeping)
                    and not any(True for _ in module.parameters(recurse=False))
                    and all(_under(f"{name}.{child}", bookkeeping) for child, _ in module.named_children())
                    and any(True for _ in module.children())]
    found: dict[str, str] = {}
    class_only: dict[str, str] = {}
    only_quantized: list[str] = []
    # fused experts a tool quantized in place, viewed expert by expert (qcore.graph.experts.with_experts_held): their
    # layers are the views, not the experts module that holds the tool's quantizers
    viewed = {name for name, module in modules if any(isinstance(child, QuantizedExpertProjection)
                                                      for holder in module.children() for child in holder.children())}
    for name, module in modules:
        if _under(name, bookkeeping) or _under(name, found) and name not in references or name in viewed:
            continue  # a tool's own state, or a quantized layer's own submodules
        twin = references.get(name)
        if twin is None:
            if not _stateless(module):
                only_quantized.append(name)
            continue
        text = _format(module, twin, lambda name=name: (module_tensor(quantized, f"{name}.weight"),
                                                        module_tensor(reference, f"{name}.weight")))
        if text:
            found[name] = text
        elif tool_of_module(module) is None and not _same_class(type(module), type(twin)):
            class_only[name] = type(module).__name__
    for name, text in class_only.items():  # the finest: a changed class around quantized layers is a container
        if not any(other.startswith(name + ".") for other in found):
            found[name] = text
    order = {name: index for index, (name, _) in enumerate(modules)}
    layers = []
    for name in sorted(found, key=order.__getitem__):
        weight = getattr(references[name], "weight", None)
        layers.append(ArtifactLayer(name, type(references[name]).__name__, found[name],
                                    isinstance(weight, torch.Tensor)))
    kept = {name for name, _ in modules}
    only_reference = [name for name, module in references.items()
                      if name and name not in kept and not _under(name, found) and not _stateless(module)]
    if only_quantized or only_reference:
        raise ArtifactMismatchError(
            "the quantized model's modules do not match the float reference's by name: "
            + "; ".join(f"only in the {side} ({len(names)}): {', '.join(names[:_LISTED])}"
                        + (", ..." if len(names) > _LISTED else "")
                        for side, names in (("quantized model", only_quantized), ("reference", only_reference))
                        if names)
            + ". Fix: the qmodel function must return the float model the artifact was made from (the same "
              "architecture and module names), and quantized= the artifact loaded with the same class")
    if not layers:
        experts = [path for path, block in checkpoint_experts(reference, quantized).items() if block.changed]
        if experts:
            raise ArtifactMismatchError(
                f"the quantized model's only changed modules are the fused experts of {len(experts)} MoE block(s) "
                f"({', '.join(experts[:_LISTED])}{', ...' if len(experts) > _LISTED else ''}): artifact mode "
                "compares fused experts by their weights only, and needs a quantized layer to measure. Fix: gate "
                "the recipe in simulation on the float model (qmodel(quantizer='W4A16'), say), which measures every "
                "expert")
        raise ArtifactMismatchError(
            "the quantized model holds no quantized layer: no module has an enabled quantizer, a quantized weight, "
            "quantization parameters, a replaced forward or weights that differ from the reference's. Fix: pass "
            "the quantized checkpoint as quantized=, and the float model it was made from as the model")
    return layers


def changed_modules(reference: nn.Module, quantized: nn.Module, layers: Iterable[str]) -> list[str]:
    """The modules outside `layers` whose own parameters differ from the reference's (SmoothQuant and AWQ fold
    their scales into the norms before the layers they rescale); a fused experts module's parameters that its
    expert layers among `layers` read are theirs, not an outside module's."""
    skipped = tuple(layers)
    references = dict(reference.named_modules())
    # a fused experts module's parameters are its expert layers' weights (and biases), read through views
    viewed = set()
    modules = dict(quantized.named_modules())
    for name in skipped:
        module = modules.get(name)
        if isinstance(module, ExpertProjection):
            owner = id(module.experts_module)
            viewed.update({(owner, module.fused), (owner, f"{module.fused}_bias")})
    changed = []
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if name in skipped or any(name.startswith(prefix + ".") for prefix in skipped) or name not in references:
                continue
            twin = dict(references[name].named_parameters(recurse=False))
            for key, value in module.named_parameters(recurse=False):
                if (id(module), key) in viewed:
                    continue
                other = twin.get(key)
                if not (_plain(value) and isinstance(other, torch.Tensor) and other.shape == value.shape):
                    continue
                prefix = f"{name}." if name else ""  # read from the offload where a model holds it on meta
                value, other = module_tensor(quantized, prefix + key), module_tensor(reference, prefix + key)
                if not torch.equal(value.detach(), other.detach().to(value.dtype)):
                    changed.append(name)
                    break
    return changed


def _flat_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    if _plain(tensor) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _flat_tensors(getattr(tensor, name))]


def state_digest(model: nn.Module) -> str:
    """'sha256:...' of the model's state: names, dtypes, shapes and bytes of every parameter and buffer (the inner
    tensors of a quantized tensor subclass)."""
    digest = hashlib.sha256()
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        _digest_update(digest, name, module_tensor(model, name))  # an offloaded one from its offload, one at a time
    return "sha256:" + digest.hexdigest()


def _digest_update(digest: Any, name: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        for part in _flat_tensors(value):
            digest.update(f"{name}:{part.dtype}:{tuple(part.shape)};".encode())
            data = part.detach().contiguous().cpu().reshape(-1)
            if data.numel():
                digest.update(data.view(torch.uint8).numpy())  # hashlib reads the buffer: no copy


class StateDigest:
    """state_digest of a model computed while a block-wise pass holds its tensors onloaded: the pass offers each
    module's tensors as it onloads them, and a thread hashes them in state_digest's order (hashlib lets go of the
    GIL), so that an offloaded model's state is not read from its offload a second time. A tensor never offered is
    read from the offload when its turn comes and the pass waits for it (`wait_for`) or ends (`result`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = [name for name, _ in [*model.named_parameters(), *model.named_buffers()]]
        self.index = {name: position for position, name in enumerate(self.names)}
        self.offered: dict[str, torch.Tensor] = {}
        self.position = 0  # how many names are hashed
        self.hurry_until = 0  # names before this one are read from the offload when not offered
        self.failed: BaseException | None = None
        self.abandoned = False
        self.digest = hashlib.sha256()
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="qcore-state-digest", daemon=True)
        self.thread.start()

    def offer(self, prefix: str, module: nn.Module, before: str | None = None) -> list[str]:
        """Offers the tensors `module` (at `prefix`) holds now that are not on the meta device; `before`: only
        those that come before that name in the digest's order. Returns the names offered."""
        limit = self.index.get(before, len(self.names)) if before is not None else len(self.names)
        found = []
        with self.condition:
            for name, value in [*module.named_parameters(prefix=prefix), *module.named_buffers(prefix=prefix)]:
                position = self.index.get(name)
                if position is None or position < self.position or position >= limit or name in self.offered \
                        or value.device.type == "meta":
                    continue
                self.offered[name] = value
                found.append(name)
            self.condition.notify_all()
        return found

    def wait_for(self, names: list[str]) -> None:
        """Returns once every name in `names` is hashed (the ones before them read from the offload if they were
        never offered): the pass may then let their tensors go."""
        if not names:
            return
        last = max(self.index[name] for name in names) + 1
        with self.condition:
            self.hurry_until = max(self.hurry_until, last)
            self.condition.notify_all()
            while self.position < last and self.failed is None:
                self.condition.wait()

    def result(self) -> str:
        """The digest, once every tensor is hashed (those never offered read from the offload)."""
        with self.condition:
            self.hurry_until = len(self.names)
            self.condition.notify_all()
        self.thread.join()
        if self.failed is not None:
            raise self.failed
        return "sha256:" + self.digest.hexdigest()

    def abandon(self) -> None:
        """Stops hashing (the pass failed): the thread ends and lets go of what was offered."""
        with self.condition:
            self.abandoned = True
            self.offered.clear()
            self.condition.notify_all()
        self.thread.join()

    def _run(self) -> None:
        try:
            for position, name in enumerate(self.names):
                with self.condition:
                    while name not in self.offered and position >= self.hurry_until and not self.abandoned:
                        self.condition.wait()
                    if self.abandoned:
                        return
                    value = self.offered.pop(name, None)
                _digest_update(self.digest, name, value if value is not None else module_tensor(self.model, name))
                with self.condition:
                    self.position = position + 1
                    self.condition.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the pass that asks for the result
            with self.condition:
                self.failed = error
                self.condition.notify_all()
