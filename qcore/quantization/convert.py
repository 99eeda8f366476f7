"""Convert: observers become quantize->dequantize (fake-quant) with the observed qparams."""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.capture import capture, clone_graph_module
from qcore.graph.grouped import find_grouped_ops
from qcore.graph.ops import (
    FQN_KEY,
    INSERTED_KEY,
    QUANTIZED_WHERE_READ_KEY,
    REWRITTEN_KEY,
    fetch_attr,
    few_named,
    weight_value,
)
from qcore.observe.observers import ObserverBase, calculate_qparams_together, has_qparams, laid_end_to_end
from qcore.observe.qparams import (
    KeptRowArguments,
    fake_quantize_dynamic,
    fake_quantize_finite_per_channel,
    fake_quantize_per_channel,
    fake_quantize_per_channel_steps,
    fake_quantize_per_tensor,
    fake_quantize_rows,
    fused_kernels_preferred,
    per_channel_steps,
)
from qcore.observe.segmented import (
    ExpertsObserver,
    fake_quantize_experts_where_read,
    fake_quantize_per_expert,
    with_float_experts,
)
from qcore.quantization.calibrate import calibrate
from qcore.quantization.format_quantizer import (
    FormatFakeQuantize,
    FormatObserver,
    PerExpertFormatObservers,
    fake_quantize_format,
    fake_quantize_format_per_expert,
    fake_quantize_weight,
)
from qcore.quantization.prepare import prepare
from qcore.quantization.quantizer import Int8StaticQuantizer, Quantizer
from qcore.runtime.scratch import reused_outputs

QPARAMS_KEY = "qcore_qparams"
# gm.meta of a converted graph: {(the float weight as _weight_identity tells it, how it was quantized): buffer name}
QUANTIZED_WEIGHTS_KEY = "qcore_quantized_weights"
_WHERE_READ = contextvars.ContextVar("qcore_quantize_weights_where_read", default=False)


@contextlib.contextmanager
def quantize_weights_where_read(enabled: bool = True) -> Iterator[None]:
    """Within the block, convert keeps no quantized copy of an integer-quantized weight: the converted graph
    fake-quantizes the float weight each time it reads it (the same values, bit for bit; one pass of a native
    kernel for float32), with only the qparams held. Meant for large models, where a copy per weight would add
    its bytes again to the weights' memory. The float32 weights quantized on the CPU are written into buffers
    reused within the block (qcore.runtime.scratch): a fresh allocation of their size costs more than the
    quantization."""
    token = _WHERE_READ.set(enabled)
    try:
        with reused_outputs() if enabled else contextlib.nullcontext():
            yield
    finally:
        _WHERE_READ.reset(token)


def weights_quantized_where_read() -> bool:
    """Whether weights are quantized where they are read here (within quantize_weights_where_read())."""
    return _WHERE_READ.get()


