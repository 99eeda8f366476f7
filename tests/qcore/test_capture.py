"""Capture: export first, FX fallback, FQNs and debug handles that survive prepare and convert."""
import pytest
import torch

import qcore
from qcore.graph.inputs import call_model
from qcore.graph.ops import FQN_KEY, HANDLE_KEY, find_quantizable_ops
from tests.models import CatModel, DataDependent, KwargsModel, SmallCNN, SmallMLP, batches


def test_export_path_names_layers_by_fqn():
    gm = qcore.capture(SmallCNN().eval(), torch.randn(2, 3, 16, 16))
    assert gm.meta["qcore_capture_method"] == "export"
    assert [op.layer for op in find_quantizable_ops(gm)] == ["conv1", "conv2", "fc"]


def test_fx_and_export_agree_on_layers_and_handles():
    model = SmallMLP().eval()
    x = torch.randn(4, 32)
    exported = find_quantizable_ops(qcore.capture(model, x, method="export"))
    traced = find_quantizable_ops(qcore.capture(model, x, method="fx"))
    assert [(o.layer, o.kind) for o in exported] == [(o.layer, o.kind) for o in traced]


def test_kwargs_inputs():
    model = KwargsModel().eval()
    inputs = {"input_ids": torch.randint(0, 50, (2, 5)), "attention_mask": torch.ones(2, 5)}
    gm = qcore.capture(model, inputs)
    torch.testing.assert_close(gm(**inputs), model(**inputs))
    assert [op.layer for op in find_quantizable_ops(gm)] == ["proj"]


def test_dynamic_batch_dimension():
    model = SmallMLP().eval()
    gm = qcore.capture(model, torch.randn(4, 32))
    x = torch.randn(7, 32)
    torch.testing.assert_close(gm(x), model(x))


def test_uncapturable_model_names_model_and_construct():
    with pytest.raises(qcore.CaptureError) as info:
        qcore.capture(DataDependent().eval(), torch.randn(2, 4), name="my_model")
    text = str(info.value)
    assert "my_model" in text and "torch.export failed" in text and "symbolic_trace failed" in text


def test_handles_and_fqns_survive_prepare_and_convert():
    model = CatModel().eval()
    data = batches((4, 8))
    float_gm, quant_gm = qcore.quantize(model, data[0], data)
    before = {n.meta[HANDLE_KEY]: n.meta[FQN_KEY] for n in float_gm.graph.nodes if HANDLE_KEY in n.meta}
    after = {n.meta[HANDLE_KEY]: n.meta[FQN_KEY] for n in quant_gm.graph.nodes
             if HANDLE_KEY in n.meta and not n.meta.get("qcore_inserted")}
    assert after == before
    assert len(set(before)) == len(before)


@pytest.mark.parametrize("recompile", [True, False])
def test_a_clone_copies_each_buffer_in_one_op_and_keeps_buffers_sharing_a_storage_sharing_one(recompile):
    """A clone's buffers are copies (a forward may update them): each in one op where its storage is its own, and
    buffers that share a storage sharing one copy of it, as a deep copy keeps them."""
    from qcore.graph.capture import clone_graph_module
    from tests.helpers import count_aten_ops

    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 3))
    storage = torch.arange(6.0)
    gm.register_buffer("low", storage[:3])
    gm.register_buffer("high", storage[2:5])
    gm.register_buffer("own", torch.ones(3))
    gm.register_buffer("other", torch.full((3,), 2.0))
    graph, output = gm.graph, next(node for node in gm.graph.nodes if node.op == "output")
    value = output.args[0]
    with graph.inserting_before(output):
        for name in ("low", "high", "own", "other"):
            value = graph.call_function(torch.add, (value, graph.get_attr(name)))
    output.args = (value,)
    gm.recompile()
    ops, clone = count_aten_ops(lambda: clone_graph_module(gm, share_parameters=True, recompile=recompile))
    clone.recompile()
    assert clone.weight is gm.weight
    assert all(getattr(clone, name).data_ptr() != getattr(gm, name).data_ptr() for name in ("own", "other", "low"))
    assert clone.low.untyped_storage().data_ptr() == clone.high.untyped_storage().data_ptr()
    separate = count_aten_ops(lambda: (gm.own.clone(), gm.other.clone()))[0]
    shared = count_aten_ops(lambda: __import__("copy").deepcopy((gm.low, gm.high)))[0]
    assert ops == separate + shared
    x = torch.randn(2, 3)
    assert torch.equal(clone(x), gm(x))
    clone.own.add_(1.0)  # a forward's update of the copy leaves the original as it was
    assert torch.equal(gm.own, torch.ones(3))


