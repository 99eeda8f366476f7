"""Rerun a switchable graph from the first node a change of its switches reaches.

A search that toggles one layer's quantizers at a time reruns the whole model for each trial, although every
node before that layer computes what it computed in the configuration the trial starts from. ResumableGraph
runs that configuration once with its values recorded at a few cut points (graph positions before layers), and
runs each trial from the last cut before the first node its changed switches feed, on the recorded values: the
same ops on the same inputs, so the same outputs as a full run, for about half the compute on average. Recording
another configuration starts the same way from a recording it shares its first layers with: a greedy search records
each step's configuration, which differs from the last step's in one layer.

Only ATen graphs (torch.export) with qcore's own functions and modules resume, and only from cuts whose values
no later op writes to in place (an in-place ReLU or residual add is seen through the ops' schemas); any other
graph, such as a symbolically traced one, always runs whole.
"""
from __future__ import annotations

import bisect
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.inputs import call_model
from qcore.graph.ops import fetch_attr
from qcore.runtime.progress import graph_run

__all__ = ["ResumableGraph", "last_writes"]

class _Recorder(nn.Module):
    """Keeps the values a recording run passes to it, by node name."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, Any] = {}

    def forward(self, value: Any, name: str) -> None:
        self.values[name] = value


def last_writes(gm: fx.GraphModule) -> dict[fx.Node, int] | None:
    """{node: the last graph position that may write to its storage} for the nodes some op writes to in place;
    None when the graph cannot resume: it writes to an input or an attribute, or runs code not known to be free
    of hidden writes (Python functions and modules other than qcore's own, call_method nodes)."""
    nodes = list(gm.graph.nodes)
    parent = {node: node for node in nodes}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    writes: list[tuple[fx.Node, int]] = []
    for position, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        target = node.target
        aliased = list(node.all_input_nodes)  # outputs that may alias an input: every input, unless the schema says
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            arguments = target._schema.arguments
            aliased = []
            for index, argument in enumerate(arguments):
                value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
                if isinstance(value, fx.Node) and argument.alias_info is not None:
                    aliased.append(value)
                    if argument.alias_info.is_write:
                        writes.append((value, position))
        elif node.op == "call_function":
            if target is not operator.getitem and not str(getattr(target, "__module__", "")).startswith("qcore."):
                return None
            if target is not operator.getitem:  # qcore's own: a value computed from its first input, or that input
                aliased = aliased[:1]
        elif node.op != "call_module" or not type(gm.get_submodule(str(target))).__module__.startswith("qcore."):
            return None
        else:
            aliased = aliased[:1]
        for value in aliased:
            parent[root(node)] = root(value)
    last: dict[fx.Node, int] = {}
    for value, position in writes:
        last[root(value)] = max(last.get(root(value), -1), position)
    if any(root(node) in last for node in nodes if node.op in ("placeholder", "get_attr")):
        return None
    return {node: last[root(node)] for node in nodes if root(node) in last}


class ResumableGraph:
    """Runs `gm` whole with its values recorded at up to `max_cuts` cut points, then from the last cut before a
    change on those values.

    `switches` are the nodes whose value depends on state outside the graph (quantizer switches); `state()`
    returns that state, one hashable per switch, in the same order. Recordings are kept per state (the last
    `keep`), each for the batches it was made on.
    """

    def __init__(self, gm: fx.GraphModule, switches: Sequence[fx.Node], state: Any, *, max_cuts: int = 16,
                 keep: int = 2) -> None:
        self.gm, self._state, self._keep = gm, state, keep
        writes = last_writes(gm)
        nodes = list(gm.graph.nodes)
        self._position = {node: index for index, node in enumerate(nodes)}
        self._switch_nodes = list(switches)
        self._reemitted = {n for n in nodes if n.op == "get_attr"} | set(self._switch_nodes)
        # a switch changes nothing before the first node that reads it
        self._effect = [min((self._position[u] for u in n.users), default=len(nodes)) for n in self._switch_nodes]
        first_body = next((i for i, n in enumerate(nodes) if n.op != "placeholder"), len(nodes))
        positions = sorted({p for p in self._effect if first_body < p < len(nodes) - 1})
        live = {cut: self._live_at(nodes, cut) for cut in positions} if writes is not None else {}
        # a value written to in place after the cut would reach the next run from that cut changed
        usable = [cut for cut, (values, _) in live.items() if all(writes.get(n, -1) < cut for n in values)]  # type: ignore[union-attr]
        step = max(1, -(-len(usable) // max_cuts))
        self._cuts = usable[step - 1::step]
        self._live = {cut: live[cut] for cut in self._cuts}
        self._suffixes: dict[int, tuple[fx.GraphModule, list[str]]] = {}
        self._recording_suffixes: dict[int, tuple[fx.GraphModule, list[str]]] = {}
        self._recorder: _Recorder | None = None
        self._recordings: dict[tuple[Hashable, ...], dict[Any, dict[str, Any]]] = {}
        self._recording_gm: fx.GraphModule | None = None
        # a switch that writes in place would write to a recorded value each time the suffix emits it again
        self.enabled = bool(self._cuts) and not any(
            isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in self._switch_nodes)

    def _live_at(self, nodes: list[fx.Node], cut: int) -> tuple[list[fx.Node], list[fx.Node]]:
        """(nodes computed before `cut` that the rest reads, in graph order; nodes before `cut` emitted again in
        the suffix: attributes and switches, whose values the recording may not hold)."""
        live: set[fx.Node] = set()
        emitted: set[fx.Node] = set()
        pending = [a for n in nodes[cut:] for a in n.all_input_nodes]
        while pending:
            node = pending.pop()
            if self._position[node] >= cut or node in live or node in emitted:
                continue
            if node in self._reemitted:
                emitted.add(node)
                pending.extend(node.all_input_nodes)
            else:
                live.add(node)
        return sorted(live, key=self._position.__getitem__), sorted(emitted, key=self._position.__getitem__)

    def recorded(self, key: Any) -> bool:
        """Whether the current state has a recording of the batch `key`."""
        return key in self._recordings.get(tuple(self._state()), {})

    def forget(self) -> None:
        """Drop every recording (their tensors)."""
        self._recordings.clear()

    def record(self, key: Any, inputs: Any) -> Any:
        """Run on `inputs` (a batch; `key` names it) and keep the values at the cuts for the current state; returns
        the outputs. A recording of the batch in another state lends the values before the last cut ahead of the
        changes, and the run starts there."""
        if not self.enabled:
            return call_model(self.gm, inputs)
        recorder = self._recording_module().get_submodule("qcore_recorder")
        state = tuple(self._state())
        start = self._start(state, key)
        try:
            if start is None:
                outputs = call_model(self._recording_module(), inputs)
                values = dict(recorder.values)
            else:  # the values before the cut are the lending recording's; those after it this run's
                suffix, names = self._suffix(start[0], recording=True)
                graph_run(self._share_after(start[0]))
                outputs = self.gm.graph._codegen.process_outputs(suffix(*(start[1][name] for name in names)))
                values = {**start[1], **recorder.values}
        finally:
            recorder.values.clear()
        recordings = self._recordings.pop(state, {})
        recordings[key] = values
        self._recordings[state] = recordings  # most recent last
        while len(self._recordings) > self._keep:
            self._recordings.pop(next(iter(self._recordings)))
        return outputs

    def run(self, key: Any, inputs: Any) -> Any:
        """The outputs of `gm` on `inputs` in the current state: from a recording's last usable cut, or whole."""
        start = self._start(tuple(self._state()), key)
        if start is None:
            return call_model(self.gm, inputs)
        suffix, names = self._suffix(start[0])
        graph_run(self._share_after(start[0]))
        return self.gm.graph._codegen.process_outputs(suffix(*(start[1][name] for name in names)))

    def _share_after(self, cut: int) -> float:
        """The share of the graph's nodes a run resumed at position `cut` computes (its cost in graph runs)."""
        return (len(self._position) - cut) / max(1, len(self._position))

    def _start(self, state: tuple[Hashable, ...], key: Any) -> tuple[int, dict[str, Any]] | None:
        """(the latest cut before every switch that differs from a recording of batch `key`, that recording's
        values), over the recordings kept; None when there is none to start from."""
        best: tuple[int, dict[str, Any]] | None = None
        for recorded_state, recordings in self._recordings.items():
            if key not in recordings:
                continue
            changed = [self._effect[i] for i, (a, b) in enumerate(zip(state, recorded_state)) if a != b]
            cut_index = bisect.bisect_right(self._cuts, min(changed, default=len(self._position))) - 1
            if cut_index >= 0 and (best is None or self._cuts[cut_index] > best[0]):
                best = (self._cuts[cut_index], recordings[key])
        return best

    def _recorded(self) -> list[fx.Node]:
        """The nodes whose values some cut needs, in graph order."""
        return sorted({n for live, _ in self._live.values() for n in live}, key=self._position.__getitem__)

    def _attributes(self) -> dict[str, Any]:
        """The attributes and modules `gm`'s nodes name, with the recorder, for the graphs that record."""
        if self._recorder is None:
            self._recorder = _Recorder()
        found: dict[str, Any] = {str(n.target): fetch_attr(self.gm, str(n.target))
                                 for n in self.gm.graph.nodes if n.op in ("get_attr", "call_module")}
        return {**found, "qcore_recorder": self._recorder}

    def _recording_module(self) -> fx.GraphModule:
        """A copy of `gm` that passes each value a cut needs to a recorder as soon as it is computed."""
        if self._recording_gm is None:
            graph = fx.Graph()
            mapping: dict[fx.Node, fx.Node] = {}
            graph.output(graph.graph_copy(self.gm.graph, mapping))
            graph._codegen = self.gm.graph._codegen
            last_placeholder = [mapping[n] for n in self.gm.graph.nodes if n.op == "placeholder"][-1:]
            for node in self._recorded():
                anchor = last_placeholder[0] if node.op == "placeholder" else mapping[node]
                with graph.inserting_after(anchor):
                    graph.call_module("qcore_recorder", (mapping[node], node.name))
            self._recording_gm = fx.GraphModule(self._attributes(), graph)
        return self._recording_gm

    def _suffix(self, cut: int, recording: bool = False) -> tuple[fx.GraphModule, list[str]]:
        """(the graph from position `cut` on, taking the values live there; the names of those values, in its
        argument order); recording=True: it also passes the values later cuts need to the recorder."""
        suffixes = self._recording_suffixes if recording else self._suffixes
        if cut not in suffixes:
            nodes = list(self._position)
            live, emitted = self._live[cut]
            graph = fx.Graph()
            mapping: dict[fx.Node, fx.Node] = {}
            for node in live:
                mapping[node] = graph.placeholder(node.name)
            for node in emitted + nodes[cut:]:
                mapping[node] = graph.node_copy(node, mapping.__getitem__)
            if recording:
                for node in self._recorded():
                    if self._position[node] >= cut:
                        with graph.inserting_after(mapping[node]):
                            graph.call_module("qcore_recorder", (mapping[node], node.name))
            suffixes[cut] = (fx.GraphModule(self._attributes() if recording else self.gm, graph),
                             [node.name for node in live])
        return suffixes[cut]