def convert(prepared: fx.GraphModule, keep_float_weights: bool = True, recompile: bool = True,
            weights_from: fx.GraphModule | None = None) -> fx.GraphModule:
    """Replace every observer node of `prepared` by fake quantization with its observed qparams (in place).

    Weights (observed get_attr values) are quantized once, here, and stored as buffers; activations get
    quantize->dequantize nodes. keep_float_weights=False drops the float weights the graph no longer reads.
    recompile=False leaves the code generation to a caller that edits the graph further before running it.
    `weights_from`: a graph converted earlier from the same float parameters (the model's, for a screen's copy):
    a parameter it quantized with the same qparams or format shares that buffer instead of being quantized again.
    """
    graph = prepared.graph
    weight_cache: dict[tuple[str, str], Any] = {}
    earlier = _QuantizedWeights(prepared, weights_from)
    reads = _HostReads(prepared)
    for node in list(graph.nodes):
        if node.meta.get(INSERTED_KEY) != "observer":
            continue
        observer = prepared.get_submodule(str(node.target))
        source = node.args[0]
        if isinstance(observer, PerExpertFormatObservers):  # each expert's rows with its own static scale
            _convert_per_expert_format_node(prepared, node, source, observer)
            continue
        if isinstance(observer, FormatObserver):
            _convert_format_node(prepared, node, source, observer, weight_cache, earlier)
            continue
        if isinstance(observer, ExpertsObserver):
            with graph.inserting_before(node):
                replacement = _segmented_node(prepared, node, source, observer, weight_cache, reads, earlier)
            replacement.meta.update({k: v for k, v in node.meta.items() if k.startswith("qcore_") or k == "val"})
            replacement.meta[INSERTED_KEY] = "qdq"
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            continue
        if getattr(observer, "is_float", False) and observer.dtype == torch.float32:
            node.replace_all_uses_with(source)  # a float32 spec keeps the tensor as it is
            graph.erase_node(node)
            continue
        with graph.inserting_before(node):
            if (_is_float_weight(source) and not observer.is_dynamic
                    and not getattr(observer, "is_float", False)):
                replacement = _quantized_weight_node(prepared, source, node.target, observer, weight_cache, reads,
                                                     earlier)
            else:
                replacement = _qdq_node(prepared, node, source, observer, reads)
        replacement.meta.update({k: v for k, v in node.meta.items() if k.startswith("qcore_") or k == "val"})
        replacement.meta[INSERTED_KEY] = "qdq"
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    reads.warn_unreached()
    _move_weight_quantization_to_first_reader(graph)
    for node in list(graph.nodes):  # rewritten weights that only fed weight observers
        if node.meta.get(REWRITTEN_KEY) and not node.users:
            graph.erase_node(node)
    unread = set()
    for node in list(graph.nodes):  # float weights that only fed weight observers
        if node.op == "get_attr" and not node.users:
            unread.add(str(node.target))
            graph.erase_node(node)
    if not keep_float_weights:
        unread -= {str(node.target) for node in graph.nodes if node.op == "get_attr"}
        for target in unread:
            owner, _, name = target.rpartition(".")
            delattr(prepared.get_submodule(owner) if owner else prepared, name)
    for name, module in list(prepared.named_children()):
        if isinstance(module, ObserverBase):
            delattr(prepared, name)
    graph.lint()
    if recompile:
        prepared.recompile()
    return prepared


