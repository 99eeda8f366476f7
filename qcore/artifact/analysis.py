"""A user's quantized model (the artifact it ships) analysed against its float reference: the same questions a
ModelAnalysis answers of qcore's own simulation (per-layer and output SQNR, logits, a task metric, a verified set
of layers to keep in float), asked of the artifact, with nothing quantized here.

`float_layers` swaps the reference's modules in for those layers, as a fix does; the search for a fix swaps sets of
layers and measures each set on a few batches, then the set it prints on every batch.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from qcore.artifact.blockwise import (
    BlockwiseArtifactError,
    artifact_stack,
    measure_artifact_blockwise,
    measure_artifacts_blockwise,
    resume_artifact_blockwise,
    start_block,
)
from qcore.artifact.experts import (
    CheckpointExperts,
    checkpoint_experts,
    checkpoint_experts_from_fits,
    paired_expert_blocks,
)
from qcore.artifact.layers import ArtifactLayer, ArtifactMismatchError, artifact_layers, state_digest
from qcore.artifact.measure import (
    ArtifactError,
    ArtifactMeasurement,
    ArtifactRun,
    StreamRecord,
    float_layers_swapped,
    measure_artifact,
    measure_artifacts,
)
from qcore.artifact.offload import is_offloaded, offloaded_bytes, parameter_bytes
from qcore.artifact.tools import (
    RECIPE_KEYS,
    TOOL_NAMES,
    artifact_tool,
    quanto_quantize_weights,
    skipped_modules,
    tool_recipes,
    unwrapped_artifact,
)
from qcore.graph.experts import (
    PER_EXPERT_QUANTIZERS,
    ExpertLayer,
    compact_expert_layers,
    fused_experts_modules,
    held_expert_layers,
    module_list_experts,
    quantized_per_expert,
    with_experts_held,
)
from qcore.measure.passes import SqnrMeasurement
from qcore.measure.screens import HeadSearch, screened_ladder, screened_within_budget, shortest_head
from qcore.numeric.logits import LogitsMeasurement
from qcore.runtime.progress import stage, trials_allowed

__all__ = ["OUTPUT_METRICS", "ArtifactAnalysis", "ArtifactError", "ArtifactFix", "ArtifactGroup", "ArtifactLayer",
           "ArtifactMismatchError", "BlockwiseArtifactError", "tool_recipes"]

# metric -> (read from a measurement, higher is better)
OUTPUT_METRICS: dict[str, tuple[Callable[[ArtifactMeasurement], float], bool]] = {
    "output_sqnr_db": (lambda m: _worst_output_db(m.sqnr), True),
    "kl_nats": (lambda m: m.logits.kl_nats if m.logits else math.nan, False),
    "top1_agreement": (lambda m: m.logits.top1_agreement if m.logits else math.nan, True),
    "perplexity_increase_pct": (lambda m: m.logits.perplexity_increase_pct if m.logits else math.nan, False),
}


def _worst_output_db(sqnr: SqnrMeasurement) -> float:
    worst = sqnr.worst_output()
    return worst.sqnr_db if worst is not None else math.nan


@dataclass(frozen=True)
class ArtifactFix:
    """A verified set of layers to keep in float (the reference's modules swapped in): `measured` is the metric
    with them on the batches the item is judged on, `before` without them; `reached` whether it meets `target`."""

    metric: str
    target: float
    before: float
    float_layers: tuple[str, ...]
    measured: float
    reached: bool
    trials: int
    tool: str | None = None  # the tool that made the artifact (qcore.artifact.tools), when its marks were found
    skipped: tuple[str, ...] = ("lm_head",)  # what its quantization config kept in float already (skipped_modules)
    searched: int = 0  # the candidates the search chose among: the layers of largest own error
    quanto_weights: str | None = None  # the weights qtype of a model made by quanto's own quantize()
    patterns: tuple[str, ...] = ()  # float_layers with a block's experts written as globs (compact_expert_layers)
    stopped: bool = False  # the fix budget ran out before the search did (the set is measured all the same)
    per_expert_blocks: tuple[str, ...] = ()  # the MoE blocks whose fused experts ModelOpt quantized in place

    @property
    def measured_db(self) -> float:
        """`measured`, for a fix of the output SQNR (read as a FloatLayersFix is)."""
        return self.measured

    def meets(self, value: float) -> bool:
        """Whether `value` of the fix's metric meets its target (higher is better for SQNR and top-1, lower for KL
        and perplexity)."""
        return _meets(value, self.target, OUTPUT_METRICS[self.metric][1])

    @property
    def recipes(self) -> dict[str, str]:
        """The fix as each tool's line (tool_recipes)."""
        return tool_recipes(self.float_layers, self.skipped, self.quanto_weights, self.patterns or None,
                            self.per_expert_blocks)

    @property
    def inputs_kept_quantized(self) -> tuple[str, ...]:
        """The float layers whose input stays quantized: experts of fused experts that ModelOpt quantized in place,
        whose projection's one input quantizer is every expert's (only their weights go float, in the trial as in
        the tool's line)."""
        return tuple(layer for layer in self.float_layers
                     if any(layer.startswith(block + ".") for block in self.per_expert_blocks))

    @property
    def tool_line(self) -> str | None:
        """The fix in the words of the tool that made the artifact; None when no tool was recognised."""
        return self.recipes.get(RECIPE_KEYS.get(self.tool, self.tool)) if self.tool is not None else None

    @property
    def tool_name(self) -> str | None:
        """The name its users know the tool that made the artifact by ('llm-compressor' for compressed-tensors)."""
        return TOOL_NAMES.get(self.tool) if self.tool is not None else None