class _Counter(torch.nn.Module):
    """A call_module target with state of its own (as an observer), whose buffer another node also reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        self.seen.add_(1.0)
        return x


@pytest.mark.parametrize("recompile", [True, False])
def test_a_clone_copies_a_module_target_once_with_what_other_nodes_read_inside_it(recompile):
    """Each attribute the graph reads is copied once, with one memo: a module a node calls and its buffer that
    another node reads are the same objects in the clone, apart from the original's."""
    from qcore.graph.capture import clone_graph_module

    root = torch.nn.Module()
    root.block = torch.nn.Module()
    root.block.counter = _Counter()
    root.block.linear = torch.nn.Linear(3, 3)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    counted = graph.call_module("block.counter", (x,))
    projected = graph.call_function(torch.nn.functional.linear, (counted, graph.get_attr("block.linear.weight")))
    graph.output(graph.call_function(torch.add, (projected, graph.get_attr("block.counter.seen"))))
    gm = torch.fx.GraphModule(root, graph)
    clone = clone_graph_module(gm, share_parameters=True, recompile=recompile)
    clone.recompile()
    assert clone.block.counter is not gm.block.counter
    assert clone.block.counter.seen.data_ptr() != gm.block.counter.seen.data_ptr()
    assert clone.block.linear.weight is gm.block.linear.weight
    value = torch.randn(2, 3)
    out = clone(value)  # the clone's counter updates its own buffer, which the add then reads
    assert torch.equal(out, torch.nn.functional.linear(value, gm.block.linear.weight) + 1.0)
    assert torch.equal(gm.block.counter.seen, torch.zeros(3))


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("share_parameters", [False, True])
def test_a_clone_without_code_generation_equals_a_full_clone_once_recompiled(method, share_parameters):
    from qcore.graph.capture import clone_graph_module

    for model, inputs in ((SmallCNN().eval(), torch.randn(2, 3, 16, 16)),
                          (KwargsModel().eval(), {"input_ids": torch.randint(0, 50, (2, 5)),
                                                  "attention_mask": torch.ones(2, 5)})):
        gm = qcore.capture(model, inputs, method=method)
        full = clone_graph_module(gm, share_parameters)
        lazy = clone_graph_module(gm, share_parameters, recompile=False)
        assert [n.format_node() for n in lazy.graph.nodes] == [n.format_node() for n in full.graph.nodes]
        assert [n.meta.get(HANDLE_KEY) for n in lazy.graph.nodes] == [n.meta.get(HANDLE_KEY) for n in gm.graph.nodes]
        for ours, theirs in ((lazy.named_parameters(), full.named_parameters()),
                             (lazy.named_buffers(), full.named_buffers())):
            ours, theirs = dict(ours), dict(theirs)
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.items())
        originals = dict(gm.named_parameters())
        assert originals and all((p is originals[name]) == share_parameters for name, p in lazy.named_parameters())
        lazy.recompile()
        torch.testing.assert_close(call_model(lazy, inputs), call_model(gm, inputs))


class _SharedActivationStack(torch.nn.Module):
    """Blocks reached through a slice of their ModuleList, one activation module shared by all of them: torch.export
    then records attribute accesses (`layers.slice(1, 3, None).0`), as in transformers' decoders with shared
    modules."""

    def __init__(self):
        super().__init__()
        act = torch.nn.ReLU()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), act) for _ in range(4))

    def forward(self, x):
        for block in self.layers[1:3]:
            x = block(x)
        for block in self.layers[::3]:
            x = block(x)
        return x


def test_layers_reached_through_a_slice_are_named_by_their_module_path():
    model = _SharedActivationStack()
    gm = qcore.capture(model, torch.randn(2, 8))
    names = [op.fqn for op in find_quantizable_ops(gm)]
    assert names == ["layers.1.0", "layers.2.0", "layers.0.0", "layers.3.0"]
    assert set(names) <= {name for name, _ in model.named_modules()}


def test_a_forward_that_fails_on_its_example_inputs_names_the_inputs_not_export():
    with pytest.raises(qcore.CaptureError) as raised:
        qcore.capture(DataDependent().eval(), torch.ones(2, 5), name="mine")  # FX cannot trace it either
    message = str(raised.value)
    assert message.startswith("model 'mine' could not be captured: its forward() fails on the example inputs "
                              "(arg 0: float32 [2, 5]) when run as it is, without capture: RuntimeError")
    assert "give example inputs that forward() takes" in message
    assert "torch.cond" not in message and "co_varnames" not in message