def _convert_format_node(gm: fx.GraphModule, node: fx.Node, source: Any, observer: FormatObserver,
                         weight_cache: dict[tuple[str, str], str], earlier: _QuantizedWeights) -> None:
    """A deployed format's observer node becomes a fake-quantized weight buffer, or a FormatFakeQuantize call."""
    graph = gm.graph
    meta = {"format": repr(observer.format), "dynamic": observer.format.dynamic}
    with graph.inserting_before(node):
        if _is_float_weight(source):
            key = (_float_weight_name(source), str(node.target))
            if key not in weight_cache:
                weight = weight_value(gm, source)
                weight_cache[key] = _free_name(gm, "qcore_fq_" + key[0].replace(".", "_"))
                earlier.register(weight_cache[key], source, weight, ("format", repr(observer.format),
                                                                     bool(observer.transposed),
                                                                     bool(getattr(observer, "grouped_weight", False))),
                                 lambda: fake_quantize_weight(observer.format, weight.detach(), observer.transposed,
                                                              getattr(observer, "grouped_weight", False)))
            replacement = graph.get_attr(weight_cache[key])
            replacement.meta["qcore_float_weight"] = key[0]
        else:
            name = _free_name(gm, f"qcore_format_{node.name}")
            gm.add_submodule(name, FormatFakeQuantize(observer.format, observer.amax))
            replacement = graph.call_function(fake_quantize_format, (source, graph.get_attr(name)))
    replacement.meta.update({k: v for k, v in node.meta.items() if k.startswith("qcore_") or k == "val"})
    replacement.meta[QPARAMS_KEY] = meta
    replacement.meta[INSERTED_KEY] = "qdq"
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _convert_per_expert_format_node(gm: fx.GraphModule, node: fx.Node, source: Any,
                                    observer: PerExpertFormatObservers) -> None:
    """A grouped projection's per-expert format observers' node as one call quantizing each expert's rows with the
    amax its observer saw (fake_quantize_format_per_expert)."""
    graph = gm.graph
    name = _free_name(gm, f"qcore_format_{node.name}")
    gm.add_submodule(name, observer.fake_quantizers())
    with graph.inserting_before(node):
        replacement = graph.call_function(fake_quantize_format_per_expert, (source, node.args[1], graph.get_attr(name)))
    replacement.meta.update({k: v for k, v in node.meta.items() if k.startswith("qcore_") or k == "val"})
    replacement.meta[QPARAMS_KEY] = {"format": repr(observer.format), "dynamic": observer.format.dynamic}
    replacement.meta[INSERTED_KEY] = "qdq"
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _segmented_node(gm: fx.GraphModule, node: fx.Node, source: Any, observer: ExpertsObserver,
                    cache: dict[tuple[str, str], Any], reads: _HostReads, earlier: _QuantizedWeights) -> fx.Node:
    """A grouped projection's observer node as fake quantization per expert: its [E, ...] weight quantized once into
    a buffer, or its rows by expert fake-quantized each with its expert's qparams (an expert no batch reached with
    scale 1 and zero point 0, named in convert's warning)."""
    graph = gm.graph
    if _is_float_weight(source):
        key = (_float_weight_name(source), str(node.target))
        if key not in cache:
            weight = weight_value(gm, source)
            if reads.saw_nothing(observer):  # not calibrated: the weight is known, observe it here
                observer.observe_constant(weight.detach())
                reads.observed(observer)
            if _WHERE_READ.get() and weight.dim() == 3:  # a large model: quantized from the float weight where read
                cache[key] = None
        if cache.get(key, "") is None:
            new = _read_experts_weight_quantized_where_used(gm, source, "qcore_fq_" + key[0].replace(".", "_"),
                                                            observer)
            new.meta["qcore_float_weight"] = key[0]
            new.meta[QPARAMS_KEY] = _qparams_meta(observer, reads.values(observer))
            return new
        if key not in cache:
            meta = _qparams_meta(observer, reads.values(observer))
            cache[key] = _free_name(gm, "qcore_fq_" + key[0].replace(".", "_"))
            earlier.register(cache[key], source, weight,
                             ("qparams", type(observer).__qualname__, qparams_meta_digest(meta),
                              observer.float_experts),
                             lambda: with_float_experts(observer.fake_quantize_weight(weight.detach()),
                                                        weight.detach(), observer.float_experts))
        new = graph.get_attr(cache[key])
        new.meta["qcore_float_weight"] = key[0]
    else:
        counts = node.args[1]
        scale, zero_point = observer.calculate_qparams()
        reached = observer.observed.tolist()
        if not all(reached):
            reads.unreached.extend(_expert_readers(gm, node, [
                expert for expert, seen in enumerate(reached)
                if not seen and expert not in observer.float_experts and expert not in observer.dynamic_experts]))
        base = _free_name(gm, f"qcore_qparams_{node.name}")
        gm.register_buffer(base + "_scale", scale.detach().float().clone())
        gm.register_buffer(base + "_zero_point", zero_point.detach().clone())
        # the rows of the experts left in float pass as they are; those of dynamic experts take their own qparams
        masks = {suffix: _experts_mask(gm, base + suffix, observer.experts, experts, scale.device)
                 for suffix, experts in (("_kept_float", observer.float_experts),
                                         ("_dynamic", observer.dynamic_experts))}
        new = graph.call_function(fake_quantize_per_expert, (
            source, counts, graph.get_attr(base + "_scale"), graph.get_attr(base + "_zero_point"),
            observer.quant_min, observer.quant_max, masks["_kept_float"], masks["_dynamic"], observer.symmetric))
    new.meta[QPARAMS_KEY] = _qparams_meta(observer, reads.values(observer))
    return new


def _read_experts_weight_quantized_where_used(gm: fx.GraphModule, source: fx.Node, name: str,
                                              observer: ExpertsObserver) -> fx.Node:
    """A node (at the insertion point) fake-quantizing a grouped projection's float [E, ...] weight `source` reads
    each time it runs, with each expert's qparams as buffers (fake_quantize_experts_where_read), no quantized copy;
    the experts kept in float read the float weight's slices."""
    scale, zero_point = observer.calculate_qparams()
    name = _free_name(gm, name)
    gm.register_buffer(name + "_scale", scale.detach().clone())
    gm.register_buffer(name + "_zero_point", zero_point.detach().clone())
    node = gm.graph.call_function(fake_quantize_experts_where_read, (
        source, gm.graph.get_attr(name + "_scale"), gm.graph.get_attr(name + "_zero_point"), observer.quant_min,
        observer.quant_max, tuple(observer.float_experts)))
    node.meta[QUANTIZED_WHERE_READ_KEY] = True
    return node


def _experts_mask(gm: fx.GraphModule, name: str, count: int, experts: tuple[int, ...],
                  device: torch.device) -> fx.Node | None:
    """A get_attr of an [E] bool buffer `name` marking `experts`; None when there are none."""
    if not experts:
        return None
    mask = torch.zeros(count, dtype=torch.bool, device=device)
    mask[list(experts)] = True
    gm.register_buffer(name, mask)
    return gm.graph.get_attr(name)