class ArtifactGroup:
    """Several artifacts of one float reference, measured together: the first member's measurement runs the
    reference once per batch for every member not measured yet (measure_artifacts), each compared with it. Members
    join by key; a later analysis of the same key (ArtifactAnalysis.planned) takes its place."""

    def __init__(self) -> None:
        self.members: dict[str, ArtifactAnalysis] = {}
        self.stack_chosen = False  # a member chose whether to go block by block: every member keeps that choice

    def join(self, key: str, analysis: ArtifactAnalysis) -> None:
        """`analysis` is the group's member `key` (replacing an earlier analysis of that key)."""
        self.members[key] = analysis

    def whole_bytes(self) -> int:
        """What whole passes of every member at once are expected to hold besides the models as loaded."""
        members = list(self.members.values())
        if not members:
            return 0
        reference = members[0].reference
        return offloaded_bytes(reference) + sum(offloaded_bytes(member.quantized) + parameter_bytes(member.reference)
                                                for member in members)

    def measured(self, asking: ArtifactAnalysis) -> ArtifactMeasurement:
        """`asking`'s measurement, taken in one pass with every member that shares its reference, stack, device and
        batches and is not measured yet (a member without batches gets `asking`'s: they come from one declaration).
        When that pass fails, each member is measured alone, so that an artifact that errors errors alone."""
        together = [asking] + [member for member in self.members.values() if member is not asking
                               and "measurement" not in member.__dict__ and member.reference is asking.reference
                               and member.stack == asking.stack and member.device == asking.device
                               and (member._batches is None or member._batches is asking._batches)]
        for member in together:
            member.digest_as_loaded()
        if len(together) == 1:
            return asking._measure(asking.batches, asking.float_layers, asking.focus, asking.logits_planned,
                                   digest=True)
        runs = [ArtifactRun(member.quantized, tuple(member._artifact_layers), member.float_layers, member.focus,
                            member.logits_planned) for member in together]
        try:
            if asking.stack is not None:
                results = measure_artifacts_blockwise(asking.reference, runs, asking.batches, asking.stack,
                                                      device=asking.device, digests=True)
            else:
                results = measure_artifacts(asking.reference, runs, asking.batches)
        except Exception:  # noqa: BLE001 - measured alone below, where each member's own error is raised
            return asking._measure(asking.batches, asking.float_layers, asking.focus, asking.logits_planned,
                                   digest=True)
        for member, result in zip(together[1:], results[1:]):
            member.attach_batches(asking.batches)
            member.__dict__["measurement"] = result
        return results[0]


