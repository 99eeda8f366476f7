"""Capture an nn.Module as a GraphModule: torch.export first, torch.fx.symbolic_trace as the fallback."""
from __future__ import annotations

import contextlib
import contextvars
import copy
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

from qcore.graph.experts import (
    EXPERTS_KEY,
    expand_expert_templates,
    fused_expert_layers,
    fused_experts_modules,
    grouped_experts,
    linearized_experts,
    module_list_record,
    templates_only,
    traced_with_templates,
)
from qcore.graph.fold import fold_batch_norm, fold_computed_weights, linear_from_transposed_weight_matmuls
from qcore.graph.inputs import as_args_kwargs, describe_batch
from qcore.graph.ops import FQN_KEY, HANDLE_KEY, normalize_module_path
from qcore.runtime.progress import stage

__all__ = ["CaptureError", "annotate_fqns_and_handles", "capture", "clone_graph_module", "experts_grouped",
           "experts_grouping",
           "graph_view", "module_fqn"]


class CaptureError(RuntimeError):
    """Neither torch.export nor torch.fx could capture the model."""


class _TraceThroughLayers(fx.Tracer):
    """FX tracer that traces into Linear/Conv so that their weights become get_attr nodes, like export."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return False
        return super().is_leaf_module(m, module_qualified_name)


def capture(model: nn.Module, example_inputs: Any, name: str | None = None, method: str = "auto",
            fold_bn: bool = True) -> fx.GraphModule:
    """Capture `model` called on `example_inputs` (a tensor, a tuple of args, or a dict of kwargs).

    `method` is "auto" (torch.export, then FX on failure), "export" or "fx". With `fold_bn`, each eval-mode
    BatchNorm that directly follows a conv (or a linear on [N, C] inputs) is folded into it, as torchao's
    prepare_pt2e does; gm.meta["qcore_folded_bn"] lists them.

    Every op node gets meta[FQN_KEY] (its module's fully qualified name) and meta[HANDLE_KEY]
    (a debug handle, unique and stable in graph order) that later rewrites keep.
    """
    if isinstance(model, fx.GraphModule) and _is_annotated(model):
        return model
    with stage("capture"):
        return _capture(model, example_inputs, name, method, fold_bn)


def _capture(model: nn.Module, example_inputs: Any, name: str | None, method: str, fold_bn: bool) -> fx.GraphModule:
    label = name or type(model).__name__
    args, kwargs = as_args_kwargs(example_inputs)
    was_training = model.training
    model.eval()
    _materialize_lazy_modules(model, args, kwargs)
    if method not in ("auto", "export", "fx"):
        raise ValueError(f"capture method must be 'auto', 'export' or 'fx', not {method!r}")
    export_error: BaseException | None = None
    grouped = bool(_EXPERTS_GROUPED.get())
    with _experts_held(model, grouped) as experts_record:
        try:
            try:
                if method == "fx":
                    raise CaptureError("export skipped (method='fx')")
                with without_kv_cache(model):
                    if grouped:
                        gm = _export(model, args, kwargs, recompile=False)
                        _drop_unread_fused_parameters(gm, experts_record["blocks"])
                    else:
                        gm = _export_experts(model, args, kwargs, experts_record)
            except Exception as error:  # noqa: BLE001 - any export failure means: try FX
                export_error = error
                try:
                    if method == "export":
                        raise CaptureError("FX skipped (method='export')")
                    gm = _fx_trace(model)
                except Exception as fx_error:  # noqa: BLE001
                    refused = _eager_failure(model, args, kwargs)
                    if refused is not None:
                        raise CaptureError(
                            f"model {label!r} could not be captured: its forward() fails on the example inputs "
                            f"({describe_batch(example_inputs)}) when run as it is, without capture: "
                            f"{_first_line(refused)}\n"
                            "  Fix: give example inputs that forward() takes (without example_inputs, the example is "
                            "the first calibration batch)."
                        ) from refused
                    raise CaptureError(
                        f"model {label!r} could not be captured.\n"
                        f"  torch.export failed: {_first_line(export_error)}\n"
                        f"  torch.fx.symbolic_trace failed: {_first_line(fx_error)}\n"
                        f"  Fix: {_capture_fix(export_error)}"
                    ) from fx_error
        finally:
            model.train(was_training)
    if experts_record["layers"] or experts_record.get("grouped"):
        gm.meta[EXPERTS_KEY] = experts_record
    annotate_fqns_and_handles(gm)
    fold_computed_weights(gm)
    linear_from_transposed_weight_matmuls(gm)
    if fold_bn:
        gm.meta["qcore_folded_bn"] = fold_batch_norm(gm)
    gm.meta["qcore_model_name"] = label
    gm.meta["qcore_capture_method"] = "fx" if export_error is not None else "export"
    if export_error is not None and method == "auto":  # FX took over: keep why export did not
        gm.meta["qcore_export_error"] = f"{type(export_error).__name__}: {_first_line(export_error)}"
    return gm


# None: not said (a capture keeps one Linear per expert; an analysis's capture chooses: capture_for_analysis)
_EXPERTS_GROUPED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("qcore_experts_grouped", default=None)


def experts_grouping() -> bool | None:
    """What the experts_grouped() open here says: True, False, or None where none is open."""
    return _EXPERTS_GROUPED.get()


@contextlib.contextmanager
def experts_grouped(enabled: bool = True) -> Iterator[None]:
    """Within the block, a capture computes each projection of every expert of a fused experts block as one
    grouped_linear node (qcore.graph.experts.grouped_experts), not one Linear per expert: the form a graph measuring
    a projection's experts as one op is captured in (qcore.analysis.capture_for_analysis chooses it where the analysis
    measures that form). enabled=False: one Linear per expert, whatever an analysis's capture would choose."""
    token = _EXPERTS_GROUPED.set(enabled)
    try:
        yield
    finally:
        _EXPERTS_GROUPED.reset(token)