def _expert_readers(gm: fx.GraphModule, node: fx.Node, experts: list[int]) -> list[str]:
    """The names of what reads `experts`' rows of an observed value, as the per-expert graph names them: each
    expert's layer of a grouped projection (`block.3.down_proj`), else the reading op's module."""
    grouped = {op.node: op for op in find_grouped_ops(gm)}
    return [grouped[user].layers[expert] if user in grouped else str(user.meta.get(FQN_KEY) or user.name)
            for expert in experts for user in node.users]


def _free_name(gm: nn.Module, name: str) -> str:
    while hasattr(gm, name):
        name += "_"
    return name


def _qparams_meta(observer: ObserverBase, values: _QParamsValues) -> dict[str, Any]:
    scale, zero_point, low, high = (_compact(value) for value in values)
    meta = {"dtype": str(observer.dtype), "quant_min": observer.quant_min, "quant_max": observer.quant_max,
            "qscheme": str(observer.qscheme), "ch_axis": observer.ch_axis, "eps": float(observer.eps),
            "scale": scale, "zero_point": zero_point}
    if low is not None and high is not None:  # the observed range, before any clipping
        meta["min_val"], meta["max_val"] = low, high
    return meta


# per tensor, lists of one value; per channel, host arrays (_read_values) or lists
_QParamsValues = tuple[Sequence[float], Sequence[Any], "Sequence[float] | None", "Sequence[float] | None"]


def _compact(values: Sequence[Any] | None) -> Any:
    """A per-channel list of host values as an array.array (8 bytes a value where a list holds a 32-byte object per
    channel: a converted LLM's weights have hundreds of thousands); an array, or a per-tensor one (one value), as it
    is."""
    if values is None or len(values) <= 1 or isinstance(values, array):
        return values
    return array("q" if type(values[0]) is int else "d", values)  # one tensor's tolist(): one type


class _HostReads:
    """What convert reads of its observers on the host (whether each saw anything; qparams and observed ranges for
    the graph's metadata and constants), read in one copy per kind and device instead of a few per observer: each
    read of a GPU tensor waits for the device."""

    def __init__(self, prepared: fx.GraphModule) -> None:
        self.observers = [prepared.get_submodule(str(node.target)) for node in prepared.graph.nodes
                          if node.meta.get(INSERTED_KEY) == "observer"]
        ranged = [o for o in dict.fromkeys(self.observers) if isinstance(getattr(o, "min_val", None), torch.Tensor)
                  and isinstance(getattr(o, "max_val", None), torch.Tensor)]
        self.nothing = _saw_nothing_together(ranged)
        self._values: dict[ObserverBase, _QParamsValues] | None = None
        self.unreached: list[str] = []  # the ops reading a tensor that no calibration batch reached

    def warn_unreached(self) -> None:
        """One warning for every tensor calibration never reached, naming the ops that read them (an MoE model's
        unreached experts are many: one warning each would bury the rest)."""
        names = list(dict.fromkeys(self.unreached))
        if names:
            warnings.warn(f"no calibration batch reached the inputs of {len(names)} op(s) ({few_named(names)}): they "
                          "are quantized with scale 1.0 and zero point 0, as torch.ao's convert does", stacklevel=3)

    def saw_nothing(self, observer: ObserverBase) -> bool:
        """Whether an observer is in its initial state (no batch reached it; NaN or inf values are not nothing)."""
        return observer in self.nothing

    def observed(self, observer: ObserverBase) -> None:
        """An observer convert itself fed (a weight no batch reached) has now seen something."""
        self.nothing.discard(observer)

    def values(self, observer: ObserverBase) -> _QParamsValues:
        """The observer's (scale, zero point, observed min, observed max) as lists: those of every observer still to
        convert computed together and read at once, the first time one is asked for."""
        if self._values is None or observer not in self._values:
            wanted = [o for o in dict.fromkeys(self.observers) if o not in self.nothing
                      and not isinstance(o, FormatObserver) and not o.is_dynamic and not getattr(o, "is_float", False)]
            if observer not in wanted:
                wanted.append(observer)
            calculate_qparams_together(wanted)
            self._values = _read_values(wanted)
        return self._values[observer]