SCREEN_BATCHES = 2  # the batches fix searches screen on by default: the analysis's pass keeps their stream


def _meets(value: float, target: float, higher_is_better: bool) -> bool:
    return not math.isnan(value) and (value >= target if higher_is_better else value <= target)


def _plainly_fused(model: nn.Module) -> list[str]:
    """The fused experts modules of `model` that compute with their parameters as stored (no tool's per-expert
    quantizers beside them, as ModelOpt keeps)."""
    return [path for path, module in fused_experts_modules(model).items()
            if not any(name.endswith(PER_EXPERT_QUANTIZERS) for name, _ in module.named_children())]


def _quantized_per_expert(model: nn.Module) -> list[str]:
    """The fused experts modules of `model` that a tool quantizes in place, a weight quantizer per expert
    (ModelOpt: qcore.graph.experts.quantized_per_expert)."""
    return [path for path, module in fused_experts_modules(model).items() if quantized_per_expert(module)]


class ArtifactAnalysis:
    """A quantized model measured against its float reference, layer by layer by module name; measurements are
    computed on first use and kept. Both models are put in eval mode, and `device` moves both."""

    artifact = True
    blockwise = False
    quantizer = None
    equalize_recipe = None

    def __init__(self, reference: nn.Module, quantized: nn.Module, batches: Iterable[Any] | None = None, *,
                 float_layers: Iterable[str] = (), layers: list[ArtifactLayer] | None = None,
                 logits: bool = False, focus: Iterable[str] | None = None, stack: str | None = None,
                 device: Any = None, group: ArtifactGroup | None = None, member: str = "",
                 shadow: bool = True) -> None:
        """`logits`: compare the logits in the same pass (the output checks ask for them); `stack`: the module path
        of the stack of blocks to go through one at a time (qcore.artifact.blockwise), None for whole passes;
        `device`: where a block-wise pass onloads the blocks; `group`: the ArtifactGroup of artifacts of the same
        reference this one is measured with, as its member `member`; `shadow`: measure each layer's own error."""
        quantized = unwrapped_artifact(quantized)
        # fused experts pair with a checkpoint's experts held as modules through a view of them; a checkpoint whose
        # experts were fused again at load (and dequantized) is viewed so too, and each expert measured (the views
        # read the fused parameters as they are, onloaded or offloaded)
        fused_again = _plainly_fused(quantized)
        # experts a tool quantized in place, a weight quantizer per expert, are viewed through its quantizers, a
        # gated expert's gate and up halves as the one projection the tool quantizes (ModelOpt)
        per_expert = _quantized_per_expert(quantized)
        self.per_expert_blocks = tuple(per_expert)
        quantized = with_experts_held(quantized, [*fused_again, *per_expert])
        reference = with_experts_held(reference, [path for path in [*module_list_experts(quantized), *fused_again]
                                                  if path not in per_expert])
        reference = with_experts_held(reference, per_expert, whole_gate_up=True)
        self.quantized, self.reference = quantized.eval(), reference.eval()
        self.stack, self.device = stack, device
        self.float_layers = tuple(float_layers)
        self.logits_planned = logits
        self.focus = None if focus is None else frozenset(focus)
        self._batches = None if batches is None else list(batches)
        self._artifact_layers = list(layers) if layers is not None else artifact_layers(reference, self.quantized)
        self.tool = artifact_tool(self.quantized)
        self.skipped = tuple(skipped_modules(self.quantized))
        self.quanto_weights = quanto_quantize_weights(self.quantized)
        self._by_name = {layer.name: layer for layer in self._artifact_layers}
        unknown = [name for name in self.float_layers if name not in self._by_name]
        if unknown:
            raise ArtifactMismatchError(f"float_layers {unknown} name no quantized layer of the artifact; its layers: "
                                        + ", ".join(layer.name for layer in self._artifact_layers))
        self._variants: dict[tuple, ArtifactAnalysis] = {}
        self._fixes: dict[tuple, ArtifactFix] = {}
        self._logits_on: dict[int, tuple[list, LogitsMeasurement]] = {}
        self._records: dict[int, tuple[list, StreamRecord]] = {}  # the trials' streams, per batch list
        self._trials: dict[tuple, tuple[list, ArtifactMeasurement]] = {}  # (float layers, batch list) -> outputs
        self._found_stack: str | None = ""  # the stack trials resume in, once looked for ("": not yet)
        self._screens: dict[tuple[int, int], tuple[list, list]] = {}  # (batch list, count) -> its first batches
        self._confirmed: list[tuple[list, tuple[str, ...]]] = []  # the sets the searches measured on every batch
        self.group, self.member, self.shadow = group, member, shadow
        if group is not None:
            group.join(member, self)

    @cached_property
    def expert_blocks(self) -> list[str]:
        """The MoE blocks whose experts the checkpoint and the reference both hold (checkpoint_experts' keys, found
        without reading a weight)."""
        return paired_expert_blocks(self.reference, self.quantized)

    @cached_property
    def checkpoint_experts(self) -> dict[str, CheckpointExperts]:
        """{experts module path: CheckpointExperts}: each expert of the checkpoint (fused, or held as modules)
        against the reference's; block by block, as the pass measured them while their blocks were onloaded."""
        if self.stack is not None and self.expert_layers:
            measured = checkpoint_experts_from_fits(self.measurement.expert_fits, self.expert_layers)
            if measured:
                return measured
        return checkpoint_experts(self.reference, self.quantized)

    @cached_property
    def expert_layers(self) -> dict[str, ExpertLayer]:
        """{layer: ExpertLayer} of the artifact's layers that are experts held as modules (each measured on the
        reference's tokens; their items are one per projection)."""
        return held_expert_layers(self.quantized, lambda name, module: name in self._by_name)

    def planned(self, logits: bool = False, float_layers: Iterable[str] = ()) -> ArtifactAnalysis:
        """The same artifact, to measure with the logits compared in its pass, and the reference's modules swapped
        in at `float_layers` (nothing has been measured yet)."""
        return ArtifactAnalysis(self.reference, self.quantized, self._batches, float_layers=float_layers,
                                layers=self._artifact_layers, logits=logits, stack=self.stack, device=self.device,
                                group=self.group, member=self.member)

    # -- block by block --------------------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        """Whether either model waits on the meta device behind accelerate's offloading hooks."""
        return is_offloaded(self.reference) or is_offloaded(self.quantized)

    def whole_bytes(self) -> int:
        """What whole passes are expected to hold besides the models as loaded: the offloaded weights onloaded, and
        a decompressed copy of the quantized model (compressed-tensors decompresses every layer on the first
        forward), about the reference's size."""
        return offloaded_bytes(self.reference) + offloaded_bytes(self.quantized) + parameter_bytes(self.reference)

    def resident_bytes(self) -> int:
        """The bytes both models hold in memory as loaded (offloaded parameters not counted)."""
        return sum(parameter_bytes(model) - offloaded_bytes(model) for model in (self.reference, self.quantized))

    def blockwise_bytes(self) -> tuple[str, int]:
        """(the biggest part a block-wise pass onloads: a block, or the modules outside the stack, and the bytes
        both models' copies of it take onloaded)."""
        assert self.stack is not None
        parts = {f"{self.stack}.{index}": block for index, block in enumerate(self.reference.get_submodule(self.stack))}
        outside = sum(parameter_bytes(module) for module in self.reference.children()) - parameter_bytes(
            self.reference.get_submodule(self.stack))
        name, biggest = max(((name, parameter_bytes(block)) for name, block in parts.items()), key=lambda e: e[1])
        if outside > biggest:
            name, biggest = "the modules outside the stack", outside
        return name, 2 * biggest

    def choose_blocks(self, mode: bool | str, budget: int | None) -> None:
        """Set the stack to go through block by block: when `mode` (the blockwise setting) is True or a path, or,
        for "auto", when a model is offloaded or whole passes would not fit `budget`; BlockwiseArtifactError when
        asked for and the models have no stack."""
        if self.group is not None:
            if self.group.stack_chosen:  # a member chose for the group, whose first pass measures them together
                return
            self.group.stack_chosen = True
            members = self.group.members.values()
            self._choose_blocks(mode, budget, self.group.whole_bytes(), any(other.offloaded for other in members))
            for other in self.group.members.values():
                if other is not self and self.stack is not None and other.stack is None:
                    with contextlib.suppress(BlockwiseArtifactError):
                        other.stack = artifact_stack(other.reference, other.quantized, self.stack)
            return
        self._choose_blocks(mode, budget, self.whole_bytes(), self.offloaded)

    def _choose_blocks(self, mode: bool | str, budget: int | None, whole: int, offloaded: bool) -> None:
        if mode is False:
            return
        if mode == "auto":
            if not (offloaded or (budget is not None and whole > budget)):
                return
            try:
                self.stack = artifact_stack(self.reference, self.quantized)
            except BlockwiseArtifactError:
                return  # no stack: whole passes, onloading through the models' own hooks
            return
        self.stack = artifact_stack(self.reference, self.quantized, mode if isinstance(mode, str) else None)

    def _measure(self, batches: list[Any], float_layers: Iterable[str], focus: Iterable[str] | None, logits: bool,
                 shadow: bool = True, digest: bool = False) -> ArtifactMeasurement:
        """One pass over `batches`: whole, or block by block when a stack is set (`digest`: hashing the quantized
        model's state as its blocks are onloaded)."""
        if self.stack is not None:
            return measure_artifact_blockwise(self.reference, self.quantized, self._artifact_layers, batches,
                                              self.stack, float_layers=float_layers, focus=focus, logits=logits,
                                              shadow=shadow, device=self.device, digest=digest)
        return measure_artifact(self.reference, self.quantized, self._artifact_layers, batches,
                                float_layers=float_layers, focus=focus, logits=logits, shadow=shadow)

    # -- what the checks read, as of a ModelAnalysis ---------------------------------------------------------------
    @property
    def float_gm(self) -> nn.Module:
        """The float reference (what a ModelAnalysis captured)."""
        return self.reference

    @property
    def batches(self) -> list[Any]:
        """The calibration batches, materialized once."""
        if self._batches is None:
            raise ValueError("this analysis was made without batches; pass batches=... to measure")
        return self._batches

    def attach_batches(self, batches: Iterable[Any]) -> None:
        """Give the analysis its batches (materialized once; later calls keep the first set)."""
        if self._batches is None:
            self._batches = list(batches)

    @property
    def layers(self) -> list[ArtifactLayer]:
        """The artifact's quantized layers, in module order, less those float_layers swaps the reference's modules in
        for."""
        return [layer for layer in self._artifact_layers if layer.name not in self.float_layers]

    def layer(self, name: str) -> ArtifactLayer:
        """One quantized layer by name."""
        if name not in self._by_name:
            raise KeyError(f"{name!r} is not a quantized layer of the artifact; known: {list(self._by_name)}")
        return self._by_name[name]

    def digest_as_loaded(self) -> None:
        """Takes the digest before a whole pass, which decompresses compressed-tensors layers in place: the
        artifact's identity is its state as loaded, as a block-wise pass (which compresses them again) hashes it."""
        if self.stack is None and "measurement" not in self.__dict__:
            _ = self.digest

    @cached_property
    def digest(self) -> str:
        """'sha256:...' of the quantized model's state (its identity in a baseline); block by block, as the pass
        hashed it while onloading the blocks."""
        if self.stack is not None and self.measurement.digest:
            return self.measurement.digest
        return state_digest(self.quantized)

    def describe_outputs(self) -> list[str]:
        """What each output leaf of the reference is on the first batch."""
        from qcore.measure.diagnose import describe_outputs

        return describe_outputs(self.reference, self.batches[0])

    @cached_property
    def measurement(self) -> ArtifactMeasurement:
        """Both models over the batches: one reference pass, one quantized pass and the shadow layers."""
        with stage("comparison"):
            if self.group is not None:
                return self.group.measured(self)
            self.digest_as_loaded()
            stack = self._trial_stack() if self.stack is None else None
            if stack is None:
                return self._measure(self.batches, self.float_layers, self.focus, self.logits_planned, self.shadow,
                                     digest=True)
            # the quantized stream at each block's input and the reference's outputs over the batches fix searches
            # screen on, so that their trials resume from the first block they change without running the reference
            record = StreamRecord()
            run = ArtifactRun(self.quantized, tuple(self._artifact_layers), self.float_layers, self.focus,
                              self.logits_planned)
            measured = measure_artifacts(self.reference, [run], self.batches, shadow=self.shadow, stack=stack,
                                         records=[record], recorded=SCREEN_BATCHES)[0]
            if record.complete:
                head = self._first_batches(self.batches, SCREEN_BATCHES)
                self._records[id(head)] = (head, record)
            elif not record.chained:
                self._found_stack = None  # the model computes between its blocks: trials take whole passes
            return measured

    @property
    def sqnr(self) -> SqnrMeasurement:
        """Per layer (propagated, shadow, weight) and per output leaf."""
        return self.measurement.sqnr

    @property
    def not_comparable(self) -> Mapping[str, str]:
        """{layer: why its own error (shadow) is not measured}."""
        return self.measurement.not_comparable

    @property
    def logits(self) -> LogitsMeasurement:
        """KL, top-1 agreement and perplexity over the batches."""
        if self.logits_planned:
            assert self.measurement.logits is not None
            return self.measurement.logits
        return self.logits_on(self.batches)

    def logits_on(self, batches: Iterable[Any]) -> LogitsMeasurement:
        """The logits compared on other batches (evaluation data); kept per batch list."""
        batches = batches if isinstance(batches, list) else list(batches)
        kept = self._logits_on.get(id(batches))
        if kept is None or kept[0] is not batches:
            with stage("comparison"):
                measured = self._measure(batches, self.float_layers, (), True, shadow=False)
            assert measured.logits is not None
            kept = self._logits_on[id(batches)] = (batches, measured.logits)
        return kept[1]

    def task_metric(self, metric: Any, batches: Any) -> tuple[float, float]:
        """(reference, artifact) values of a user's `metric(model, batches) -> float` (higher is better)."""
        with torch.no_grad():
            reference = float(metric(self.reference, batches))
            with float_layers_swapped(self.quantized, self.reference, self.float_layers):
                return reference, float(metric(self.quantized, batches))

    # -- fixes -----------------------------------------------------------------------------------------------------
    def variant(self, float_layers: Iterable[str] = (), layers: Iterable[str] | None = None,
                logits: bool = False, shadow: bool = True) -> ArtifactAnalysis:
        """The same artifact with the reference's modules swapped in at `float_layers` too (the same as pasting
        them), kept per set; `layers`: the only layers measured (the outputs always); `shadow`: their own error
        measured too (a variant measured with it serves one asked without)."""
        swapped = tuple(dict.fromkeys([*self.float_layers, *float_layers]))
        key: tuple = (swapped, None if layers is None else tuple(sorted(layers)), logits)
        if not shadow and key not in self._variants:
            key = (*key, "no shadow")
        if key not in self._variants:
            variant = ArtifactAnalysis(self.reference, self.quantized, self.batches, float_layers=swapped,
                                       layers=self._artifact_layers, logits=logits, focus=layers, stack=self.stack,
                                       device=self.device, shadow=shadow)
            if layers is not None and not list(layers):  # the outputs only: a fix trial's, shared with the searches
                variant.__dict__["measurement"] = self._trial(swapped[len(self.float_layers):], self.batches, False)
            self._variants[key] = variant
        return self._variants[key]

    def _value(self, metric: str, float_layers: Iterable[str], batches: list[Any], resume: bool = False) -> float:
        """`metric` over `batches` with `float_layers` kept in float too (_trial)."""
        read, _ = OUTPUT_METRICS[metric]
        return read(self._trial(float_layers, batches, resume, logits=metric != "output_sqnr_db"))

    def _trial(self, float_layers: Iterable[str], batches: list[Any], resume: bool,
               logits: bool = True) -> ArtifactMeasurement:
        """The outputs and logits over `batches` with `float_layers` kept in float too, kept per set and batch list:
        every metric's search reads the same trials (`logits`: whether the caller reads them). `resume`: the trial
        runs from the first block of the models' stack it changes, on the quantized stream a first pass over the
        same batch list recorded, against the reference outputs that pass recorded (no reference pass, no model
        copy)."""
        extra = tuple(dict.fromkeys(float_layers))
        key = (frozenset(extra), id(batches))
        kept = self._trials.get(key)
        if kept is not None and kept[0] is batches:
            return kept[1]
        if not extra and not resume and batches is self._batches and "measurement" in self.__dict__ \
                and (self.measurement.logits is not None or not logits):
            return self.measurement  # the analysis's own pass: the same outputs (and logits, when it compared them)
        swapped = [*self.float_layers, *extra]
        record = self._records.get(id(batches))
        if record is not None and record[0] is not batches:
            record = None
        stack = self._trial_stack() if resume or record is not None else None
        if stack is None:
            measured = self._measure(batches, swapped, (), True, shadow=False)
        elif record is None:
            stream = StreamRecord()
            try:
                measured = measure_artifact_blockwise(self.reference, self.quantized, self._artifact_layers, batches,
                                                      stack, float_layers=swapped, focus=(), logits=True,
                                                      shadow=False, device=self.device,
                                                      record=None if extra else stream)
            except BlockwiseArtifactError:
                if self.stack is not None:
                    raise
                self._found_stack = None  # the models' stack does not run as one: trials take whole passes
                measured = self._measure(batches, swapped, (), True, shadow=False)
            else:
                if not extra:
                    self._records[id(batches)] = (batches, stream)
        else:
            blocks = len(self.quantized.get_submodule(stack))
            start = start_block(extra, stack, blocks, self._before_stack(stack))
            if start is None:
                measured = self._measure(batches, swapped, (), True, shadow=False)
            else:
                measured = resume_artifact_blockwise(self.reference, self.quantized, batches, stack, record[1], start,
                                                     float_layers=swapped, logits=True, device=self.device)
        self._trials[key] = (batches, measured)
        return measured

    def _first_batches(self, batches: list[Any], count: int | None) -> list[Any]:
        """The first `count` of `batches` (all when None or 0), as one list object per batch list and count: every
        search screens on the same list, so their trials and recorded streams are shared."""
        if not count or count >= len(batches):
            return batches
        kept = self._screens.get((id(batches), count))
        if kept is None or kept[0] is not batches:
            kept = self._screens[(id(batches), count)] = (batches, batches[:count])
        return kept[1]

    def _trial_stack(self) -> str | None:
        """The stack trials resume in: the analysis's, else the models' own stack of blocks (None: whole passes)."""
        if self.stack is not None:
            return self.stack
        if self._found_stack == "":
            try:
                self._found_stack = artifact_stack(self.reference, self.quantized)
            except BlockwiseArtifactError:
                self._found_stack = None
        return self._found_stack

    def _climb(self, metric: str, target: float, ladder: list[str], screen_batches: list[Any],
               batches: list[Any]) -> HeadSearch:
        """shortest_head of `ladder` for `metric` to meet `target`: screened on `screen_batches` (resumed), each
        head returned measured on every batch and kept as a confirmed set other gates may take."""
        _, higher = OUTPUT_METRICS[metric]

        def screen(head: list[str]) -> bool:
            return _meets(self._value(metric, head, screen_batches, resume=True), target, higher)

        def confirm(head: list[str]) -> bool:
            self._confirmed.append((batches, tuple(head)))
            return _meets(self._value(metric, head, batches), target, higher)

        return shortest_head(ladder, screen, confirm)

    def _before_stack(self, stack: str) -> list[str]:
        """The artifact's layers that run before the stack (in module order before it)."""
        names = [name for name, _ in self.quantized.named_modules()]
        first = names.index(stack)
        return [layer.name for layer in self._artifact_layers if layer.name in names[:first]]

    def _candidates(self, max_candidates: int) -> list[str]:
        """The layers whose own error is largest first (SqnrMeasurement.by_own_error)."""
        names = [layer.name for layer in self._artifact_layers if layer.name not in self.float_layers]
        return self.sqnr.by_own_error(names)[:max_candidates]

    def largest_errors_in_float(self, metric: str, count: int, max_batches: int | None = SCREEN_BATCHES,
                                batches: list[Any] | None = None) -> tuple[float, int]:
        """(`metric` with the `count` layers of largest own error kept in float at once, on the first `max_batches`
        of `batches`; how many batches that is): what a float_layers search among that many candidates can reach
        at most, since keeping more layers in float does not make the output worse."""
        trial_batches = self._first_batches(self.batches if batches is None else batches, max_batches)
        with stage("trials"):
            return self._value(metric, self._candidates(count), trial_batches, resume=True), len(trial_batches)

    def float_layers_fix(self, target: float, metric: str = "output_sqnr_db", max_float_layers: int = 8,
                         max_batches: int | None = SCREEN_BATCHES, batches: list[Any] | None = None,
                         max_candidates: int = 32) -> ArtifactFix:
        """A verified set of up to `max_float_layers` layers to keep in float (the reference's modules swapped in)
        for `metric` (OUTPUT_METRICS) to meet `target` on `batches` (default: the analysis's). A set another
        metric's search confirmed serves when it meets the target; else the `max_candidates` layers with the largest
        own error are screened on the first `max_batches` batches (all at once first: when that misses the target
        no set of them meets it; then each alone), the shortest head of them, best first, that meets the target is
        found (_climb), and the set returned is measured on every batch."""
        batches = self.batches if batches is None else batches
        key = (metric, target, max_float_layers, max_batches, max_candidates, id(batches))
        if key in self._fixes:
            return self._fixes[key]
        _, higher = OUTPUT_METRICS[metric]
        trial_batches = self._first_batches(batches, max_batches)

        searched, stopped = 0, False

        def kept(chosen: Iterable[str], measured: float, trials: int) -> ArtifactFix:
            chosen = tuple(chosen)
            fix = ArtifactFix(metric, target, before, chosen, measured, _meets(measured, target, higher),
                              trials, self.tool, self.skipped, searched, self.quanto_weights,
                              tuple(compact_expert_layers(chosen, self.expert_layers)), stopped,
                              self.per_expert_blocks)
            self._fixes[key] = fix
            return fix

        with stage("trials"):
            before = self._value(metric, (), batches, resume=trial_batches is batches)
            if _meets(before, target, higher):  # nothing to fix
                return kept((), before, 1)
            # one search serves every gate: a set another metric's search measured on these batches, if it meets this
            # target too (read from the same trials, nothing run)
            served = [chosen for measured_on, chosen in self._confirmed if measured_on is batches
                      and len(chosen) <= max_float_layers and _meets(self._value(metric, chosen, batches), target,
                                                                     higher)]
            if served:
                chosen_set = min(served, key=len)
                return kept(chosen_set, self._value(metric, chosen_set, batches), 1)
            if not trials_allowed():  # the fix budget is spent: nothing is searched
                stopped = True
                return kept((), before, 1)
            candidates = self._candidates(max_candidates)
            searched = len(candidates)
            quantized = [layer for layer in self._artifact_layers if layer.name not in self.float_layers]
            limit = min(max_float_layers, len(quantized) - 1)  # a proper subset, never every layer
            if candidates and not _meets(self._value(metric, candidates, trial_batches, resume=True), target, higher):
                # every candidate kept in float at once does not meet the target on the screen, so no set of them
                # does (keeping more in float does not make the output worse): the most the fix may keep, measured
                chosen = candidates[:limit]
                self._confirmed.append((batches, tuple(chosen)))
                return kept(chosen, self._value(metric, chosen, batches), 3)
            base = self._value(metric, (), trial_batches, resume=True) if trial_batches is not batches else before
            # largest own error first: the most promising first when the fix budget runs out
            singles, stopped = screened_within_budget(
                candidates, lambda name: self._value(metric, (name,), trial_batches, resume=True))
            trials = len(singles) + 3
            ladder = screened_ladder([name for name in candidates if name in singles], singles, base, higher)
            found = self._climb(metric, target, ladder[:limit], trial_batches, batches)
            trials += found.screened + found.confirmed
            stopped = stopped or found.stopped
            return kept(found.head, self._value(metric, found.head, batches) if found.head else before, trials)

