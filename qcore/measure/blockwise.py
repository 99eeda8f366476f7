"""Block-wise analysis: a model quantized and compared one block of its decoder (or encoder) stack at a time.

The model is annotated, prepared and calibrated whole (observers hold no copy of the weights, and calibration is
one float forward per batch), so every quantization decision is the whole model's, across block boundaries too.
The prepared graph and the float graph are then cut into consecutive blocks at the stack's modules
(`model.layers.0`, `model.layers.1`, ...): the first block also holds what comes before the stack (embeddings), the
last what comes after it (final norm, LM head). Each block is a GraphModule of its own that shares the model's
parameters. One at a time, a block is converted (its weights fake-quantized), compared in one pass (the float block
on the float stream, the quantized block on the quantized stream of the blocks before it, so that propagated and
output SQNR are the whole model's) and released: the analysis holds one block's quantized weights at a time, and
the two activation streams, the way llm-compressor's sequential pipeline and GPTQ process a model layer by layer.
"""
from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from qcore.graph.deferred import Rule, deferred_parameters, materialized
from qcore.graph.experts import moe_blocks
from qcore.graph.ops import FQN_KEY, LAYER_NAME_KEY, find_quantizable_ops, is_inserted
from qcore.measure.passes import (
    ModelMeasurement,
    ProbedModel,
    SqnrMeasurement,
    compare_quantized,
    diagnosed_calibration,
)
from qcore.measure.variants import variant_results
from qcore.numeric.logits import LogitsComparator
from qcore.quantization.calibrate import calibrate
from qcore.quantization.convert import convert, restore_model_state
from qcore.quantization.quantizer import Quantizer
from qcore.report.detectors import DetectorBase

__all__ = ["Block", "BlockwiseError", "block_stack", "measure_blockwise", "split_into_blocks"]

_OPS = ("call_function", "call_method", "call_module")


class BlockwiseError(ValueError):
    """The graph has no stack of numbered blocks to cut it at, or not the one named."""


@dataclass
class Block:
    """One block of a cut graph: its graph (sharing the model's parameters), the names of the values it reads from
    the blocks before it (in its placeholders' order; the first block reads the model's own inputs), the names of
    the values it hands on (in its output tuple's order; the last block returns the model's output), and the
    stack's block indices it holds."""

    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    indices: tuple[int, ...]


def block_stack(gm: fx.GraphModule) -> str:
    """The module path of the graph's largest stack of numbered blocks ("model.layers"), from its ops' FQNs."""
    counts: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        parts = str(node.meta.get(FQN_KEY, "")).split(".") if node.op in _OPS else []
        for depth, part in enumerate(parts):
            if part.isdigit():
                counts.setdefault(".".join(parts[:depth]), set()).add(int(part))
    experts = set(moe_blocks(gm))  # a block's experts are numbered too, but are no stack: each runs on its own tokens
    stacks = {prefix: len(indices) for prefix, indices in counts.items() if len(indices) >= 2
              and not any(prefix == path or prefix.startswith(path + ".") for path in experts)}
    if not stacks:
        raise BlockwiseError("the model has no stack of numbered blocks (an nn.ModuleList or nn.Sequential of two "
                             "or more, such as model.layers) to analyse one at a time")
    return max(stacks, key=lambda prefix: (stacks[prefix], -prefix.count(".")))