@contextlib.contextmanager
def _experts_held(model: nn.Module, grouped: bool) -> Iterator[dict[str, Any]]:
    """linearized_experts(model), or with `grouped` grouped_experts(model): the record names each expert's layers as
    the per-expert capture does (the experts held as modules too), its blocks the grouped ones."""
    if not grouped:
        with linearized_experts(model) as linearized:
            yield linearized
        return
    record: dict[str, Any] = {"layers": {}, "blocks": {}}
    module_list_record(model, record)  # experts held as modules stay layers of their own
    with grouped_experts(model) as blocks:
        modules = fused_experts_modules(model)
        for path, block in blocks.items():
            record["layers"].update(fused_expert_layers(path, modules[path]))
            record["blocks"][path] = block
        record["grouped"] = bool(blocks)
        yield record


def _drop_unread_fused_parameters(gm: fx.GraphModule, blocks: Mapping[str, Any]) -> None:
    """Erase the reads of the fused parameters that a grouped capture computes through views of, and generate the
    code: export reads every parameter of a module, used or not, on every run of the graph and of its copies."""
    prefixes = tuple(f"{path}." for path, block in blocks.items() if block.fused)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and str(node.target).startswith(prefixes):
            gm.graph.erase_node(node)
    gm.recompile()


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """Run `model` without a key-value cache for the duration: a Hugging Face model whose config has `use_cache`
    (every causal LM and seq2seq model, True by default) returns a cache object that torch.export cannot flatten,
    and a quality comparison needs the logits and hidden states only. The config is restored afterwards."""
    found = [m.config for m in model.modules() if getattr(getattr(m, "config", None), "use_cache", None)]
    configs = list({id(c): c for c in found}.values())  # submodules often share their model's config
    try:
        for config in configs:
            config.use_cache = False
        yield
    finally:
        for config in configs:
            config.use_cache = True


def _eager_failure(model: nn.Module, args: tuple, kwargs: dict) -> BaseException | None:
    """The error `model` raises on the example inputs when run eagerly, or None: neither torch.export nor FX can
    capture a forward that fails on its inputs, and the fix is then the inputs, not the model."""
    try:
        with torch.no_grad(), without_kv_cache(model):
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure of the model's own forward
        return error
    return None


def _capture_fix(export_error: BaseException | None) -> str:
    """The fix for the construct torch.export named, where it named one."""
    text = str(export_error or "")
    unknown = re.search(r"Found <class '([^']+)'> in (output|input)", text)
    if unknown:
        kind = unknown.group(2)
        return (f"forward() takes or returns a {unknown.group(1)} ({kind}), which torch.export cannot flatten into "
                "tensors. Return tensors, tuples, dicts or dataclasses instead (register a dataclass with "
                "torch.export.register_dataclass), or, for a cache object, turn the cache off "
                "(model.config.use_cache = False).")
    return ("make the failing construct export-friendly (for example replace data-dependent Python control flow "
            "with torch.cond or tensor ops), or pass example inputs that match forward().")


