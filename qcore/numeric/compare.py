"""Streaming float-vs-quantized comparison: per-layer sums on the device, memory flat in the batch count."""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from qcore.graph.capture import clone_graph_module
from qcore.graph.inputs import call_model, move_to
from qcore.graph.ops import (
    INSERTED_KEY,
    REWRITTEN_KEY,
    is_inserted,
    may_change_after,
    op_schema,
    viewed_value,
    written_after,
)
from qcore.numeric.instrument import (
    FloatNodes,
    attach_after,
    copy_layer_into,
    makes_new_tensor,
    merge_repeated_shadow_inputs,
    merge_repeated_shadow_weights,
    pair_shadow_matmuls,
    reads_only,
    shadow_signature,
    skip_requantizations,
)
from qcore.numeric.loggers import ActivationStash, ExpertsComparator, StreamingComparator
from qcore.numeric.logits import LogitsComparator
from qcore.numeric.matching import LayerPair, layer_value, match_layers
from qcore.quantization.calibrate import OutputSink, model_device
from qcore.runtime.deferred import batched_updates
from qcore.runtime.progress import batch_done, graph_run, stage

__all__ = ["KEPT_BYTES", "ExtraShadows", "KeptBudget", "KeptFloatOutputs", "KeptLayerInputs",
           "KnownShadows", "ShadowGraph", "compare", "compare_outputs", "compare_propagated_and_shadow", "run_both"]

_SHADOW_PREFIX = "qcore_shadow_b.quantized"

KEPT_BYTES = 64 << 20  # the float values kept for later passes (outputs, layer inputs) that one budget holds, at most

# {layer: [(shadow_signature, shadow record)]}: shadows measured before over the same float graph and batches
KnownShadows = Mapping[str, Sequence[tuple[tuple, Mapping[str, float]]]]


class _QuantizedHolder(nn.Module):
    """Holds the quantized graph inside the float one, so that shadow copies resolve its weights, without being
    a GraphModule child: GraphModule.recompile recompiles those, and the float copy is recompiled twice."""

    def __init__(self, quantized: fx.GraphModule) -> None:
        super().__init__()
        self.quantized = quantized


def _hold(gm_a: fx.GraphModule, gm_b: fx.GraphModule) -> None:
    gm_a.add_submodule(_SHADOW_PREFIX.split(".")[0], _QuantizedHolder(gm_b))


def compare(
    float_model: fx.GraphModule,
    quant_model: fx.GraphModule,
    batches: Iterable[Any],
    propagate: bool = True,
) -> list[dict]:
    """One record per matched layer: fqn, layer, op, sqnr_db, normalized_l2, cosine, batches.

    propagate=True runs both models end to end (each layer inherits upstream error) and adds one record
    per output leaf (op "output"). propagate=False is the shadow mode: each quantized layer gets the float
    model's input, so it shows the layer's own error.
    """
    if propagate:
        pairs, runner, comparators, outputs = _propagated(float_model, quant_model)
    else:
        pairs, runner, comparators, outputs = _shadowed(float_model, quant_model)
    device = model_device(float_model)
    count = 0
    with torch.no_grad():
        for batch in batches:
            runner(move_to(batch, device))
            count += 1
    if count == 0:
        raise ValueError("compare needs at least one batch")
    records = []
    for pair, comparator in zip(pairs, comparators):
        records.append({"layer": pair.layer, "fqn": pair.a.fqn, "op": pair.a.kind, **comparator.result()})
    for index, comparator in enumerate(outputs):
        name = "output" if len(outputs) == 1 else f"output.{index}"
        records.append({"layer": name, "fqn": "", "op": "output", **comparator.result()})
    return records