def _saw_nothing_together(observers: list[nn.Module]) -> set[ObserverBase]:
    """The observers still in their initial state, with one host read per device."""
    nothing = {o for o in observers if o.min_val.numel() == 0}
    by_device: dict[torch.device, list[nn.Module]] = {}
    for observer in observers:
        if observer not in nothing and not has_qparams(observer):
            by_device.setdefault(observer.min_val.device, []).append(observer)
    for members in by_device.values():
        # amin is +inf only where every value is +inf
        lows = laid_end_to_end([o.min_val if o.min_val.numel() == 1 else o.min_val.amin() for o in members])
        highs = laid_end_to_end([o.max_val if o.max_val.numel() == 1 else o.max_val.amax() for o in members])
        initial = torch.isposinf(lows) & torch.isneginf(highs)
        nothing.update(o for o, flag in zip(members, initial.tolist()) if flag)
    return nothing


def _read_values(observers: list[ObserverBase]) -> dict[ObserverBase, _QParamsValues]:
    """Each observer's qparams and observed range as host lists: a copy per device, dtype and rank (scalar or
    not)."""
    columns: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
    places = []
    for observer in observers:
        reader = getattr(observer, "memoized_qparams", observer.calculate_qparams)
        parts = list(reader())
        low, high = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
        if isinstance(low, torch.Tensor) and isinstance(high, torch.Tensor):
            parts += [low.float(), high.float()]
        place = []
        for part in parts:
            key = (part.device, part.dtype, part.dim() == 0)  # scalars stacked, the rest laid end to end
            column = columns.setdefault(key, [])
            place.append((key, len(column)))
            column.append(part)
        places.append((observer, place))
    host: dict[tuple[torch.device, torch.dtype, bool], list[Any]] = {}
    for key, column in columns.items():
        laid = laid_end_to_end(column)
        # per-channel values as arrays made from the tensor's bytes (_compact keeps them), not one Python object a
        # value: an MoE's converts read millions; a per-tensor value, and a scalar, as a list
        flat: Any = laid.tolist() if key[2] else _host_array(laid)
        at, lists = 0, []
        for part in column:
            piece = flat[at:at + part.numel()]
            lists.append(piece.tolist() if isinstance(piece, array) and len(piece) <= 1 else piece)
            at += part.numel()
        host[key] = lists
    values: dict[ObserverBase, _QParamsValues] = {}
    for observer, place in places:
        lists = [host[key][index] for key, index in place]
        values[observer] = (lists[0], lists[1], lists[2] if len(lists) > 2 else None,
                            lists[3] if len(lists) > 3 else None)
    return values


def _host_array(values: torch.Tensor) -> array:
    """A tensor's values in one host array: float64 ("d") for a floating dtype, int64 ("q") for any other, the values
    tolist() gives (float32, float16 and bfloat16 values are float64 values exactly)."""
    floating = values.is_floating_point()
    laid = values.detach().to("cpu", torch.float64 if floating else torch.int64).contiguous()
    host = array("d" if floating else "q")
    host.frombytes(laid.numpy().tobytes())
    return host


def fake_quantize_with(observer: ObserverBase, value: torch.Tensor, values: _QParamsValues | None = None
                       ) -> torch.Tensor:
    """Fake-quantize a tensor with an observer's qparams (per tensor or per channel); `values`: those qparams
    already read to the host (convert's lists: a per-tensor one's constants; for a per-channel one, whether torch's
    fused kernel gives the same values in one op, on the torch path)."""
    # only read here: a memo's own tensors, not copies of them
    scale, zero_point = getattr(observer, "memoized_qparams", observer.calculate_qparams)()
    if observer.per_channel:
        if values is not None and fused_kernels_preferred(value) and _fused_kernel_takes(values, observer):
            return fake_quantize_finite_per_channel(value, scale.to(torch.float32), zero_point.to(torch.int32),
                                                    observer.ch_axis or 0, observer.quant_min, observer.quant_max)
        return fake_quantize_per_channel(value, scale, zero_point, observer.ch_axis or 0, observer.quant_min,
                                         observer.quant_max)
    if values is not None:
        return fake_quantize_per_tensor(value, values[0][0], int(values[1][0]), observer.quant_min,
                                        observer.quant_max)
    return fake_quantize_per_tensor(value, float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0]),
                                    observer.quant_min, observer.quant_max)


def _is_float_weight(source: Any) -> bool:
    """A parameter read, or a rewritten weight computed from one (qcore.graph.deferred)."""
    return isinstance(source, fx.Node) and (source.op == "get_attr" or bool(source.meta.get(REWRITTEN_KEY)))


