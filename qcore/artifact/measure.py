"""One pass of the float reference and one of the quantized model per batch, in eager mode, with forward hooks by
module name: each quantized layer's output against the reference's (propagated error), the quantized layer run on the
reference's input of the same layer (shadow: its own error), the weights, and the model outputs and logits.

Nothing is kept across batches but streaming sums on the model's device: within a batch, the reference's layer
inputs and outputs wait for the quantized pass. The sums come to the host once, at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from qcore.artifact.layers import ArtifactLayer, ArtifactMismatchError, changed_modules, dequantized_weight
from qcore.artifact.offload import decompress_pending, module_tensor, read_from_offload
from qcore.artifact.weights import WeightFit, input_channel_scales, weight_fit
from qcore.graph.capture import without_kv_cache
from qcore.graph.experts import ExpertProjection, QuantizedExpertProjection, held_expert_layers
from qcore.graph.inputs import call_model
from qcore.measure.passes import LayerSqnr, OutputSqnr, SqnrMeasurement
from qcore.numeric.loggers import StreamingComparator
from qcore.numeric.logits import LogitsComparator, LogitsMeasurement

__all__ = ["RECORD_LIMIT_BYTES", "RESCALED_GAIN_DB", "ArtifactError", "ArtifactMeasurement", "ArtifactRun",
           "StreamRecord", "float_layers_swapped", "input_channel_scales", "measure_artifact", "measure_artifacts",
           "quantized_forward_error"]

# a layer whose weight matches the reference's this much better once each input channel is rescaled was rescaled
# (SmoothQuant, AWQ): quantization noise alone is nearly orthogonal to the weight, so the fit gains ~0 dB
RESCALED_GAIN_DB = 3.0

# a whole pass keeps the stream fix trials resume from (the quantized stream at each block's input and the
# reference's outputs) for its first batches only, the ones fix searches screen on: what it holds does not grow
# with the number of batches; and only while that holds at most this much, else the screens record their own
RECORD_LIMIT_BYTES = 256 << 20


class ArtifactError(RuntimeError):
    """The quantized model could not be measured against its reference (a forward that raises, NaN)."""


@dataclass(frozen=True)
class ArtifactMeasurement:
    """The artifact against its reference over some batches: per layer and per output leaf (SqnrMeasurement, the
    same records as a simulated model's), the logits when asked for, the layers whose own error cannot be measured
    and why, and the layers in the order the quantized model ran them."""

    sqnr: SqnrMeasurement
    logits: LogitsMeasurement | None
    not_comparable: Mapping[str, str]
    order: tuple[str, ...]
    expert_fits: Mapping[str, WeightFit] = field(default_factory=dict)  # {expert layer: its weight's fit}
    digest: str = ""  # the quantized model's state_digest, when the pass computed it (block by block)


class StreamRecord:
    """What a fix trial resumes from: the quantized stream at each block's input and after the last block, and the
    reference's outputs, per batch of one batch list, as the artifact computes them with its own float layers."""

    def __init__(self) -> None:
        self.inputs: list[list[tuple[tuple, dict]]] = []  # per block, per batch: the quantized block's (args, kwargs)
        self.last: list[Any] = []  # per batch: the last quantized block's output
        self.expected: list[Any] = []  # per batch: the reference model's output
        self.complete = False
        self.chained = True  # False once a block's stream input was seen not to be the previous block's output


def _detached(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def _stream_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _stream_of(value: Any) -> Any:
    """The stream a block returns (itself, or the first tensor of a tuple), or a block's stream input."""
    return value if isinstance(value, torch.Tensor) else next(
        (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)


class _StreamRecorder:
    """Fills a StreamRecord during a whole pass, from hooks on the quantized model's blocks of `stack`; gives up (an
    empty, incomplete record) past `limit` bytes, or when a block's stream input is not the previous block's output
    (the model computes between its blocks: a trial could not resume from the stream)."""

    def __init__(self, record: StreamRecord, quantized: nn.Module, stack: str, limit: int) -> None:
        self.record, self.limit, self.bytes, self.given_up = record, limit, 0, False
        blocks = quantized.get_submodule(stack)
        record.inputs = [[] for _ in blocks]
        self.previous: Any = None  # the stream the last block that ran returned
        self.handles = [block.register_forward_pre_hook(self._entered(index), with_kwargs=True)
                        for index, block in enumerate(blocks)]
        self.handles += [block.register_forward_hook(self._returned) for block in blocks]
        self.handles.append(blocks[-1].register_forward_hook(self._left))

    def _returned(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.previous = _stream_of(output)

    def _give_up(self) -> None:
        self.given_up = True
        self.record.inputs, self.record.last, self.record.expected = [], [], []

    def stop(self) -> None:
        """Record no further batch."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _entered(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.given_up:
                return
            stream = args[0] if args else kwargs.get("hidden_states")
            if index > 0 and (stream is None or stream is not self.previous):
                self.record.chained = False
                self._give_up()
                return
            self.record.inputs[index].append(_detached((args, kwargs)))
            self._count(stream)  # masks and embeddings are the blocks' own
        return hook

    def _left(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.given_up:
            self.record.last.append(_detached(output))
            self._count(output)

    def expected(self, output: Any) -> None:
        """The reference's output for the batch the pass is on."""
        if not self.given_up and self.handles:
            self.record.expected.append(_detached(output))
            self._count(output)

    def _count(self, value: Any) -> None:
        self.bytes += _stream_bytes(value)
        if self.bytes > self.limit:
            self._give_up()

    def finish(self, batches: int) -> None:
        """Remove the hooks; the record is complete when every block saw each of the `batches` first batches once."""
        self.stop()
        record = self.record
        record.complete = not self.given_up and len(record.last) == len(record.expected) == batches and all(
            len(entries) == batches for entries in record.inputs)
        if not record.complete:
            record.inputs, record.last, record.expected = [], [], []


@dataclass(frozen=True)
class ArtifactRun:
    """One artifact of a pass shared with others of the same reference: the quantized model and its layers, the
    reference's modules swapped in at `float_layers`, the only layers measured (`focus`, None: every one) and
    whether its logits are compared."""

    quantized: nn.Module
    layers: Sequence[ArtifactLayer]
    float_layers: tuple[str, ...] = ()
    focus: frozenset[str] | None = None
    logits: bool = False

    def measured_names(self) -> list[str]:
        """The layers this run measures, in the artifact's module order."""
        return [layer.name for layer in self.layers if self.focus is None or layer.name in self.focus]


class _FloatLayer(nn.Module):
    """The reference's module in place of a quantized one: its input cast to the reference's dtype, its output back
    to the dtype the quantized model runs in. `input_quantizer`: a quantizer the tool shares between this layer and
    others, which keeps quantizing its input (ModelOpt's one input quantizer for all the experts of a projection)."""

    def __init__(self, reference: nn.Module, input_quantizer: nn.Module | None = None) -> None:
        super().__init__()
        self.reference = reference
        self.__dict__["input_quantizer"] = input_quantizer  # the tool's, not this layer's own
        tensors = [*reference.parameters(), *reference.buffers()]
        self.dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        floating = [a for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.is_floating_point()]
        dtype = floating[0].dtype if floating else self.dtype
        if self.input_quantizer is not None and args:
            args = (self.input_quantizer(args[0]), *args[1:])
        args, kwargs = _cast((args, kwargs), self.dtype)
        return _cast(self.reference(*args, **kwargs), dtype)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           value)


@contextlib.contextmanager
def float_layers_swapped(quantized: nn.Module, reference: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """The reference's modules swapped into the quantized model at `names` for the duration."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = quantized.get_submodule(parent_name)
            original = parent.get_submodule(child)
            swapped.append((parent, child, original))
            # a tool's fused experts keep their projection's shared input quantizer: only the weights go float
            shared = original.input_quantizer if isinstance(original, QuantizedExpertProjection) else None
            setattr(parent, child, _FloatLayer(reference.get_submodule(name), shared))
        yield
    finally:
        for parent, child, original in reversed(swapped):
            setattr(parent, child, original)


def _output_tensor(output: Any) -> torch.Tensor | None:
    """A layer's output tensor (the first floating leaf of a tuple)."""
    return next((leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)
                 and leaf.is_floating_point()), None)


def _floating_leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    paths, _ = pytree.tree_flatten_with_path(output)
    return [(pytree.keystr(path) or "output", leaf) for path, leaf in paths
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def _weight_sqnr(reference: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """(weight SQNR in dB, its gain when each input channel's scale is fitted first), from per-channel sums."""
    fit = weight_fit(reference, weight)
    return fit.sqnr_db, fit.channel_gain_db


def _rescaled_reason(name: str, changed: list[str]) -> str:
    near = max(changed, key=lambda other: len(_common_prefix(other, name)), default="")
    where = f" ({near} differs from the reference's)" if near else ""
    return ("the artifact rescales this layer's input channels against the reference (SmoothQuant or AWQ fold the "
            f"inverse scales into the layer before it{where}), so the layer run on the reference's input is not "
            "comparable: its own error is not measured")


def _common_prefix(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def quantized_forward_error(entered: Sequence[str], error: Exception) -> ArtifactError:
    """The error of a quantized forward that raised, naming the last layer it entered and what to do."""
    layer = entered[-1] if entered else ""
    where = f" in layer {layer}" if layer else ""
    text = str(error).strip().rstrip(".")
    computes_in = _other_dtype(text)
    if computes_in is not None:  # a loader that left the layers' computation in another dtype than the rest
        fix = (f" Fix: load the artifact in the dtype its layers compute in, {computes_in} (transformers: "
               f"from_pretrained(..., dtype=torch.{computes_in})), or run it where its kernels run (device=...)")
    elif layer:
        fix = (f" Fix: run the artifact where its kernels run (device=...), or keep that layer in float with "
               f"float_layers={[layer]!r}")
    else:
        fix = " Fix: call the quantized model as the reference is called, where its kernels run"
    return ArtifactError(f"the quantized model's forward raised {type(error).__name__}{where}: {text}.{fix}")


# how torch's errors name the dtypes a mismatch is between (float32 is the reference's: the other one is named)
_DTYPE_WORDS = {"BFloat16": "bfloat16", "bfloat16": "bfloat16", "Half": "float16", "float16": "float16"}


def _other_dtype(text: str) -> str | None:
    """The half-precision dtype a dtype-mismatch error names beside float32 ('expected m1 and m2 to have the same
    dtype, but got: float != c10::BFloat16'), or None for another error."""
    if "dtype" not in text and "type" not in text:
        return None
    if not re.search(r"\b(float|Float|float32)\b", text):
        return None
    found = [dtype for word, dtype in _DTYPE_WORDS.items() if re.search(rf"\b{word}\b", text)]
    return found[0] if found else None


class _Pass:
    """The hooks of one comparison over a batch list: the reference stores each layer's input and output, the
    quantized model's hooks compare against them and run the shadow."""

    def __init__(self, names: Sequence[str], shadow: bool, experts: Iterable[str] = ()) -> None:
        self.names, self.shadow = list(names), shadow
        # experts run on the tokens their router sends them, which differ between the two models once a choice
        # flips: each is compared on the reference's own tokens (its shadow), as the simulation compares them
        self.experts = frozenset(experts)
        self.stash: dict[str, deque] = defaultdict(deque)
        self.propagated = {name: StreamingComparator() for name in names}
        self.shadows = {name: StreamingComparator() for name in names}
        self.order: list[str] = []  # the layers in the order the quantized model first ran them
        self._ordered: set[str] = set()
        self.entered: list[str] = []
        self.in_shadow = False
        self.recording = False  # the reference's pass: its modules also run inside the quantized model when swapped in
        self.active: set[str] | None = None  # the layers measured in this phase of a block-wise pass (None: all)

    def reference_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.active is not None and name not in self.active:
                return
            tensor = _output_tensor(output)
            if tensor is not None and self.recording:
                kept_inputs = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                              (args, kwargs)) if self.shadow else None
                self.stash[name].append((kept_inputs, tensor.detach()))
        return hook

    def entered_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.in_shadow and (self.active is None or name in self.active):
                self.entered.append(name)
        return hook

    def attach(self, reference: nn.Module, quantized: nn.Module) -> list[Any]:
        """Hook every measured layer of both models (the reference's modules swapped in included); the handles."""
        handles = []
        for name in self.names:
            handles.append(reference.get_submodule(name).register_forward_hook(self.reference_hook(name),
                                                                               with_kwargs=True))
            module = quantized.get_submodule(name)
            handles.append(module.register_forward_pre_hook(self.entered_hook(name), with_kwargs=True))
            handles.append(module.register_forward_hook(self.quantized_hook(name), with_kwargs=True))
        return handles

    def compare(self, quantized: nn.Module, batch: Any) -> Any:
        """The quantized model on one batch, compared with what the reference's pass stashed: its output;
        ArtifactError naming the layer the quantized model's forward raised in."""
        self.entered.clear()
        try:
            actual = call_model(quantized, batch)
        except ArtifactMismatchError:
            raise
        except Exception as error:
            raise quantized_forward_error(self.entered, error) from error
        finally:
            self.stash.clear()
        return actual

    def quantized_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.in_shadow or (self.active is not None and name not in self.active):
                return
            if self.entered and self.entered[-1] == name:
                self.entered.pop()
            tensor = _output_tensor(output)
            if tensor is None:
                return
            if name in self.experts:
                self._compare_expert(name, module, tensor)
                return
            if not self.stash[name]:
                raise ArtifactMismatchError(f"layer {name} ran in the quantized model but not in the reference (or "
                                            "more often): the two models do not compute alike")
            inputs, reference = self.stash[name].popleft()
            if tensor.shape != reference.shape:
                raise ArtifactMismatchError(
                    f"layer {name}: its output has shape {tuple(tensor.shape)} in the quantized model and "
                    f"{tuple(reference.shape)} in the reference. Fix: quantized= must be the reference quantized, "
                    "with the same layer sizes")
            if name not in self._ordered:
                self._ordered.add(name)
                self.order.append(name)
            self.propagated[name].update(reference, tensor)  # a NaN makes its sums NaN: first_nan reads them
            if self.shadow and inputs is not None:
                dtype = tensor.dtype
                self.in_shadow = True
                try:
                    with torch.no_grad():
                        own = _output_tensor(module(*_cast(inputs[0], dtype), **_cast(inputs[1], dtype)))
                finally:
                    self.in_shadow = False
                if own is not None:
                    self.shadows[name].update(reference, own)
        return hook

    def _compare_expert(self, name: str, module: nn.Module, tensor: torch.Tensor) -> None:
        """An expert's output on the reference's tokens against the reference's (nothing when the reference did not
        run it on this call)."""
        if not self.stash[name]:
            return
        inputs, reference = self.stash[name].popleft()
        if reference.numel() == 0:  # no token was routed to it on this call: nothing to compare
            return
        if name not in self._ordered:
            self._ordered.add(name)
            self.order.append(name)
        if inputs is None:  # no shadow: the two outputs compare only where both models routed alike
            own: torch.Tensor | None = tensor if tensor.shape == reference.shape else None
        else:
            self.in_shadow = True
            try:
                with torch.no_grad():
                    own = _output_tensor(module(*_cast(inputs[0], tensor.dtype), **_cast(inputs[1], tensor.dtype)))
            finally:
                self.in_shadow = False
        if own is not None:
            self.propagated[name].update(reference, own)
            if inputs is not None:
                self.shadows[name].update(reference, own)

    def first_nan(self) -> str:
        """The first layer, in the order the quantized model ran them, whose output held NaN (its sums are NaN)."""
        return next((name for name in self.order if bool(torch.isnan(self.propagated[name].sums).any())), "")


def measure_artifact(reference: nn.Module, quantized: nn.Module, layers: Sequence[ArtifactLayer],
                     batches: Iterable[Any], *, float_layers: Iterable[str] = (), focus: Iterable[str] | None = None,
                     logits: bool = False, shadow: bool = True) -> ArtifactMeasurement:
    """Compare `quantized` with `reference` over `batches`, with the reference's modules swapped in at
    `float_layers`. `focus`: the only layers measured (None: every one; the outputs always); `logits`: the logits
    compared too (KL, top-1, perplexity); `shadow`: each layer's own error measured too."""
    run = ArtifactRun(quantized, tuple(layers), tuple(float_layers), None if focus is None else frozenset(focus),
                      logits)
    return measure_artifacts(reference, [run], batches, shadow=shadow)[0]


class _RunState:
    """A run's hooks and sums through a shared pass."""

    def __init__(self, run: ArtifactRun, shadow: bool) -> None:
        self.run, self.quantized = run, run.quantized
        self.kept = {layer.name: layer for layer in run.layers}
        names = run.measured_names()
        listed = set(names)
        self.measured = _Pass(names, shadow, held_expert_layers(run.quantized, lambda name, module: name in listed))
        self.outputs: list[tuple[str, StreamingComparator]] = []
        self.comparator = LogitsComparator() if run.logits else None

    def result(self, reference: nn.Module, weights: Mapping[str, tuple[float, float]] | None = None,
               expert_fits: Mapping[str, WeightFit] | None = None, digest: str = "") -> ArtifactMeasurement:
        """The run's records."""
        measured = _measurement(reference, self.quantized, self.kept, self.measured, self.outputs, self.comparator,
                                list(self.run.float_layers), weights, expert_fits)
        return dataclasses.replace(measured, digest=digest) if digest else measured


@contextlib.contextmanager
def _runs_prepared(reference: nn.Module, states: Sequence[_RunState]) -> Iterator[None]:
    """Every run's float layers swapped in, no KV cache in any model, no autograd, and every run's hooks attached."""
    with contextlib.ExitStack() as held:
        for state in states:
            held.enter_context(float_layers_swapped(state.quantized, reference, state.run.float_layers))
        held.enter_context(without_kv_cache(reference))
        for state in states:
            held.enter_context(without_kv_cache(state.quantized))
        held.enter_context(torch.no_grad())
        for state in states:
            for handle in state.measured.attach(reference, state.quantized):
                held.callback(handle.remove)
        yield


def _recording(states: Sequence[_RunState], on: bool) -> None:
    for state in states:
        state.measured.recording = on


def measure_artifacts(reference: nn.Module, runs: Sequence[ArtifactRun], batches: Iterable[Any], *,
                      shadow: bool = True, stack: str | None = None,
                      records: Sequence[StreamRecord | None] | None = None,
                      recorded: int = 2) -> list[ArtifactMeasurement]:
    """measure_artifact for several artifacts of one reference at once: per batch the reference runs once, and each
    artifact's pass is compared with it (the reference's layer inputs and outputs are shared, not copied); one
    measurement per run, each equal to measure_artifact's for that run alone. `records`: per run, a StreamRecord
    to fill from the blocks of `stack` for the first `recorded` batches (complete only while it holds at most
    RECORD_LIMIT_BYTES) or None."""
    states = [_RunState(run, shadow) for run in runs]
    for state in states:
        decompress_pending(state.quantized)  # now, where its progress bars are kept out of the run's output
    recorders = [None if record is None or stack is None
                 else _StreamRecorder(record, state.quantized, stack, RECORD_LIMIT_BYTES)
                 for state, record in zip(states, records or [None] * len(states))]
    count = 0
    try:
        with _runs_prepared(reference, states):
            for batch in batches:
                _recording(states, True)
                try:
                    expected = call_model(reference, batch)
                finally:
                    _recording(states, False)
                for state, recorder in zip(states, recorders):
                    if recorder is not None:
                        recorder.expected(expected)
                    actual = state.measured.compare(state.quantized, batch)
                    _compare_outputs(expected, actual, state.outputs, state.comparator, batch)
                    del actual
                del expected  # before the next batch's passes: one batch's values at a time
                count += 1
                if count == recorded:
                    for recorder in recorders:
                        if recorder is not None:
                            recorder.stop()
    finally:
        for recorder in recorders:
            if recorder is not None:
                recorder.finish(min(count, recorded))
    return [state.result(reference) for state in states]


def _compare_outputs(expected: Any, actual: Any, outputs: list[tuple[str, StreamingComparator]],
                     comparator: LogitsComparator | None, batch: Any) -> None:
    reference_leaves, quantized_leaves = _floating_leaves(expected), _floating_leaves(actual)
    shapes = [(n, tuple(t.shape)) for n, t in reference_leaves], [(n, tuple(t.shape)) for n, t in quantized_leaves]
    if shapes[0] != shapes[1]:
        raise ArtifactMismatchError(
            f"the quantized model's outputs differ in structure from the reference's: its floating leaves (name, "
            f"shape) are {shapes[1]}, against {shapes[0]}. Fix: quantized= must be the reference quantized, called "
            "the same way and returning the same structure")
    if not outputs:
        outputs.extend((name, StreamingComparator()) for name, _ in reference_leaves)
    for (_, streaming), (_, ref), (_, ours) in zip(outputs, reference_leaves, quantized_leaves):
        streaming.update(ref, ours)
    if comparator is not None:
        comparator.decide(None, expected)
        comparator.update([t for _, t in reference_leaves], [t for _, t in quantized_leaves], batch)


def _measurement(reference: nn.Module, quantized: nn.Module, kept: Mapping[str, ArtifactLayer], measured: _Pass,
                 outputs: list[tuple[str, StreamingComparator]], comparator: LogitsComparator | None,
                 float_layers: list[str], weights: Mapping[str, tuple[float, float]] | None = None,
                 expert_fits: Mapping[str, WeightFit] | None = None) -> ArtifactMeasurement:
    """The records of a pass. `weights`: each layer's (weight SQNR, rescaled-fit gain), measured while its weights
    were onloaded (a block-wise pass); None reads them from the models now. `expert_fits`: the expert layers'
    weight fits, measured with them."""
    output_records = {}
    for name, streaming in outputs:
        numbers = streaming.result()
        output_records[name] = OutputSqnr(name, numbers["sqnr_db"], numbers["cosine"], numbers["normalized_l2"])
    if any(math.isnan(record.sqnr_db) for record in output_records.values()):
        first = measured.first_nan()
        # an MoE block measured whole (a tool's fused experts): its experts' own weights are compared one by one
        block = (", an MoE block's experts: its expert_coverage item names each expert whose weights hold NaN or "
                 "infinite values") if first and first.rpartition(".")[2] == "experts" else ""
        where = (f"; the first layer whose output holds NaN is {first}{block}. Fix: look at that layer's scales in "
                 f"the artifact, or keep it in float with float_layers={[first]!r}") if first else ""
        raise ArtifactError(f"the quantized model's output holds NaN{where}")
    records, not_comparable = {}, {}
    changed: list[str] | None = None  # the modules outside the layers whose parameters changed, once one is rescaled
    for name in measured.names:
        numbers = measured.propagated[name].result()
        if not numbers["batches"] and name not in measured.experts:
            continue  # not run on these batches (an expert no token reached is kept: not measured, nan)
        weight_db, rescaled = None, False
        fitted = None
        if weights is not None:
            fitted = weights.get(name)
        else:
            reference_weight = getattr(reference.get_submodule(name), "weight", None)
            if kept[name].weighted and name not in float_layers and isinstance(reference_weight, torch.Tensor):
                reference_weight = module_tensor(reference, f"{name}.weight")  # an offloaded one from its offload
                with read_from_offload(quantized, name) as module:
                    plain_view = isinstance(module, ExpertProjection) and \
                        not isinstance(module, QuantizedExpertProjection)  # a tool's view computes through its own
                    ours = module_tensor(quantized, f"{name}.weight") if plain_view else dequantized_weight(module)
                    if ours is not None and ours.numel() == reference_weight.numel() \
                            and ours.device.type != "meta" and reference_weight.device.type != "meta":
                        fitted = _weight_sqnr(reference_weight, ours)
        if fitted is not None:
            weight_db, gain = fitted
            if gain > RESCALED_GAIN_DB:
                # a better fit once rescaled is no evidence alone (a damaged layer fits a uniform scale): the
                # artifact rescaled the layer only where a module outside the layers changed too (the norm or
                # layer its inverse scales were folded into)
                if changed is None:
                    changed = changed_modules(reference, quantized, list(kept))
                rescaled = bool(changed)
            if rescaled:
                weight_db += gain  # compared up to its input channels' scales, which the rescaling moved
        shadow_db = measured.shadows[name].result()["sqnr_db"] if measured.shadows[name].batches else math.nan
        if rescaled:
            not_comparable[name] = _rescaled_reason(name, changed or [])
            shadow_db = math.nan
        records[name] = LayerSqnr(layer=name, fqn=name, op=kept[name].kind, sqnr_db=numbers["sqnr_db"],
                                  shadow_sqnr_db=shadow_db, normalized_l2=numbers["normalized_l2"],
                                  cosine=numbers["cosine"], batches=int(numbers["batches"]), weight_sqnr_db=weight_db)
    ordered = [name for name in measured.order if name in records] + \
        [name for name in records if name not in measured.order]
    return ArtifactMeasurement(sqnr=SqnrMeasurement({name: records[name] for name in ordered}, output_records),
                               logits=comparator.result() if comparator is not None else None,
                               not_comparable=not_comparable, order=tuple(measured.order),
                               expert_fits=dict(expert_fits or {}))