def _materialize_lazy_modules(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Run a model with lazy modules (nn.LazyLinear, nn.LazyConv2d) once, so that their parameters get shapes."""
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        with torch.no_grad():
            model(*args, **kwargs)


def _export(model: nn.Module, args: tuple, kwargs: dict, recompile: bool = True) -> fx.GraphModule:
    """torch.export's module of `model` on the example inputs, without its input guards. recompile=False leaves the
    code generation to a caller that edits the graph before it runs (until then the module cannot run)."""
    dynamic = _auto_batch_dims(args, kwargs)
    with _code_generated_when_run(), _without_stack_traces():
        try:
            exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
        except Exception:  # noqa: BLE001 - a model that refuses a dynamic batch dim still exports statically
            if dynamic is None:
                raise
            exported = torch.export.export(model, args, kwargs, strict=False)
    gm = exported.module()
    for node in list(gm.graph.nodes):  # the input-guard submodule is not part of the model's computation
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    _drop_input_constraint_check(gm)
    if recompile:
        gm.recompile()
    return gm


def _code_generated_when_run() -> contextlib.AbstractContextManager:
    """A context in which the graph modules torch.export's trace makes generate their Python code when first run,
    not after each of its passes: none of them runs, and each generation costs a pass over every node (half the
    code generations of a capture). The module export returns is built apart and generates its code as before."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without lazy graph modules: every pass generates its code
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """A context in which a trace records no Python stack trace per node (node.meta["stack_trace"]): qcore reads
    none, its errors name the user's frames from the exception, and taking one costs a traceback extraction and
    its symbolization for every node."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):  # a torch without the setting
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _export_experts(model: nn.Module, args: tuple, kwargs: dict, experts_record: dict[str, Any]) -> fx.GraphModule:
    """_export, a model with fused experts traced with one template per block (expand_expert_templates): the
    trace's cost grows with the blocks, not with their experts. Traced expert by expert where the templates fail."""
    fused = {path: block for path, block in experts_record["blocks"].items() if block.fused}
    if not fused:
        return _export(model, args, kwargs)
    try:
        with traced_with_templates(), templates_only(model, fused) as held:
            gm = _export(model, args, kwargs, recompile=False)
        for path, experts in held.items():  # the same tensors, at their paths in the model, for the expansion
            for index, expert in experts.items():
                for name, parameter in expert.named_parameters():
                    _install_attribute(gm, f"{path}.{index}.{name}", parameter)
        if not expand_expert_templates(gm, fused):  # it generates the code of a graph it expanded
            gm.recompile()
        return gm
    except Exception:  # noqa: BLE001 - a block whose template does not stand for its experts: trace them all
        return _export(model, args, kwargs)


def _drop_input_constraint_check(gm: fx.GraphModule) -> None:
    """Remove export's per-call input-shape check: it costs as much as the observers of a small layer on every
    call, and a mismatched input still fails in the first op it reaches."""
    for key, hook in list(gm._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del gm._forward_pre_hooks[key]
            gm._forward_pre_hooks_with_kwargs.pop(key, None)


def _auto_batch_dims(args: tuple, kwargs: dict) -> tuple | None:
    """dynamic_shapes for a model called with positional tensors: their first dimension left to export (Dim.AUTO),
    so that batches of another size run on the graph. A model called with keywords (a transformers model) is
    exported for the first batch's shapes (None): a dynamic batch doubles its trace's cost, and the experts'
    templates (qcore.graph.experts) copy a trace whose routed-token counts are known; a calibration batch of
    another size is named as such when it fails (qcore.quantization.calibrate)."""
    if kwargs:
        return None
    auto = torch.export.Dim.AUTO
    return tuple({0: auto} if isinstance(value, torch.Tensor) and value.dim() > 0 else None for value in args)


def _fx_trace(model: nn.Module) -> fx.GraphModule:
    graph = _TraceThroughLayers().trace(model)
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _is_annotated(gm: fx.GraphModule) -> bool:
    return any(HANDLE_KEY in n.meta for n in gm.graph.nodes)


def module_fqn(node: fx.Node) -> str:
    """The FQN of the innermost module a node was called from ('' for the top level)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return normalize_module_path(str(path))
    if node.op == "call_module":
        return str(node.target)
    return ""


def annotate_fqns_and_handles(gm: fx.GraphModule) -> None:
    """Give every op node its FQN and a debug handle, numbering in graph order."""
    handle = 0
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.meta.setdefault(FQN_KEY, module_fqn(node))
            node.meta.setdefault(HANDLE_KEY, handle)
            handle += 1


def clone_graph_module(gm: fx.GraphModule, share_parameters: bool = False, recompile: bool = True) -> fx.GraphModule:
    """Deep copy of a captured GraphModule, node meta (FQNs, handles) included. share_parameters=True keeps the
    same parameter tensors (for a copy whose passes never write to them: no memory for a second set of weights);
    buffers, which a forward may update, are always copied. recompile=False skips the copy's code generation, for
    a caller that edits the graph and recompiles it before running it (until then the copy cannot run)."""
    # what copy.deepcopy(gm) keeps: the graph's attribute targets, each copied once (a shared memo keeps what they
    # share shared), without copying the module tree around them that GraphModule.__init__ would rebuild and drop
    memo: dict[int, Any] = {id(parameter): parameter for parameter in gm.parameters()} if share_parameters else {}
    targets = list(dict.fromkeys(str(node.target) for node in gm.graph.nodes if node.op in ("get_attr", "call_module")))
    values = {target: _attribute(gm, target) for target in targets}
    memo.update(_buffer_clones(list(values.values()), memo))
    copies = {target: copy.deepcopy(value, memo) for target, value in values.items()}
    clone = _graph_module_of(gm, copies, generate_code=recompile or not hasattr(gm.graph, "_codegen"))
    clone.meta = copy.deepcopy(getattr(gm, "meta", {}), memo)
    return clone


def graph_view(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of `gm`'s graph (node meta included) that reads `gm`'s own attributes: its top-level
    modules and tensors are shared, not copied, so that it costs a graph copy, not a module per attribute path (an
    MoE model has thousands). For passes that read it and change only its graph, its node meta and its own top-level
    attributes (an annotation; a prepare whose observers are only read): never run it, nor write into the modules
    and tensors it shares. Its code is not generated (where the graph can go without)."""
    names = dict.fromkeys(str(node.target).split(".")[0] for node in gm.graph.nodes
                          if node.op in ("get_attr", "call_module"))
    view = _graph_module_of(gm, {name: getattr(gm, name) for name in names},
                            generate_code=not hasattr(gm.graph, "_codegen"))
    view.meta = dict(getattr(gm, "meta", {}))
    return view


def _graph_module_of(gm: fx.GraphModule, attributes: Mapping[str, Any], generate_code: bool) -> fx.GraphModule:
    """A GraphModule with `attributes` ({dotted path: value}) and a copy of `gm`'s graph (node meta included), its
    code generated only with `generate_code` (else it cannot run until recompiled)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        made = fx.GraphModule({}, fx.Graph(), class_name=type(gm).__name__)  # generates code for no nodes
        for path, value in attributes.items():
            parents = path.split(".")
            # a module's value holds what it holds (GraphModule.__init__ installs a module target whole, alone)
            if not any(".".join(parents[:end]) in attributes for end in range(1, len(parents))):
                _install_attribute(made, path, value)
        if generate_code:
            made.graph = copy.deepcopy(gm.graph)
        else:
            _copy_graph_into(gm.graph, made.graph)
    return made


def _attribute(module: nn.Module, path: str) -> Any:
    """The attribute at dotted `path` of `module`."""
    for item in path.split("."):
        module = getattr(module, item)
    return module


def _buffer_clones(values: list[Any], memo: dict[int, Any]) -> dict[int, torch.Tensor]:
    """{id: clone} of the plain tensors among `values` and of their modules' buffers that share their storage with no
    other tensor there: what deepcopy makes of each (a tensor's own deep copy takes a few ops, a clone one); tensors
    sharing a storage are left to deepcopy, which keeps them sharing a copy."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, nn.Module):
            found.extend([*value.buffers(), *value.parameters()])
        elif isinstance(value, torch.Tensor):
            found.append(value)
    tensors = {id(t): t for t in found}
    storages: dict[tuple, int] = {}
    for tensor in tensors.values():
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        storages[key] = storages.get(key, 0) + 1
    return {key: tensor.clone() for key, tensor in tensors.items()
            if key not in memo and type(tensor) is torch.Tensor and not tensor.requires_grad
            and storages[(tensor.device, tensor.untyped_storage().data_ptr())] == 1}


def _install_attribute(target: nn.Module, path: str, value: Any) -> None:
    """Give `target` `value` at dotted `path`, as GraphModule.__init__ does for each get_attr and call_module target:
    intermediate modules are new, empty ones where none is there yet."""
    *prefix, field = path.split(".")
    for item in prefix:
        found = getattr(target, item, None)
        if found is None:
            found = nn.Module()
            setattr(target, item, found)
        target = found
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        target.register_buffer(field, value)
    else:
        setattr(target, field, value)


def _copy_graph_into(source: fx.Graph, target: fx.Graph) -> None:
    """What Graph.__deepcopy__ does, into the empty graph a GraphModule already owns (setting a GraphModule's graph
    generates its code)."""
    copied = target.graph_copy(source, val_map={}, return_output_node=True)
    target.set_codegen(copy.deepcopy(source._codegen))  # the exported graph's pytree calling convention
    if isinstance(copied, tuple):
        value, old_output = copied
        output = target.output(value, type_expr=getattr(old_output, "type", None))
        output.meta = copy.copy(old_output.meta)