def _assign_blocks(gm: fx.GraphModule, stack: str, blocks_per_step: int, fixed: Mapping[str, int] | None = None
                   ) -> tuple[dict[fx.Node, int], list[tuple[int, ...]]]:
    """Each op node's block, and each block's stack indices. A stack op goes to its block (or a later one, when it
    reads one); another op goes to the last block it reads from, or, when it is an observer or reads only
    parameters, to its first reader's. `fixed` gives some nodes' blocks by name (a prepared graph's ops, as in its
    float graph)."""
    pattern = re.compile(re.escape(stack) + r"\.(\d+)(?:\.|$)" if stack else r"(\d+)(?:\.|$)")
    found = sorted({int(m.group(1)) for n in gm.graph.nodes if n.op in _OPS
                    for m in [pattern.match(str(n.meta.get(FQN_KEY, "")))] if m})
    if len(found) < 2:
        raise BlockwiseError(f"no stack of numbered blocks at {stack!r}: its ops name {len(found)} block(s); give "
                             f"blockwise=True to find the stack, or the path of an nn.ModuleList of blocks")
    step_of = {index: position // blocks_per_step for position, index in enumerate(found)}
    count = max(step_of.values()) + 1
    assigned: dict[fx.Node, int] = {}  # first the earliest block each node can go to (after what it reads)
    floating = []
    for node in gm.graph.nodes:
        if node.op not in (*_OPS, "placeholder"):
            continue
        read = [assigned.get(value, 0) for value in node.all_input_nodes if value.op != "get_attr"]
        match = pattern.match(str(node.meta.get(FQN_KEY, ""))) if node.op in _OPS and not is_inserted(node) else None
        if fixed is not None and node.name in fixed:
            assigned[node] = fixed[node.name]
        elif match:
            assigned[node] = max([step_of[int(match.group(1))], *read])
        else:
            assigned[node] = max(read, default=0)
            if node.op in _OPS and (is_inserted(node) or not read):
                floating.append(node)
    # an observer (or an op that reads only parameters) goes with the layers it serves: a layer's input
    # quantization is part of its shadow copy. Its readers come later in graph order, so they are placed by now.
    for node in reversed(floating):
        readers = [count - 1 if user.op == "output" else assigned[user] for user in node.users if user in assigned
                   or user.op == "output"]
        assigned[node] = max(assigned[node], min(readers, default=assigned[node]))
    indices = [tuple(i for i in found if step_of[i] == block) for block in range(count)]
    return {node: block for node, block in assigned.items() if node.op in _OPS}, indices


def split_into_blocks(gm: fx.GraphModule, stack: str | None = None, blocks_per_step: int = 1,
                      fixed: Mapping[str, int] | None = None) -> list[Block]:
    """Cut `gm` at the blocks of `stack` (default: block_stack(gm)), `blocks_per_step` stack blocks per Block.
    Running the blocks in order, each on the values named by its inputs, computes what `gm` computes. `fixed`:
    see _assign_blocks."""
    stack = block_stack(gm) if stack is None else stack
    assigned, indices = _assign_blocks(gm, stack, max(1, int(blocks_per_step)), fixed)
    count = len(indices)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    home = {**{n: 0 for n in placeholders}, **assigned}  # get_attr nodes have no home: each block copies its own
    readers: dict[fx.Node, set[int]] = {}
    for node in gm.graph.nodes:
        block = count - 1 if node.op == "output" else assigned.get(node)
        if block is None:
            continue
        for value in node.all_input_nodes:
            if value.op != "get_attr":
                readers.setdefault(value, set()).add(block)
    layer_names = {op.node: op.layer for op in find_quantizable_ops(gm)}
    codegen = gm.graph._codegen
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    blocks = []
    for block in range(count):
        graph, env = fx.Graph(), {}
        own = [n for n in gm.graph.nodes if assigned.get(n) == block]
        reads = [] if block == 0 else sorted((v for v in readers if home[v] < block and block in readers[v]),
                                             key=position.__getitem__)
        for node in placeholders if block == 0 else reads:
            env[node] = graph.node_copy(node) if block == 0 else graph.placeholder(node.name)
            if block:  # a value from an earlier block: its shape, not its role there (an observer, say)
                env[node].meta = {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
        for node in own:
            for value in node.all_input_nodes:
                if value not in env and value.op == "get_attr":
                    env[value] = graph.node_copy(value)
            env[node] = graph.node_copy(node, env.__getitem__)
            if node in layer_names:
                env[node].meta[LAYER_NAME_KEY] = layer_names[node]
        handed: list[fx.Node] = []
        if block == count - 1:
            for value in output.all_input_nodes:
                if value not in env and value.op == "get_attr":
                    env[value] = graph.node_copy(value)
            graph.output(fx.node.map_arg(output.args[0], env.__getitem__))
        else:
            handed = [v for v in [*placeholders, *own] if home[v] == block and max(readers.get(v, {-1})) > block]
            graph.output(tuple(env[v] for v in handed))
        _set_codegen(graph, codegen, block, count, [env[v].name for v in reads])
        module = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Block{block}")
        module.meta = dict(getattr(gm, "meta", {}))
        blocks.append(Block(module, tuple(v.name for v in reads), tuple(v.name for v in handed), indices[block]))
    return blocks


def _set_codegen(graph: fx.Graph, codegen: Any, block: int, count: int, input_names: list[str]) -> None:
    """The first block is called like the model; the last returns the model's output structure."""
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        info = codegen.pytree_info
        if block == 0:
            graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(info.orig_args, info.in_spec,
                                                         info.out_spec if count == 1 else None)))
        elif block == count - 1:
            graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(input_names, pytree.tree_structure(tuple(input_names)),
                                                         info.out_spec)))
    elif block == 0:
        graph.set_codegen(codegen)


def _calibrate_blocks(blocks: list[Block], batches: list[Any], rules: Mapping[str, list[Rule]]) -> None:
    """calibrate() one block at a time on the float stream of every batch, each block holding its rewritten
    parameters (qcore.graph.deferred) only while it runs."""
    envs: list[dict[str, Any]] = [{} for _ in batches]
    last_read = _last_readers(blocks)
    for index, block in enumerate(blocks):
        inputs = batches if index == 0 else [tuple(env[name] for name in block.inputs) for env in envs]
        outputs: list[Any] = []  # the last block's go nowhere
        with materialized([block.gm], rules):
            calibrate(block.gm, inputs, outputs if index < len(blocks) - 1 else None, keep_all=True)
        for env, output in zip(envs, outputs):
            env.update(zip(block.outputs, output))
        _drop_read(envs, last_read, index)


def _last_readers(blocks: list[Block]) -> dict[str, int]:
    """{value name: the last block that reads it}."""
    return {name: index for index, block in enumerate(blocks) for name in block.inputs}