def _float_weight_name(source: fx.Node) -> str:
    """The attribute path of a float weight node's parameter (the original, for a rewritten one)."""
    return str(source.meta["qcore_float_weight"]) if source.meta.get(REWRITTEN_KEY) else str(source.target)


def _quantized_weight_node(gm, source: fx.Node, observer_name, observer, cache, reads: _HostReads,
                           earlier: _QuantizedWeights) -> fx.Node:
    key = (_float_weight_name(source), str(observer_name))
    meta = None
    if key not in cache:
        weight = weight_value(gm, source)
        with torch.no_grad():
            if reads.saw_nothing(observer):  # not calibrated: the weight is known, observe it here
                observer(weight.detach())
                reads.observed(observer)
            if _WHERE_READ.get():  # a large model: quantized from the float weight where it is read
                cache[key] = None
            else:
                values = reads.values(observer)
                meta = _qparams_meta(observer, values)
                cache[key] = _free_name(gm, "qcore_fq_" + key[0].replace(".", "_"))
                earlier.register(cache[key], source, weight,
                                 ("qparams", type(observer).__qualname__, qparams_meta_digest(meta)),
                                 lambda: fake_quantize_with(observer, weight.detach(), values))
    if cache[key] is None:
        node = _read_weight_quantized_where_used(gm, source, "qcore_fq_" + key[0].replace(".", "_"), observer,
                                                 reads.values(observer))
    else:
        node = gm.graph.get_attr(cache[key])
    node.meta[QPARAMS_KEY] = meta if meta is not None else _qparams_meta(observer, reads.values(observer))
    node.meta["qcore_float_weight"] = key[0]
    return node


class _QuantizedWeights:
    """The weights a converted graph quantized from its float parameters, by the parameter and how it was
    quantized (gm.meta[QUANTIZED_WEIGHTS_KEY]): what a later convert of a copy of the same float graph finds there
    instead of quantizing the same weight with the same qparams again (a screen's copy that changes the
    activations' observers only quantizes every weight of its layers as the model's convert did)."""

    def __init__(self, gm: fx.GraphModule, earlier: fx.GraphModule | None) -> None:
        self.gm, self.earlier = gm, earlier
        self.known = earlier.meta.get(QUANTIZED_WEIGHTS_KEY, {}) if earlier is not None else {}

    def find(self, source: fx.Node, weight: torch.Tensor, how: tuple) -> torch.Tensor | None:
        """The earlier graph's quantized copy of `weight` made `how`, or None."""
        identity = _weight_identity(source, weight)
        name = self.known.get((identity, how)) if identity is not None else None
        return fetch_attr(self.earlier, name) if name is not None else None

    def register(self, buffer: str, source: fx.Node, weight: torch.Tensor, how: tuple,
                 quantize: Callable[[], torch.Tensor]) -> None:
        """Register as `buffer` of this graph `weight` quantized `how`: the earlier graph's copy where it has one,
        else quantize()'s; and record it for a later convert."""
        quantized = self.find(source, weight, how)
        if quantized is None:
            with torch.no_grad():
                quantized = quantize()
        self.gm.register_buffer(buffer, quantized)
        identity = _weight_identity(source, weight)
        if identity is not None:
            self.gm.meta.setdefault(QUANTIZED_WEIGHTS_KEY, {})[identity, how] = buffer


def _weight_identity(source: fx.Node, weight: torch.Tensor) -> tuple | None:
    """A float parameter as it is now: its path, memory, layout and version (a rewritten weight, computed from a
    parameter, has none: its values are not the parameter's; nor has one without memory, on the meta device)."""
    if source.op != "get_attr" or source.meta.get(REWRITTEN_KEY) or weight.device.type == "meta":
        return None
    return (str(source.target), weight.device.type, weight.data_ptr(), tuple(weight.shape), weight.stride(),
            weight.dtype, weight._version)


def qparams_meta_digest(meta: Mapping[str, Any]) -> str:
    """A digest of a converted weight node's qparams meta (QPARAMS_KEY): equal for equal qparams, per-channel arrays
    read by their machine values."""
    digest = hashlib.sha256()
    for key, value in sorted(meta.items()):
        for part in (repr(key).encode(), _digest_bytes(value)):  # each part length-prefixed: no two read alike
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def _digest_bytes(value: Any) -> bytes:
    """A qparams entry as bytes: a per-channel array's machine values as they are (writing each float's repr
    costs about a microsecond a channel, and an MoE block has hundreds of thousands), any other entry's repr."""
    if isinstance(value, array):
        return b"array:" + value.typecode.encode() + value.tobytes()
    return repr(value).encode()


