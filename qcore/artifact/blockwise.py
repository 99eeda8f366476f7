"""A shipped artifact against its float reference one block of their stack at a time, as llm-compressor's sequential
pipeline quantizes: every batch goes through one block before the next block is onloaded.

The first block's inputs (positional and keyword: hidden states, position embeddings, masks) are captured for every
batch from each model's own forward, stopped at the block; the layers before the stack are measured on the way. Then
for each block, the reference's block is onloaded, run on the float stream of every batch and released, and the
quantized block likewise on the quantized stream (its compressed-tensors layers decompressed with it): the forward
hooks of qcore.artifact.measure compare each layer's output and run its shadow, exactly as in a whole pass. Last,
each model runs again with its stack replayed (every block returns the stream's final output), so the layers after
the stack, the outputs and the logits are measured by the model's own code. The numbers are the whole pass's; each
weight is read once per pass.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from qcore.artifact.layers import ArtifactLayer, ArtifactMismatchError, StateDigest, dequantized_weight
from qcore.artifact.measure import (
    ArtifactError,
    ArtifactMeasurement,
    ArtifactRun,
    StreamRecord,
    _compare_outputs,
    _measurement,
    _Pass,
    _recording,
    _runs_prepared,
    _RunState,
    _stream_of,
    float_layers_swapped,
    quantized_forward_error,
)
from qcore.artifact.offload import (
    compressed_layers_decompressed,
    first_forward_decompression_held,
    module_tensor,
    onloaded,
)
from qcore.artifact.weights import WeightFit, weight_fit
from qcore.graph.capture import without_kv_cache
from qcore.graph.inputs import call_model
from qcore.numeric.loggers import StreamingComparator
from qcore.numeric.logits import LogitsComparator

__all__ = ["BlockwiseArtifactError", "StreamRecord", "artifact_stack", "measure_artifact_blockwise",
           "measure_artifacts_blockwise", "resume_artifact_blockwise", "start_block"]


class BlockwiseArtifactError(ValueError):
    """The models cannot be analysed one block at a time (no stack of blocks, or one that does not run as one)."""


class _Stop(Exception):
    """Raised at the first block once its inputs are captured: the rest of the forward is the blocks' pass's."""


def artifact_stack(reference: nn.Module, quantized: nn.Module, path: str | None = None) -> str:
    """The module path of the stack of blocks to go through one at a time: `path` when given, else the largest
    nn.ModuleList or nn.Sequential of two or more modules of one class ("model.layers"), present in both models."""
    if path:
        found = dict(reference.named_modules()).get(path)
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) < 2:
            raise BlockwiseArtifactError(f"blockwise={path!r}: no stack of two or more numbered blocks at {path!r} in "
                                         "the reference. Fix: name the model's stack of blocks (model.layers, "
                                         "transformer.h, encoder.layer), or blockwise=False")
        return path
    stacks = [(len(module), name) for name, module in reference.named_modules()
              if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2 and name
              and len({type(child).__qualname__ for child in module}) == 1]
    quantized_names = dict(quantized.named_modules())
    stacks = [(count, name) for count, name in stacks if name in quantized_names]
    if not stacks:
        raise BlockwiseArtifactError("the model has no stack of numbered blocks (an nn.ModuleList of two or more "
                                     "blocks of one class, such as model.layers) to analyse one at a time. Fix: "
                                     "blockwise=False")
    return max(stacks, key=lambda entry: (entry[0], -entry[1].count(".")))[1]


def _block_index(name: str, stack: str) -> int | None:
    if not name.startswith(stack + "."):
        return None
    head = name[len(stack) + 1:].split(".")[0]
    return int(head) if head.isdigit() else None


def _outside(model: nn.Module, stack: str) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    """(the subtrees outside the stack, by name; the stack's ancestors): what the capture and the replay run besides
    the blocks."""
    ancestors = {""} | {".".join(stack.split(".")[:depth]) for depth in range(1, stack.count(".") + 1)}
    subtrees = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0] if name else None
        if name and name != stack and name not in ancestors and parent in ancestors:
            subtrees.append((name, module))
    return subtrees, [model.get_submodule(name) for name in sorted(ancestors)]


@contextlib.contextmanager
def _outside_onloaded(model: nn.Module, stack: str, device: Any, which: str,
                      offer: Callable[[str, nn.Module], Any] | None = None) -> Iterator[None]:
    """Every module outside the stack onloaded (and the stack's ancestors' own tensors: their blocks are onloaded
    one at a time), for a whole phase; `offer(name, module)` sees each subtree onloaded, as the model holds it."""
    subtrees, ancestors = _outside(model, stack)
    with contextlib.ExitStack() as held:
        for name, module in subtrees:
            held.enter_context(_block_onloaded(module, device, which, name))
            if offer is not None:
                offer(name, module)
            held.enter_context(compressed_layers_decompressed(module))
        for module in ancestors:
            held.enter_context(onloaded(module, recurse=False))
        yield


class _Replay(nn.Module):
    """Stands in for every block of a stack: returns the stream's final output for the current batch. Every block
    but the first must be handed what the block before it returned, as the block-wise pass hands it: `broken` says
    where the model computes between its blocks instead (its calls, block by block, are counted per batch)."""

    def __init__(self, outputs: Sequence[Any], stack: str) -> None:
        super().__init__()
        self.outputs, self._index, self.stack, self.calls, self.broken = outputs, 0, stack, 0, ""

    @property
    def index(self) -> int:
        """The batch being replayed."""
        return self._index

    @index.setter
    def index(self, position: int) -> None:
        self._index, self.calls = position, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        returned = self.outputs[self._index]
        if self.calls and not self.broken:
            stream, before = (args[0] if args else kwargs.get("hidden_states")), _stream_of(returned)
            if stream is not before and not (isinstance(stream, torch.Tensor) and isinstance(before, torch.Tensor)
                                             and stream.shape == before.shape and torch.equal(stream, before)):
                self.broken = (f"on batch {self._index}, block {self.stack}.{self.calls} is not handed what "
                               f"{self.stack}.{self.calls - 1} returns")
        self.calls += 1
        return returned


@contextlib.contextmanager
def _replayed(model: nn.Module, stack: str, outputs: Sequence[Any]) -> Iterator[_Replay]:
    parent_name, _, child = stack.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, child)
    replay = _Replay(outputs, stack)
    setattr(parent, child, type(original)(*[replay] * len(original)) if isinstance(original, nn.Sequential)
            else nn.ModuleList([replay] * len(original)))
    try:
        yield replay
    finally:
        setattr(parent, child, original)


def _hidden(output: Any) -> torch.Tensor:
    """A block's output stream: the output itself, or the first tensor of a tuple (older transformers)."""
    if isinstance(output, torch.Tensor):
        return output
    leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise BlockwiseArtifactError("a block of the stack returned no tensor to carry to the next block. Fix: "
                                     "blockwise=False")
    return leaves[0]


def _advanced(args: tuple, kwargs: dict, output: Any) -> tuple[tuple, dict]:
    """The next block's inputs: the same keywords, the stream replaced by this block's output."""
    hidden = _hidden(output)
    if args:
        return (hidden, *args[1:]), kwargs
    if "hidden_states" not in kwargs:
        raise BlockwiseArtifactError("the stack's blocks take their stream neither as the first argument nor as "
                                     "hidden_states=. Fix: blockwise=False")
    return args, {**kwargs, "hidden_states": hidden}


def _captured(model: nn.Module, first: nn.Module, batches: Sequence[Any], run: Callable[[Callable[[], Any]], Any]
              ) -> list[tuple[tuple, dict]]:
    """The first block's (args, kwargs) for each batch, from the model's own forward stopped at the block."""
    inputs: list[tuple[tuple, dict]] = []

    def grab(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.append((args, kwargs))
        raise _Stop

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            with contextlib.suppress(_Stop):
                run(functools.partial(call_model, model, batch))
    finally:
        handle.remove()
    if len(inputs) != len(batches):
        raise BlockwiseArtifactError("the stack's first block did not run on every batch: the stack is not what the "
                                     "model computes with. Fix: name its stack with blockwise='...', or "
                                     "blockwise=False")
    return inputs


def _quantized_call(measured: _Pass) -> Callable[[Callable[[], Any]], Any]:
    """Runs one call of the quantized model (or a block of it): ArtifactError naming the layer it raised in."""
    def run(call: Callable[[], Any]) -> Any:
        measured.entered.clear()
        try:
            return call()
        except (ArtifactMismatchError, _Stop, BlockwiseArtifactError):
            raise
        except Exception as error:
            raise quantized_forward_error(measured.entered, error) from error
    return run


@contextlib.contextmanager
def _quantized_block_ready(reference: nn.Module, quantized: nn.Module, stack: str, index: int, swapped: set,
                           device: Any, offer: Callable[[str, nn.Module], Any] | None = None
                           ) -> Iterator[nn.Module]:
    """The quantized model's block `index` onloaded and its compressed-tensors layers decompressed (with the
    reference's block onloaded too when a trial swaps a reference layer into it); `offer(name, block)` sees the
    block onloaded, as the model holds it."""
    where = f"block {stack}.{index}"
    with contextlib.ExitStack() as held:
        if index in swapped:
            held.enter_context(_block_onloaded(reference.get_submodule(stack)[index], device, "the reference", where))
        block = quantized.get_submodule(stack)[index]
        held.enter_context(_block_onloaded(block, device, "the quantized model", where))
        if offer is not None:
            offer(f"{stack}.{index}", block)
        held.enter_context(compressed_layers_decompressed(block))
        yield block


@contextlib.contextmanager
def _block_onloaded(module: nn.Module, device: Any, which: str, where: str) -> Iterator[None]:
    """onloaded(module), an unreadable offload named: which model, which block, and what to do."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(onloaded(module, device))
        except Exception as error:
            raise ArtifactError(f"{which}: {where} could not be onloaded: its weights could not be read from the "
                                f"offload ({type(error).__name__}: {error}). Fix: load the model again with "
                                "from_pretrained(..., device_map=..., offload_folder=...) pointing at an offload "
                                "folder that exists and is writable, from a checkpoint whose shards are complete"
                                ) from error
        yield


def _plain_call(call: Callable[[], Any]) -> Any:
    return call()


def start_block(float_layers: Iterable[str], stack: str, blocks: int, before: Iterable[str]) -> int | None:
    """The first block a trial that keeps `float_layers` in float changes (`blocks` when only layers after the stack;
    None when a layer before the stack, in `before`, changes the stream from the start)."""
    first = blocks
    for name in float_layers:
        index = _block_index(name, stack)
        if index is not None:
            first = min(first, index)
        elif name in set(before):
            return None
    return first


def measure_artifact_blockwise(reference: nn.Module, quantized: nn.Module, layers: Sequence[ArtifactLayer],
                               batches: Iterable[Any], stack: str, *, float_layers: Iterable[str] = (),
                               focus: Iterable[str] | None = None, logits: bool = False, shadow: bool = True,
                               device: Any = None, record: StreamRecord | None = None,
                               digest: bool = False) -> ArtifactMeasurement:
    """measure_artifact's numbers, one block of `stack` at a time (module docstring); `device`: where blocks are
    onloaded to (default: where each model's hooks put them); `record`: filled with the streams a fix trial resumes
    from (resume_artifact_blockwise); `digest`: the measurement carries the quantized model's state_digest, hashed
    as its blocks are onloaded."""
    run = ArtifactRun(quantized, tuple(layers), tuple(float_layers), None if focus is None else frozenset(focus),
                      logits)
    return measure_artifacts_blockwise(reference, [run], batches, stack, shadow=shadow, device=device,
                                       records=[record], digests=digest)[0]


class _BlockRun(_RunState):
    """A run's hooks, sums, quantized stream and weights through a shared block-wise pass."""

    def __init__(self, run: ArtifactRun, shadow: bool, stack: str, record: StreamRecord | None) -> None:
        super().__init__(run, shadow)
        self.stack, self.record = stack, record
        self.in_stack = {name for name in self.measured.names if _block_index(name, stack) is not None}
        self.weights: dict[str, tuple[float, float]] = {}
        self.expert_fits: dict[str, WeightFit] = {}
        self.swapped_blocks = {_block_index(name, stack) for name in run.float_layers} - {None}
        self.digest: StateDigest | None = None
        self.offered: list[str] = []
        self.call = _quantized_call(self.measured)
        self.stream: list[tuple[tuple, dict]] = []
        self.last: list[Any] = []
        self.before: set[str] = set()

    def weigh(self, reference: nn.Module, names: Iterable[str]) -> None:
        """Each named layer's weight SQNR, while its weights (and the reference's) are onloaded."""
        for name in names:
            if name in self.run.float_layers or not self.kept[name].weighted or name in self.weights:
                continue
            ours = dequantized_weight(self.quantized.get_submodule(name))
            theirs = module_tensor(reference, name + ".weight")
            if ours is not None and isinstance(theirs, torch.Tensor) and ours.numel() == theirs.numel():
                fit = weight_fit(theirs, ours)
                self.weights[name] = (fit.sqnr_db, fit.channel_gain_db)
                if name in self.measured.experts:  # the checkpoint's experts, compared while onloaded
                    self.expert_fits[name] = fit

    def offer(self, before: str | None = None) -> Callable[[str, nn.Module], Any] | None:
        """What hands a module's onloaded tensors to the digest (those before `before` in its order), or None."""
        if self.digest is None:
            return None
        digest = self.digest
        return lambda name, module: self.offered.extend(digest.offer(name, module, before))

    def hashed(self) -> None:
        """Waits until what was offered is hashed, so that the pass may let it go."""
        if self.digest is not None:
            self.digest.wait_for(self.offered)
        self.offered = []

    def block_names(self, index: int) -> set[str]:
        """The measured layers in block `index`."""
        return {name for name in self.in_stack if _block_index(name, self.stack) == index}


def _activate(states: Sequence[_BlockRun], active: Callable[[_BlockRun], set[str] | None]) -> None:
    for state in states:
        state.measured.active = active(state)


def measure_artifacts_blockwise(reference: nn.Module, runs: Sequence[ArtifactRun], batches: Iterable[Any],
                                stack: str, *, shadow: bool = True, device: Any = None,
                                records: Sequence[StreamRecord | None] | None = None,
                                digests: bool = False) -> list[ArtifactMeasurement]:
    """measure_artifact_blockwise for several artifacts of one reference at once: each reference block is onloaded
    and run once per batch, then each artifact's block on that artifact's stream (measure_artifacts' rule: one
    measurement per run, each equal to its own pass's). `records`: per run, a StreamRecord to fill or None;
    `digests`: each measurement carries its quantized model's state_digest, hashed as the pass onloads it."""
    batches = list(batches)
    records = list(records) if records is not None else [None] * len(runs)
    states = [_BlockRun(run, shadow, stack, record) for run, record in zip(runs, records)]
    reference_blocks = reference.get_submodule(stack)
    for state in states:
        quantized_blocks = state.quantized.get_submodule(stack)
        if len(reference_blocks) != len(quantized_blocks):
            raise ArtifactMismatchError(f"the stack {stack} has {len(quantized_blocks)} blocks in the quantized model "
                                        f"and {len(reference_blocks)} in the reference")
    with contextlib.ExitStack() as held:
        for state in states:
            held.enter_context(first_forward_decompression_held(state.quantized))
            if digests:  # the quantized model's identity, hashed from the blocks as they are onloaded
                state.digest = StateDigest(state.quantized)
                held.callback(_abandon, state)
        held.enter_context(_runs_prepared(reference, states))
        held.callback(_activate, states, lambda state: None)
        # the first block's inputs for every batch, and the layers before the stack on the way
        _activate(states, lambda state: set(state.measured.names) - state.in_stack)
        _recording(states, True)
        try:
            with _outside_onloaded(reference, stack, device, "the reference"):
                reference_stream = _captured(reference, reference_blocks[0], batches, _plain_call)
        finally:
            _recording(states, False)
        for state in states:
            first = next((name for name in state.digest.names if name.startswith(f"{stack}.")), None) \
                if state.digest is not None else None
            with _outside_onloaded(state.quantized, stack, device, "the quantized model", state.offer(first)):
                state.stream = _captured(state.quantized, state.quantized.get_submodule(stack)[0], batches,
                                         state.call)
                state.before = set(state.measured.order)
                state.weigh(reference, state.before)
                state.hashed()
        reference_last: list[Any] = []
        for index in range(len(reference_blocks)):
            for state in states:
                if state.record is not None:
                    state.record.inputs.append(state.stream)
            _activate(states, lambda state: state.block_names(index))  # noqa: B023 - used at once
            _recording(states, True)
            try:
                with _block_onloaded(reference_blocks[index], device, "the reference", f"block {stack}.{index}"):
                    reference_last = [reference_blocks[index](*args, **kwargs) for args, kwargs in reference_stream]
            finally:
                _recording(states, False)
            reference_stream = [_advanced(args, kwargs, out)
                                for (args, kwargs), out in zip(reference_stream, reference_last)]
            for state in states:
                with _quantized_block_ready(reference, state.quantized, stack, index, state.swapped_blocks,
                                            device, state.offer()) as block:
                    state.last = [state.call(functools.partial(block, *args, **kwargs))
                                  for args, kwargs in state.stream]
                    state.weigh(reference, state.block_names(index))
                    state.hashed()
                state.stream = [_advanced(args, kwargs, out) for (args, kwargs), out in zip(state.stream, state.last)]
        del reference_stream
        for state in states:
            state.stream = []
        # the layers after the stack, the outputs and the logits: each model with its stack replayed
        _activate(states, lambda state: set(state.measured.names) - state.in_stack - state.before)
        _recording(states, True)
        expected = []
        try:
            with _outside_onloaded(reference, stack, device, "the reference"), \
                    _replayed(reference, stack, reference_last) as replay:
                for position, batch in enumerate(batches):
                    replay.index = position
                    expected.append(call_model(reference, batch))
                if replay.broken:
                    raise BlockwiseArtifactError(
                        f"the model computes between the blocks of {stack}: {replay.broken}. The block-wise pass "
                        "hands each block's output straight to the next, so its numbers would not be the model's. "
                        "Fix: blockwise=False (whole passes, with the memory of the whole model), or "
                        "blockwise='...' naming a stack whose blocks feed each other directly")
        finally:
            _recording(states, False)
        del reference_last
        for state in states:
            if state.record is not None:
                state.record.last, state.record.expected = state.last, list(expected)
                state.record.complete = True
        for number, state in enumerate(states):
            with _outside_onloaded(state.quantized, stack, device, "the quantized model", state.offer()), \
                    _replayed(state.quantized, stack, state.last) as replay:
                for position, batch in enumerate(batches):
                    replay.index = position
                    actual = state.call(functools.partial(call_model, state.quantized, batch))
                    _compare_outputs(expected[position], actual, state.outputs, state.comparator, batch)
                    if number == len(states) - 1:
                        expected[position] = None  # compared by every run: let it go
                    del actual
                state.weigh(reference, set(state.measured.names) - state.in_stack)
                state.hashed()
            if state.record is None:
                state.last = []
        digests_found = [state.digest.result() if state.digest is not None else "" for state in states]
        for state in states:
            state.digest = None
    return [state.result(reference, state.weights, state.expert_fits, digest)
            for state, digest in zip(states, digests_found, strict=True)]


def _abandon(state: _BlockRun) -> None:
    """Ends the digest's thread of a pass that failed (one that finished took its result already)."""
    if state.digest is not None:
        state.digest.abandon()
        state.digest = None


def resume_artifact_blockwise(reference: nn.Module, quantized: nn.Module, batches: Sequence[Any], stack: str,
                              record: StreamRecord, start: int, *, float_layers: Iterable[str] = (),
                              logits: bool = False, device: Any = None) -> ArtifactMeasurement:
    """A fix trial's outputs (no layer measured): the quantized stream resumed at block `start` from `record`, the
    blocks from there run with `float_layers` swapped in, and the outputs compared with the reference's recorded
    ones. Equal to a whole block-wise pass with those float layers, for the trial's batches."""
    assert record.complete
    float_layers = list(float_layers)
    measured = _Pass([], shadow=False)
    run_quantized = _quantized_call(measured)
    quantized_blocks = quantized.get_submodule(stack)
    swapped_blocks = {_block_index(name, stack) for name in float_layers} - {None}
    outputs: list[tuple[str, StreamingComparator]] = []
    comparator = LogitsComparator() if logits else None
    with float_layers_swapped(quantized, reference, float_layers), without_kv_cache(quantized), \
            first_forward_decompression_held(quantized), torch.no_grad():
        last = record.last
        if start < len(quantized_blocks):
            stream = record.inputs[start]
            for index in range(start, len(quantized_blocks)):
                with _quantized_block_ready(reference, quantized, stack, index, swapped_blocks, device) as block:
                    last = [run_quantized(functools.partial(block, *args, **kwargs)) for args, kwargs in stream]
                stream = [_advanced(args, kwargs, out) for (args, kwargs), out in zip(stream, last)]
        with _outside_onloaded(quantized, stack, device, "the quantized model"), \
                _replayed(quantized, stack, last) as replay:
            for position, batch in enumerate(batches):
                replay.index = position
                actual = run_quantized(functools.partial(call_model, quantized, batch))
                _compare_outputs(record.expected[position], actual, outputs, comparator, batch)
    return _measurement(reference, quantized, {}, measured, outputs, comparator, float_layers, {})