def _drop_read(envs: list[dict[str, Any]], last_read: Mapping[str, int], index: int) -> None:
    """Forget the values no block after `index` reads."""
    for name in [name for name, reader in last_read.items() if reader == index]:
        for env in envs:
            env.pop(name, None)


class _LogitsOnModelBatches(LogitsComparator):
    """Logits compared on the last block, with the model's own batches (their input_ids) for perplexity."""

    def __init__(self, batches: list[Any]) -> None:
        super().__init__()
        self._model_batches, self._seen = batches, 0

    def update(self, reference: list[torch.Tensor], actual: list[torch.Tensor], batch: Any) -> None:
        super().update(reference, actual, self._model_batches[self._seen])
        self._seen += 1


def measure_blockwise(float_gm: fx.GraphModule, batches: Iterable[Any], quantizer: Quantizer | None = None, *,
                      stack: str | None = None, propagate: bool = True,
                      detectors: Mapping[str, DetectorBase] | None = None, equalization_layers: Iterable[str] = (),
                      smoothing: float | str | None = None, logits: bool = False,
                      on_block: Callable[[Block], None] | None = None) -> ModelMeasurement:
    """measure_model one block of `stack` at a time (see the module's docstring): the same numbers. `on_block` is
    called with each quantized block before its comparison pass."""
    batches = list(batches)
    stack = block_stack(float_gm) if stack is None else stack
    rules = deferred_parameters(float_gm)  # an equalized or smoothed graph's rewritten weights, made per block
    probed = ProbedModel(float_gm, quantizer, detectors, equalization_layers, smoothing)
    float_blocks = split_into_blocks(float_gm, stack)
    homes = {node.name: block for block, part in enumerate(float_blocks) for node in part.gm.graph.nodes
             if node.op in _OPS}
    if rules:  # calibrated one block at a time too: the whole rewritten model never exists
        quant_blocks = split_into_blocks(probed.prepared, stack, fixed=homes)
        with diagnosed_calibration(float_gm, batches):
            _calibrate_blocks(quant_blocks, batches, rules)
    else:
        with diagnosed_calibration(float_gm, batches):
            calibrate(probed.prepared, batches)
    variants, unmeasured, smoothed = probed.read()
    probed.prepared.recompile()
    if not rules:  # the probes' observers are gone from the graph now
        quant_blocks = split_into_blocks(probed.prepared, stack, fixed=homes)
    probed_reports = probed.detector_reports
    del probed  # the blocks hold what they need of the prepared graph
    last_read = [_last_readers(float_blocks), _last_readers(quant_blocks)]
    float_env: list[dict[str, Any]] = [{} for _ in batches]
    quant_env: list[dict[str, Any]] = [{} for _ in batches]
    layers, baselines, outputs = {}, {}, {}  # type: ignore[var-annotated]
    routing: dict[str, Any] = {}  # {MoE block: its routing agreement}, from the block that holds it
    logits_result = ModelMeasurement.logits
    for index in range(len(float_blocks)):  # not zip(): its cached result tuple would keep a block alive
        float_block, quant_block = float_blocks[index], quant_blocks[index]
        last = index == len(float_blocks) - 1
        if index == 0:
            float_in, quant_in = batches, None
        else:
            float_in = [tuple(env[name] for name in float_block.inputs) for env in float_env]
            quant_in = [tuple(env[name] for name in quant_block.inputs) for env in quant_env]
        comparator = _LogitsOnModelBatches(batches) if logits and last and propagate else None
        streams: list[tuple[Any, Any]] = []
        with materialized([float_block.gm, quant_block.gm], rules):
            with diagnosed_calibration(float_gm, batches):
                quantized = convert(quant_block.gm, keep_float_weights=False, recompile=False)
            restore_model_state(quantized, float_block.gm)
            if on_block is not None:
                on_block(quant_block)
            sqnr, measured = compare_quantized(float_block.gm, quantized, float_in, variants, unmeasured,
                                               propagate=propagate, logits=comparator, quant_batches=quant_in,
                                               streams=streams, routing=routing)
        layers.update(sqnr.layers)
        baselines.update(measured)
        if last:
            outputs = dict(sqnr.outputs)
            logits_result = comparator.result() if comparator is not None else logits_result
            break
        for position, (float_out, quant_out) in enumerate(streams):
            float_env[position].update(zip(float_block.outputs, float_out))
            quant_env[position].update(zip(quant_block.outputs, quant_out))
        _drop_read(float_env, last_read[0], index)
        _drop_read(quant_env, last_read[1], index)
        float_blocks[index] = quant_blocks[index] = None  # type: ignore[call-overload]
        del quantized, streams, float_in, quant_in, float_block, quant_block
        gc.collect()  # the block's quantized copy is held in reference cycles (fx graphs)
    return ModelMeasurement(SqnrMeasurement(layers, outputs), probed_reports, variant_results(
        variants, baselines, unmeasured), unmeasured, smoothed, logits_result, routing=routing)
