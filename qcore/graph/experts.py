"""Mixture-of-experts blocks: fused experts captured as one Linear per expert projection.

transformers 5 keeps a block's experts as fused 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
and computes them with grouped or batched matrix products that no quantizer sees as linear layers. For capture,
each expert's projections become `nn.Linear` modules whose weights are views of the fused parameters (no copy),
named as llm-compressor's linearized experts are (`mlp.experts.3.gate_proj`), and the experts module computes
with them through transformers' own experts interface: each expert runs on the tokens routed to it only, so
its activation observers see exactly those and a per-channel or per-group weight quantizer treats its slice as
the Linear it stands for. The model computes the same function; the graph records which layer is which expert.
`grouped_experts` is the other form: each projection of every expert one `qcore.graph.grouped.grouped_linear` over
the routed tokens sorted by expert, a few nodes a block whatever its expert count.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.grouped import GROUPED_PREFIX, grouped_linear
from qcore.graph.ops import EXPERTS_KEY

__all__ = ["EXPERTS_KEY", "PER_EXPERT_QUANTIZERS", "ExpertLayer", "ExpertProjection", "MoeBlock",
           "QuantizedExpertProjection", "Router", "compact_expert_layers", "expand_expert_templates", "expert_counts",
           "expert_layers", "expert_linears", "expert_projections", "fused_expert_layers", "fused_experts_modules",
           "grouped_experts", "grouped_projection_views", "held_expert_layers", "linearized_experts",
           "module_list_experts", "module_list_record", "moe_blocks",
           "quantized_per_expert", "routers", "templates_only", "traced_with_templates", "with_experts_held"]

_IMPLEMENTATION = "qcore_linear_experts"


@dataclass(frozen=True)
class ExpertLayer:
    """One expert's projection: the block's experts module, the parameter (or, for linearized experts, the
    common path) that its items are named by, and the expert's index."""

    block: str
    projection: str
    expert: int


@dataclass(frozen=True)
class MoeBlock:
    """A block's experts: its path, how many there are, and whether the model holds them fused."""

    path: str
    experts: int
    fused: bool
    first_projection: str  # the projection every routed token goes through first ("gate_proj" or "up_proj")


def fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{path: module} of the experts modules that transformers' experts interface computes (fused 3-D weights)."""
    found = {}
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        fused = getattr(module, "gate_up_proj", None) if getattr(module, "has_gate", False) else \
            getattr(module, "up_proj", None)
        if config is not None and hasattr(module, "is_transposed") and isinstance(fused, nn.Parameter) \
                and fused.dim() == 3 and isinstance(getattr(module, "down_proj", None), nn.Parameter):
            found[path] = module
    return found


def module_list_experts(model: nn.Module) -> dict[str, dict[int, nn.Module]]:
    """{path: {index: expert}} of the experts a model holds as modules (llm-compressor's linearized experts, older
    transformers, a user's own, a tool's quantized copy of them): a module named `experts` whose numbered children,
    at least two, are of one class. Fused experts are not among them."""
    found = {}
    for path, module in model.named_modules():
        if path.rpartition(".")[2] != "experts":
            continue
        numbered = {int(name): child for name, child in module.named_children() if name.isdigit()}
        if len(numbered) >= 2 and len({type(child) for child in numbered.values()}) == 1:
            found[path] = dict(sorted(numbered.items()))
    return found


def held_expert_layers(model: nn.Module, is_layer: Callable[[str, nn.Module], bool] | None = None
                       ) -> dict[str, ExpertLayer]:
    """{layer: ExpertLayer} of the layers of the experts `model` holds as modules (module_list_experts): its Linear
    modules, or those `is_layer(name, module)` accepts (a tool's quantized layers)."""
    record: dict[str, Any] = {"layers": {}, "blocks": {}}
    module_list_record(model, record, is_layer)
    return record["layers"]


def module_list_record(model: nn.Module, record: dict[str, Any],
                       is_layer: Callable[[str, nn.Module], bool] | None = None) -> None:
    """Adds each module-held expert's layers to `record`, named by their common path within the experts
    (`mlp.experts.down_proj` for `mlp.experts.3.down_proj`)."""
    accepts = is_layer or (lambda name, module: isinstance(module, nn.Linear))
    for path, experts in module_list_experts(model).items():
        names = []
        for expert, module in experts.items():
            for name, layer in module.named_modules():
                if name and accepts(f"{path}.{expert}.{name}", layer):
                    record["layers"][f"{path}.{expert}.{name}"] = ExpertLayer(path, f"{path}.{name}", expert)
                    if name not in names:
                        names.append(name)
        if names:
            first = next((name for name in ("gate_proj", "w1", "up_proj") if name in names), names[0])
            record["blocks"][path] = MoeBlock(path, len(experts), False, first)