_KEPT_ROW_ARGUMENTS = KeptRowArguments()  # a weight quantized where read is read every batch of every pass


def fake_quantize_where_read(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
                             quant_min: int, quant_max: int) -> torch.Tensor:
    """fake_quantize_per_channel of a weight where it is read, into a reused buffer where one is free (its result
    lives until its layer's matmul: qcore.runtime.scratch); the native kernel's arguments made once per qparams."""
    arguments = _KEPT_ROW_ARGUMENTS.arguments(x, scale, zero_point, axis, quant_min, quant_max)
    if arguments is not None:
        return fake_quantize_rows(x, arguments, reuse_output=True)
    return fake_quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max, reuse_output=True)


def fake_quantize_over_input(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
                             quant_min: int, quant_max: int) -> torch.Tensor:
    """fake_quantize_per_channel written over x, a tensor made for this call alone (a rewritten weight)."""
    return fake_quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max, in_place=True)


def _read_weight_quantized_where_used(gm: fx.GraphModule, source: fx.Node, name: str, observer: ObserverBase,
                                      values: _QParamsValues) -> fx.Node:
    """A node (at the insertion point) computing fake_quantize_with(observer, the float weight `source` reads) each
    time it runs: the observer's qparams as buffers (per channel) or constants (per tensor), no quantized copy."""
    graph = gm.graph
    if observer.per_channel:
        scale, zero_point = observer.calculate_qparams()
        name = _free_name(gm, name)
        # a rewritten weight made for this read alone is quantized over itself: no second copy of an LM head
        alone = bool(source.meta.get(REWRITTEN_KEY)) and len(source.users) == 1
        weight = fetch_attr(gm, _float_weight_name(source))  # its dtype and device: a rule keeps them
        axis = observer.ch_axis or 0
        if (weight.dtype == torch.float32 and weight.is_cpu) or zero_point.is_floating_point():
            gm.register_buffer(name + "_scale", scale)  # the native kernel's path, or float zero points
            gm.register_buffer(name + "_zero_point", zero_point)
            node = graph.call_function(fake_quantize_over_input if alone else fake_quantize_where_read, (
                source, graph.get_attr(name + "_scale"), graph.get_attr(name + "_zero_point"), axis,
                observer.quant_min, observer.quant_max))
        elif fused_kernels_preferred(weight) and _fused_kernel_takes(values, observer):
            # one op (and a 0.0 added in place), where the chain is five or more per chunk of rows; for a rewritten
            # weight read alone the result is a second weight-sized tensor while the op runs, as any read makes
            gm.register_buffer(name + "_scale", scale.to(torch.float32))
            gm.register_buffer(name + "_zero_point", zero_point.to(torch.int32))
            node = graph.call_function(fake_quantize_finite_per_channel, (
                source, graph.get_attr(name + "_scale"), graph.get_attr(name + "_zero_point"), axis,
                observer.quant_min, observer.quant_max))
        else:  # torch ops, with the qparams laid out once, not at every read
            steps = per_channel_steps(scale, zero_point, axis, weight)
            kept = ("_scale", "_inverse_scale") if all(z == 0 for z in values[1]) else (
                "_scale", "_inverse_scale", "_zero_point")
            for suffix, step in zip(kept, steps):
                gm.register_buffer(name + suffix, step)
            reads = [graph.get_attr(name + suffix) for suffix in kept]
            node = graph.call_function(fake_quantize_per_channel_steps, (
                source, *reads, *([None] if len(reads) == 2 else []), axis, observer.quant_min, observer.quant_max,
                alone))
    else:
        node = graph.call_function(fake_quantize_per_tensor, (
            source, values[0][0], int(values[1][0]), observer.quant_min, observer.quant_max))
    node.meta[QUANTIZED_WHERE_READ_KEY] = True
    return node


def _fused_kernel_takes(values: _QParamsValues, observer: ObserverBase) -> bool:
    """Whether torch's fused per-channel kernel quantizes the weight an observer saw as fake_quantize_per_channel
    does (fake_quantize_finite_per_channel): zero points all 0, and a finite range (no NaN or inf in the weight)
    whose largest magnitude over the smallest scale is well inside int64. Read from the host lists convert has."""
    scales, zero_points, lows, highs = values
    if lows is None or highs is None or not scales or any(z != 0 for z in zero_points):
        return False
    if max(abs(observer.quant_min), abs(observer.quant_max)) > 1 << 16:
        return False
    ranges = [*lows, *highs]
    if not all(math.isfinite(v) for v in ranges):  # max() would pass a NaN by
        return False
    smallest = min(scales)
    return smallest > 0 and max(abs(v) for v in ranges) / smallest < 2.0 ** 60