def _propagated(float_model, quant_model):
    gm_a, gm_b = clone_graph_module(float_model, True), clone_graph_module(quant_model, True)
    pairs = match_layers(gm_a, gm_b)
    comparators = []
    for index, pair in enumerate(pairs):
        stash = ActivationStash()
        attach_after(gm_a, layer_value(pair.a), f"qcore_stash_{index}", stash)
        comparator = StreamingComparator(stash)
        attach_after(gm_b, layer_value(pair.b), f"qcore_compare_{index}", comparator)
        comparators.append(comparator)
    gm_a.recompile()
    gm_b.recompile()
    outputs: list[StreamingComparator] = []
    return pairs, lambda batch: run_both(gm_a, gm_b, batch, outputs), comparators, outputs


def run_both(gm_a: fx.GraphModule, gm_b: fx.GraphModule, batch: Any, outputs: list[StreamingComparator],
              logits: LogitsComparator | None = None, batch_b: Any = None) -> tuple[Any, Any]:
    """Run A on one batch then B (on `batch_b` when given: a block's quantized input stream), and add their
    floating output leaves to `outputs` (one comparator per leaf), and to `logits` when given; returns both
    outputs."""
    result = call_model(gm_a, batch)
    with batched_updates():  # the output comparators update with the quantized graph's, in one chain
        result_b = call_model(gm_b, batch if batch_b is None else batch_b)
        compare_outputs(gm_a, batch, result, result_b, outputs, logits)
    return result, result_b