def _weight(module: nn.Module, name: str, expert: int) -> torch.Tensor:
    """Expert `expert`'s [out, in] weight view of fused parameter `name`."""
    weight = getattr(module, name)[expert].detach()
    return weight.t() if module.is_transposed else weight


def _halves(module: nn.Module, tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a fused gate_up tensor along `dim`: concatenated [gate; up] or interleaved."""
    if getattr(module, "is_concatenated", True):
        half = tensor.shape[dim] // 2
        return tensor.narrow(dim, 0, half), tensor.narrow(dim, half, half)
    index = [slice(None)] * tensor.dim()
    gate, up = list(index), list(index)
    gate[dim], up[dim] = slice(0, None, 2), slice(1, None, 2)
    return tensor[tuple(gate)], tensor[tuple(up)]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def expert_linears(module: nn.Module, expert: int) -> nn.Module:
    """An expert's projections as Linear modules whose weights are views of the fused parameters."""
    holder = nn.Module()
    bias = getattr(module, "has_bias", False)
    if module.has_gate:
        weight = _weight(module, "gate_up_proj", expert)
        biases = _halves(module, module.gate_up_proj_bias[expert], 0) if bias else (None, None)
        for name, half, half_bias in zip(("gate_proj", "up_proj"), _halves(module, weight, 0), biases, strict=True):
            holder.add_module(name, _linear(half, half_bias))
    else:
        holder.add_module("up_proj", _linear(_weight(module, "up_proj", expert),
                                             module.up_proj_bias[expert] if bias else None))
    holder.add_module("down_proj", _linear(_weight(module, "down_proj", expert),
                                           module.down_proj_bias[expert] if bias else None))
    return holder


class ExpertProjection(nn.Linear):
    """One expert's projection of a fused experts module, read from the fused parameters each time it is used:
    a view that follows them when they are onloaded and offloaded again (accelerate's hooks set new tensors), and
    holds nothing of its own."""

    def __init__(self, experts: nn.Module, fused: str, expert: int, half: int | None, bias: bool) -> None:
        nn.Module.__init__(self)
        # kept out of _modules: the experts module is this projection's parent, not its child
        self.__dict__["experts_module"] = experts
        self.fused, self.expert, self.half, self.has_bias = fused, expert, half, bias
        self.out_features, self.in_features = (int(size) for size in self.weight.shape)

    @property
    def weight(self) -> torch.Tensor:
        """The expert's [out, in] slice of the fused parameter as it is now."""
        return self.sliced(getattr(self.experts_module, self.fused))

    def sliced(self, fused: torch.Tensor) -> torch.Tensor:
        """The expert's [out, in] slice of `fused`, a value of the fused parameter (read from an offload, say)."""
        module = self.experts_module
        weight = fused[self.expert].detach()
        weight = weight.t() if module.is_transposed else weight
        return weight if self.half is None else _halves(module, weight, 0)[self.half]

    @property
    def bias(self) -> torch.Tensor | None:
        """The expert's slice of the fused bias, or None."""
        if not self.has_bias:
            return None
        bias = getattr(self.experts_module, f"{self.fused}_bias")[self.expert].detach()
        return bias if self.half is None else _halves(self.experts_module, bias, 0)[self.half]

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's signature
        """The projection of `input` through the expert's current weight."""
        return nn.functional.linear(input, self.weight, self.bias)


PER_EXPERT_QUANTIZERS = "_weight_quantizers"  # the suffix of a fused parameter's per-expert weight quantizers


class QuantizedExpertProjection(ExpertProjection):
    """One expert's projection of fused experts that a tool quantizes in place, keeping the float parameters with
    one weight quantizer per expert and one input quantizer per projection beside them (ModelOpt's fused experts:
    `down_proj_weight_quantizers`, `down_proj_input_quantizer`): it computes as the tool's forward computes that
    expert, through the tool's own quantizers, held as its children `input_quantizer` and `weight_quantizer` (as
    the tool's quantized Linear holds them)."""

    def __init__(self, experts: nn.Module, fused: str, expert: int, bias: bool) -> None:
        super().__init__(experts, fused, expert, None, bias)
        self.input_quantizer = getattr(experts, f"{fused}_input_quantizer")
        self.weight_quantizer = getattr(experts, f"{fused}{PER_EXPERT_QUANTIZERS}")[expert]

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's signature
        """The projection of `input` through the tool's input quantizer and the expert's weight quantizer."""
        return nn.functional.linear(self.input_quantizer(input), self.weight_quantizer(self.weight), self.bias)


def quantized_per_expert(module: nn.Module) -> bool:
    """Whether a fused experts module is quantized in place by a tool that keeps one weight quantizer per expert and
    one input quantizer per projection beside each fused parameter (ModelOpt), for a layout it computes as
    `F.linear(x, parameter[expert])` (not transposed)."""
    if getattr(module, "is_transposed", True):
        return False
    count = module.down_proj.shape[0]
    for fused in ("gate_up_proj" if getattr(module, "has_gate", False) else "up_proj", "down_proj"):
        quantizers = getattr(module, f"{fused}{PER_EXPERT_QUANTIZERS}", None)
        if not (isinstance(quantizers, nn.ModuleList) and len(quantizers) == count
                and isinstance(getattr(module, f"{fused}_input_quantizer", None), nn.Module)):
            return False
    return True


def expert_projections(module: nn.Module, expert: int, whole_gate_up: bool = False) -> nn.Module:
    """An expert's projections as ExpertProjection modules reading the fused parameters (expert_linears' layout);
    with `whole_gate_up`, a gated expert's gate and up halves as one projection, `gate_up_proj` (the layout of a
    tool that quantizes them as one: quantized_per_expert). A module quantized_per_expert holds its experts so,
    as QuantizedExpertProjection modules."""
    holder = nn.Module()
    bias = bool(getattr(module, "has_bias", False))
    if quantized_per_expert(module):
        for fused in ("gate_up_proj" if module.has_gate else "up_proj", "down_proj"):
            holder.add_module(fused, QuantizedExpertProjection(module, fused, expert, bias))
        return holder
    if module.has_gate and whole_gate_up:
        holder.add_module("gate_up_proj", ExpertProjection(module, "gate_up_proj", expert, None, bias))
    elif module.has_gate:
        for half, name in enumerate(("gate_proj", "up_proj")):
            holder.add_module(name, ExpertProjection(module, "gate_up_proj", expert, half, bias))
    else:
        holder.add_module("up_proj", ExpertProjection(module, "up_proj", expert, None, bias))
    holder.add_module("down_proj", ExpertProjection(module, "down_proj", expert, None, bias))
    return holder


def _expert_computation(self: nn.Module, inputs: torch.Tensor,
                        project: Callable[[str, torch.Tensor], torch.Tensor], whole_gate_up: bool = False
                        ) -> torch.Tensor:
    """The experts' computation of `inputs` as transformers' experts compute it, each projection by
    `project(name, x)` (one expert's Linear, or every expert's grouped projection); `whole_gate_up`: the gate and
    up halves as one projection (expert_projections)."""
    if self.has_gate and whole_gate_up:
        hidden = self._apply_gate(project("gate_up_proj", inputs))
    elif self.has_gate:
        gate, up = project("gate_proj", inputs), project("up_proj", inputs)
        if getattr(type(self)._apply_gate, "__name__", "") == "_default_apply_gate":
            hidden = self.act_fn(gate) * up  # as the Linear layers it stands for: no cat to share a range
        elif getattr(self, "is_concatenated", True):
            hidden = self._apply_gate(torch.cat([gate, up], dim=-1))
        else:
            hidden = self._apply_gate(torch.stack([gate, up], dim=-1).flatten(-2))
    else:
        hidden = self.act_fn(project("up_proj", inputs))
    projected = project("down_proj", hidden)
    if getattr(self, "has_post_expert_norm", False):
        projected = self.post_expert_norm(projected)
    return projected


def _expert_projection(self: nn.Module, expert: int, inputs: torch.Tensor) -> torch.Tensor:
    """Expert `expert`'s projections of `inputs` through its Linear modules, as transformers' experts compute them."""
    linears = getattr(self, str(expert))
    return _expert_computation(self, inputs, lambda name, x: getattr(linears, name)(x),
                               whole_gate_up="gate_up_proj" in linears._modules)


def _routed(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each token's row of the routed tokens sorted by expert, those tokens, their routing weights, the tokens
    routed to each expert): each expert's tokens a run, in token order."""
    count = int(self.num_experts if hasattr(self, "num_experts") else self.down_proj.shape[0])
    chosen = top_k_index.reshape(-1)
    order = chosen.argsort(stable=True)  # by expert, each expert's tokens in token order
    token_of = order // top_k_index.shape[-1]
    routed_inputs = hidden_states.index_select(0, token_of)
    routed_weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    # a static-sized count (bincount's size depends on the largest index)
    counts = torch.zeros(count, dtype=torch.long, device=chosen.device).index_add_(0, chosen, torch.ones_like(chosen))
    return token_of, routed_inputs, routed_weights, counts


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts computation, one expert at a time on the tokens routed to it, through the expert's
    Linear modules (the experts interface's signature). The routed tokens are sorted by expert once per block and
    each expert takes its run of them, in token order: one host read of the counts per block, not one per expert.
    While a capture traces it with templates (traced_with_templates), expert 0's projections of every routed token
    stand for all the experts' (expand_expert_templates makes each expert's from them after the trace)."""
    token_of, routed_inputs, routed_weights, counts = _routed(self, hidden_states, top_k_index, top_k_weights)
    if _TEMPLATES.get():
        template = _expert_projection(self, 0, routed_inputs)
        weighted = torch.ops.qcore.routed_experts_stand_in(routed_inputs, routed_weights, counts, template)
    else:
        sizes = counts.tolist()
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == routed_inputs.shape[0])
        # weighted before the cat: a cat of the projections' outputs would share one observer across the experts
        weighted = torch.cat([_expert_projection(self, expert, inputs) * weights for expert, (inputs, weights)
                              in enumerate(zip(routed_inputs.split(sizes), routed_weights.split(sizes), strict=True))])
    # one index_add in expert order adds each token's experts in the order the per-expert sums did
    return torch.zeros_like(hidden_states).index_add(0, token_of, weighted.to(hidden_states.dtype))


def grouped_projection_views(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of a fused experts module's projections as [E, out, in] weights and [E, out] biases, views of
    its fused parameters (a gate or up half, the transpose of a transposed layout): `grouped_gate_proj`,
    `grouped_up_proj`, `grouped_down_proj`, and `grouped_<name>_bias` where the module has biases."""
    views: dict[str, torch.Tensor] = {}
    bias = getattr(module, "has_bias", False)
    inputs = "gate_up_proj" if module.has_gate else "up_proj"
    weight = getattr(module, inputs).detach()
    weight = weight.transpose(1, 2) if module.is_transposed else weight
    biases = getattr(module, f"{inputs}_bias").detach() if bias else None
    if module.has_gate:
        views["gate_proj"], views["up_proj"] = _halves(module, weight, 1)
        if biases is not None:
            views["gate_proj_bias"], views["up_proj_bias"] = _halves(module, biases, 1)
    else:
        views["up_proj"] = weight
        if biases is not None:
            views["up_proj_bias"] = biases
    down = module.down_proj.detach()
    views["down_proj"] = down.transpose(1, 2) if module.is_transposed else down
    if bias:
        views["down_proj_bias"] = module.down_proj_bias.detach()
    return {GROUPED_PREFIX + name: view for name, view in views.items()}


def _grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts computation with each projection of every expert as one grouped_linear over the routed
    tokens sorted by expert (the experts interface's signature): the values of _experts_forward, expert by expert,
    in a graph of a few ops per block whatever its expert count. Reads the views grouped_experts gives the module."""
    token_of, routed_inputs, routed_weights, counts = _routed(self, hidden_states, top_k_index, top_k_weights)

    def projection(name: str, inputs: torch.Tensor) -> torch.Tensor:
        return grouped_linear(inputs, counts, getattr(self, GROUPED_PREFIX + name),
                              getattr(self, f"{GROUPED_PREFIX}{name}_bias", None))

    weighted = _expert_computation(self, routed_inputs, projection) * routed_weights
    return torch.zeros_like(hidden_states).index_add(0, token_of, weighted.to(hidden_states.dtype))


_GROUPED_IMPLEMENTATION = "qcore_grouped_experts"


@contextlib.contextmanager
def grouped_experts(model: nn.Module) -> Iterator[dict[str, MoeBlock]]:
    """While open, every fused experts module of `model` computes each projection of all its experts as one
    grouped_linear (_grouped_experts_forward) on the views grouped_projection_views names, held as its parameters;
    yields {path: MoeBlock} of those blocks. The model is restored on exit. The grouped form of a capture: what a
    graph measuring a projection's experts as one op is traced from."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modules = fused_experts_modules(model)
    if modules and _GROUPED_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(_GROUPED_IMPLEMENTATION, _grouped_experts_forward)
    blocks = {}
    with _computed_by(modules.values(), _GROUPED_IMPLEMENTATION) as added:
        for path, module in modules.items():
            for name, view in grouped_projection_views(module).items():  # parameters: a capture reads them by path
                module.register_parameter(name, nn.Parameter(view, requires_grad=False))
                added.append((module, name))
            count = int(getattr(module, "num_experts", module.down_proj.shape[0]))
            blocks[path] = MoeBlock(path, count, True, "gate_proj" if module.has_gate else "up_proj")
        yield blocks


@contextlib.contextmanager
def _computed_by(modules: Iterable[nn.Module], implementation: str) -> Iterator[list[tuple[nn.Module, str]]]:
    """While open, the configs of the experts `modules` name `implementation` as their experts implementation;
    yields a list of (module, attribute) the caller adds to a module, deleted on exit, the configs restored."""
    configs: dict[int, tuple[Any, Any]] = {}
    added: list[tuple[nn.Module, str]] = []
    try:
        for module in modules:
            config = module.config
            configs.setdefault(id(config), (config, getattr(config, "_experts_implementation", None)))
            config._experts_implementation = implementation
        yield added
    finally:
        for config, previous in configs.values():
            config._experts_implementation = previous
        for module, name in added:
            delattr(module, name)


@torch.library.custom_op("qcore::routed_experts_stand_in", mutates_args=())
def _routed_experts_stand_in(routed_inputs: torch.Tensor, routed_weights: torch.Tensor, counts: torch.Tensor,
                             template: torch.Tensor) -> torch.Tensor:
    """In a traced graph only, until expand_expert_templates replaces it: every expert's weighted projections of
    its run of `routed_inputs` (`counts` per expert), from `template`, expert 0's projections of them all."""
    raise RuntimeError("qcore's experts stand-in was left in a captured graph: expand_expert_templates replaces it")


@_routed_experts_stand_in.register_fake
def _(routed_inputs: torch.Tensor, routed_weights: torch.Tensor, counts: torch.Tensor,
      template: torch.Tensor) -> torch.Tensor:
    return template.new_empty(template.shape, dtype=torch.promote_types(template.dtype, routed_weights.dtype))


_TEMPLATES: contextvars.ContextVar[bool] = contextvars.ContextVar("qcore_expert_templates", default=False)


@contextlib.contextmanager
def traced_with_templates() -> Iterator[None]:
    """While open, a trace of linearized experts records expert 0's projections once per block as the template of
    every expert's: a block costs the trace a few ops, not a few per expert. expand_expert_templates completes
    the graph."""
    token = _TEMPLATES.set(True)
    try:
        yield
    finally:
        _TEMPLATES.reset(token)


@contextlib.contextmanager
def templates_only(model: nn.Module, paths: Iterable[str]) -> Iterator[dict[str, dict[str, nn.Module]]]:
    """While open, the linearized experts modules at `paths` hold expert 0's projections only (the template a trace
    with templates reads): torch.export lifts every parameter a module holds, read or not, so that hiding the other
    experts' makes a block's trace cost the same whatever its expert count. Yields {path: {index: expert module}} of
    those held back, whose parameters the traced graph is given; the modules are restored on exit."""
    held: dict[str, dict[str, nn.Module]] = {}
    originals: dict[str, dict[str, nn.Module | None]] = {}
    try:
        for path in paths:
            module = model.get_submodule(path)
            originals[path] = dict(module._modules)
            held[path] = {name: child for name, child in module._modules.items()
                          if name.isdigit() and name != "0" and child is not None}
            for name in held[path]:
                del module._modules[name]
        yield held
    finally:
        for path, children in originals.items():
            module = model.get_submodule(path)
            module._modules.clear()
            module._modules.update(children)  # in their order: named_modules() walks them as before


def expert_counts(counts: torch.Tensor) -> list[int]:
    """The tokens routed to each expert, read to the host (a captured block's one read)."""
    return counts.tolist()


def expand_expert_templates(gm: fx.GraphModule, blocks: Mapping[str, MoeBlock]) -> int:
    """Replace each experts stand-in of a graph traced with templates by every expert's projections of its run of
    the routed tokens, each a copy of expert 0's template reading the expert's own parameters, weighted and
    concatenated in expert order: the graph a trace of every expert makes. Returns the stand-ins replaced; the
    template's own nodes go. ValueError when a stand-in's template is not one expert's computation."""
    from qcore.graph.ops import FQN_KEY

    stand_ins = [node for node in gm.graph.nodes
                 if node.op == "call_function" and node.target is torch.ops.qcore.routed_experts_stand_in.default]
    for node in stand_ins:
        routed_inputs, routed_weights, counts, template = node.args
        path = _module_path(node)
        block = blocks.get(path)
        if block is None:
            raise ValueError(f"an experts stand-in at {path!r} has no MoE block")
        body = _template_nodes(routed_inputs, template, f"{path}.0.")
        with gm.graph.inserting_before(node):
            sizes = gm.graph.call_function(expert_counts, (counts,))
            split_inputs = gm.graph.call_function(torch.ops.aten.split_with_sizes.default, (routed_inputs, sizes))
            split_weights = gm.graph.call_function(torch.ops.aten.split_with_sizes.default, (routed_weights, sizes))
            made = [sizes, split_inputs, split_weights]
            products = []
            for expert in range(block.experts):
                inputs = gm.graph.call_function(operator.getitem, (split_inputs, expert))
                weights = gm.graph.call_function(operator.getitem, (split_weights, expert))
                copies = {routed_inputs: inputs}
                for original in body:
                    if original.op == "get_attr":
                        target = f"{path}.{expert}." + str(original.target)[len(path) + 3:]
                        copies[original] = gm.graph.get_attr(target)
                    else:
                        copies[original] = gm.graph.node_copy(original,
                                                              lambda arg, copies=copies: copies.get(arg, arg))
                        _rename_expert(copies[original], path, expert)
                    copies[original].meta.pop(FQN_KEY, None)
                products.append(gm.graph.call_function(torch.ops.aten.mul.Tensor, (copies[template], weights)))
                made += [inputs, weights, products[-1]]
            weighted = gm.graph.call_function(torch.ops.aten.cat.default, (products,))
            made.append(weighted)
        for new in made:
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack", {}))
        node.replace_all_uses_with(weighted)
        gm.graph.erase_node(node)
        for original in reversed(body):
            if not original.users:
                gm.graph.erase_node(original)
    # export reads every parameter of the module, used or not: the fused ones and the experts' own reads that the
    # templates' copies replaced would be fetched on every run of the graph and of each copy made of it
    if stand_ins:
        prefixes = tuple(f"{path}." for path in blocks)
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users and str(node.target).startswith(prefixes):
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return len(stand_ins)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else ""


def _template_nodes(routed_inputs: fx.Node, template: fx.Node, own_prefix: str) -> list[fx.Node]:
    """The nodes of expert 0's template, in graph order: those on the way from the routed inputs to the template,
    and those that read expert 0's own parameters (named under `own_prefix`), the parameters' get_attr nodes
    included. ValueError for a template that reads another expert's parameters."""
    ancestors: set[fx.Node] = set()
    stack = [template]
    while stack:
        current = stack.pop()
        # a computation traced before the routed tokens is the block's, not the template's: the walk ends there
        if current in ancestors or current is routed_inputs or (current.op != "get_attr" and current < routed_inputs):
            continue
        ancestors.add(current)
        stack.extend(current.all_input_nodes)
    own: set[fx.Node] = set()
    for node in sorted(ancestors):  # graph order: a node's inputs come first
        if node.op == "get_attr":
            if str(node.target).startswith(own_prefix):
                own.add(node)
            elif ".experts." in str(node.target) and str(node.target).rpartition(".experts.")[2][:1].isdigit():
                raise ValueError(f"the experts template reads {node.target}, another expert's parameter")
        elif any(arg is routed_inputs or arg in own for arg in node.all_input_nodes):
            own.add(node)
    if template not in own:
        raise ValueError("the experts template does not compute from the routed tokens")
    # a shape the trace fixed to every routed token's count (a view, say) would not fit one expert's run of them
    value = routed_inputs.meta.get("val")
    routed = value.shape[0] if isinstance(value, torch.Tensor) else None
    if not isinstance(routed, int):
        raise ValueError("the routed tokens' count is not known from the trace")
    for node in own:
        if node.op != "get_attr" and routed in _integers(node.args) + _integers(list(node.kwargs.values())):
            raise ValueError(f"the experts template's {node.name} is fixed to the {routed} routed tokens")
    return [node for node in template.graph.nodes if node in own]


def _integers(arguments: Any) -> list[int]:
    """The integers among `arguments`, in lists and tuples too (a shape)."""
    if isinstance(arguments, (list, tuple)):
        return [found for argument in arguments for found in _integers(argument)]
    return [arguments] if isinstance(arguments, int) and not isinstance(arguments, bool) else []


def _rename_expert(node: fx.Node, path: str, expert: int) -> None:
    """Point a copied template node's module stack at expert `expert`'s modules (`path.0.` -> `path.<expert>.`)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return
    old, new = f"{path}.0", f"{path}.{expert}"
    renamed = {}
    for key, (module_path, kind) in stack.items():
        text = str(module_path)
        if text == old or text.startswith(old + "."):
            text = new + text[len(old):]
        renamed[key.replace(old.replace(".", "_"), new.replace(".", "_")) if isinstance(key, str) else key] = \
            (text, kind)
    node.meta["nn_module_stack"] = renamed


def _register_implementation(module: nn.Module) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if _IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(_IMPLEMENTATION, _experts_forward)


@contextlib.contextmanager
def linearized_experts(model: nn.Module) -> Iterator[dict[str, Any]]:
    """While open, every fused experts module of `model` computes through one Linear per expert projection (views
    of its fused weights, as children "0", "1", ...); yields what EXPERTS_KEY records, experts held as modules
    (module_list_experts) included. The model is restored on exit."""
    modules = fused_experts_modules(model)
    record: dict[str, Any] = {"layers": {}, "blocks": {}}
    module_list_record(model, record)
    if not modules:
        yield record
        return
    with _computed_by(modules.values(), _IMPLEMENTATION) as added:
        for path, module in modules.items():
            _register_implementation(module)
            count = int(getattr(module, "num_experts", module.down_proj.shape[0]))
            for expert in range(count):
                module.add_module(str(expert), expert_linears(module, expert))
                added.append((module, str(expert)))
            record["layers"].update(fused_expert_layers(path, module))
            record["blocks"][path] = MoeBlock(path, count, True, "gate_proj" if module.has_gate else "up_proj")
        yield record


def fused_expert_layers(path: str, module: nn.Module) -> dict[str, ExpertLayer]:
    """{layer: ExpertLayer} of a fused experts module's projections, each expert's named as the per-expert capture
    names its Linear (`path.3.down_proj`), its items by the fused parameter it reads (`path.gate_up_proj`)."""
    names = ("gate_proj", "up_proj", "down_proj") if module.has_gate else ("up_proj", "down_proj")
    fused = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj" if module.has_gate else "up_proj",
             "down_proj": "down_proj"}
    count = int(getattr(module, "num_experts", module.down_proj.shape[0]))
    return {f"{path}.{expert}.{name}": ExpertLayer(path, f"{path}.{fused[name]}", expert)
            for expert in range(count) for name in names}


def with_experts_held(model: nn.Module, paths: Iterable[str], whole_gate_up: bool = False) -> nn.Module:
    """`model` as a view whose fused experts modules at `paths` hold their experts as modules too (children "0",
    "1", ... with Linear views of the fused weights: expert_projections, `whole_gate_up` its) and compute through
    them, one expert at a time on its routed tokens: the same function, layer names that pair with a checkpoint
    holding its experts as modules. Nothing is copied but the modules on the way to each path (their parameters
    are shared); `model` is left as it was."""
    fused = fused_experts_modules(model)
    # a view already holds its experts (an analysis planned again from one): nothing to make twice
    wanted = [path for path in paths if path in fused and not any(name.isdigit() for name in fused[path]._modules)]
    if not wanted:
        return model
    root = _shallow(model)
    for path in wanted:
        parent = root
        parts = path.split(".")
        for name in parts[:-1]:
            child = _shallow(parent._modules[name])
            parent._modules[name] = child
            parent = child
        view = _shallow(fused[path])
        for expert in range(int(getattr(view, "num_experts", view.down_proj.shape[0]))):
            view._modules[str(expert)] = expert_projections(view, expert, whole_gate_up)
        _set_forward(view, types.MethodType(_experts_forward, view))
        parent._modules[parts[-1]] = view
    return root


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing its parameters, buffers and children, with a children dict of its own; a forward
    that accelerate's hooks wrap is wrapped again around the copy (the original's calls the original)."""
    copied = copy.copy(module)
    copied._modules = dict(module._modules)
    old = module.__dict__.get("_old_forward")
    if isinstance(old, types.MethodType) and old.__self__ is module:
        _set_forward(copied, types.MethodType(old.__func__, copied))
    return copied


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """`module` computes with `forward`, inside accelerate's hook when it has one (the hook onloads its weights)."""
    wrapper = module.__dict__.get("forward")
    if "_old_forward" in module.__dict__ and isinstance(wrapper, functools.partial):
        module._old_forward = forward
        module.forward = functools.update_wrapper(functools.partial(wrapper.func, module), forward)
    else:
        module.forward = forward


def compact_expert_layers(layers: Iterable[str], experts: Mapping[str, ExpertLayer]) -> list[str]:
    """`layers` with each block's expert layers written as globs where they cover every expert: all of one
    projection as `block.*.down_proj`, all of a block's as `block`; the others by name, in order."""
    layers = list(layers)
    chosen = set(layers)
    every: dict[tuple[str, str], set[str]] = {}
    for layer, entry in experts.items():
        every.setdefault((entry.block, layer.rsplit(".", 1)[-1]), set()).add(layer)
    complete = {key for key, members in every.items() if members <= chosen}
    whole_blocks = {block for block in {key[0] for key in every}
                    if all(key in complete for key in every if key[0] == block)}
    compacted: list[str] = []
    for layer in layers:
        found = experts.get(layer)
        if found is None:
            name = layer
        elif found.block in whole_blocks:
            name = found.block
        elif (found.block, layer.rsplit(".", 1)[-1]) in complete:
            name = f"{found.block}.*.{layer.rsplit('.', 1)[-1]}"
        else:
            name = layer
        if name not in compacted:
            compacted.append(name)
    return compacted


def expert_layers(gm: fx.GraphModule) -> dict[str, ExpertLayer]:
    """{layer: ExpertLayer} of a captured graph's expert projections (empty for a model without experts)."""
    return dict(gm.meta.get(EXPERTS_KEY, {}).get("layers", {}))


def moe_blocks(gm: fx.GraphModule) -> dict[str, MoeBlock]:
    """{experts module path: MoeBlock} of a captured graph."""
    return dict(gm.meta.get(EXPERTS_KEY, {}).get("blocks", {}))


@dataclass(frozen=True)
class Router:
    """The layer whose output an MoE block's top-k choice of experts is made from, and that choice's k."""

    block: str
    layer: str
    top_k: int
    experts: int


def routers(gm: fx.GraphModule) -> dict[str, Router]:
    """{experts module path: Router} of the blocks whose choice is a top-k over the experts of one quantizable layer's
    output (softmax or sigmoid between them keep the order); a block whose router is not found is left out."""
    from qcore.graph.ops import FQN_KEY, find_quantizable_ops

    blocks = {path.rpartition(".")[0]: block for path, block in moe_blocks(gm).items()}  # {the block's module: ...}
    if not blocks:
        return {}
    by_node = {op.node: op for op in find_quantizable_ops(gm)}
    found: dict[str, Router] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "") not in ("topk.default", "topk") \
                or len(node.args) < 2:
            continue
        fqn = str(node.meta.get(FQN_KEY, ""))
        parent = next((p for p in blocks if fqn == p or fqn.startswith(p + ".")), None)
        if parent is None:
            continue
        source = _router_layer(node.args[0], by_node)
        if source is not None:
            block = blocks[parent]
            found[block.path] = Router(block.path, source.layer, int(node.args[1]), block.experts)
    return found


def _router_layer(node: Any, by_node: dict) -> Any:
    """The quantizable op whose output reaches `node` through ops of that output alone (softmax, sigmoid, casts),
    or None: a choice that also reads a parameter on the way (DeepSeek-V3's score correction bias) is not the top-k
    of the layer's output."""
    for _ in range(6):
        if not isinstance(node, fx.Node):
            return None
        if node in by_node:
            return by_node[node]
        if len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return None