class _FilledInPlace(torch.nn.Module):
    """A buffer made with new_empty and filled slice by slice, then read by a layer (DeepSeek-V3's attention makes
    its keys this way)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), torch.nn.Linear(8, 3)

    def forward(self, x):
        filled = x.new_empty(*x.shape[:-1], 8)
        filled[..., :4].copy_(self.a(x))
        filled[..., 4:].copy_(self.b(x))
        return self.head(filled)


def test_a_value_filled_in_place_is_observed_as_its_reader_reads_it():
    from torch.ao.quantization import observer as ao

    import qcore
    from qcore.graph.ops import find_quantizable_ops

    torch.manual_seed(0)
    model, batches = _FilledInPlace().eval(), [torch.randn(4, 8) for _ in range(3)]
    prepared = qcore.prepare(qcore.capture(model, batches[0]), qcore.Int8StaticQuantizer())
    reference = ao.MinMaxObserver(dtype=torch.qint8)
    for batch in batches:
        prepared(batch)
        with torch.no_grad():
            reference(torch.cat([model.a(batch), model.b(batch)], dim=-1))
    head = next(op for op in find_quantizable_ops(prepared) if op.layer == "head")
    observer = prepared.get_submodule(head.node.args[0].target)
    assert observer.min_val == reference.min_val and observer.max_val == reference.max_val
    _, quantized = qcore.quantize(model, batches[0], batches)
    with torch.no_grad():
        assert (quantized(batches[1]) - model(batches[1])).abs().max() < 0.05  # not the buffer before its fill


@pytest.fixture
def code_generations(monkeypatch):
    """The number of times a graph's Python code is generated, counted from here on."""
    counted = [0]
    generate = torch.fx.Graph.python_code

    def counting(graph, *args, **kwargs):
        counted[0] += 1
        return generate(graph, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", counting)
    return counted


def test_a_capture_generates_code_for_the_module_it_returns_only(code_generations, monkeypatch):
    import contextlib

    import qcore.graph.capture as capture_module

    model, inputs = KwargsModel().eval(), {"input_ids": torch.randint(0, 50, (2, 5)),
                                            "attention_mask": torch.ones(2, 5)}
    lazy = qcore.capture(model, inputs)
    lazy_generations = code_generations[0]
    monkeypatch.setattr(capture_module, "_code_generated_when_run", contextlib.nullcontext)
    code_generations[0] = 0
    eager = qcore.capture(model, inputs)
    # torch.export's passes generate no code, and the module export builds still generates its own
    assert 0 < lazy_generations < code_generations[0]
    assert lazy.code == eager.code
    assert not isinstance(lazy, torch.fx._lazy_graph_module._LazyGraphModule)
    torch.testing.assert_close(call_model(lazy, inputs), call_model(eager, inputs))


def test_an_moe_capture_generates_its_expanded_graphs_code_once():
    import traceback

    from qcore.graph.experts import EXPERTS_KEY
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", layers=1, experts=4, batch=2, n=2)
    by_qcore = []
    original = torch.fx.GraphModule.recompile

    def recompile(gm):
        caller = traceback.extract_stack()[-2].filename  # who asked for the code: qcore, or torch.export
        if "qcore" in caller:
            by_qcore.append(gm)
        return original(gm)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.fx.GraphModule, "recompile", recompile)
        gm = qcore.capture(model, data[0])
    assert gm.meta[EXPERTS_KEY]["layers"]
    # once, after the experts' expansion: not also after export, for a graph the expansion then changes
    assert sum(1 for generated in by_qcore if generated is gm) == 1
    with torch.no_grad():
        torch.testing.assert_close(call_model(gm, data[1]).logits, model(**data[1]).logits)


def test_a_graph_view_reads_the_graphs_own_attributes_and_keeps_its_node_meta_apart(monkeypatch):
    """quantized_layers annotates a view (a copy of the graph over the same attributes, no module copied): the layers
    a clone's annotation gives, and the float graph's nodes untouched."""
    from torch import nn

    import qcore.analysis
    from qcore.analysis import quantized_layers
    from qcore.graph.capture import clone_graph_module, graph_view
    from qcore.quantization.format_quantizer import FormatQuantizer

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 8)).eval()
    gm = qcore.capture(model, torch.randn(4, 64))
    before = [(node.format_node(), dict(node.meta)) for node in gm.graph.nodes]
    view = graph_view(gm)
    assert [node.format_node() for node in view.graph.nodes] == [text for text, _ in before]
    assert all(view.get_parameter(name) is parameter for name, parameter in gm.named_parameters())
    for node in view.graph.nodes:
        node.meta["written"] = True
    assert [(node.format_node(), node.meta) for node in gm.graph.nodes] == before
    quantizers = (qcore.Int8StaticQuantizer(per_channel=False), FormatQuantizer("NVFP4"))
    viewed = [quantized_layers(gm, quantizer) for quantizer in quantizers]
    assert [(node.format_node(), node.meta) for node in gm.graph.nodes] == before
    monkeypatch.setattr(qcore.analysis, "graph_view", lambda g: clone_graph_module(g, True, recompile=False))
    assert viewed == [quantized_layers(gm, quantizer) for quantizer in quantizers]
    assert {entry.format_refusal.split(":")[0] for entry in viewed[1]} == {"", "NVFP4"}  # layer 4 refuses NVFP4