def compare_outputs(gm_a: fx.GraphModule, batch: Any, result: Any, result_b: Any, outputs: list[StreamingComparator],
                    logits: LogitsComparator | None = None) -> None:
    """Add the floating output leaves of A's and B's results on one batch to `outputs` (one comparator per leaf),
    and to `logits` when given; inside a model call's scope (qcore.runtime.deferred), the leaves join its queue:
    nothing may change them in place before the scope closes."""
    out_a, out_b = pytree.tree_leaves(result), pytree.tree_leaves(result_b)
    tensors = [(a, b) for a, b in zip(out_a, out_b) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    while len(outputs) < len(tensors):
        outputs.append(StreamingComparator(actual_held=True, reference_held=True))
    for comparator, (a, b) in zip(outputs, tensors):
        comparator.add(a, b)
    if logits is not None:
        logits.decide(gm_a, result)
        logits.update([a for a, _ in tensors], [b for _, b in tensors], batch)


def _shadowed(float_model, quant_model):
    gm_a, gm_b = clone_graph_module(float_model, True), clone_graph_module(quant_model, True)
    _hold(gm_a, gm_b)
    pairs = match_layers(gm_a, gm_b)
    comparators = []
    known = FloatNodes(gm_a)
    for index, pair in enumerate(pairs):
        shadow_value = copy_layer_into(gm_a, pair.a, pair.b, _SHADOW_PREFIX, known=known)
        comparator = StreamingComparator()
        attach_after(gm_a, shadow_value, f"qcore_compare_{index}", comparator, layer_value(pair.a))
        comparators.append(comparator)
    gm_a.graph.lint()
    gm_a.recompile()
    return pairs, (lambda batch: call_model(gm_a, batch)), comparators, []


@dataclass
class ShadowGraph:
    """What an `instrument` callback of compare_propagated_and_shadow may add to: the float copy `gm` (the quantized
    graph is its submodule `prefix`), the matched layers, and per layer the node whose value is the float layer
    output flattened (`references`, see ActivationStash) and the shadow comparator (`shadows`)."""

    gm: fx.GraphModule
    pairs: list[LayerPair]
    prefix: str
    references: dict[str, fx.Node]
    shadows: dict[str, StreamingComparator]
    known: FloatNodes | None = None  # gm's original nodes, read once for every layer copied into it

    def float_nodes(self) -> FloatNodes:
        """gm's FloatNodes for copy_layer_into, read from gm once (the shadows' own, when they made one)."""
        if self.known is None:
            self.known = FloatNodes(self.gm)
        return self.known


@dataclass
class ExtraShadows:
    """Another quantized copy of the same float graph whose `layers` also run as shadows (on the float inputs, over
    every batch) in a comparison pass; `results` is {layer: comparator result} afterwards."""

    quantized: fx.GraphModule
    layers: Collection[str]
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    signatures: dict[str, tuple | None] = field(default_factory=dict)  # {layer: its shadow's shadow_signature}


def compare_propagated_and_shadow(float_model: fx.GraphModule, quant_model: fx.GraphModule, batches: Iterable[Any],
                                  own_quant_model: bool = False, propagate: bool = True,
                                  instrument: Callable[[ShadowGraph], Callable[[], None] | None] | None = None,
                                  instrument_batches: int | None = None, keep_first_output: OutputSink | None = None,
                                  logits: LogitsComparator | None = None, quant_batches: list | None = None,
                                  streams: list | None = None, layers: Collection[str] | None = None,
                                  extra_shadows: Sequence[ExtraShadows] = (),
                                  shadowed_layers: Collection[str] | None = None,
                                  propagated_layers: Collection[str] | None = None,
                                  float_outputs: Sequence[Any] | None = None,
                                  keep_float_outputs: KeptFloatOutputs | None = None,
                                  known_shadows: KnownShadows | None = None,
                                  layer_inputs: KeptLayerInputs | None = None,
                                  keep_layer_inputs: KeptLayerInputs | None = None,
                                  watch: Callable[[ShadowGraph], None] | None = None
                                  ) -> tuple[list[dict], list[dict]]:
    """Both modes of `compare` in one pass over the batches: (propagated records, shadow records).

    The float graph runs once per batch with the shadow copies of the quantized layers inside it, and its
    layer values feed the propagated comparison too. own_quant_model=True instruments `quant_model` itself
    instead of a copy (for a caller that discards it afterwards). propagate=False runs the float graph only
    (no propagated records). `instrument(shadow_graph)` may add more branches to the float copy before it runs;
    with `instrument_batches`, they run on that many batches only, then the callable it returned (if any) is
    called and they are removed (their buffers with them). The float graph's output on the first batch is
    appended to `keep_first_output` when given; `logits` compares the output logits (propagate=True only).
    `quant_batches` are the quantized graph's own inputs, one per batch (default: the same batches), and `streams`,
    when given, gets each batch's (float output, quantized output): a block of a block-wise analysis hands both on.
    `layers`, when given, are the only layers compared (the output leaves always are). Each of `extra_shadows`
    adds its layers' shadows from its own quantized copy, compared with the same float layer values.

    A caller that reads only some of these values says which: `shadowed_layers` and `propagated_layers` (default:
    every compared layer) are the layers whose shadow and propagated SQNR are measured (the others' records hold
    nan). `float_outputs`, the float graph's output on each batch kept from an earlier pass over the same graph and
    batches (KeptFloatOutputs), are compared with the quantized outputs instead, and the float copy then runs only as
    far as the last layer value it still has to give (not at all when it has none). `keep_float_outputs` keeps this
    pass's float outputs for such a later pass. `watch(shadow_graph)`, like `instrument`, adds branches that run on
    every batch. `known_shadows`, {layer: [(shadow_signature, shadow record)]} of
    shadows measured before over the same float graph and batches (ExtraShadows.signatures and results), give a
    layer's shadow record where its shadow here has one of those signatures, instead of running it again.
    `keep_layer_inputs` keeps the float inputs and values of the `extra_shadows`' layers on each batch;
    `layer_inputs`, kept so by an earlier pass over the same float graph and batches, feed the float copy where it
    reads them when the float outputs are kept too: it then runs only what its layer values need from those inputs
    on.
    """
    gm_a = clone_graph_module(float_model, share_parameters=True, recompile=False)  # both are recompiled below
    gm_b = quant_model if own_quant_model else clone_graph_module(quant_model, share_parameters=True, recompile=False)
    pairs = [pair for pair in match_layers(gm_a, gm_b) if layers is None or _names_any(pair, layers)]
    rewritten = [may_change_after(layer_value(pair.a), reads_only) for pair in pairs]  # before any node is added
    extra_pairs = [[pair for pair in match_layers(gm_a, extra.quantized) if _names_any(pair, extra.layers)]
                   for extra in extra_shadows]
    if keep_layer_inputs is not None:  # before any node is added: a shadow's op may change what it reads
        keep_layer_inputs.watch(gm_a, [pair.a for extra in extra_pairs for pair in extra], outputs=True)
    _hold(gm_a, gm_b)
    propagated: list[StreamingComparator | None] = []
    shadowed: list[StreamingComparator | ExpertsComparator | None] = []
    stashes, references = [], {}
    known: dict[str, dict] = {}
    floats: FloatNodes | None = None  # gm_a's original nodes, read once for every shadow copied
    for pair in pairs:
        earlier = (known_shadows or {}).get(pair.layer, ())
        if earlier and (shadowed_layers is None or pair.layer in shadowed_layers):
            signature = shadow_signature(gm_b, pair.b)
            record = next((record for seen, record in earlier if signature is not None and seen == signature), None)
            if record is not None:
                known[pair.layer] = dict(record)
    for index, pair in enumerate(pairs):
        shadow_it = (shadowed_layers is None or _names_any(pair, shadowed_layers)) and pair.layer not in known
        # a grouped projection's experts run on the tokens routed to them, which differ between the two models once
        # a router's choice flips: measured on the float model's tokens alone (its shadow)
        propagate_it = propagate and (propagated_layers is None or pair.layer in propagated_layers) and \
            pair.a.kind != "grouped_linear"
        if not (shadow_it or propagate_it or any(_names_any(pair, extra.layers) for extra in extra_shadows)):
            shadowed.append(None)
            propagated.append(None)
            continue
        stash = ActivationStash(copy=rewritten[index])  # the float layer value, for every comparator that reads it
        references[pair.layer] = attach_after(gm_a, layer_value(pair.a), f"qcore_stash_{index}", stash)
        stashes.append(stash)
        shadow = None
        if shadow_it:
            floats = floats or FloatNodes(gm_a)
            shadow_value = copy_layer_into(gm_a, pair.a, pair.b, _SHADOW_PREFIX, known=floats)
            # the shadow's value is read by its comparator only, and the reference is the stash's
            reads: tuple[fx.Node, ...] = (references[pair.layer],)
            if pair.a.kind == "grouped_linear":  # each expert's sums over its rows: the float graph's counts
                shadow = ExpertsComparator(len(pair.a.expert_layers))
                reads += (pair.a.node.args[1],)
            else:
                shadow = StreamingComparator(actual_held=True, reference_held=True)
            attach_after(gm_a, shadow_value, f"qcore_shadow_compare_{index}", shadow, *reads)
        shadowed.append(shadow)
        comparator = None
        if propagate_it:
            quantized_value = layer_value(pair.b)
            held = not may_change_after(quantized_value, reads_only, makes_new_tensor)
            comparator = StreamingComparator(stash, actual_held=held)
            attach_after(gm_b, quantized_value, f"qcore_compare_{index}", comparator)
        propagated.append(comparator)
    extra_comparators = _add_extra_shadows(gm_a, extra_shadows, extra_pairs, references)
    if watch is not None:  # branches that stay for every batch, unlike `instrument`'s
        watch(ShadowGraph(gm_a, pairs, _SHADOW_PREFIX, references,
                          {pair.layer: c for pair, c in zip(pairs, shadowed) if c is not None}, floats))
    merge_repeated_shadow_inputs(gm_a.graph)
    merge_repeated_shadow_weights(gm_a.graph)
    pair_shadow_matmuls(gm_a.graph)
    before = set(gm_a.graph.nodes)
    finish = None
    if instrument is not None:
        finish = instrument(ShadowGraph(gm_a, pairs, _SHADOW_PREFIX, references,
                                        {pair.layer: c for pair, c in zip(pairs, shadowed) if c is not None}, floats))
    kept = float_outputs is not None and propagate and instrument is None
    run_float = not kept or _truncate_after_last_logger(gm_a)
    total = len(batches) if isinstance(batches, Sized) else None
    if kept and run_float and layer_inputs is not None and total is not None:
        run_float = layer_inputs.feed(gm_a, total)
        before = set(gm_a.graph.nodes)  # no instrument runs with kept outputs: nothing to remove after some batches
    gm_a.graph.lint()
    gm_a.recompile()
    skip_requantizations(gm_b.graph)  # the shadows copied the layers' own quantizations above
    gm_b.recompile()
    outputs: list[StreamingComparator] = []
    device = model_device(float_model)
    count = 0
    # the shadow copies run inside the float graph: their share of a quantized graph's layers, counted as graph runs
    # (a grouped projection counts as its experts' layers, as the per-expert graph counts them: the fix budget, a
    # multiple of these runs, is then the same however the experts were captured)
    shadow_count = sum(_layer_count(pair) for pair, c in zip(pairs, shadowed) if c is not None) + \
        sum(_layer_count(pair, extra.layers) for extra, extras in zip(extra_shadows, extra_pairs) for pair in extras)
    shadow_share = shadow_count / max(1, sum(_layer_count(pair) for pair in pairs))
    with torch.no_grad(), stage("comparison", total):
        for batch in batches:
            if layer_inputs is not None:
                layer_inputs.position = count
            batch = move_to(batch, device)
            batch_b = None if quant_batches is None else move_to(quant_batches[count], device)
            if kept:
                assert float_outputs is not None
                if run_float:
                    call_model(gm_a, batch)
                result = float_outputs[count]
                with batched_updates():  # the output comparators update with the quantized graph's
                    result_b = call_model(gm_b, batch if batch_b is None else batch_b)
                    compare_outputs(float_model, batch, result, result_b, outputs, logits)
            elif propagate:
                result, result_b = run_both(gm_a, gm_b, batch, outputs, logits, batch_b)
            else:
                result = result_b = call_model(gm_a, batch)
            if keep_float_outputs is not None:
                keep_float_outputs.add(result)
            if streams is not None:
                streams.append((result, result_b))
            if count == 0 and keep_first_output is not None and not kept:
                keep_first_output.append(result)
            for stash in stashes:
                stash.value = None
            del result, result_b  # not held while the next batch runs (an LM's logits: two copies)
            if shadow_share and (run_float or not kept):
                graph_run(shadow_share)
            count += 1
            batch_done(count, total)
            if count == instrument_batches:
                if finish is not None:
                    finish()
                _remove_nodes_since(gm_a, before)
    if count == 0:
        raise ValueError("compare needs at least one batch")
    records = [{"layer": p.layer, "fqn": p.a.fqn, "op": p.a.kind, **_result(c, count)}
               for p, c in zip(pairs, propagated) if p.a.kind != "grouped_linear"] if propagate else []
    for index, comparator in enumerate(outputs):
        records.append({"layer": "output" if len(outputs) == 1 else f"output.{index}", "fqn": "", "op": "output",
                        **comparator.result()})
    shadows: list[dict] = []
    for pair, comparator in zip(pairs, shadowed):
        if isinstance(comparator, ExpertsComparator):  # a record per expert, named as the per-expert graph names it
            shadows.extend({"layer": layer, "fqn": layer, "op": "linear", **result}
                           for layer, result in zip(pair.a.expert_layers, comparator.results(), strict=True))
        elif pair.a.kind == "grouped_linear":
            shadows.extend({"layer": layer, "fqn": layer, "op": "linear", **_result(None, count)}
                           for layer in pair.a.expert_layers)
        else:
            shadows.append({"layer": pair.layer, "fqn": pair.a.fqn, "op": pair.a.kind,
                            **(known[pair.layer] if pair.layer in known else _result(comparator, count))})
    for extra, pair, comparator in extra_comparators:
        if isinstance(comparator, ExpertsComparator):  # the experts the copy changed, by their layers
            extra.results.update({layer: result for layer, result in zip(pair.a.expert_layers, comparator.results(),
                                                                         strict=True) if layer in extra.layers})
        else:
            extra.results[pair.layer] = comparator.result()
    return records, shadows


def _layer_count(pair: LayerPair, named: Collection[str] | None = None) -> int:
    """How many layers a pair stands for (a grouped projection: its experts'), of those `named` when given."""
    if not pair.a.expert_layers:
        return 1
    return sum(named is None or layer in named for layer in pair.a.expert_layers)


def _names_any(pair: LayerPair, layers: Collection[str]) -> bool:
    """Whether `layers` names the pair's layer, or for a grouped projection one of its experts' layers."""
    return pair.layer in layers or any(layer in layers for layer in pair.a.expert_layers)


def _result(comparator: StreamingComparator | None, batches: int) -> dict[str, float]:
    """A comparator's result; nan for a value the caller did not ask to measure."""
    if comparator is None:
        return {"sqnr_db": math.nan, "normalized_l2": math.nan, "cosine": math.nan, "batches": batches}
    return comparator.result()


def _truncate_after_last_logger(gm: fx.GraphModule) -> bool:
    """Erase the nodes after the last inserted logger (nothing after it feeds one), the graph returning None for
    each output leaf; False when it has no logger (nothing to run)."""
    nodes = list(gm.graph.nodes)
    last = max((i for i, node in enumerate(nodes) if node.meta.get(INSERTED_KEY) == "logger"), default=None)
    output = nodes[-1]
    output.args = fx.node.map_arg(output.args, lambda _: None)
    for node in reversed(nodes[(last if last is not None else -1) + 1:-1]):
        if node.op != "placeholder":
            gm.graph.erase_node(node)
    return last is not None


class KeptBudget:
    """The bytes that the keepers sharing it (KeptFloatOutputs, KeptLayerInputs) hold together, at most: one model's
    analysis keeps its comparison pass's values while its trials keep their own, and what they keep in all is what
    its peak memory pays for them."""

    def __init__(self, limit: int = KEPT_BYTES) -> None:
        self.limit = limit
        self._keepers: weakref.WeakSet[Any] = weakref.WeakSet()

    def join(self, keeper: Any) -> None:
        """Count what `keeper` holds (its `held` bytes) against this budget while it is alive."""
        self._keepers.add(keeper)

    def room(self, keeper: Any) -> int:
        """The bytes `keeper` may hold in all: the limit less what the other keepers alive hold."""
        return self.limit - sum(other.held for other in list(self._keepers) if other is not keeper)


def _room(keeper: Any, budget: KeptBudget | None) -> int:
    """The bytes `keeper` may hold in all: its own limit, and no more than its budget leaves it when it shares one."""
    return keeper.limit if budget is None else min(keeper.limit, budget.room(keeper))


class KeptFloatOutputs:
    """The float graph's output on each batch of a comparison pass, kept while their tensors hold at most `limit`
    bytes in all (and fit the `budget` it shares, when given), so that a later pass over the same float graph and
    batches (a fix trial's) need not run it again; `outputs` is None once they would hold more."""

    def __init__(self, limit: int = KEPT_BYTES, budget: KeptBudget | None = None) -> None:
        self.limit = limit
        self.outputs: list[Any] | None = []
        self._bytes = 0
        self._budget = budget
        if budget is not None:
            budget.join(self)

    @property
    def held(self) -> int:
        """The bytes the kept outputs hold."""
        return self._bytes

    def add(self, output: Any) -> None:
        """Keep one batch's output (or give up on keeping them)."""
        if self.outputs is None:
            return
        size = sum(leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(output)
                   if isinstance(leaf, torch.Tensor))
        if self._bytes + size > _room(self, self._budget):
            self.outputs, self._bytes = None, 0
            return
        self.outputs.append(output)
        self._bytes += size

    append = add  # an OutputSink: calibrate() keeps every batch's output in it


class KeptLayerInputs:
    """The float inputs of some layers (the float graph's values their shadow copies read) on each batch of a
    comparison pass, kept while they hold at most `limit` bytes in all and fit the `budget` they share, when given
    (a value that would pass either is not kept on any batch), so that a later pass over the same float graph and
    batches (a fix trial's) feeds those layers' float values and shadows from them instead of running the float graph
    up to them. `values`: {float node name: one tensor per batch}. The layers' own float values, when watched too,
    take at most half of `limit`, so that an input, which saves more of a float run, always has room. `limit` is half
    of the budget's (of KEPT_BYTES without one) by default: the float outputs, kept after a batch's inputs and saving
    a whole float run, have the other half."""

    def __init__(self, limit: int | None = None, budget: KeptBudget | None = None) -> None:
        self.limit = limit if limit is not None else (budget.limit if budget is not None else KEPT_BYTES) // 2
        self.values: dict[str, list[torch.Tensor]] = {}
        self.position = 0  # the batch being run
        self._refused: set[str] = set()
        self._bytes = {False: 0, True: 0}  # {a layer's own value: bytes kept}
        self._keepers: list[fx.Node] = []
        self._budget = budget
        if budget is not None:
            budget.join(self)

    @property
    def held(self) -> int:
        """The bytes the kept values hold."""
        return self._bytes[False] + self._bytes[True]

    def watch(self, gm: fx.GraphModule, ops: Iterable[Any], outputs: bool = False) -> None:
        """Keep, on each batch `gm` runs, the values the float `ops` read that an aten op computes (not weights or
        model inputs) and that nothing writes to in place later (a view of part of a tensor is kept as a copy); with
        `outputs`, each op's layer value too (the float graph then need not compute it again). `ops` are of a float
        graph without observers (the float copy before anything is added to it, or the graph `gm` was prepared
        from): their values are `gm`'s nodes of the same names."""
        names: dict[str, bool] = {}
        ops = list(ops)

        def keepable(node: fx.Node) -> bool:
            return op_schema(node) is not None and not node.meta.get(REWRITTEN_KEY) \
                and (not is_inserted(node) or node.meta[INSERTED_KEY] == "equalization") \
                and not written_after(viewed_value(node))

        for op in ops:
            for node in op.node.all_input_nodes:
                if keepable(node):
                    names.setdefault(node.name, False)
        for op in ops if outputs else ():
            node = layer_value(op)
            if keepable(node):
                names.setdefault(node.name, True)
        nodes = {node.name: node for node in gm.graph.nodes}
        for name, own in names.items():
            if name in nodes:
                target = f"qcore_keep_input_{len(self._keepers)}"
                self._keepers.append(attach_after(gm, nodes[name], target, _InputKeeper(self, name, own)))

    def unwatch(self, gm: fx.GraphModule) -> None:
        """Take the nodes `watch` added out of `gm` (recompiled by the caller)."""
        for node in self._keepers:
            target = str(node.target)
            gm.graph.erase_node(node)
            delattr(gm, target)
        self._keepers = []

    def add(self, name: str, value: Any, own: bool = False) -> None:
        """Keep one batch's value of the float node `name` (`own`: a layer's own value) or give up on keeping it."""
        if name in self._refused:
            return
        kept = self.values.setdefault(name, [])
        size = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        if not isinstance(value, torch.Tensor) or (own and self._bytes[True] + size > self.limit // 2) \
                or self.held + size > _room(self, self._budget):
            self._refused.add(name)
            self._bytes[own] -= sum(v.numel() * v.element_size() for v in self.values.pop(name))
            return
        # a view of part of its base would hold all of it; a whole one (a linear's 3-d result) holds no more
        whole = value._base is None or value._base.numel() == value.numel()
        kept.append(value if whole else value.clone())
        self._bytes[own] += size

    def feed(self, gm: fx.GraphModule, batches: int) -> bool:
        """Read the values kept on all `batches` from here in `gm` (a float copy, cut after its last logger), and
        erase what only computed them; whether a logger is left to run."""
        complete = {name for name, values in self.values.items() if len(values) == batches}
        for index, node in enumerate([node for node in gm.graph.nodes if node.name in complete and node.users]):
            gm.add_submodule(f"qcore_kept_input_{index}", _KeptInput(self, node.name))
            with gm.graph.inserting_after(node):
                read = gm.graph.call_module(f"qcore_kept_input_{index}", ())
            node.replace_all_uses_with(read)
        for node in reversed(list(gm.graph.nodes)):  # a random op (dropout) is pure here: the model is deterministic
            if not node.users and node.op not in ("placeholder", "output") and node.meta.get(INSERTED_KEY) != "logger" \
                    and not (node.op == "call_function" and node.is_impure(impure_random=False)):
                gm.graph.erase_node(node)
        return any(node.meta.get(INSERTED_KEY) == "logger" for node in gm.graph.nodes)


class _InputKeeper(nn.Module):
    """Hands each batch's value of one float node to KeptLayerInputs."""

    def __init__(self, kept: KeptLayerInputs, name: str, own: bool = False) -> None:
        super().__init__()
        self.kept, self.name, self.own = kept, name, own

    def forward(self, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.requires_grad:  # detach is an op even under no_grad
            value = value.detach()
        self.kept.add(self.name, value, self.own)


class _KeptInput(nn.Module):
    """The value of one float node on the batch being run, from KeptLayerInputs."""

    def __init__(self, kept: KeptLayerInputs, name: str) -> None:
        super().__init__()
        self.kept, self.name = kept, name

    def forward(self) -> torch.Tensor:
        return self.kept.values[self.name][self.kept.position]


def _add_extra_shadows(gm_a: fx.GraphModule, extras: Sequence[ExtraShadows], extra_pairs: list[list[LayerPair]],
                       references: dict[str, fx.Node]
                       ) -> list[tuple[ExtraShadows, LayerPair, StreamingComparator | ExpertsComparator]]:
    """Each extra copy held in gm_a, its layers' shadows compared with the float layer values (`references`); a
    grouped projection's, expert by expert (its records are its experts' layers' that the copy names)."""
    found: list[tuple[ExtraShadows, LayerPair, StreamingComparator | ExpertsComparator]] = []
    floats: FloatNodes | None = None
    for index, (extra, pairs) in enumerate(zip(extras, extra_pairs)):
        holder = f"qcore_screen_{index}"
        gm_a.add_submodule(holder, _QuantizedHolder(extra.quantized))
        for number, pair in enumerate(p for p in pairs if p.layer in references):
            signature = shadow_signature(extra.quantized, pair.b)
            extra.signatures.update({layer: signature for layer in (pair.layer, *pair.a.expert_layers)
                                     if layer in extra.layers})
            floats = floats or FloatNodes(gm_a)
            value = copy_layer_into(gm_a, pair.a, pair.b, f"{holder}.quantized", known=floats)
            comparator: StreamingComparator | ExpertsComparator
            reads: tuple[fx.Node, ...] = (references[pair.layer],)
            if pair.a.kind == "grouped_linear":  # each expert's sums over its rows, as the model's shadow's
                comparator = ExpertsComparator(len(pair.a.expert_layers))
                reads += (pair.a.node.args[1],)
            else:
                comparator = StreamingComparator(actual_held=True, reference_held=True)  # as a shadow's
            attach_after(gm_a, value, f"{holder}_compare_{number}", comparator, *reads)
            found.append((extra, pair, comparator))
    return found


def _remove_nodes_since(gm: fx.GraphModule, kept: set[fx.Node]) -> None:
    """Erase the nodes not in `kept` (users first), and the top-level submodules and buffers only they used (those
    of a submodule, such as the quantized graph's, stay)."""
    added = [node for node in gm.graph.nodes if node not in kept]
    targets = {str(node.target) for node in added if node.op in ("get_attr", "call_module")}
    for node in reversed(added):
        gm.graph.erase_node(node)
    targets -= {str(node.target) for node in gm.graph.nodes if node.op in ("get_attr", "call_module")}
    for target in targets:
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)
    gm.recompile()