def _move_weight_quantization_to_first_reader(graph: fx.Graph) -> None:
    """Move each weight quantized where it is read (and its reads) to just before its first user: at the graph's
    top, where the weight observers were, every layer's quantized weight would be alive at once."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.meta.get(QUANTIZED_WHERE_READ_KEY)]:
        if not node.users:
            continue
        first = min(node.users, key=lambda user: order[user])
        first.prepend(node)
        for value in node.all_input_nodes:
            if len(value.users) == 1:
                node.prepend(value)


def round_trip_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to a lower-precision float dtype and back (the float16/bfloat16 'quantization' of a float spec)."""
    return x.to(dtype).to(x.dtype)


def _qdq_node(gm, node: fx.Node, source, observer: ObserverBase, reads: _HostReads) -> fx.Node:
    if getattr(observer, "is_float", False):
        new = gm.graph.call_function(round_trip_through, (source, observer.dtype))
        new.meta[QPARAMS_KEY] = {"dtype": str(observer.dtype)}
        return new
    if observer.is_dynamic:
        new = gm.graph.call_function(fake_quantize_dynamic, (source, observer.quant_min, observer.quant_max,
                                                             observer.symmetric))
        new.meta[QPARAMS_KEY] = {"dynamic": True, "quant_min": observer.quant_min, "quant_max": observer.quant_max}
        return new
    if reads.saw_nothing(observer) and not observer.per_channel:
        # calibration never reached this tensor: torch.ao's convert warns and uses scale 1 and zero point 0
        reads.unreached.extend(str(user.meta.get(FQN_KEY) or user.name) for user in node.users)
        values: _QParamsValues = ([1.0], [0], [float("inf")] * observer.min_val.numel(),
                                  [float("-inf")] * observer.max_val.numel())
    else:
        values = reads.values(observer)
    if observer.per_channel:
        scale, zero_point = observer.calculate_qparams()
        base = f"qcore_qparams_{node.name}"
        gm.register_buffer(base + "_scale", scale.detach().float().clone())
        gm.register_buffer(base + "_zero_point", zero_point.detach().clone())
        args: tuple = (source, gm.graph.get_attr(base + "_scale"), gm.graph.get_attr(base + "_zero_point"),
                observer.ch_axis or 0, observer.quant_min, observer.quant_max)
        new = gm.graph.call_function(fake_quantize_per_channel, args)
    else:
        args = (source, values[0][0], int(values[1][0]), observer.quant_min, observer.quant_max)
        new = gm.graph.call_function(fake_quantize_per_tensor, args)
    new.meta[QPARAMS_KEY] = _qparams_meta(observer, values)
    return new


def restore_model_state(quant_gm: nn.Module, float_gm: nn.Module) -> list[str]:
    """Give `quant_gm` the float model's buffers back (running statistics, caches that forward updates
    during calibration), so that the two are compared from the same state; returns the names restored."""
    restored = []
    quant_buffers = dict(quant_gm.named_buffers())
    for name, value in float_gm.named_buffers():
        target = quant_buffers.get(name)
        if target is not None and target.shape == value.shape and not torch.equal(target, value.to(target.device)):
            target.copy_(value)
            restored.append(name)
    return restored


def quantize(
    model: nn.Module,
    example_inputs: Any,
    calibration: Iterable[Any],
    quantizer: Quantizer | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Capture, prepare, calibrate and convert in one call; returns (float_gm, quant_gm)."""
    float_gm = capture(model, example_inputs)
    prepared = prepare(clone_graph_module(float_gm), quantizer or Int8StaticQuantizer())
    calibrate(prepared, calibration)
    quant_gm = convert(prepared)
    restore_model_state(quant_gm, float_gm)
    return float_gm, quant_gm


__all__ = ["convert", "quantize", "fake_quantize_over_input", "fake_quantize_where_read", "fake_quantize_with",
           "quantize_weights_where_read",
           "weights_quantized_where_read", "restore_model_state",
           "round_trip_through",
           "qparams_meta_digest", "QPARAMS_KEY", "QUANTIZED_WEIGHTS_KEY", "FQN_KEY"]
